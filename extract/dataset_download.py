"""Data files on S3 as a `--dataset`: one object (`s3://bucket/data/chats.jsonl`) or a glob of
them (`s3://bucket/ultrachat/data/train_sft-*.parquet`), fetched once per machine into a local
cache that `datasets` then reads as it reads local files (the same rows, and the same fingerprint
as the same bytes on a local disk).

Each object is fetched whole, streamed to disk (`S3Store.get_to_file`: its MD5 ETag checked where it
is one, a single PUT's) under a name made of its URI, size and ETag, by one process of a machine at a time (a lock
file): the ranks and tasks on one node fetch it once, and an object written again is fetched
again. The cache is `$LAYERTAP_DATA_CACHE`, else ~/.cache/layertap/datasets; it holds the
dataset's size (a Hub chat dataset: a few GB), never activations, and is never pruned. `*`, `?`
and `[...]` match within a key's folder, `**` across folders, as a local glob does. The S3 server
and its settings are the command's: the "s3" settings of its --config over the environment's
(AWS_*, LAYERTAP_S3_*), as for its --out.
"""

from __future__ import annotations

import fcntl
import fnmatch
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import xxhash

from layertap.extract.dataset_files import FILE_FORMATS, GLOB_CHARS
from layertap.storage.errors import InputError, MissingInput
from layertap.storage.store import ObjectInfo, open_configured_store
from layertap.storage.units import size

if TYPE_CHECKING:
    from layertap.storage.s3 import S3Store

log = logging.getLogger(__name__)

CACHE_ENV = "LAYERTAP_DATA_CACHE"


def is_s3_data(path: str) -> bool:
    """Whether `path` names S3 data files (an object of a data file's type, or a glob), not a
    `layertap regenerate` output (a prefix)."""
    return path.startswith("s3://") and (bool(GLOB_CHARS.search(path)) or path.lower().endswith(tuple(FILE_FORMATS)))


def listed_s3_data(path: str, s3: Mapping[str, Any] | None = None) -> tuple[S3Store, list[ObjectInfo]]:
    """The bucket's store and the objects `path` names, in key order: one listing, of the keys that
    begin as the glob's literal start does (not the whole folder, nor the bucket). `s3`: the "s3"
    settings of the command's --config."""
    bucket, _, pattern = path[len("s3://"):].partition("/")
    if not bucket or not pattern or pattern.endswith("/"):
        raise InputError(f"dataset {path!r}: give the objects' bucket and key, e.g. s3://bucket/data/train-*.parquet")
    store = open_configured_store(f"s3://{bucket}", s3)
    glob_at = m.start() if (m := GLOB_CHARS.search(pattern)) else len(pattern)
    wanted = pattern.split("/")
    listed = [o for o in store.list(pattern[:glob_at]) if _matches(wanted, o.key.split("/"))]
    if not listed:
        raise MissingInput(f"dataset {path!r} names no object on S3" + (" (a glob that matches none)" if m else ""))
    return store, sorted(listed, key=lambda o: o.key)


def fetch_s3_data(path: str, s3: Mapping[str, Any] | None = None) -> list[str]:
    """The local copies of the objects `path` names, in key order (fetched where the cache lacks them)."""
    store, listed = listed_s3_data(path, s3)
    return [_fetched(store, o) for o in listed]


def _matches(pattern: list[str], key: list[str]) -> bool:
    """Whether a key's folders and name match a glob's: `**` any number of them (none too), other
    parts one each as `fnmatch` (`*`, `?`, `[0-4]`, `[!a]`) within it."""
    if not pattern:
        return not key
    if pattern[0] == "**":
        return any(_matches(pattern[1:], key[i:]) for i in range(len(key) + 1))
    return bool(key) and fnmatch.fnmatchcase(key[0], pattern[0]) and _matches(pattern[1:], key[1:])


def _fetched(store: S3Store, o: ObjectInfo) -> str:
    """The local copy of object `o` of `store`, fetched now if the cache lacks this version of it:
    by one process of a machine at a time (a lock per object; the others then find it fetched)."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "layertap", "datasets")
    uri = f"{store.uri.rstrip('/')}/{o.key}"
    folder = os.path.join(root, xxhash.xxh3_64(f"{uri}|{o.size}|{o.version}".encode()).hexdigest())
    local = os.path.join(folder, os.path.basename(o.key))
    if os.path.isfile(local) and os.path.getsize(local) == o.size:
        return local
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.isfile(local) and os.path.getsize(local) == o.size:  # fetched while this process waited
            return local
        log.info("dataset: fetching %s (%s) into %s", uri, size(o.size), root)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".part-")
        try:
            with os.fdopen(fd, "wb") as f:
                got = store.get_to_file(o.key, f)  # its MD5 ETag checked where it is one (a single PUT's)
            if got != o.size:  # written again since it was listed: the next fetch takes its new version
                raise InputError(f"dataset object {uri} changed while it was fetched ({size(o.size)} listed, "
                                 f"{size(got)} read); run the command again")
            os.chmod(tmp, 0o666 & ~_umask())  # as a plain file would be: a cache shared by a node's users
            os.replace(tmp, local)  # whole or not at all
        except BaseException:
            os.unlink(tmp)
            raise
    return local


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
