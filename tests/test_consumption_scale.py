"""Request counts of the storage window at scale (manifests/consumption.py): deleting 1,000s of
consumed shards, and 1,000s of extraction workers waiting behind a full window. Real stores (a
local folder and the moto S3 server), counted by a thin wrapper rather than timed."""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

import fake_worker
from layertap.manifests import layout
from layertap.manifests.consumption import (WindowGate, at_rest, consumed_shards, data_objects, delete_consumed,
                                            record_consumed)
from layertap.manifests.manifest import load_manifest
from layertap.manifests.work import Gate
from layertap.manifests.records import CommitRecord, encode
from layertap.storage.store import ObjectStore, open_store

PAGE = 1000  # keys per S3 listing page and per DeleteObjects request


class Counting:
    """A real store that counts the requests S3 gets for each call: a listing one a page of 1,000
    keys, `delete_many` one per 1,000 keys, any other call one. What the store does inside a call
    (a local folder's `delete_many`, key by key) is not counted again."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self.requests: Counter[str] = Counter()
        self.listed: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def _count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.requests[kind] += n

    def total(self) -> int:
        return sum(self.requests.values())

    def get(self, key: str) -> bytes:
        self._count("get")
        return self.store.get(key)

    def put(self, key: str, data: bytes) -> None:
        self._count("put")
        self.store.put(key, data)

    def delete(self, key: str) -> None:
        self._count("delete")
        self.store.delete(key)

    def delete_many(self, keys) -> None:
        self._count("delete", math.ceil(len(keys) / PAGE))
        self.store.delete_many(keys)

    def list(self, prefix: str = "", start_after: str = ""):
        objects = list(self.store.list(prefix, start_after))
        self._count("list", max(1, math.ceil(len(objects) / PAGE)))
        with self._lock:
            self.listed.append(prefix)
        return iter(objects)


def committed_shards(store: ObjectStore, shards: range) -> None:
    """A data object and a commit record naming it for each shard: what `delete_consumed` reads."""

    def commit(s: int) -> None:
        key = layout.data_key(s, "a1")
        store.put(key, b"x" * 100)
        store.put(layout.commit_key(s), encode(CommitRecord(
            shard=s, data_key=key, bytes=100, xxh3_128="0" * 32, num_records=1, num_tokens=1, raw_bytes=100,
            sample_ids=[f"s{s}"], producer={}, attempt=1, started_at=0.0, committed_at=0.0)))

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(commit, shards))


def data_keys(store: ObjectStore) -> set[str]:
    return {o.key for o in store.list(layout.SHARDS)}


# -- deleting consumed shards ----------------------------------------------------------------------


K = 1_200  # more than one DeleteObjects request's worth


def consumed_run(store: ObjectStore, k: int = K) -> tuple[list[int], set[str]]:
    """`k` committed shards, every one consumed by rank 0 and all but the last by rank 1, with one of
    each case `delete_consumed` tells apart. Returns the shards it must delete and the data keys
    that must stay."""
    committed_shards(store, range(k))
    store.put(layout.data_key(5, "crashed"), b"y")  # an attempt of a consumed shard that died: goes too
    store.delete(layout.commit_key(7))  # consumed by its ids, but not committed (any more): its data stays
    store.put(layout.commit_key(8), b"{not json")  # a corrupt commit record: its data stays
    store.put(layout.consumed_marker_key(9), b"")  # a crash between marker and data: finished
    store.put(layout.consumed_marker_key(10), b"")  # deleted before: not deleted again
    store.delete(layout.data_key(10, "a1"))
    record_consumed(store, rank=0, world_size=2, shards=list(range(k)), step=1)
    record_consumed(store, rank=1, world_size=2, shards=list(range(k - 1)), step=1)
    gone = [s for s in range(k - 1) if s not in (7, 8, 10)]
    kept = {layout.data_key(s, "a1") for s in (7, 8, k - 1)}
    return gone, kept


def test_deleting_consumed_shards_batches_the_deletes(store, caplog):
    """1,200 shards consumed everywhere: the data objects go in two DeleteObjects requests, not one
    (plus the marker, plus a GET of the commit) per shard one after another; which shards go, and
    what stays, is as before."""
    gone, kept = consumed_run(store)
    counting = Counting(store)
    assert delete_consumed(counting) == gone
    assert data_keys(store) == kept
    assert consumed_shards(store) == set(gone) | {10}
    assert all(store.get(layout.consumed_marker_key(s)) == b"" for s in gone)
    assert "shard 8: consumed, but its commit record is unreadable" in caplog.text
    assert counting.requests["delete"] <= math.ceil((len(gone) + 1) / PAGE) == 2  # ~1,200 before
    assert counting.requests["put"] == len(gone) - 1  # a marker each (shard 9 had one already)
    assert delete_consumed(counting) == [] and data_keys(store) == kept  # idempotent


def test_a_crash_between_the_markers_and_the_deletes_is_finished_by_the_next_call(store):
    """Every marker is written before any data object is deleted: a crash in between leaves the data
    of marked shards only, which the next call deletes; nothing not consumed everywhere goes."""
    gone, kept = consumed_run(store, 50)
    everything = data_keys(store)

    class Crashing(Counting):
        def delete_many(self, keys) -> None:
            raise KeyboardInterrupt("killed")

    with pytest.raises(KeyboardInterrupt):
        delete_consumed(Crashing(store))
    assert consumed_shards(store) == set(gone) | {10} and data_keys(store) == everything
    assert delete_consumed(store) == gone and data_keys(store) == kept


def test_deleting_with_the_run_named_leaves_another_runs_markers(store_uri):
    """With `run_id`, the leftovers' markers are read side by side; one naming another run does not
    make its shard's data consumed."""
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    run_id = load_manifest(store).run_id
    for s in (1, 2):
        store.put(layout.consumed_marker_key(s), json.dumps({"run_id": "0ldrun0ldrun"}).encode())
    store.put(layout.consumed_marker_key(3), json.dumps({"run_id": run_id}).encode())
    assert delete_consumed(store, run_id=run_id) == [3]
    assert set(data_objects(store)) == {0, 1, 2, 4, 5, 6}


# -- gates waiting on a full window ----------------------------------------------------------------


M, LOOKS, RANKS = 10, 5, 2


def waiting_run(store_uri: str) -> tuple[ObjectStore, int]:
    """fake_worker's 7 shards, the first 3 consumed by both ranks of a trainer and deleted: a window
    of what is left is full, with nothing consumed in it."""
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    for rank in range(RANKS):
        record_consumed(store, rank=rank, world_size=RANKS, shards=[0, 1, 2], step=1)
    assert delete_consumed(store) == [0, 1, 2]
    return store, at_rest(store).bytes


def test_gates_waiting_on_a_full_window_read_the_consumption_records_once(store_uri):
    """M gates looking LOOKS times each at a full window, every look due a sweep (as when a long
    wait's looks are `max_poll_s` = `sweep_every_s` apart). Each look swept before: the manifest,
    the markers' listing (as large as the run), the watermarks' listing and every watermark. Now
    a look lists `shards/` and the watermarks' listing; each gate reads the manifest, the run's
    trainer claim (whose watermarks count) and the watermarks once; no gate lists the markers. The
    window stays shut throughout."""
    store, window = waiting_run(store_uri)
    counting = Counting(store)
    gates = [WindowGate(counting, window, sweep_every_s=0) for _ in range(M)]
    for _ in range(LOOKS):
        for gate in gates:
            assert gate.check().bytes >= window
    # before: M * LOOKS * (2 listings + a manifest GET + a markers' listing + RANKS GETs) + M GETs = 310
    assert counting.total() <= M * LOOKS * 2 + M * (2 + RANKS)  # 140
    assert counting.requests["get"] <= M * (2 + RANKS)
    assert layout.CONSUMED_SHARDS not in counting.listed and counting.requests["delete"] == 0

    # The trainer consumes shard 3 and is killed before deleting it: the first gate to look sweeps
    # and opens; the others find the window open in their listing of `shards/`, without a sweep.
    for rank in range(RANKS):
        record_consumed(store, rank=rank, world_size=RANKS, shards=[0, 1, 2, 3], step=2)
    assert all(gate.check().bytes < window for gate in gates)
    assert counting.listed.count(layout.CONSUMED_SHARDS) == 1
    assert set(data_objects(store)) == {4, 5, 6} and consumed_shards(store) == {0, 1, 2, 3}


def test_a_waiting_gate_opens_once_a_killed_trainers_shards_are_swept_and_waits_out_of_step(store_uri):
    """`gate()` waits while the window is full, its pauses jittered (1,000 workers held back
    together looked in step), and goes on once what a killed trainer consumed is deleted."""
    store, window = waiting_run(store_uri)
    pauses: list[float] = []

    def pause(s: float) -> None:
        pauses.append(s)
        if len(pauses) == 4:  # the trainer consumed shard 3, and was killed before deleting it
            for rank in range(RANKS):
                record_consumed(store, rank=rank, world_size=RANKS, shards=[0, 1, 2, 3], step=2)

    gate = WindowGate(store, window, poll_s=1.0, max_poll_s=8.0, sweep_every_s=0, sleep=pause)
    store.delete(layout.commit_key(6))  # the shard the gate's worker would claim next: not committed
    assert gate(6, lambda s: True) is Gate.WAITED and len(pauses) == 4
    assert at_rest(store).bytes < window and 3 in consumed_shards(store)
    nominal = [1.0, 2.0, 4.0, 8.0]
    assert all(0.75 * n <= p <= 1.25 * n for p, n in zip(pauses, nominal)) and pauses != nominal
