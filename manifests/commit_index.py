"""Every commit record of a run in one object, so that a reader starts with a listing and one GET
instead of a GET per shard.

Why: docs/ESTIMATE.md's 27B run has 25,383 shards. Read one by one on each of 1,000 training
ranks, that is 25 M GETs per start; S3 serves ~5,500 GETs/s per prefix, so over an hour of
throttling before the first step, again at every restart.

`index/commits.json.zst` (JSON in one zstd frame) holds, per commit key, the size and version
(S3's ETag) its listing showed and the record itself. It is derived data, rewritten whole: a
reader still lists `commits/` (the truth of "done") and takes an entry only while the listing
shows that commit with the same size and version; every other commit it reads on its own. A
commit that `layertap verify` withdrew is no longer listed, and a redone one is a new object with
a new version (S3's LastModified, at one-second resolution, could not tell), so a stale snapshot
never stands in for either. An index that is missing, unreadable or of another
version is ignored. Reading never writes: a reader that found the index lacking hands back the
index it would write, and one reader (the trainer's rank 0, before the others start) stores it
with `write_index`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zstandard

from layertap.manifests import layout
from layertap.manifests.manifest import ManifestError
from layertap.manifests.records import CommitRecord, FeedCommit, decode_commit
from layertap.storage.store import ObjectInfo, ObjectNotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

INDEX_FORMAT = "layertap-commit-index"
INDEX_VERSION = 1
# With `instead`: the records left to read from which one GET of the index beats a GET each (256 GETs,
# 16 at a time, take ~0.3 s on S3, about what parsing the index of 10,000 shards takes)
INDEX_FROM = 256


@dataclass(frozen=True, slots=True)
class Commits:
    """A run's commit records in shard order, and the index that holds all of them when the
    stored one lacked some (None: it lacked none, the store keeps no versions to key it by, or
    `instead` declined some: such an index would lack them).
    With `read_commits(instead=...)`, FeedCommits stand for the records it declined."""

    records: list[CommitRecord | FeedCommit]
    new_index: bytes | None


def read_commits(store: ObjectStore, threads: int = 16,
                 instead: Callable[[int], FeedCommit | None] | None = None) -> Commits:
    """The run's commit records: one listing of `commits/`, the index, and a GET for each listed
    commit the index does not hold unchanged, unless `instead(shard)` gives what stands for it
    (a reader that needs only the counts of some shards). Writes nothing (see `write_index`).

    With `instead`, the index is read only when INDEX_FROM or more records are left to read, and
    only their entries are decoded: a follow consumer among thousands needs a few of a run's
    records, and parsing and decoding the whole index of a 50,000-shard run cost each consumer
    process ~160 MB and 1.5 s, where a few dozen GETs take a fraction of a second."""
    # By shard id, not key: past shard 999,999 the ids outgrow their 6-digit padding, and a
    # listing's key order is no longer shard order ("1000000" sorts before "999999").
    listing = sorted((o for o in store.list(layout.COMMITS) if _is_commit(o.key)),
                     key=lambda o: layout.shard_of(o.key, layout.COMMITS))
    told: dict[str, FeedCommit] = {}
    if instead is not None:
        for o in listing:
            if (stand_in := instead(layout.shard_of(o.key, layout.COMMITS))) is not None:
                told[o.key] = stand_in
    needed = [o for o in listing if o.key not in told]
    snapshot = _load(store, {o.key for o in needed}) if instead is None or len(needed) >= INDEX_FROM else {}
    root = store.uri.rstrip("/")
    records: dict[str, CommitRecord] = {}
    indexed: dict[str, dict] = {}  # listed commits the snapshot holds unchanged, as JSON objects
    for o in needed:
        entry = snapshot.get(o.key)
        if entry is not None and o.version and (entry[0], entry[1]) == (o.size, o.version):
            try:
                records[o.key] = decode_commit(entry[2], f"{root}/{o.key}")
                indexed[o.key] = entry[2]
            except ManifestError:  # read the commit itself: its own error, if any, names it
                pass
    todo = [o for o in needed if o.key not in records]

    def get(o: ObjectInfo) -> tuple[ObjectInfo, bytes | None]:
        try:
            return o, store.get(o.key)
        except ObjectNotFound:  # withdrawn by `verify` since the listing
            return o, None

    fresh: list[tuple[ObjectInfo, bytes]] = []
    if todo:
        with ThreadPoolExecutor(max(1, min(threads, len(todo)))) as pool:
            for o, raw in pool.map(get, todo):
                if raw is not None:
                    records[o.key] = decode_commit(raw, f"{root}/{o.key}")
                    fresh.append((o, raw))
    new_index = None
    if not told and any(o.version for o, _ in fresh):  # a store without versions gets no index
        kept = {o.key: (o.size, o.version, indexed[o.key]) for o in listing if o.key in indexed}
        kept.update({o.key: (o.size, o.version, json.loads(raw)) for o, raw in fresh if o.version})
        new_index = _encode(kept)
    log.debug("%s: %d commits, %d from %s, %d declined", root, len(records), len(records) - len(fresh),
              layout.COMMIT_INDEX, len(told))
    return Commits([records.get(o.key) or told[o.key] for o in listing if o.key in records or o.key in told],
                   new_index)


def write_index(store: ObjectStore, new_index: bytes) -> bool:
    """Store the index `read_commits` built (`Commits.new_index`), so later readers get every
    commit it holds from one GET. Meant for one writer (the trainer's rank 0) before the others
    read; best effort: a failure (e.g. read-only credentials) is logged, and only makes later
    starts slower. True if written."""
    try:
        store.put(layout.COMMIT_INDEX, new_index)
    except StoreError as e:
        log.warning("could not write %s (%s): each start reads every commit", layout.COMMIT_INDEX, e)
        return False
    return True


def _is_commit(key: str) -> bool:
    shard = layout.shard_of(key, layout.COMMITS)
    return shard is not None and key == layout.commit_key(shard)


def _load(store: ObjectStore, keys: set[str]) -> dict[str, tuple[int, str, dict]]:
    """{commit key: (size, version, record's JSON object)} from the index, for those of `keys` it
    holds; {} when there is none to use."""
    where = f"{store.uri.rstrip('/')}/{layout.COMMIT_INDEX}"
    try:
        data = store.get(layout.COMMIT_INDEX)
    except ObjectNotFound:
        return {}
    except StoreError as e:
        log.warning("could not read %s (%s): reading every commit instead", where, e)
        return {}
    try:
        obj = json.loads(zstandard.ZstdDecompressor().decompress(data))
        if obj.get("format") != INDEX_FORMAT or obj.get("version") != INDEX_VERSION:
            raise ValueError(f"format {obj.get('format')!r} version {obj.get('version')!r}, "
                             f"this layertap reads {INDEX_FORMAT!r} version {INDEX_VERSION}")
        return {key: (int(size), str(version), record) for key, (size, version, record) in obj["commits"].items()
                if key in keys}
    except (zstandard.ZstdError, ValueError, TypeError, AttributeError, KeyError) as e:
        log.warning("ignoring %s (%s): reading every commit instead", where, e)
        return {}


def _encode(entries: dict[str, tuple[int, str, dict]]) -> bytes:
    obj = {"format": INDEX_FORMAT, "version": INDEX_VERSION,
           "commits": {key: [size, version, record] for key, (size, version, record) in sorted(entries.items())}}
    return zstandard.ZstdCompressor(level=3).compress(json.dumps(obj, separators=(",", ":")).encode())
