"""What pins a run's input: the fingerprint of a dataset's rows, and the saved-dataset folder it
reads. Torch-free, so `layertap submit extract` compares a planned run's dataset with the one it
is given (as each task would, at its start) without importing the extractor."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import xxhash

from layertap.extract.dataset_files import DataFiles, data_files
from layertap.storage.errors import InputError


def load_saved(path: str):
    import datasets

    try:
        with open(os.path.join(path, "state.json")) as f:
            if json.load(f).get("_data_files") == []:
                raise InputError(f"dataset {path!r} has no rows; give a dataset with at least one row")
    except (OSError, json.JSONDecodeError):
        pass  # a DatasetDict folder, or not a dataset at all: load_from_disk says which
    try:
        ds = datasets.load_from_disk(path)
    except FileNotFoundError as e:
        raise InputError(f"dataset {path!r} is a folder but not a datasets save_to_disk folder "
                         f"(no dataset_info.json / state.json): {e}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" in ds:
            return ds["train"]
        if len(ds) == 1:
            return next(iter(ds.values()))
        raise InputError(f"dataset {path!r} holds splits {sorted(ds)}; save the one to extract "
                         f"on its own, or name it 'train'")
    return ds


def dataset_fingerprint(path: str, limit: int | None = None, s3: Mapping[str, Any] | None = None) -> str:
    """A hex id of the rows :func:`load_rows` would return, for a manifest to pin its input.

    Files are hashed in full (xxh3-128 runs at disk speed): a size+mtime shortcut would miss
    an edited file of the same size. A saved dataset folder already carries a content
    fingerprint that ``datasets`` maintains through every transform.
    """
    from layertap.extract.regenerated import is_regenerated, regenerated_fingerprint

    if is_regenerated(path):
        return regenerated_fingerprint(path, limit, s3)
    return fingerprint_of(path, data_files(path, s3), limit)


def fingerprint_of(path: str, source: DataFiles | None, limit: int | None) -> str:
    """`dataset_fingerprint` of the files `source` names (None: `path` is a save_to_disk folder)."""
    if source is None:
        ds = load_saved(os.path.expanduser(path))
        content = f"saved:{ds._fingerprint}:{len(ds)}"
    elif source.single:
        content = f"file:{_file_hash(source.files[0])}"
    else:  # each file's size and hash in order: not their names (a copied folder is the same data)
        content = f"files:{len(source.files)}:" + xxhash.xxh3_128(
            "|".join(_file_hash(f) for f in source.files).encode()).hexdigest()
    return xxhash.xxh3_128(f"v1|{content}|limit={limit}".encode()).hexdigest()


def _file_hash(path: str) -> str:
    """'SIZE:XXH3' of a file's bytes."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return f"{os.path.getsize(path)}:{h.hexdigest()}"
