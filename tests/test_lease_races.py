"""Leases against a holder paused at the worst moment (Slurm suspend, a frozen VM, a PUT retried
after a read timeout), and workers whose clocks disagree. Each test forces its interleaving by
blocking one store call in one thread, on a local folder and on the moto S3 server over HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest

import fake_worker
from layertap.manifests import layout
from layertap.manifests.output_lease import OutputLease, live_holder
from layertap.manifests.records import Producer
from layertap.manifests.state import scan_shard
from layertap.manifests.work import Claim, WorkQueue
from layertap.storage.store import ObjectStore, open_store
from layertap.train.follow import pending_work


class Paused:
    """Blocks the first call of `store.<method>` made by a thread whose name starts with `thread`
    and whose first argument starts with `prefix`, until `resume()`: the holder's process paused
    right there. `reached` is set when it blocks, `done` once the call has returned."""

    def __init__(self, store: ObjectStore, method: str, thread: str, prefix: str = ""):
        self.reached, self.done, self._gate = threading.Event(), threading.Event(), threading.Event()
        real: Callable = getattr(store, method)

        def paused(*args, **kwargs):
            if (not self._gate.is_set() and threading.current_thread().name.startswith(thread)
                    and str(args[0] if args else kwargs.get("prefix", "")).startswith(prefix)):
                self.reached.set()
                self._gate.wait()
                try:
                    return real(*args, **kwargs)
                finally:
                    self.done.set()
            return real(*args, **kwargs)

        setattr(store, method, paused)

    def resume(self) -> None:
        self._gate.set()
        assert self.done.wait(30), "the paused call did not return"


def _lease_keys(store: ObjectStore, prefix: str) -> list[str]:
    return sorted(o.key for o in store.list(prefix) if layout.beat_of(o.key) is None)


def test_a_late_renewal_of_a_trainer_taken_over_never_evicts_the_live_one(store_uri):
    """T1 checks that it still holds the output and pauses before its renewal's PUT, past its
    ttl. T2 takes the output over (generation 2, deleting generation 1) and ends; T3 finds no
    lease left, so generations restart: T3 holds `lease/000001...` under T1's old key name. T1's
    PUT then lands. It rewrote that key with its own body, so T3 (the live trainer) stopped and
    T1 (the stale one) went on writing checkpoints over newer ones."""
    ttl = 3.0  # beats every 0.75 s: a live holder must not look stale on a loaded CI machine
    s1 = open_store(store_uri)
    paused = Paused(s1, "put", "output-lease", "lease/")
    t1 = OutputLease(s1, ttl_s=ttl, poll_s=0.1)
    t1.acquire()
    t3 = None
    try:
        assert paused.reached.wait(10)  # T1's renewal checked the lease (its own) and pauses before its PUT
        with OutputLease(open_store(store_uri), ttl_s=ttl, poll_s=0.1) as t2:  # waits for T1's lease to go stale
            assert t2.generation == 2
        t3 = OutputLease(open_store(store_uri), ttl_s=ttl, poll_s=0.1)
        t3.acquire()
        assert t3.key == t1.key  # the same key, another holder
        paused.resume()  # T1's PUT lands
        assert not t1.holds() and t3.holds()
        held = live_holder(s1)
        assert held is not None and held.holder["token"] == t3.token
        time.sleep(ttl / 2)  # T3's own heartbeat sees it still holds
        assert t3.holds() and not t3.lost.is_set()
    finally:
        t1.release()
        if t3 is not None:
            t3.release()
    assert not list(s1.list("lease/"))  # each released what was its own, T1 its beat


def test_a_late_renewal_of_a_trainer_taken_over_creates_no_lease(store_uri):
    """The same pause with T2 still holding: T1's late PUT re-created generation 1 (beside T2's
    generation 2), which outlived T2's release as a lease of nobody that looked alive."""
    ttl = 3.0  # beats every 0.75 s: a live holder must not look stale on a loaded CI machine
    s1 = open_store(store_uri)
    paused = Paused(s1, "put", "output-lease", "lease/")
    t1 = OutputLease(s1, ttl_s=ttl, poll_s=0.1)
    t1.acquire()
    try:
        assert paused.reached.wait(10)
        with OutputLease(open_store(store_uri), ttl_s=ttl, poll_s=0.1) as t2:
            paused.resume()
            assert _lease_keys(s1, "lease/") == [t2.key]
            assert not t1.holds() and t2.holds()
        assert live_holder(s1) is None  # T2 released: nothing holds the output
    finally:
        t1.release()


def _claim(store: ObjectStore, manifest, ttl: float) -> Claim:
    claim = next(iter(WorkQueue(store, manifest, Producer.current(0), ttl_s=ttl, shards=[0], poll_s=0.1)))
    claim.__enter__()  # starts its heartbeat
    return claim


@pytest.mark.parametrize("case", ["race", "ttl"])
def test_a_worker_taken_over_while_paused_never_shares_its_shard_with_a_new_claim(store_uri, case):
    """Worker A (--lease-ttl 3) pauses in its heartbeat past its ttl; B takes shard 0 over
    (generation 2, deleting A's generation 1) and is preempted; D finds no lease left and claims
    generation 1 anew. `race`: A's heartbeat had checked its lease and paused before its PUT,
    which then overwrote D's lease (same key): D abandoned, A went on. `ttl`: D runs with
    --lease-ttl 4.5, so its generation-1 key is another; A's heartbeat found its own key gone and
    created it again, and A and D both held generation 1 and both ran the shard to the end."""
    ttl_a, ttl_other = 3.0, (3.0 if case == "race" else 4.5)  # loaded CI: see above
    sa = open_store(store_uri)
    manifest = fake_worker.plan(sa, samples=8, shard_bytes=100000)
    assert len(manifest.shards) == 1
    if case == "race":
        paused = Paused(sa, "put", "lease-", layout.LEASES)  # after the heartbeat's look, before its PUT
    else:
        paused = Paused(sa, "list", "lease-")  # before the heartbeat's look
    a = _claim(sa, manifest, ttl_a)
    d = None
    try:
        assert paused.reached.wait(10)
        b = _claim(open_store(store_uri), manifest, ttl_other)  # waits for A's lease to go stale
        assert b.generation == 2
        b.__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)  # preempted: its lease released
        d = _claim(open_store(store_uri), manifest, ttl_other)
        assert d.generation == 1
        paused.resume()
        assert a.lost.wait(10), "the attempt taken over kept its lease"
        time.sleep(ttl_other / 2)  # D's heartbeat looks again
        assert not d.lost.is_set()
        assert _lease_keys(sa, layout.lease_prefix(0)) == [d.lease_key]
        assert json.loads(sa.get(d.lease_key))["data_key"] == d.data_key
        lease = scan_shard(sa, manifest, 0).live_lease(0)
        assert lease is not None and lease.key == d.lease_key
    finally:
        a.__exit__(RuntimeError, RuntimeError("lost"), None)
        if d is not None:
            d.__exit__(None, None, None)
    # A's beat may have landed late beside D's lease; it keeps nothing alive and the end of a run sweeps it
    assert _lease_keys(sa, layout.LEASES) == []


def _ahead(monkeypatch, seconds: float) -> None:
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_a_shard_given_up_after_a_failure_on_a_clock_ahead_counts_as_given_up(store_uri, monkeypatch):
    """Worker A, on a node whose clock runs 5 s ahead, fails shard 0 for the last time
    (--retries 0) and is preempted; worker B gives the shard up a moment later. Failure and
    verdict were named by each worker's own clock, so the verdict looked older than the failure:
    `pending_work` said "retrying" forever and a follow-mode trainer waited for good."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    qb = WorkQueue(open_store(store_uri), manifest, Producer.current(1), ttl_s=5, retries=0, poll_s=0.1)
    _ahead(monkeypatch, 5.0)
    qa = WorkQueue(open_store(store_uri), manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.1)
    with pytest.raises(RuntimeError), next(iter(qa)):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    monkeypatch.undo()  # A's job ends
    assert list(qb) == [] and qb.given_up == {0}
    work = pending_work(store, manifest, set())
    assert work.given_up == [0] and work.retrying == [] and work.over


def test_retries_count_the_failures_since_the_queues_start_whatever_the_clocks(store_uri, monkeypatch):
    """A failure recorded before a worker started is not one of its retries. A worker whose
    clock runs 5 s behind compared its own start with failure keys of others' clocks: under
    --retries 0 it gave up, without one try, a shard that another worker had failed before it."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    qx = WorkQueue(open_store(store_uri), manifest, Producer.current(1), ttl_s=5, retries=0, poll_s=0.1)
    with pytest.raises(RuntimeError), next(iter(qx)):
        raise RuntimeError("out of memory")
    _ahead(monkeypatch, -5.0)
    qy = WorkQueue(open_store(store_uri), manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.1)
    claim = next(iter(qy), None)
    assert claim is not None and claim.shard == 0 and not qy.given_up
    claim.release()


def test_a_rerun_within_a_second_of_a_failure_named_by_a_later_clock_reading_tries_the_shard(store_uri):
    """S3's Date header has whole seconds, so two processes' readings of the store's clock differ
    by up to a second. A failure named by a reading 0.9 s later than a rerun's made the rerun,
    started right after it, count that failure as its own: under --retries 0 it gave the shard up
    untried (`test_status_cli.py::test_exit_codes_rate_and_eta[s3]`, once in a few full suites)."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8, shard_bytes=100000)
    early, late = open_store(store_uri), open_store(store_uri)
    late._clock_offset = (early.now() - time.time()) + 0.9  # the reading a second Date header could give
    qx = WorkQueue(late, manifest, Producer.current(1), ttl_s=5, retries=0, poll_s=0.1)
    with pytest.raises(RuntimeError), next(iter(qx)):
        raise RuntimeError("out of memory")
    qy = WorkQueue(early, manifest, Producer.current(0), ttl_s=5, retries=0, poll_s=0.1)
    claims = iter(qy)
    claim = next(claims, None)
    assert claim is not None and claim.shard == 0 and not qy.given_up
    with pytest.raises(RuntimeError), claim:  # the rerun's own failure is one of its retries
        raise RuntimeError("out of memory")
    assert list(claims) == [] and qy.given_up == {0}


def test_a_beat_that_outlived_its_lease_keeps_nothing_alive_and_is_swept(store_uri):
    """A holder killed right after its late beat landed (its lease deleted by a takeover) leaves
    a beat of no lease: the shard is not running for it, and the end of the run removes it."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=8)
    stray = layout.beat_key(layout.lease_key(0, 1, 600), "deadbeef")
    store.put(stray, b"")
    assert scan_shard(store, manifest, 0).live_lease(0) is None
    fake_worker.work(store_uri, samples=8)  # commits the shard, then sweeps
    assert not list(store.list(layout.LEASES))


def test_one_lease_stamped_ahead_does_not_age_every_other_lease_in_a_scan(tmp_path):
    """A scan moved its "now" up to the newest lease's stamp: one lease stamped 90 s ahead (a client
    or gateway whose clock runs ahead) made every other lease 90 s older, a live one stale in
    `status` and in the work queue's and the end-of-run sweep's view of the run."""
    import os

    from layertap.manifests.state import scan

    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    first, second = (next(iter(WorkQueue(store, manifest, Producer.current(r), ttl_s=60, shards=[r], poll_s=0.1)))
                     for r in (0, 1))
    ahead = time.time() + 90
    os.utime(tmp_path / "run" / second.lease_key, (ahead, ahead))
    st = scan(store, manifest)
    assert st.live_lease(0) is not None and st.live_lease(1) is not None
    assert st.state(0) == st.state(1) == "running"
