"""A worker's shard loop (extract.worker.ShardLoop): shard n finishes while shard n+1's forwards
run, and a failure or a stop on either side loses nothing and leaves nothing behind. Real
leases, commits and shards on a real store (a folder, and moto over HTTP), a tiny real model."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import fake_worker
from layertap.extract.inputs import TokenizedSample
from layertap.extract.model import Capture
from layertap.extract.pipeline import start_shard
from layertap.extract.worker import ShardLoop, Started
from layertap.manifests import layout
from layertap.manifests.preemption import Interrupted
from layertap.manifests.records import Producer, decode_failure
from layertap.manifests.status import run_status, verify_run
from layertap.manifests.work import Claim, Gate, WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.store import StoreError, open_store
from layertap.storage.writer import ShardWriter


@pytest.fixture(scope="module")
def capture():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=128)
    torch.manual_seed(0)
    # the layers fake_worker's plan records: a shard's header must agree with its run's manifest
    return Capture(AutoModelForCausalLM.from_config(config).eval().requires_grad_(False), fake_worker.LAYERS)


class Run:
    """A planned run on `store_uri` and a shard loop over it, logging what happens in which order."""

    def __init__(self, store_uri: str, capture, samples: int = 40):
        self.store = open_store(store_uri)
        self.manifest = fake_worker.plan(self.store, samples)
        self.capture = capture
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        self.fail_close: set[int] = set()  # shards whose next object close fails (once each)
        self.fail_start: set[int] = set()  # shards whose next start fails (once each)
        self.rival_commits: set[int] = set()  # ... either after another attempt committed the shard
        self.stop_at: int | None = None  # the shard whose start a stop signal interrupts
        self.hold_finish = False  # each finish waits for the next shard's start (or 5 s)
        self.slow_finish: set[int] = set()  # shards whose finish takes 2 s more
        self.abandoned: list[tuple[int, int]] = []

    def log(self, what: str, shard: int) -> None:
        with self.lock:
            self.events.append((what, shard))

    def start(self, claim, counted) -> Started:
        self.log("start", claim.shard)
        if claim.shard == self.stop_at:
            raise Interrupted("a stop signal")
        if claim.shard in self.fail_start:  # e.g. an upload of its parts failing
            self.fail_start.discard(claim.shard)
            if claim.shard in self.rival_commits:
                self.rival_commit(claim)
            raise StoreError("injected: a part's upload failed")
        counts = fake_worker.token_counts(self.manifest.num_samples)
        samples = [TokenizedSample(f"s{i:05d}", torch.arange(counts[i]) % 128, torch.ones(counts[i], dtype=torch.bool))
                   for i in range(claim.plan.start, claim.plan.end)]
        meta = ShardMeta(run_id=self.manifest.run_id, shard_id=claim.shard, model="tiny", layers=fake_worker.LAYERS,
                         hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
        out = self.store.open_writer(claim.data_key)
        if claim.shard in self.fail_close:
            self.fail_close.discard(claim.shard)
            out = FailingClose(out, before=(lambda: self.rival_commit(claim)) if claim.shard in self.rival_commits
                               else None)
        tail = start_shard(self.capture, samples, meta, out, batch_tokens=64, pad_id=0, encode_threads=2,
                           on_record=counted)
        real_finish = tail.finish

        def finish():
            self.log("finish", claim.shard)
            if claim.shard in self.slow_finish:
                time.sleep(2.0)
            if self.hold_finish:
                deadline = time.time() + 5
                while time.time() < deadline and not any(e == "start" and s != claim.shard and i > self.index(
                        ("finish", claim.shard)) for i, (e, s) in enumerate(self.events)):
                    time.sleep(0.01)
            return real_finish()

        tail.finish = finish
        return Started(tail, [], 0)

    def rival_commit(self, claim) -> None:
        """Another attempt (a takeover of this slow one) finishes the shard and commits it first."""
        q = WorkQueue(self.store, self.manifest, Producer.current(1))
        rival = Claim(q, claim.plan, generation=claim.generation + 1, attempt=q.producer.token)
        meta = ShardMeta(run_id=self.manifest.run_id, shard_id=claim.shard, model="synthetic",
                         layers=fake_worker.LAYERS, hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
        with ShardWriter(self.store.open_writer(rival.data_key), meta) as w:
            for i in range(claim.plan.start, claim.plan.end):
                w.write_sample(fake_worker.make_sample(i))
            assert rival.commit(w.close())

    def index(self, event: tuple[str, int]) -> int:
        return self.events.index(event)

    def fail_tallies(self, monkeypatch, shards: set[int]) -> None:
        real_put = self.store.put

        def put(key, data):
            if key.startswith(layout.TALLY) and layout.parse_tally(key)[0] in shards:
                raise StoreError("injected: the tally marker's PUT failed")
            return real_put(key, data)

        monkeypatch.setattr(self.store, "put", put)

    def loop(self, overlap: bool) -> ShardLoop:
        return ShardLoop(self.start, overlap=overlap,
                         committed=lambda claim, info, skipped: self.log("committed", claim.shard),
                         abandoned=lambda claim, records: self.abandoned.append((claim.shard, records)))

    def queue(self, loop: ShardLoop, poll_s: float = 0.1) -> WorkQueue:
        return WorkQueue(self.store, self.manifest, Producer.current(0), poll_s=poll_s, on_idle=loop.settle)


class FailingClose:
    """An object writer whose completion fails: what a store that errs at the last moment does."""

    def __init__(self, inner, before=None):
        self.inner, self.before = inner, before

    def close(self):
        if self.before:
            self.before()
        raise StoreError("injected: the object's completion failed")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _intact(run: Run) -> bool:
    """Every shard committed and re-read whole, and no object that no commit names (an orphan)."""
    result = verify_run(run.store)
    return run_status(run.store)["complete"] and result.ok == len(run.manifest.shards) and not result.bad \
        and result.orphans_deleted == 0


def _commits_in_order(run: Run) -> list[int]:
    return [s for e, s in run.events if e == "committed"]


def test_the_next_shards_forwards_start_before_the_last_one_is_committed(store_uri, capture):
    run = Run(store_uri, capture)
    run.hold_finish = True  # a finish waits for the next start: a serial loop would stall 5 s per shard here
    n = len(run.manifest.shards)
    assert n >= 4
    t0 = time.time()
    # a poll of a minute: the queue must not wait one out on the lease of its own last shard
    assert (loop := run.loop(overlap=True)).run(run.queue(loop, poll_s=60)) == n
    assert time.time() - t0 < 5 * (n - 1) - 1  # the finishes did not wait out their 5 s, nor the queue a poll
    order = _commits_in_order(run)
    assert sorted(order) == list(range(n))
    for prev, nxt in zip(order, order[1:]):  # every shard's successor started before it was committed
        assert run.index(("start", nxt)) < run.index(("committed", prev))
    assert run_status(run.store)["samples_done"] == run.manifest.num_samples and _intact(run)
    assert not list(run.store.list(layout.LEASES))


def test_serial_shards_commit_before_the_next_start(store_uri, capture):
    run = Run(store_uri, capture)
    assert (loop := run.loop(overlap=False)).run(run.queue(loop)) == len(run.manifest.shards)
    order = _commits_in_order(run)
    for prev, nxt in zip(order, order[1:]):
        assert run.index(("committed", prev)) < run.index(("start", nxt))


def test_a_shard_whose_completion_fails_behind_the_next_is_recorded_and_redone(store_uri, capture):
    run = Run(store_uri, capture)
    run.fail_close = {1}
    loop = run.loop(overlap=True)
    assert loop.run(run.queue(loop)) == len(run.manifest.shards)  # shard 1 again, in the queue's next pass
    failures = [decode_failure(run.store.get(o.key), o.key) for o in run.store.list(layout.FAILURES)]
    assert [(f.shard, f.preempted) for f in failures] == [(1, False)]
    assert "completion failed" in failures[0].error
    plan = run.manifest.shards[1]
    assert run.abandoned == [(1, plan.end - plan.start)]  # its records, taken back from the progress count
    assert _commits_in_order(run).count(1) == 1
    assert len(list(run.store.list(f"{layout.SHARDS}000001-"))) == 1  # the failed attempt's object is gone
    assert not run.store.list_pending_uploads(f"{layout.SHARDS}000001-") and _intact(run)


def test_a_shard_whose_commit_landed_counts_as_committed_though_a_later_step_failed(store_uri, capture, caplog,
                                                                                    monkeypatch):
    """The commit record exists, then the tally marker's PUT fails: the shard is done (status
    reads the commit; verify restores the marker), so the loop counts it, without an error."""
    run = Run(store_uri, capture)
    run.fail_tallies(monkeypatch, {1})
    loop = run.loop(overlap=True)
    assert loop.run(run.queue(loop)) == len(run.manifest.shards)
    assert sorted(_commits_in_order(run)) == list(range(len(run.manifest.shards))) and run.abandoned == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("after its commit" in r.getMessage() for r in caplog.records)
    assert list(run.store.list(layout.FAILURES)) == []
    monkeypatch.undo()
    assert _intact(run)


@pytest.mark.parametrize("overlap,at", [(True, "close"), (False, "close"), (True, "start")])
def test_a_shard_failing_after_another_attempt_committed_it_is_no_failure(store_uri, capture, overlap, at, caplog):
    """A slow attempt taken over fails (the winner's sweep removed its upload) at its completion
    or during its forwards: the shard is done, so no failure record, no error, no retry; its
    records go back to the progress count, since the winner's commit counts them."""
    run = Run(store_uri, capture)
    run.rival_commits = {1}
    (run.fail_close if at == "close" else run.fail_start).add(1)
    loop = run.loop(overlap=overlap)
    assert loop.run(run.queue(loop)) == len(run.manifest.shards) - 1  # shard 1 is the rival's
    assert list(run.store.list(layout.FAILURES)) == []
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    plan = run.manifest.shards[1]
    assert run.abandoned == [(1, plan.end - plan.start if at == "close" else 0)]
    assert 1 not in _commits_in_order(run) and [e for e in run.events if e[1] == 1].count(("start", 1)) == 1
    assert _intact(run)


def test_a_stop_during_the_next_shards_start_keeps_the_finishing_shard_and_releases_the_other(store_uri, capture):
    run = Run(store_uri, capture)
    run.stop_at = 2
    with pytest.raises(Interrupted):
        (loop := run.loop(overlap=True)).run(run.queue(loop))
    status = run_status(run.store)
    assert status["shards_done"] == 2  # shards 0 and 1 committed, 1 while the stop went up
    assert not list(run.store.list(layout.LEASES))  # shard 2's lease released, no other left
    failures = [decode_failure(run.store.get(o.key), o.key) for o in run.store.list(layout.FAILURES)]
    assert [(f.shard, f.preempted) for f in failures] == [(2, True)]
    assert not list(run.store.list(f"{layout.SHARDS}000002-")) and not run.store.list_pending_uploads()
    run.stop_at = None
    assert (loop := run.loop(overlap=True)).run(run.queue(loop)) == len(run.manifest.shards) - 2  # the rerun does the rest
    assert _intact(run)


def test_a_shard_left_finishing_past_the_stop_wait_is_told_as_abandoned(store_uri, capture, monkeypatch):
    """A shard still finishing STOP_WAIT_S after a stop is left (its lease goes stale, it is redone):
    nothing said so to the stop's message, which told "no shard was in progress here"."""
    monkeypatch.setattr(ShardLoop, "STOP_WAIT_S", 0.3)
    run = Run(store_uri, capture)
    run.stop_at, run.slow_finish = 2, {1}
    with pytest.raises(Interrupted):
        (loop := run.loop(overlap=True)).run(run.queue(loop))
    assert [shard for shard, _ in run.abandoned] == [2, 1]  # the one stopped at its start, and the one left


def test_a_stop_inside_the_queue_leaves_the_lease_of_the_shard_finishing_behind_to_it(store_uri, capture):
    """A stop signal that lands in the work queue (here: its check before the next claim) while
    shard 0 still finishes: the queue releases what it had not handed over, never shard 0's lease,
    which goes only with shard 0's own end, after its commit."""
    run = Run(store_uri, capture)
    run.hold_finish = True  # shard 0's finish waits for the next start, which never comes (5 s)
    delete = run.store.delete

    def logged_delete(key):
        if (lease := layout.parse_lease(key)) is not None:
            run.log("lease deleted", lease[0])
        return delete(key)

    run.store.delete = logged_delete
    put_if_absent = run.store.put_if_absent

    def logged_put_if_absent(key, data):
        done = put_if_absent(key, data)
        if done and key.startswith(layout.COMMITS):
            run.log("commit record", layout.shard_of(key, layout.COMMITS))
        return done

    run.store.put_if_absent = logged_put_if_absent
    calls = []

    def stop_before_the_second_claim(shard, would_redo) -> Gate:
        calls.append(1)
        if len(calls) == 2:
            raise Interrupted("a stop signal")
        return Gate.OPEN

    loop = run.loop(overlap=True)
    queue = WorkQueue(run.store, run.manifest, Producer.current(0), poll_s=0.1, on_idle=loop.settle,
                      before_claim=stop_before_the_second_claim)
    with pytest.raises(Interrupted):
        loop.run(queue)
    assert run.index(("commit record", 0)) < run.index(("lease deleted", 0))
    assert run_status(run.store)["shards_done"] == 1 and not list(run.store.list(layout.LEASES))


def test_an_aborted_attempts_work_is_not_counted_as_stored(tmp_path, capture):
    """The worker's summary ("N samples, T tokens ... stored as ...") counted an attempt aborted
    after a lost lease as if stored, beside the attempt that stored the shard: twice the samples,
    and a compression ratio of raw bytes of one over stored bytes of both."""
    from layertap.extract.pipeline import LeaseLost, PipelineStats, extract_shard
    from layertap.storage.identity import RunIdentity

    store = open_store(str(tmp_path / "run"))
    meta = ShardMeta.of(RunIdentity(model="x", layers=[1, 2], hidden_size=32, codec="bf16-zstd"), run_id="r",
                        shard_id=0, extra={})
    g = torch.Generator().manual_seed(1)
    samples = [TokenizedSample(f"s{i}", torch.randint(1, 128, (50,), generator=g), torch.ones(50, dtype=torch.bool))
               for i in range(8)]
    stats, looks = PipelineStats(), []
    with pytest.raises(LeaseLost):
        extract_shard(capture, samples, meta, store.open_writer("shards/a.lts"), batch_tokens=100, pad_id=0,
                      stats=stats, should_stop=lambda: looks.append(1) or len(looks) > 2)  # lost after 2 batches
    assert stats.samples == stats.tokens == stats.stored_bytes == 0 and stats.forward_s > 0  # its time was spent
    info = extract_shard(capture, samples, meta, store.open_writer("shards/b.lts"), batch_tokens=100, pad_id=0,
                         stats=stats)
    assert (stats.samples, stats.tokens, stats.raw_bytes) == (8, 400, info.raw_bytes)
    alone = PipelineStats()  # the same shard in one attempt
    extract_shard(capture, samples, meta, store.open_writer("shards/c.lts"), batch_tokens=100, pad_id=0, stats=alone)
    assert 0 < stats.stored_bytes == alone.stored_bytes < info.bytes


def test_a_stop_between_the_queues_hand_over_and_the_shards_start_releases_its_lease(store_uri, capture):
    """The queue hands a claim over (its lease no longer the queue's to release); a stop landing in
    the few bytecodes before the worker's deferred block left that lease to go stale: a rerun
    elsewhere waited a ttl for the shard. Here the stop lands as the block is entered."""
    from layertap.manifests.preemption import Preempted, StopSignals

    class StopAtTheBlock(StopSignals):
        def deferred(self):
            raise Preempted("received SIGTERM")

    run = Run(store_uri, capture)
    loop = ShardLoop(run.start, overlap=True, committed=lambda *a: None, abandoned=lambda *a: None,
                     stops=StopAtTheBlock(at_once=True))
    with pytest.raises(Preempted):
        loop.run(run.queue(loop))
    assert not list(run.store.list(layout.LEASES)) and run.events == []  # released, and never started


def test_a_failed_pinning_gives_its_staging_slot_back(monkeypatch):
    """A host allocation that failed (memory short) after a slot was taken lost the slot for good:
    after three such shard attempts the next batch waited for a slot forever, a stop signal
    unheard (the stall watchdog ended it 30 min later). CPU-run: the slot handling comes before
    any CUDA call, and the pinning is made to fail as cudaHostAlloc does."""
    import queue

    from layertap.extract.pipeline import HostStaging

    staging = HostStaging.__new__(HostStaging)  # __init__ makes a CUDA stream
    staging._free = queue.Queue()
    for _ in range(3):
        staging._free.put(None)
    real_empty = torch.empty

    def no_pinned_memory(*args, **kwargs):
        if kwargs.get("pin_memory"):
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", no_pinned_memory)
    for _ in range(3):  # as many as there are slots (a fourth would wait for ever before the fix)
        with pytest.raises(RuntimeError, match="cudaHostAlloc"):
            staging.wait_and_copy(real_empty(2, 3, 8, dtype=torch.bfloat16), None, users=2)
    assert staging._free.qsize() == 3
