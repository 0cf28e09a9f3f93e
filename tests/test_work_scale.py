"""The work queue where a run is large or its store unwell: a shard whose store keeps failing is
given up after a bound, not retried by every worker forever; and the end of a run sweeps what
killed attempts left once, not once per worker. On a local folder and on the moto S3 server over
HTTP; requests are counted, never timed."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

import fake_worker
from faultproxy import FaultProxy
from layertap.manifests import layout, work
from layertap.manifests.manifest import Manifest
from layertap.manifests.records import Producer
from layertap.manifests.state import scan
from layertap.manifests.work import STORE_FAILURES, Claim, WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.local import LocalStore
from layertap.storage.s3 import S3Store
from layertap.storage.store import ObjectStore, TransientStoreError, open_store
from layertap.storage.writer import ShardWriter
from layertap.train.follow import pending_work

DISK_FULL = ("put of commits/000000.json failed: XMinioStorageFull: Storage backend has reached its minimum free "
             "drive threshold. Please delete a few objects to proceed. (tried 8 times)")


def _extract_and_commit(claim: Claim, manifest: Manifest) -> bool:
    """The claim's shard written as `fake_worker` writes it, then committed."""
    meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    with ShardWriter(claim.queue.store.open_writer(claim.data_key), meta) as w:
        for i in range(claim.plan.start, claim.plan.end):
            w.write_sample(fake_worker.make_sample(i))
        info = w.close()
    return claim.commit(info)


def _fail_commits(claims: Iterator[Claim], manifest: Manifest, n: int) -> None:
    """Take `n` claims of the queue, each commit failing with the store."""
    for _ in range(n):
        claim = next(claims, None)
        assert claim is not None, "the queue ended"
        with pytest.raises(TransientStoreError), claim:
            _extract_and_commit(claim, manifest)


def _assert_given_up_by_the_store(store: ObjectStore, manifest: Manifest, queue: WorkQueue, failed: int,
                                  error: str) -> None:
    assert queue.given_up == {0}
    keys = scan(store, manifest).failures[0]
    assert len(keys) == failed and all(k.endswith(layout.STORE_STOPPED) for k in keys)
    (verdict,) = store.list(layout.GIVEN_UP)
    record = json.loads(store.get(verdict.key))
    assert record["store_failures"] == failed and error in record["error"], record
    assert pending_work(store, manifest, set()).over  # a follow trainer ends its epoch without it


def test_a_shard_whose_commit_the_store_always_fails_is_given_up_after_a_bound(store_uri, caplog, monkeypatch):
    """A store failing one shard for good, in a way classed transient (MinIO's 507 when its disk
    is full): its failures are stops, not counted at --retries, so every worker retried the shard
    forever, a failure record each time. Past `STORE_FAILURES` of them in one run, over at least
    `OUTAGE_S`, it is given up, saying why and how to go on; the same command, once the store is
    healthy, finishes it."""
    caplog.set_level(logging.ERROR, logger=work.__name__)
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    assert len(manifest.shards) == 1
    create = store.put_if_absent

    def disk_full_for_the_commit(key: str, data: bytes) -> bool:
        if key == layout.commit_key(0):
            raise TransientStoreError(DISK_FULL)
        return create(key, data)

    store.put_if_absent = disk_full_for_the_commit
    queue = WorkQueue(store, manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.05)
    claims = iter(queue)
    _fail_commits(claims, manifest, STORE_FAILURES + 2)  # past the bound, within seconds: an outage yet
    monkeypatch.setattr(work, "OUTAGE_S", 0.0)  # and now longer than workers ride one out
    assert next(claims, None) is None, "the shard the store keeps failing is tried on and on"
    _assert_given_up_by_the_store(store, manifest, queue, STORE_FAILURES + 2, "XMinioStorageFull")
    (said,) = [r.getMessage() for r in caplog.records if "giving it up" in r.getMessage()]
    assert "XMinioStorageFull" in said and "the same command finishes it" in said

    store.put_if_absent = create  # the store is healthy again: a rerun tries the shard anew
    rerun = WorkQueue(open_store(store_uri), manifest, Producer.current(1), ttl_s=5, retries=0, poll_s=0.05)
    claims = iter(rerun)
    with next(claims) as claim:
        assert _extract_and_commit(claim, manifest)
    assert list(claims) == [] and not rerun.given_up


def test_a_commit_answered_500_on_every_try_is_given_up_after_a_bound(s3_endpoint, s3_bucket, monkeypatch):
    """The same through boto3 and a real server: every PUT of the shard's commit record answered
    500 InternalError (one try a request). The proxy counts the commits tried."""
    monkeypatch.setattr(work, "OUTAGE_S", 0.0)  # the count alone decides
    prefix = f"s3://{s3_bucket}/full"
    manifest = fake_worker.plan(open_store(prefix), samples=8, shard_bytes=100000)
    is_commit = lambda method, path: method == "PUT" and "/commits/000000.json" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("500",), match=is_commit) as proxy:
        store = open_store(prefix, endpoint_url=proxy.url, max_attempts=1)
        queue = WorkQueue(store, manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.05)
        claims = iter(queue)
        _fail_commits(claims, manifest, STORE_FAILURES + 1)
        assert next(claims, None) is None, "the shard the store keeps failing is tried on and on"
        assert proxy.counts["500"] == STORE_FAILURES + 1
    _assert_given_up_by_the_store(open_store(prefix), manifest, queue, STORE_FAILURES + 1, "InternalError")


def test_stops_from_outside_are_never_counted_however_many(store_uri, monkeypatch):
    """Preemptions and takeovers say nothing of the shard nor of the store: past the store's bound
    of them, a transient store error among them, the shard is still claimed."""
    monkeypatch.setattr(work, "OUTAGE_S", 0.0)  # the count alone would decide
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    queue = WorkQueue(store, manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.05)
    claims = iter(queue)
    for n in range(STORE_FAILURES + 2):
        claim = next(claims)
        if n % 2:  # taken over, then its commit met the store failing
            with pytest.raises(TransientStoreError), claim:
                claim.lost.set()
                raise TransientStoreError("put of commits/000000.json failed: SlowDown (tried 8 times)")
        else:  # preempted
            with pytest.raises(KeyboardInterrupt), claim:
                raise KeyboardInterrupt
    keys = scan(store, manifest).failures[0]
    assert len(keys) == STORE_FAILURES + 2
    assert all(k.endswith(layout.STOPPED) and not k.endswith(layout.STORE_STOPPED) for k in keys)
    claim = next(claims)
    assert claim.shard == 0 and not queue.given_up
    claim.release()


class Sweeps:
    """Counts the listings only a sweep makes (all of shards/, every pending upload) over stores
    shared by `n` workers, and holds each worker at its look at the sweep's claims until all `n`
    are there: workers finishing at the same moment, each having scanned the run before any swept."""

    def __init__(self, n: int):
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._together = threading.Barrier(n, timeout=60)

    def wrap(self, store: ObjectStore) -> ObjectStore:
        listing, uploads = store.list, store.list_pending_uploads

        def list_(prefix: str = "", *args, **kwargs):
            if prefix == layout.SHARDS:
                self._count("shards/")
            if prefix.startswith(layout.SWEEPS) and not self._together.broken:
                self._together.wait()
            return listing(prefix, *args, **kwargs)

        def pending(prefix: str = ""):
            if not prefix:
                self._count("uploads")
            return uploads(prefix)

        store.list, store.list_pending_uploads = list_, pending
        return store

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1


def _plant_leftovers(store: ObjectStore) -> tuple[str, str]:
    """What a killed attempt leaves on a committed shard: its lease (stale: a 1 ms ttl), and a
    data object of its own."""
    lease, orphan = layout.lease_key(1, 7, 0.001), layout.data_key(2, "0123456789abcdef")
    store.put(orphan, b"x")
    _plant_stale(store, lease)
    return lease, orphan


def _plant_stale(store: ObjectStore, lease: str) -> None:
    """Past its ttl by the next scan's clock (ours: `_finish` sets the offset 0), which starts before
    it lists the lease: on S3 a second may pass first (LastModified counts as the end of its second)."""
    store.put(lease, b"{}")
    [written] = [o.modified for o in store.list(lease) if o.key == lease]
    while time.time() <= written + 0.01:
        time.sleep(0.01)


def _finish(store_uri: str, manifest: Manifest, sweeps: Sweeps, ranks: range) -> None:
    """Workers that find every shard committed, side by side: each yields nothing and ends."""
    stores = [open_store(store_uri) for _ in ranks]
    for store in stores:
        store._clock_offset = 0.0  # moto runs here: a lease of a 1 ms ttl is stale at once, as on a folder
    queues = [WorkQueue(sweeps.wrap(store), manifest, Producer.current(r), world_size=len(ranks), poll_s=0.05)
              for r, store in zip(ranks, stores)]
    results: list[list[Claim]] = []
    threads = [threading.Thread(target=lambda q=q: results.append(list(q))) for q in queues]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [[]] * len(ranks)


def test_the_end_of_a_run_is_swept_once_not_once_per_worker(store_uri):
    """Every worker swept once its candidates were all committed: at 1,000 workers and 150,000
    shards, ~150,000 LISTs within seconds. Four workers finishing together sweep once, and still
    remove what a killed attempt left; one finishing later does not sweep again, unless its scan
    shows a new leftover."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=16)
    assert len(manifest.shards) >= 3
    fake_worker.work(store_uri, samples=16)  # commits every shard, and sweeps
    lease, orphan = _plant_leftovers(store)

    sweeps = Sweeps(4)
    _finish(store_uri, manifest, sweeps, range(4))
    assert sweeps.counts == {"shards/": 1, "uploads": 1}
    assert not store.exists(lease) and not store.exists(orphan)

    sweeps = Sweeps(1)
    _finish(store_uri, manifest, sweeps, range(1))  # a worker finishing later: swept already
    assert not sweeps.counts

    _plant_stale(store, lease)  # an attempt killed since (one a sweep spared as still at work)
    _finish(store_uri, manifest, sweeps, range(1))
    assert sweeps.counts == {"shards/": 1, "uploads": 1} and not store.exists(lease)


def test_a_sweep_left_unfinished_is_taken_over_once_its_claim_is_old(store_uri, monkeypatch):
    """A worker killed while it swept leaves its claim and no mark of a sweep done: the others
    skip the sweep while the claim is young, and one takes it over once it is `SWEEP_TTL_S` old."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=16)
    fake_worker.work(store_uri, samples=16)  # commits every shard, and sweeps
    (claim, done) = sorted(o.key for o in store.list(layout.SWEEPS))
    assert done == claim + work.SWEPT
    killed = claim[: -len("000001")] + "000002"  # the next sweep's claim, its worker killed
    store.put(killed, b"{}")
    _, orphan = _plant_leftovers(store)

    sweeps = Sweeps(1)
    _finish(store_uri, manifest, sweeps, range(1))
    assert not sweeps.counts and store.exists(orphan)
    monkeypatch.setattr(work, "SWEEP_TTL_S", 0.0)
    _finish(store_uri, manifest, sweeps, range(1))
    assert sweeps.counts == {"shards/": 1, "uploads": 1} and not store.exists(orphan)
    assert store.exists(killed[: -len("000002")] + "000003" + work.SWEPT)


def test_the_store_failure_bound_spans_the_last_failures_not_the_first():
    """A shard the store failed once early, then fast within a later outage, is not given up
    within seconds of that outage: the span is of the last bound + 1 failures (review finding)."""
    key = lambda ms: layout.failure_key(3, ms, "tok", 1, by_store=True)
    burst = [key(3_600_000 + 100 * i) for i in range(STORE_FAILURES + 1)]  # 21 failures within 2 s
    assert not work.store_gave_out([key(0), *burst], STORE_FAILURES)
    spread = [key(40_000 * i) for i in range(STORE_FAILURES + 1)]  # 21 failures over 800 s
    assert work.store_gave_out(spread, STORE_FAILURES)
    assert not work.store_gave_out(spread[1:], STORE_FAILURES)  # no more than the bound
    # failing fast for good: 48 attempts 13 s apart (a store answering BadDigest to every upload of the
    # shard), the last 21 within 260 s: given up once the streak spans OUTAGE_S, not tried forever
    fast = [key(13_000 * i) for i in range(48)]
    assert not work.store_gave_out(fast[:46], STORE_FAILURES)  # 585 s so far
    assert work.store_gave_out(fast, STORE_FAILURES)
    gap = [key(0), key(int(work.STREAK_GAP_S * 1000) + 1), *(key(4_000_000 + 13_000 * i) for i in range(30))]
    assert not work.store_gave_out(gap, STORE_FAILURES)  # two streaks apart: the newest spans 377 s


def test_a_store_stop_newer_than_a_verdict_keeps_the_shard_pending(tmp_path):
    """A worker still trying a shard another gave up (its store failing now) makes the verdict
    stale for a follow trainer, as a newer failure of the shard's own does."""
    from layertap.manifests.state import RunState

    st = RunState(manifest=None, now=0.0)
    st.failures[3] = [layout.failure_key(3, 1_000, "a", 1), layout.failure_key(3, 5_000, "b", 2, by_store=True),
                      layout.failure_key(3, 9_000, "c", 3, stopped=True)]
    assert st.last_failure_ms(3) == 5_000  # the preemption is no attempt of the shard's; the store's stop is


def test_idle_passes_list_the_feed_and_a_withdrawn_shard_is_redone_at_once(store_uri, monkeypatch):
    """1,000 workers idle near a run's end listed every commit record on each pass (~96 LIST
    pages at 90,000 shards, every <=30 s each). A worker waiting on another's shard now lists the
    feed keys since its last pass, and every commit record only at its start and to find the run
    done (`work.CommitView`); a shard `layertap verify` withdraws meanwhile is redone at its next
    pass, not at the next full look."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    last = len(manifest.shards) - 1
    fake_worker.work(store_uri, shards=list(range(last)))
    other = layout.lease_key(last, 1, 600)  # another worker's, alive
    store.put(other, json.dumps({"holder": {"host": "elsewhere", "pid": 1, "token": "t"}}).encode())

    scans: list[bool] = []  # whether each pass's look listed every commit record
    real_scan = work.scan
    monkeypatch.setattr(work, "scan", lambda *a, **kw: scans.append(kw.get("with_commits", True)) or real_scan(*a, **kw))
    listed: list[str] = []
    real_list = store.list
    monkeypatch.setattr(store, "list", lambda prefix="", **kw: listed.append(prefix) or real_list(prefix, **kw))
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.05)
    claimed: list[int] = []

    def run() -> None:
        for claim in queue:
            with claim:
                claimed.append(claim.shard)
                _extract_and_commit(claim, manifest)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()

    def until(what, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline and worker.is_alive(), (scans, claimed)
            time.sleep(0.05)

    until(lambda: scans.count(False) >= 3)
    # shard 0's data rots; verify withdraws its commit (and marks it for a redo)
    data_key = json.loads(store.get(layout.commit_key(0)))["data_key"]
    store.put(data_key, b"rot" * 100)
    from layertap.cli import main as cli
    assert cli(["verify", store_uri]) == 1 and not store.exists(layout.commit_key(0))
    until(lambda: 0 in claimed)
    until(lambda: store.exists(layout.commit_key(0)))
    store.delete(other)  # its worker let it go: this one takes the shard, and the run is done
    worker.join(120)
    assert not worker.is_alive() and claimed == [0, last]
    assert scans[0] and scans[-1] and scans.count(True) == 2, scans
    assert listed.count(layout.COMMITS) == 2 and listed.count(layout.FEED) >= 3
    assert store.exists(layout.commit_key(last)) and not store.exists(layout.redo_key(0))


def test_a_first_attempts_commit_does_not_look_for_earlier_attempts_leftovers(store_uri, monkeypatch):
    """Each commit listed its shard's data objects and pending uploads: two LISTs a commit, and
    on a folder store a read of all of shards/ (0.16 s at 90,000 shards). Only a shard that saw an
    attempt before (a failure, a lease) is looked at; there, a dead attempt's object still goes."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    looked: list[str] = []
    for method in ("list", "list_pending_uploads"):
        real = getattr(store, method)
        monkeypatch.setattr(store, method, lambda prefix="", _real=real, **kw:
                            (looked.append(prefix) if prefix.startswith(layout.SHARDS) else None)
                            or _real(prefix, **kw))
    orphan = layout.data_key(1, "dead0000")  # an attempt at shard 1 SIGKILLed: its lease went stale
    store.put(orphan, b"half a shard")
    store.put(layout.lease_key(1, 1, 0.001), b"{}")
    time.sleep(2.6)  # stale by the store's clock (whole seconds on S3)
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.05)
    for claim in queue:
        with claim:
            _extract_and_commit(claim, manifest)
    assert scan(store, manifest).committed == set(range(len(manifest.shards)))
    assert looked.count(f"{layout.SHARDS}000001-") == 2 and not store.exists(orphan)
    assert [p for p in looked if p != f"{layout.SHARDS}000001-" and p != layout.SHARDS] == [], looked


def test_workers_started_together_spread_their_full_looks(tmp_path, monkeypatch):
    """Workers (re)started together would list every commit record within seconds of each other
    every COMMITS_LOOK_S: the first full look's successor comes after a random 1/4 to all of it."""
    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    views = [work.CommitView(store, manifest) for _ in range(16)]
    for view in views:
        view.scan()
        assert view.last_full
    real_now = store.now

    def full_looks(later: float) -> list[bool]:
        with monkeypatch.context() as m:
            m.setattr(store, "now", lambda: real_now() + later * work.COMMITS_LOOK_S)
            return [view.scan() is not None and view.last_full for view in views]

    assert not any(full_looks(0.2))
    spread = full_looks(0.6)
    assert 0 < sum(spread) < len(views)  # each with a chance of ~0.47: all or none ~4e-5
    assert full_looks(1.01) == [not full for full in spread]  # the others' first full look was due by now


def _drop_feed_keys(monkeypatch) -> None:
    """Commits whose worker died before the feed key: every store's puts of feed/ keys are dropped."""
    for cls in (LocalStore, S3Store):
        real = cls.put
        monkeypatch.setattr(cls, "put", lambda self, key, data, _real=real:
                            None if key.startswith(layout.FEED) else _real(self, key, data))


def test_a_commit_the_feed_missed_still_ends_the_queue_with_its_sweep(store_uri, monkeypatch):
    """The last shard committed by a worker killed before its feed key: an incremental look has it
    open, its fresh look finds it committed, and nothing is left to wait on. The queue returned
    there, without the full scan and the end-of-run sweep; it looks again now."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    last = len(manifest.shards) - 1
    fake_worker.work(store_uri, shards=list(range(last)))
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.05)
    assert not queue.finished()  # its full look: the last shard open
    with monkeypatch.context() as m:
        _drop_feed_keys(m)
        assert fake_worker.work(store_uri, shards=[last]) == [last]
    assert list(queue) == [] and queue.done_state is not None
    assert queue.done_state.committed == set(range(len(manifest.shards)))
    assert list(store.list(layout.SWEEPS))  # the end-of-run sweep was claimed


def test_a_redo_marker_written_after_a_commit_was_learned_opens_the_shard(store_uri, monkeypatch):
    """A fresh look that found a shard committed (the feed missed it) took any later redo marker of
    the shard for a stale one: `verify` withdrawing it was unseen until the next full look."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    last = len(manifest.shards) - 1
    fake_worker.work(store_uri, shards=list(range(last)))
    view = work.CommitView(store, manifest)
    assert last not in view.scan().committed and view.last_full
    with monkeypatch.context() as m:
        _drop_feed_keys(m)
        fake_worker.work(store_uri, shards=[last])
    assert last not in view.scan().committed and not view.last_full
    view.learn(last)
    assert last in view.scan().committed
    store.delete(layout.commit_key(last))  # as verify withdraws it
    store.put(layout.redo_key(last), b"")
    st = view.scan()
    assert not view.last_full and last not in st.committed and st.withdrawn(last)


def test_a_run_that_ends_with_a_shard_given_up_still_sweeps_its_committed_shards(store_uri):
    """A worker whose last open shard was given up (past --retries) ended without the sweep, which
    ran only once every shard was committed: what killed attempts left on the committed shards
    stayed on the store for good where nobody reran the run."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=16)
    assert len(manifest.shards) >= 3
    assert 0 not in fake_worker.work(store_uri, samples=16, fail_shard=0)  # shard 0 given up, the rest committed
    lease, orphan = _plant_leftovers(store)  # on shards 1 and 2
    store._clock_offset = 0.0  # as in `_finish`: the planted lease is stale at once

    queue = WorkQueue(store, manifest, Producer.current(0), retries=0, poll_s=0.05)
    for claim in queue:
        assert claim.shard == 0
        with pytest.raises(RuntimeError), claim:
            raise RuntimeError("injected failure in shard 0")
    assert queue.given_up == {0}
    assert not store.exists(lease) and not store.exists(orphan)
    assert store.exists(layout.commit_key(1)) and store.exists(layout.commit_key(2))


def test_an_outage_is_counted_from_its_first_failure_not_from_a_long_looks_start(monkeypatch):
    """`patiently` set its deadline when called: a window gate's look waits for hours, so a store
    failing once after that ended the worker at once, its 10 minutes of patience long spent."""
    from layertap.storage.store import TransientStoreError

    monkeypatch.setattr(work, "OUTAGE_S", 1.0)
    monkeypatch.setattr(work, "LONG_LOOK_S", 1.5)
    looks = []

    def gate_like() -> str:
        looks.append(time.monotonic())
        if len(looks) == 1:
            time.sleep(2.0)  # waited behind the window longer than OUTAGE_S, then the store failed
            raise TransientStoreError("SlowDown (retries used up)")
        return "open"

    assert work.patiently(gate_like, lambda: 0.01) == "open" and len(looks) == 2

    def failing() -> str:  # quick looks failing past OUTAGE_S: given up, as before
        raise TransientStoreError("SlowDown (retries used up)")

    began = time.monotonic()
    with pytest.raises(TransientStoreError):
        work.patiently(failing, lambda: 0.2)
    assert 1.0 <= time.monotonic() - began < 3.0
