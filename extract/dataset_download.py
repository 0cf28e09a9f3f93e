"""Data files on S3 as a `--dataset`: one object (`s3://bucket/data/chats.jsonl`) or a glob of
them (`s3://bucket/ultrachat/data/train_sft-*.parquet`), fetched once per machine into a local
cache that `datasets` then reads as it reads local files (the same rows, and the same fingerprint
as the same bytes on a local disk).

Each object is fetched whole (its MD5 ETag checked, `S3Store.get`) under a name made of its URI,
size and ETag: the tasks of an array on one node fetch it once, and an object written again is
fetched again. The cache is `$LAYERTAP_DATA_CACHE`, else ~/.cache/layertap/datasets; it holds the
dataset's size (a Hub chat dataset: a few GB), never activations. `*` and `?` match within a key's
folder, `**` across folders, as a local glob does.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

import xxhash

from layertap.storage.errors import InputError, MissingInput
from layertap.storage.store import ObjectInfo, ObjectStore, open_store
from layertap.storage.units import size

log = logging.getLogger(__name__)

CACHE_ENV = "LAYERTAP_DATA_CACHE"
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")
_GLOB = re.compile(r"[*?[]")


def is_s3_data(path: str) -> bool:
    """Whether `path` names S3 data files (an object of a data file's type, or a glob), not a
    `layertap regenerate` output (a prefix)."""
    return path.startswith("s3://") and (bool(_GLOB.search(path)) or path.lower().endswith(DATA_SUFFIXES))


def fetch_s3_data(path: str) -> list[str]:
    """The local copies of the objects `path` names, in key order (fetched where the cache lacks them)."""
    bucket_and_key = path[len("s3://"):]
    glob_at = m.start() if (m := _GLOB.search(bucket_and_key)) else len(bucket_and_key)
    folder = bucket_and_key[:glob_at].rpartition("/")[0]
    if "/" not in bucket_and_key[:glob_at] or not folder:
        raise InputError(f"dataset {path!r}: give the objects' bucket and key, e.g. s3://bucket/data/train-*.parquet")
    store = open_store(f"s3://{folder}")
    pattern = bucket_and_key[len(folder) + 1:]
    matcher = re.compile(_regex(pattern))
    start = pattern[:_GLOB.search(pattern).start()] if _GLOB.search(pattern) else pattern
    listed = sorted((o for o in store.list(start.rpartition("/")[0] + "/" if "/" in start else "")
                     if matcher.fullmatch(o.key)), key=lambda o: o.key)
    if not listed:
        raise MissingInput(f"dataset {path!r} names no object on S3" + (" (a glob that matches none)"
                                                                         if _GLOB.search(pattern) else ""))
    return [_fetched(store, o) for o in listed]


def _regex(pattern: str) -> str:
    """A key glob as a regular expression: `**/` any folders (or none), `**` anything, `*` and `?`
    within a folder, `[...]` a character class."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + re.escape(body[1:]) if body[0] == "!" else re.escape(body)) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


def _fetched(store: ObjectStore, o: ObjectInfo) -> str:
    """The local copy of object `o` of `store`, fetched now if the cache lacks this version of it."""
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "layertap", "datasets")
    uri = f"{store.uri.rstrip('/')}/{o.key}"
    name = xxhash.xxh3_64(f"{uri}|{o.size}|{o.version}".encode()).hexdigest()
    local = os.path.join(root, name, os.path.basename(o.key))
    if os.path.isfile(local) and os.path.getsize(local) == o.size:
        return local
    os.makedirs(os.path.dirname(local), exist_ok=True)
    log.info("dataset: fetching %s (%s) into %s", uri, size(o.size), root)
    data = store.get(o.key)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(local), prefix=".part-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, local)  # whole or not at all: another task of the node may read it next
    except BaseException:
        os.unlink(tmp)
        raise
    return local
