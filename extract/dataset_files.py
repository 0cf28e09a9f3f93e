"""Which data a `--dataset` names: one .jsonl/.json/.parquet file, a `datasets`
save_to_disk folder, or several data files, given as a folder of them (a Hugging Face Hub
dataset as `hf download --repo-type dataset ... --local-dir DIR` writes it: its train split) or
as a glob (one split's files, e.g. 'ultrachat/data/train_sft-*.parquet'); or such files on S3
(an object or a glob of them, read from local copies: `dataset_download`).

Loading (`inputs.load_rows`) and pinning (`fingerprint.dataset_fingerprint`) both start here,
so a run reads exactly the files its manifest's fingerprint hashed. A folder's splits are found
as `datasets` finds a Hub dataset's (its file names, or its README's `configs`), never guessed
past that: several splits, several configs or two file kinds are refused, naming the glob to
give instead. Torch-free: `layertap submit extract` resolves a dataset without the extractor.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from layertap.storage.errors import InputError, MissingInput

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}  # extension -> `datasets` builder
SAVED_MARKERS = ("state.json", "dataset_dict.json")  # what save_to_disk writes (a Dataset's, a DatasetDict's)
GLOB_CHARS = re.compile(r"[*?[]")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True, slots=True)
class DataFiles:
    """The data files a `--dataset` reads, in row order, and the `datasets` builder that reads them."""

    given: str  # the --dataset text, for messages
    files: tuple[str, ...]
    builder: str  # "json" or "parquet"

    @property
    def single(self) -> bool:
        return len(self.files) == 1


def is_pattern(path: str) -> bool:
    """Whether `path` is a local glob: it has glob characters and names no existing file or folder."""
    return bool(GLOB_CHARS.search(path)) and not path.startswith("s3://") and not os.path.exists(os.path.expanduser(path))


def is_saved_folder(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, name)) for name in SAVED_MARKERS)


def data_files(path: str, s3: Mapping[str, Any] | None = None) -> DataFiles | None:
    """The data files `path` names; None for a save_to_disk folder (`fingerprint.load_saved`).

    Raises `MissingInput` for a path that does not exist or a glob that matches no file, and
    `InputError` for a folder or glob whose files layertap would not read whole and alone. Data
    files on S3 (an object or a glob of them) are read from local copies (`dataset_download`;
    `s3`: the "s3" settings of the command's --config)."""
    from layertap.extract.dataset_download import fetch_s3_data, is_s3_data

    if is_s3_data(path):
        return _of_one_kind(path, fetch_s3_data(path, s3))
    if is_pattern(path):
        matched = pattern_files(path)
        if not matched:
            raise MissingInput(f"dataset {path!r} is a glob that matches no file; quote it on the command line "
                               "(the shell expands an unquoted glob) and check its folder")
        return _of_one_kind(path, matched)
    if not os.path.exists(local := os.path.expanduser(path)):
        hint = ""
        if _HUB_ID.fullmatch(path) and not os.path.isdir(path.split("/")[0]):  # not a typo in a folder here
            hint = (f"; layertap reads local data: for the Hugging Face Hub dataset {path!r}, download it first "
                    f"(`hf download --repo-type dataset {path} --local-dir DIR`) and give --dataset DIR (its train "
                    "split) or a glob of one split's files")
        raise MissingInput(f"dataset {path!r} does not exist{hint}")
    if os.path.isdir(local):
        return None if is_saved_folder(local) else _folder(local)
    return _of_one_kind(path, [local])


def pattern_files(pattern: str) -> list[str]:
    """The files a glob matches (folders it matches are not data), in name order."""
    return sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))


def recorded_path(path: str) -> str:
    """`path` as a manifest or recipe records it: absolute (a glob too: "data/*.jsonl" said nothing
    of where it was read), with `~` expanded and an existing path's links resolved."""
    local = os.path.expanduser(path)
    return os.path.realpath(local) if os.path.exists(local) else os.path.abspath(local) if is_pattern(path) else path


def _of_one_kind(given: str, files: list[str]) -> DataFiles:
    kinds = {os.path.splitext(f)[1].lower() for f in files}
    other = sorted(kinds - FILE_FORMATS.keys())
    if other:
        what = f"unsupported file type {other[0] or '(none)'!r}" if len(files) == 1 else \
            f"matches files of unsupported types ({', '.join(repr(k or '(none)') for k in other)})"
        raise InputError(f"dataset {given!r}: {what}; use .jsonl, .json or .parquet files (one file, a folder of "
                         "them, or a glob) or a datasets save_to_disk folder")
    builders = {FILE_FORMATS[k] for k in kinds}
    if len(builders) > 1:
        most = max(sorted(kinds), key=lambda k: sum(os.path.splitext(f)[1].lower() == k for f in files))
        head, slash, name = given.rstrip("/").rpartition("/")
        if name == "**" or not GLOB_CHARS.search(name):  # 'data/**', or a folder: the files under it
            name = "**/*" if name == "**" else f"{name}/**/*"
        else:  # 'data*.*': 'data*'
            name = name.rpartition(".")[0] or name
        example = f"{head}{slash}{name}{most}"
        raise InputError(f"dataset {given!r} mixes {' and '.join(sorted(kinds))} files: give a glob of one kind, "
                         f"e.g. --dataset '{example}'")
    return DataFiles(given, tuple(files), builders.pop())


def _folder(path: str) -> DataFiles:
    """A folder of data files: its split's files as `datasets` resolves a Hub dataset's."""
    import datasets

    if GLOB_CHARS.search(path):  # `datasets` takes the folder's path for a pattern, and reads another folder
        raise InputError(f"dataset folder {path!r} has glob characters (*, ?, [) in its path, which the Hub dataset "
                         f"reader takes for a pattern: give a glob of its files instead, e.g. --dataset "
                         f"'{os.path.join(glob.escape(path), '**', '*.parquet')}', or rename it")

    try:
        with quiet("datasets", "huggingface_hub"):
            builder = datasets.load_dataset_builder(path)
    except ValueError as e:
        if "Config name is missing" not in str(e):
            raise InputError(f"dataset {path!r} could not be read as a folder of data files: {e}") from None
        with quiet("datasets", "huggingface_hub"):
            configs = datasets.get_dataset_config_names(path)
            example = _example(path, datasets.load_dataset_builder(path, configs[0]))
        raise InputError(f"dataset {path!r} declares {len(configs)} configs in its README.md ({', '.join(configs)}): "
                         f"give the files of one split of one as a glob{example}") from None
    except (FileNotFoundError, datasets.exceptions.DataFilesNotFoundError) as e:
        raise InputError(f"dataset {path!r} is a folder with no data files (.jsonl, .json, .parquet) and not a "
                         f"datasets save_to_disk folder (no {' / '.join(SAVED_MARKERS)}): {e}") from None
    splits = {str(name): list(files) for name, files in builder.config.data_files.items()}
    if builder.name not in FILE_FORMATS.values():
        found = sorted({os.path.splitext(f)[1] or os.path.basename(f) for fs in splits.values() for f in fs})
        raise InputError(f"dataset {path!r} is a folder of {', '.join(found)} files: layertap reads .jsonl, .json and "
                         ".parquet files, or a datasets save_to_disk folder")
    if "train" in splits or len(splits) == 1:
        name = "train" if "train" in splits else next(iter(splits))
    else:
        names = sorted(splits)
        name = next((n for n in names if "train" in n), names[0])
        raise InputError(f"dataset {path!r} holds the splits {', '.join(names)} (by its files' names): give the files "
                         f"of the one to extract as a glob{_example(path, builder, name)}")
    listed = {os.path.realpath(f) for files in splits.values() for f in files}
    unread = [f for f in _data_files_under(path) if os.path.splitext(f)[1].lower() in FILE_FORMATS
              and os.path.basename(f) not in datasets.data_files.FILES_TO_IGNORE and os.path.realpath(f) not in listed]
    if unread:
        raise InputError(f"dataset {path!r} holds {builder.name} files and also {len(unread)} other data file(s) "
                         f"(e.g. {unread[0]!r}) that reading it as a dataset would leave out: give a glob of the "
                         "files to extract")
    return _of_one_kind(path, splits[name])


def _data_files_under(path: str) -> list[str]:
    """The files under `path`, but in hidden folders (`hf download`'s .cache/ of download metadata)."""
    found = []
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
    return found


def _example(path: str, builder, split: str | None = None) -> str:
    """', e.g. --dataset GLOB' for a split's files (its train split, or `split`), where one glob
    of the folder as given names exactly them; '' where none does."""
    splits = {str(name): list(files) for name, files in builder.config.data_files.items()}
    files = splits.get(split or "train") or next(iter(splits.values()), [])
    rel = [os.path.relpath(f, os.path.abspath(path)) for f in files]
    names = [os.path.basename(r) for r in rel]
    exts = {os.path.splitext(n)[1] for n in names}
    if not rel or len({os.path.dirname(r) for r in rel}) != 1 or len(exts) != 1:
        return ""
    stem = os.path.commonprefix(names)
    numbered = re.match(r"(.*?[-_.])\d", stem)  # the Hub's "train-00000-of-00002.parquet": "train-*.parquet"
    for head in ([numbered.group(1)] if numbered else []) + [stem]:
        pattern = os.path.join(path, os.path.dirname(rel[0]), head + "*" + next(iter(exts)))
        if sorted(os.path.realpath(p) for p in glob.glob(pattern)) == sorted(os.path.realpath(f) for f in files):
            return f", e.g. --dataset '{pattern}'"
    return ""


@contextlib.contextmanager
def quiet(*loggers: str) -> Iterator[None]:
    """`loggers`' records below CRITICAL dropped for the block (`datasets` logs the errors it
    raises; `huggingface_hub` notes dataset cards without metadata)."""
    logs = [logging.getLogger(name) for name in loggers]
    levels = [log_.level for log_ in logs]
    for log_ in logs:
        log_.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for log_, level in zip(logs, levels):
            log_.setLevel(level)
