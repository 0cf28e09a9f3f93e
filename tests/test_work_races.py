"""`WorkQueue` and `Claim` against another worker acting at the worst moment, on a local folder and
on the moto S3 server over HTTP: a shard committed between a worker's scan and its lease, and a
takeover seen by the holder before the taker has removed the holder's lease. Each interleaving is
forced by running (or blocking) the other worker inside one store call of the first."""

from __future__ import annotations

import threading

import fake_worker
from layertap.manifests import layout
from layertap.manifests.records import Producer, decode_commit
from layertap.manifests.state import scan_shard
from layertap.manifests.work import Claim, WorkQueue, lease_attempt
from layertap.storage.reader import verify_shard
from layertap.storage.store import ObjectStore, open_store
from test_lease_races import Paused, _claim
from test_manifest import _write_and_commit


def _assert_committed_once_by(store: ObjectStore, claim: Claim) -> None:
    """The shard's one commit names `claim`'s data, which is intact and the only data object;
    no lease is left, and no failure was recorded."""
    key = layout.commit_key(claim.shard)
    record = decode_commit(store.get(key), key)
    assert record.data_key == claim.data_key and record.producer["token"] == claim.queue.producer.token
    assert [o.key for o in store.list(layout.SHARDS)] == [claim.data_key]
    assert verify_shard(store, claim.data_key, expected_xxh3_128=record.xxh3_128).ok
    assert [o.key for o in store.list(layout.LEASES)] == []


def test_a_shard_committed_between_the_scan_and_the_lease_is_not_claimed(store_uri):
    """Worker A finds shard 0 free (its pass's scan and its fresh look at the shard); before A's
    lease lands, worker B claims the shard, writes it and commits, releasing its lease on the way.
    A's create of that same lease key (generation 1) then succeeds: nothing but the commit record
    says the shard is done. A must back off rather than hand its caller a claim on a committed
    shard (a whole forward pass for nothing, then a refused commit), and leave B's commit, data
    and lease state as they were."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    assert len(manifest.shards) == 1
    rivals: list[Claim] = []
    created: list[bool] = []
    real_put_if_absent = store.put_if_absent

    def rival_commits_first(key, data):
        if key.startswith(layout.lease_prefix(0)) and not rivals:
            # B, a worker of its own (its own store client), runs the whole shard to its commit
            other = WorkQueue(open_store(store_uri), manifest, Producer.current(1), ttl_s=60, shards=[0], poll_s=0.1)
            rival = next(iter(other))
            with rival:
                _write_and_commit(rival)
            rivals.append(rival)
            assert rival.lease_key == key  # the very key A is creating: B's release deleted it
            created.append(real_put_if_absent(key, data))
            return created[-1]
        return real_put_if_absent(key, data)

    store.put_if_absent = rival_commits_first
    queue = WorkQueue(store, manifest, Producer.current(0), ttl_s=60, shards=[0], poll_s=0.1)
    claims: list[Claim] = []
    try:
        for claim in queue:
            claims.append(claim)
    finally:
        for claim in claims:
            claim.release()
    assert rivals and created == [True]  # A scanned the shard free and won its lease's create
    assert claims == [] and not queue.given_up
    _assert_committed_once_by(store, rivals[0])
    assert list(store.list(layout.FAILURES)) == []


def test_a_holder_stops_once_a_newer_generation_exists_though_its_own_lease_is_intact(store_uri):
    """Worker A's heartbeat stalls past its ttl (a paused process); worker B takes shard 0 over:
    it creates generation 2, then, before it deletes A's generation 1, stalls too (a slow LIST, a
    signal, or killed right there). A's heartbeat resumes and finds its own lease still there and
    still naming A: only the newer generation says that the shard is B's now. A must abandon at
    once (`Claim.lost`, which the worker's forward pass polls) instead of renewing its lease and
    running the shard beside B until B gets round to deleting A's lease (never, if B was killed
    there: then A and B both run the shard to its end). Its stop is recorded as one from outside,
    not as a failure of the shard's, and B's commit is the one."""
    ttl = 2.0  # A's heartbeat looks every 0.5 s; B waits ~2 s for A's lease to go stale
    sa, sb = open_store(store_uri), open_store(store_uri)
    manifest = fake_worker.plan(sa, samples=8, shard_bytes=100000)
    assert len(manifest.shards) == 1
    look = Paused(sa, "list", "lease-")  # A's heartbeat, before its first look at the leases
    remove_old = Paused(sb, "delete_many", "taker")  # B, after its create, before deleting older leases
    a = _claim(sa, manifest, ttl)
    got: dict[str, Claim] = {}

    def take_over() -> None:
        got["b"] = next(iter(WorkQueue(sb, manifest, Producer.current(1), ttl_s=ttl, shards=[0], poll_s=0.1)))

    taker = threading.Thread(target=take_over, name="taker", daemon=True)
    try:
        assert look.reached.wait(10)
        taker.start()  # waits for A's lease to go stale, then claims generation 2
        assert remove_old.reached.wait(60), "B did not take the stale lease over"
        leases = sorted(o.key for o in sb.list(layout.lease_prefix(0)))
        assert [layout.parse_lease(k)[1] for k in leases] == [1, 2]
        assert lease_attempt(sb, a.lease_key) == a.data_key  # A's own lease: intact, and naming A
        look.resume()  # A's heartbeat looks at the leases now
        assert a.lost.wait(10), "A kept a lease that a newer generation took over"
        assert not sb.exists(a.beat_key)  # and renewed nothing
    finally:
        for pause in (look, remove_old):
            if pause.reached.is_set():
                pause.resume()
        taker.join(60)
    b = got["b"]
    assert b.generation == 2 and not sb.exists(a.lease_key)  # B went on and removed generation 1
    a.__exit__(RuntimeError, RuntimeError("stopped: the lease was taken over"), None)  # the worker abandons
    assert scan_shard(sb, manifest, 0).attempt_failures(0) == 0  # a stop from outside, not the shard's failure
    with b:
        _write_and_commit(b)
    _assert_committed_once_by(sb, b)
