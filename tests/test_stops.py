"""Stop signals and outages at a worker's edges, from a chaos hunt: real `layertap extract`
processes (forked, tests/forked_cli.py) on moto over HTTP, behind tests/faultproxy.py where a
request must stall or fail at a chosen moment.

- A stop while a shard commits lets it commit (up to 30 s), then exits 143 with nothing left: the
  stop's exception broke the loop's `Thread.join` on the finishing shard, CPython 3.11 then took
  the thread for ended, and the worker exited mid-commit (lease, object, no commit left behind).
- A stop signal that arrives inside the writer's queue is taken at the next batch boundary, not
  raised in there (one raised inside `Queue.put` lost the writer's wake-up: a worker hung for good).
- A stopped worker's heartbeat lets its lease go stale after a grace, even if the worker hangs.
- A store outage while a worker starts (its plan, its window record) is ridden out, not exit 2.
- Ctrl-C while `layertap` builds its parser: one line, exit 130.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

import fake_worker
import forked_cli
from faultproxy import FaultProxy
from layertap.manifests import layout
from layertap.manifests.preemption import Preempted, StopSignals
from layertap.manifests.records import Producer, decode_commit, decode_failure
from layertap.manifests.state import scan
from layertap.manifests.status import run_status
from layertap.manifests.work import STOP_GRACE_S, WorkQueue
from layertap.storage.store import open_store
from tiny_models import tiny_model_dir

MiB = 1 << 20


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """test_reliability.py's job: a 2-layer llama 1024 wide, 24 pre-tokenized rows, shards of
    6-7 MB that are multipart uploads on S3 (5 MiB parts)."""
    root = tmp_path_factory.mktemp("job")
    model = tiny_model_dir(root, "llama", num_layers=2, hidden_size=1024)
    rng = random.Random(0)
    data = root / "rows.jsonl"
    with open(data, "w") as f:
        for i in range(24):
            k = rng.randint(60, 200)
            f.write(json.dumps({"id": f"r{i}", "input_ids": [rng.randrange(300) for _ in range(k)],
                                "loss_mask": [int(j >= 8) for j in range(k)]}) + "\n")

    def args(out: str, *extra: str, s3: dict | None = None) -> list[str]:
        settings = {"part_size": 5 * MiB, "max_parts_in_memory": 2, **(s3 or {})}
        config = root / f"s3-{'-'.join(f'{k}{v}' for k, v in sorted(settings.items()))}.json"
        config.write_text(json.dumps({"s3": settings}))
        return ["extract", "--model", model, "--dataset", str(data), "--out", out, "--layers", "0,1", "--codec",
                "bf16", "--final-state", "prenorm", "--dtype", "float32", "--max-length", "256", "--batch-tokens",
                "1024", "--shard-bytes", "6MB", "--log-dir", str(root / "logs"), "--config", str(config), *extra]

    forked_cli.warm()
    return args


def assert_left_clean(store) -> None:
    """No lease, no pending upload, no data object without its commit: what a clean stop leaves."""
    assert list(store.list(layout.LEASES)) == []
    assert store.list_pending_uploads() == []
    committed = {decode_commit(store.get(o.key), o.key).data_key for o in store.list(layout.COMMITS)}
    assert {o.key for o in store.list(layout.SHARDS)} == committed
    assert run_status(store)["shards_running"] == 0


def wait_for(what, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.parametrize("sig,extra,code", [
    (signal.SIGTERM, (), 143), (signal.SIGUSR1, ("--window", "1GB"), 143), (signal.SIGINT, (), 130),
    (signal.SIGTERM, ("--overlap-shards", "on"), 143)], ids=["sigterm", "sigusr1-window", "sigint", "sigterm-overlap"])
def test_a_stop_while_a_shard_commits_lets_it_commit_and_leaves_nothing(job, s3_endpoint, s3_bucket, tmp_path, sig,
                                                                       extra, code):
    """The hunt's s9.py: a CPU worker (shards in turn; with --window too) stopped while its shard's
    object completes. The completion's answer stalls 5 s, so the signal lands while the loop waits
    for that shard: before, the worker exited at once (exit 143 with a lease left, the object
    without a commit, `status` showing the shard running); now it commits the shard, then exits.
    Overlapped (a GPU worker's default), the signal comes 2 s into the stall, once shard 1's
    forwards are done and the loop waits for shard 0 behind them: shard 1 is aborted."""
    uri = f"s3://{s3_bucket}/stopped"
    completes = lambda method, path: method == "POST" and "uploadId=" in path  # noqa: E731
    overlap = "--overlap-shards" in extra
    with FaultProxy(s3_endpoint, rate=1.0, faults=("stall",), stall_s=5.0, match=completes, limit=1) as proxy:
        log = tmp_path / "worker.log"
        worker = forked_cli.start(job(uri, *extra), log, env={"AWS_ENDPOINT_URL": proxy.url})
        wait_for(lambda: proxy.counts["stall"] or not worker.is_alive())  # shard 0's completion is in flight
        time.sleep(2.0 if overlap else 0.0)
        os.kill(worker.pid, sig)
        worker.join(120)
    assert worker.exitcode == code, log.read_text()[-3000:]
    store = open_store(uri)
    assert [o.key for o in store.list(layout.COMMITS)] == [layout.commit_key(0)]  # committed behind the stop
    failures = [decode_failure(store.get(o.key), o.key) for o in store.list(layout.FAILURES)]
    # overlapped, shard 1 was aborted (unless, on a crawling machine, it was not even claimed yet)
    expected = ([(1, True)], []) if overlap else ([],)
    assert [(f.shard, f.preempted) for f in failures] in expected
    assert_left_clean(store)
    rerun = forked_cli.start(job(uri, *extra), tmp_path / "rerun.log")
    rerun.join(300)
    assert rerun.exitcode == 0 and run_status(store)["complete"]


def _signalled_inside_the_writers_queue(argv: list[str], log_path: str) -> None:
    """A forked worker whose second record's hand-over to the writer gets a SIGUSR1 inside
    `Queue.put`, where the hunt's hung worker had one (its handler runs as the put is entered)."""
    from layertap.extract import pipeline

    real = pipeline._Writer.wait_and_queue
    calls = []

    def wait_and_queue(self, fut, *args):
        calls.append(1)
        if len(calls) != 2:
            return real(self, fut, *args)
        real_put = self.q.put

        def put(item, *a, **kw):
            os.kill(os.getpid(), signal.SIGUSR1)
            real_put(item, *a, **kw)
            print("the record's put completed", flush=True)

        self.q.put = put
        try:
            return real(self, fut, *args)
        finally:
            del self.q.put

    pipeline._Writer.wait_and_queue = wait_and_queue
    forked_cli._child(argv, {}, log_path)


@pytest.mark.slow
def test_a_stop_signal_inside_the_writers_queue_is_taken_at_the_next_batch(job, s3_bucket, tmp_path):
    """The hunt's hung worker (1 in 102 trials): the signal's exception, raised inside the put of a
    record into the writer's queue, lost the writer's wake-up; the abort then joined a writer that
    never saw its end. Now the put completes and the shard stops at its next batch: aborted, its
    lease released, a "preempted" failure record, exit 143."""
    uri = f"s3://{s3_bucket}/queue"
    log = tmp_path / "worker.log"
    # batches of one or two rows: shard 0 has batches left after the signalled one
    worker = forked_cli._CTX.Process(target=_signalled_inside_the_writers_queue, daemon=True,
                                     args=(job(uri, "--batch-tokens", "256"), str(log)))
    worker.start()
    worker.join(120)
    text = log.read_text()
    assert worker.exitcode == 143, text[-3000:]
    assert "the record's put completed" in text  # the stop did not break into the queue
    store = open_store(uri)
    assert list(store.list(layout.COMMITS)) == []
    failures = [decode_failure(store.get(o.key), o.key) for o in store.list(layout.FAILURES)]
    assert [(f.shard, f.preempted) for f in failures] == [(0, True)]
    assert_left_clean(store)


def test_a_stop_inside_a_deferred_block_is_raised_as_it_ends_and_at_once_outside():
    """Extraction's stops: at once where the worker waits (nothing to lose), a flag inside
    `deferred()` blocks (a shard's work: joins and queues), raised at a safe point or as the
    outermost block ends; a second signal changes nothing."""
    with StopSignals(at_once=True, signals=(signal.SIGUSR1,)) as stops:
        with pytest.raises(Preempted):
            with stops.deferred():
                with stops.deferred():
                    _deliver(signal.SIGUSR1)
                    _deliver(signal.SIGUSR1)
                assert str(stops.requested) == "received SIGUSR1" and stops.stopped_for() >= 0
                with pytest.raises(Preempted):
                    stops.raise_if_requested()
            pytest.fail("the stop was not raised as the block ended")
    with pytest.raises(Preempted):
        with StopSignals(at_once=True, signals=(signal.SIGUSR1,)) as stops:
            assert stops.stopped_for() is None
            _deliver(signal.SIGUSR1)
            pytest.fail("not stopped at once outside a deferred block")


def test_an_error_leaving_a_deferred_block_after_a_stop_raises_the_stop():
    """A stop, then an error in the same block: the error went up alone, and a caller that logs
    errors and goes on (import's next shard) went on with the stop pending, deaf to signals."""
    with StopSignals(at_once=True, signals=(signal.SIGUSR1,)) as stops:
        with pytest.raises(Preempted) as stopped:
            with stops.deferred():
                _deliver(signal.SIGUSR1)
                raise ValueError("the shard's own error")
        assert isinstance(stopped.value.__cause__, ValueError)
        with pytest.raises(ValueError):  # no stop pending: the error as it is
            with StopSignals(at_once=True, signals=(signal.SIGUSR2,)) as other, other.deferred():
                raise ValueError("alone")


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this thread at the next bytecode


@pytest.mark.parametrize("stopped_for", [None, STOP_GRACE_S + 1])
def test_a_stopped_worker_stops_renewing_its_lease_after_a_grace(tmp_path, stopped_for):
    """A worker that hangs on its way out after a stop (the hunt's hung worker kept its shard
    leased for good): past `STOP_GRACE_S` after the stop its heartbeat no longer beats, so the
    lease goes stale a TTL later and another worker takes the shard."""
    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(), ttl_s=1.0, stopped_for=lambda: stopped_for)
    with next(iter(queue)) as claim:
        time.sleep(2.5)  # beats every 0.25 s while renewed
        alive = scan(store, manifest).live_lease(claim.shard) is not None
    assert alive == (stopped_for is None)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["manifest", "window"])
def test_a_store_outage_while_a_worker_starts_is_ridden_out(job, s3_endpoint, s3_bucket, tmp_path, where):
    """The hunt's s2b.py: the store failing past a request's retries (here one try each, 503) just
    after the endpoint first answered, while the worker reads and writes its plan or removes an
    earlier --window record, ended it with exit 2 (the bad-input code: under `srun
    --kill-on-bad-exit`, the node's other workers too). Now it looks again after a pause, as it
    does once it works through shards."""
    uri = f"s3://{s3_bucket}/outage"
    if where == "manifest":  # its GET (resume or plan) and its create, not the first listing
        match = lambda method, path: "manifest.json" in path and "list-type" not in path  # noqa: E731
    else:
        match = lambda method, path: method == "DELETE" and path.endswith(layout.CONSUMED_WINDOW)  # noqa: E731
    log = tmp_path / "worker.log"
    with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), match=match, limit=2) as proxy:
        worker = forked_cli.start(job(uri, s3={"max_attempts": 1}), log, env={"AWS_ENDPOINT_URL": proxy.url})
        worker.join(300)
    assert worker.exitcode == 0, log.read_text()[-3000:]
    assert proxy.counts["503"] == 2
    store = open_store(uri)
    assert run_status(store)["complete"]
    assert_left_clean(store)


def test_ctrl_c_while_the_command_starts_is_one_line_and_exit_130(monkeypatch, capsys):
    """Building the parser imports the subcommand's module (up to seconds: torch): a Ctrl-C then
    printed a KeyboardInterrupt traceback and exited -2."""
    from layertap import cli

    def interrupted(only=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    try:
        code = cli.main(["status", str(Path("nowhere"))])
    except KeyboardInterrupt:  # pytest would take it for the user's own Ctrl-C
        pytest.fail("Ctrl-C while the parser is built escaped main() as a KeyboardInterrupt")
    assert code == 130
    assert capsys.readouterr().err == "interrupted\n"
