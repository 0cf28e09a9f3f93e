"""The storage window (issue 20): consumption watermarks, deletion of consumed shards, the data
at rest and `layertap extract --window`. Real runs: fake_worker's real leases, shards and commits, and a
real tiny extraction, local and on the moto S3 server."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import fake_worker
from test_withdraw import corrupt
from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.consumption import (AtRest, WindowGate, at_rest, consumed_everywhere, consumed_shards,
                                            delete_consumed, record_consumed, stalled)
from layertap.manifests.records import Producer
from layertap.manifests.status import burst_rate, run_status, verify_run
from layertap.manifests.work import Gate, WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.store import open_store
from layertap.storage.writer import ShardWriter


def keys(store, prefix: str) -> list[tuple[str, str]]:
    return [(o.key, o.version) for o in store.list(prefix)]


def data_shards(store) -> set[int]:
    return {layout.shard_of(o.key, layout.SHARDS) for o in store.list(layout.SHARDS)}


def until_stale(done, timeout: float = 20.0) -> bool:
    """Whether `done()` holds within `timeout` s. Records age by the store's clock (`ObjectStore.now`),
    which on S3 has whole seconds and errs towards a store behind ours by the latency of the request
    that measured it: a record may look up to a second and a busy machine's latency younger than it
    is, so a test waits for one to go stale rather than sleeping a fixed time."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_record_consume_delete_round_trip(store_uri):
    store = open_store(store_uri)
    assert fake_worker.work(store_uri) == list(range(7))
    commits, tallies = keys(store, layout.COMMITS), keys(store, layout.TALLY)
    assert consumed_everywhere(store) == set() and delete_consumed(store) == []

    # Two ranks: a shard goes only once both have consumed it.
    record_consumed(store, rank=0, world_size=2, shards=[2, 0, 1], step=10)
    assert consumed_everywhere(store) == set() and delete_consumed(store) == []  # rank 1 has said nothing
    record_consumed(store, rank=1, world_size=2, shards=[1, 2, 3], step=10)
    assert json.loads(store.get("consumed/ranks/00000.json"))["ranges"] == [[0, 2]]
    assert consumed_everywhere(store) == {1, 2}
    assert delete_consumed(store) == [1, 2]
    assert data_shards(store) == {0, 3, 4, 5, 6}
    assert consumed_shards(store) == {1, 2}
    assert {o.key for o in store.list(layout.CONSUMED_SHARDS)} == {"consumed/shards/000001", "consumed/shards/000002"}
    assert keys(store, layout.COMMITS) == commits and keys(store, layout.TALLY) == tallies
    assert delete_consumed(store) == []  # idempotent

    # A crash between marker and delete: the next call finishes it.
    record_consumed(store, rank=0, world_size=2, shards=[0, 1, 2, 4], step=20)
    record_consumed(store, rank=1, world_size=2, shards=[1, 2, 3, 4], step=20)
    store.put(layout.consumed_marker_key(4), b"")
    assert 4 in data_shards(store) and 4 in consumed_everywhere(store)
    assert delete_consumed(store) == [4]
    assert data_shards(store) == {0, 3, 5, 6} and delete_consumed(store) == []

    # The run stays done: status counts every shard, a rerun redoes nothing.
    assert run_status(store)["complete"]
    assert fake_worker.work(store_uri) == []
    assert data_shards(store) == {0, 3, 5, 6}

    # A restart with another world: until every rank of the new world has written, only marked shards count.
    record_consumed(store, rank=0, world_size=1, shards=[0, 3], step=30)
    assert consumed_everywhere(store) == {0, 1, 2, 3, 4}
    record_consumed(store, rank=0, world_size=3, shards=[5], step=40)
    assert consumed_everywhere(store) == {1, 2, 4}
    assert delete_consumed(store) == [] and data_shards(store) == {0, 3, 5, 6}


def test_watermarks_are_runs_of_shard_ids_and_lists_of_ids_still_count(store_uri, caplog):
    """A watermark names every shard its rank consumed, and after each checkpoint one rank reads
    all of them: as [first, last] runs it stays small however long the run. Watermarks written
    as lists of ids (before the runs) still count; malformed runs are ignored with a warning."""
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    record_consumed(store, rank=0, world_size=2, shards=[6, 0, 1, 2, 4, 5, 2], step=3)
    assert json.loads(store.get(layout.consumed_rank_key(0)))["ranges"] == [[0, 2], [4, 6]]
    old = {"world_size": 2, "step": 3, "shards": [1, 2, 3, 4], "time": time.time()}
    store.put(layout.consumed_rank_key(1), json.dumps(old).encode())
    assert consumed_everywhere(store) == {1, 2, 4}
    store.put(layout.consumed_rank_key(1), json.dumps({**old, "ranges": [[3, 1]]}).encode())
    assert consumed_everywhere(store) == set() and "unreadable consumption watermark" in caplog.text
    record_consumed(store, rank=0, world_size=1, shards=list(range(100_000)), step=9)
    assert len(store.get(layout.consumed_rank_key(0))) < 200
    assert consumed_everywhere(store) == set(range(100_000))


def test_watermarks_of_a_trainer_that_no_longer_consumes_the_run_count_for_nothing(store_uri):
    """A run's --delete-consumed trainer gone, its claim removed (as its refusal tells), another
    trainer of the same world size claims the run: the old one's watermarks were intersected with
    the new one's, so a shard the new rank 0 had read and the old rank 1 had read was deleted
    before the new rank 1 read it. Watermarks name their trainer; only the run's consumer's count."""
    from layertap.manifests.consumption import claim_consumer

    store = open_store(store_uri)
    fake_worker.work(store_uri)
    claim_consumer(store, "s3://b/old-drafter")
    record_consumed(store, rank=1, world_size=2, shards=[0, 1, 2], step=3, output="s3://b/old-drafter")
    store.delete(layout.CONSUMER)
    claim_consumer(store, "s3://b/new-drafter")
    record_consumed(store, rank=0, world_size=2, shards=[0], step=1, output="s3://b/new-drafter")
    assert delete_consumed(store) == [] and data_shards(store) == set(range(7))
    assert consumed_everywhere(store) == set()
    record_consumed(store, rank=1, world_size=2, shards=[0, 1], step=1, output="s3://b/new-drafter")
    assert delete_consumed(store) == [0] and data_shards(store) == set(range(1, 7))


def test_a_watermark_names_a_rank_of_its_world(store):
    with pytest.raises(ValueError):
        record_consumed(store, rank=2, world_size=2, shards=[], step=0)


class ReadCounter:
    """The store's listings (by prefix) and GETs (by key), as the gate makes them."""

    def __init__(self, store, monkeypatch):
        self.listed: list[str] = []
        self.got: list[str] = []
        list_, get = store.list, store.get
        monkeypatch.setattr(store, "list", lambda prefix="", **kw: self.listed.append(prefix) or list_(prefix, **kw))
        monkeypatch.setattr(store, "get", lambda key, *a, **kw: self.got.append(key) or get(key, *a, **kw))

    def clear(self) -> None:
        self.listed.clear()
        self.got.clear()


def test_the_window_check_reads_only_the_data_at_rest_until_the_window_is_full(store_uri, monkeypatch):
    """The gate runs before every claim of a window run. Markers and watermarks grow with the run
    (each watermark names every shard its rank consumed), commits and tallies too; the data at rest
    is what the window bounds. So an open window costs one listing of `shards/` and no GET; a full
    one also reads the consumption records and deletes what they allow, at most every sweep_every_s."""
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    sizes = {layout.shard_of(o.key, layout.SHARDS): o.size for o in store.list(layout.SHARDS)}
    record_consumed(store, rank=0, world_size=2, shards=[0, 1, 2, 3], step=5)
    record_consumed(store, rank=1, world_size=2, shards=[0, 1, 2, 3], step=5)
    delete_consumed(store)  # the trainer deleted 0-3
    record_consumed(store, rank=0, world_size=2, shards=[0, 1, 2, 3, 4], step=9)
    record_consumed(store, rank=1, world_size=2, shards=[0, 1, 2, 3, 4], step=9)  # then was killed: 4 is left
    left = sum(sizes[s] for s in (4, 5, 6))
    reads = ReadCounter(store, monkeypatch)

    gate = WindowGate(store, left + 1, sleep=lambda s: pytest.fail("an open window waited"))
    assert gate.check() == AtRest(3, left, max(sizes[s] for s in (4, 5, 6))) == at_rest(store)
    assert reads.listed == [layout.SHARDS, layout.SHARDS] and reads.got == []

    gate, sleeps = WindowGate(store, left, sweep_every_s=3600), []
    gate.sleep = sleeps.append
    reads.clear()
    assert gate(7, lambda s: True) is Gate.OPEN and sleeps == []  # full, but shard 4 was consumed everywhere: deleted, and on
    assert layout.CONSUMED_RANKS in reads.listed and layout.CONSUMED_SHARDS in reads.listed
    assert data_shards(store) == {5, 6} and gate.check() == AtRest(2, left - sizes[4], max(sizes[5], sizes[6]))

    gate.window = left - sizes[4]  # full, with nothing left to delete: no second sweep within the hour
    reads.clear()
    assert gate.check() == AtRest(2, left - sizes[4], max(sizes[5], sizes[6]))
    assert reads.listed == [layout.SHARDS] and reads.got == []


def test_the_window_counts_every_object_at_rest_and_the_stall_check_agrees(store_uri):
    """An uncommitted data object (a worker between its upload and its commit, or killed there)
    takes space like any other: the window counts it, and the trainer's stall check measures what
    the gate measures, or a trainer would wait for data without freeing any while workers wait."""
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1])
    store.put(layout.data_key(2, "killed"), b"x" * 5_000)
    rest = at_rest(store)
    assert rest.shards == 3 and rest.bytes == sum(o.size for o in store.list(layout.SHARDS))
    assert rest.bytes == sum(layout.parse_tally(o.key)[1]["bytes"] for o in store.list(layout.TALLY)) + 5_000
    WindowGate(store, rest.bytes).record()
    assert stalled(store) == (rest, rest.bytes)
    assert WindowGate(store, rest.bytes).check() == rest  # the gate waits: nothing consumed to delete
    WindowGate(store, rest.bytes + 1).record()
    assert stalled(store) is None


def window_worker(store_uri: str, rank: int, gate: WindowGate, done: list[int], shards=None) -> None:
    """fake_worker's loop, with the window gate before each claim."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(rank), world_size=2, poll_s=0.05, before_claim=gate,
                      shards=shards)
    for claim in queue:
        with claim:
            meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic",
                             layers=fake_worker.LAYERS, hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                for i in range(claim.plan.start, claim.plan.end):
                    w.write_sample(fake_worker.make_sample(i))
                info = w.close()
            if claim.commit(info):
                done.append(claim.shard)


def test_workers_wait_while_the_window_is_full_and_go_on_once_training_consumed(store_uri):
    """Two workers, a window of two shards: they stop claiming once it is full and go on only as
    a trainer (this thread) consumes. The data at rest never exceeds window + one shard per worker."""
    store = open_store(store_uri)
    fake_worker.plan(store)
    window, largest, workers = 14_000, 8_200, 2  # fake_worker's shards are 7.0-8.1 kB
    waits: list[AtRest | None] = []
    gates = [WindowGate(store, window, poll_s=0.02, max_poll_s=0.1, on_wait=waits.append) for _ in range(workers)]
    done: list[int] = []
    threads = [threading.Thread(target=window_worker, args=(store_uri, r, gates[r], done), daemon=True) for r in range(workers)]
    for t in threads:
        t.start()
    consumed: list[int] = []
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, sum(o.size for o in store.list(layout.SHARDS)))
        assert peak < window + workers * largest
        if any(w is not None for w in waits[-2:]):  # the workers wait: read one committed shard
            committed = sorted(layout.shard_of(o.key, layout.COMMITS) for o in store.list(layout.COMMITS))
            left = [s for s in committed if s not in consumed]
            if left:
                consumed.append(left[0])
                record_consumed(store, rank=0, world_size=1, shards=consumed, step=len(consumed))
                delete_consumed(store)
        threads[0].join(0.02)
    for t in threads:
        t.join()
    assert sorted(done) == list(range(7))
    assert any(w is not None for w in waits) and consumed  # it did wait, and went on after consumption
    assert run_status(store)["complete"]
    assert at_rest(store).bytes < window + workers * largest


def test_a_store_outage_while_a_worker_passes_the_window_is_ridden_out(store_uri, monkeypatch):
    """The gate's looks were outside the queue's `patiently`: a listing of shards/ failing past the
    store's own retries (a throttle, when 1,000 waiting workers poll) ended the worker."""
    from layertap.storage.store import TransientStoreError

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1])
    manifest = fake_worker.plan(store)
    real_list, failed = store.list, []

    def throttled(prefix="", *args, **kwargs):
        if prefix == layout.SHARDS and len(failed) < 2:
            failed.append(prefix)
            raise TransientStoreError("SlowDown: please reduce your request rate (retries used up)")
        return real_list(prefix, *args, **kwargs)

    monkeypatch.setattr(store, "list", throttled)
    gate = WindowGate(store, 1 << 20, poll_s=0.02, max_poll_s=0.05)
    queue = WorkQueue(store, manifest, Producer.current(0), ttl_s=60, before_claim=gate, poll_s=0.02)
    claim = next(iter(queue))
    assert claim.shard not in (0, 1) and len(failed) == 2
    claim.release()


@pytest.mark.slow
def test_extract_with_a_window_waits_for_training(tmp_path, store_uri):
    """A real `python -m layertap extract --window`: it stops claiming once the window is full and
    goes on as this thread, the trainer, consumes a shard each time it waits. The bytes at rest
    stay under window + one shard (one worker); the run completes, with its consumed shards."""
    from test_extract import REPO, write_chats
    from tiny_models import tiny_model_dir

    data = write_chats(tmp_path / "chats.jsonl", 40)
    window = 50_000  # two shards as planned (~22 KiB each): no warning; two as stored (~25 KiB): full
    logs = tmp_path / "logs"
    args = [sys.executable, "-m", "layertap", "extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
            data, "--out", store_uri, "--layers", "1,3", "--max-length", "32", "--shard-bytes", "20KB",
            "--window", f"{window}B", "--log-dir", str(logs)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    store = open_store(store_uri)
    consumed: list[int] = []
    waits = peak = largest = 0
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        listed = [o.size for o in store.list(layout.SHARDS)]
        peak, largest = max([peak, sum(listed)]), max([largest, *listed])
        log_file = logs / "extract-rank0.log"
        seen = log_file.read_text().count("window full:") if log_file.exists() else 0
        if seen > waits:  # the worker waits: train on (consume) the oldest shards until the window opens
            waits = seen
            committed = sorted(layout.shard_of(o.key, layout.COMMITS) for o in store.list(layout.COMMITS))
            while at_rest(store).bytes >= window:
                consumed.append(next(s for s in committed if s not in consumed))
                record_consumed(store, rank=0, world_size=1, shards=consumed, step=len(consumed))
                delete_consumed(store)
        time.sleep(0.1)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert waits >= 2 and consumed
    assert peak < window + largest
    status = run_status(store)
    assert status["complete"] and status["shards_done"] == status["shards_total"] > len(consumed) + 1
    assert status["consumption"]["shards"] == len(consumed)
    # its closing words: not "train a drafter on it" over data the trainer deleted
    assert f"training consumed {len(consumed)} of its shards while it was extracted" in out
    assert "train a drafter on it" not in out
    assert "holds fewer than two of this run's shards" not in (logs / "extract-rank0.log").read_text()


def test_workers_waiting_behind_the_window_are_on_record_for_status_and_submit(store_uri, tmp_path, capsys, caplog,
                                                                               monkeypatch):
    """A worker waiting behind a full window holds no lease, so `submit extract` took the shards
    it waits for as free work and started more tasks (each loading the model to wait beside it),
    and `status` could only guess whether anyone waited. While it waits, the worker's record is
    under waiting/ (renewed, removed when it goes on), with the shards it may take (its
    --shards): `status` counts it; `submit` leaves those shards to it, naming its job, and plans
    only for the others; `--then-train` is refused (chained training would start before they are
    done, and they are done only as training consumes). A record not renewed for WAITING_STALE_S
    (a worker SIGKILLed while it waited) counts for nothing. The waiting worker also says when
    no trainer will open the window."""
    import layertap.manifests.consumption as consumption
    from layertap.manifests.consumption import waiting_records
    from test_slurm import submit

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", "/no-slurm-here")
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    window = at_rest(store).bytes  # full
    gate = WindowGate(store, window, producer=Producer.current(0), shards=[3, 4], poll_s=0.02, max_poll_s=0.1,
                      log_every_s=0.1)
    done: list[int] = []
    worker = threading.Thread(target=window_worker, args=(store_uri, 0, gate, done, [3, 4]), daemon=True)
    with caplog.at_level("WARNING", logger="layertap.manifests.consumption"):
        worker.start()
        deadline = time.time() + 30
        while not waiting_records(store) and time.time() < deadline:
            time.sleep(0.05)
        assert len(waiting_records(store)) == 1 and done == []
        status = run_status(store)
        assert status["workers_waiting"] == 1 and status["shards_running"] == 0
        assert cli(["status", store_uri]) == 3
        assert "no shard is running: 1 extraction worker(s) wait for the window to open" in capsys.readouterr().out
        dry = ("extract", "--dry-run", "--out", store_uri, "--max-length", "64")
        assert submit(*dry) == 0
        out = capsys.readouterr().out
        assert "1 extraction worker(s) of 777 wait behind the full storage window to take shards 3-4 as training " \
               "consumes: left to them; this array is for the other 2 shard(s)" in out
        assert "#SBATCH --array=0-1\n" in out  # a task per free shard (5, 6)
        assert submit(*dry, "--shards", "3,4") == 0
        out = capsys.readouterr().out
        assert "nothing to submit: 1 extraction worker(s) of 777 wait behind the full storage window to take " \
               "shards 3-4" in out and "#SBATCH" not in out
        assert submit(*dry, "--then-train", f"--data {store_uri} --model m --out d") == 2
        assert "Train alongside them: `layertap submit train --follow --delete-consumed" in capsys.readouterr().err
        time.sleep(0.3)
    assert "no `layertap train --delete-consumed` has claimed this run" in caplog.text
    assert caplog.text.count("no `layertap train --delete-consumed`") == 1  # at most every TRAINER_LOOK_S

    record_consumed(store, rank=0, world_size=1, shards=[0, 1, 2], step=1)  # training consumes: it goes on
    delete_consumed(store)
    while not done and time.time() < deadline:
        time.sleep(0.05)
    assert done and not waiting_records(store) and list(store.list(layout.WAITING)) == []

    store.put(layout.waiting_key("killed"), b"{}")  # a worker SIGKILLed while it waited
    assert len(waiting_records(store)) == 1
    monkeypatch.setattr(consumption, "WAITING_STALE_S", 1.0)
    assert until_stale(lambda: waiting_records(store) == [])
    record_consumed(store, rank=0, world_size=1, shards=list(range(7)), step=2)
    delete_consumed(store)  # let the worker finish its shards
    worker.join(60)
    assert not worker.is_alive() and sorted(done) == [3, 4]


class CountingCollate:
    """`collate` that appends a line to `path` per batch, from whichever process collates it."""

    def __init__(self, path):
        self.path = path

    def __call__(self, samples):
        from layertap.train.batch import collate

        with open(self.path, "a") as f:
            f.write("batch\n")
        return collate(samples)


@pytest.mark.parametrize("workers, accum", [(0, 1), (0, 4), (1, 1), (2, 1)])
def test_the_window_floor_counts_the_batches_a_rank_really_holds(tmp_path, workers, accum):
    """`window_floor` rests on how many batches a training rank holds before it has trained them
    (each sample of one can keep a shard from counting as consumed). It assumed 3 in all: a
    DataLoader worker prefetches 2 of its own, so --num-workers 1 held 5 and the submit warning's
    floor was too low. Counted here as the trainer builds its loader: batches collated once the
    first is being trained and the prefetching settled."""
    from layertap.manifests.consumption import batches_in_flight, prefetch_depth
    from layertap.train import ShardStream, StreamConfig
    from layertap.train.loader import Prefetcher, StreamLoader

    uri = str(tmp_path / "run")
    fake_worker.work(uri, samples=200)
    counted = tmp_path / "collated"
    counted.write_text("")
    stream = ShardStream(uri, config=StreamConfig(shuffle_buffer=4, seed=1), rank=0, world_size=1)
    loader = StreamLoader(stream, batch_size=2, num_workers=workers, collate_fn=CountingCollate(counted))
    want = batches_in_flight(workers, accum)
    collated = lambda: counted.read_text().count("batch")  # noqa: E731
    with Prefetcher(loader, "cpu", depth=prefetch_depth(accum)) as batches:
        batches.wait_for_batch()
        deadline = time.time() + 60  # a DataLoader worker starved on a busy machine collates late: not "settled"
        while collated() < want and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # and no more than that: nothing new for 1.5 s
        seen = collated()
    assert seen == want


def test_a_window_under_two_shards_is_warned_of_at_the_start(tmp_path):
    """`extract --shard-bytes 6MB --window 1MB` was taken silently and then went one shard at a time
    (or stalled for good, with a trainer's shuffle buffer to fill)."""
    from test_extract import REPO, write_chats
    from tiny_models import tiny_model_dir

    logs = tmp_path / "logs"
    args = [sys.executable, "-m", "layertap", "extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
            write_chats(tmp_path / "chats.jsonl", 20), "--out", str(tmp_path / "run"), "--layers", "1,3",
            "--max-length", "32", "--shard-bytes", "20KB", "--window", "30KB", "--log-dir", str(logs)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    log_file, deadline, text = logs / "extract-rank0.log", time.time() + 300, ""
    try:
        while proc.poll() is None and time.time() < deadline and "window full" not in text:
            text = log_file.read_text() if log_file.exists() else ""
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # sized by the largest shard the plan holds (the run's size where it is below --shard-bytes), not the flag's
    assert re.search(r"--window 29.3 KiB holds fewer than two of this run's shards \(~\d+\.\d+ KiB the largest\)", text), \
        text[-3000:]


def test_a_run_smaller_than_a_shard_is_warned_of_with_its_own_size(tmp_path, caplog):
    """A run of one shard below --shard-bytes: the warning named the flag's 954 MiB, a shard it never had."""
    from test_extract import write_chats
    from tiny_models import tiny_model_dir

    from layertap.manifests.manifest import load_manifest
    from layertap.storage.units import size

    out = str(tmp_path / "run")
    with caplog.at_level("WARNING"):
        assert cli(["extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
                    write_chats(tmp_path / "chats.jsonl", 6), "--out", out, "--layers", "1,3", "--max-length", "32",
                    "--window", "1KB", "--log-dir", str(tmp_path / "logs")]) == 0
    manifest = load_manifest(open_store(out))
    assert len(manifest.shards) == 1 and manifest.largest_shard_bytes < 100_000
    assert f"holds fewer than two of this run's shards (~{size(manifest.largest_shard_bytes)} the largest)" in \
        caplog.text


def test_status_and_verify_of_a_run_with_consumed_shards(store_uri, capsys):
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    tallies = dict(layout.parse_tally(o.key) for o in store.list(layout.TALLY))
    assert json.loads(cli_out(capsys, "status", store_uri, "--json")[1])["consumption"] is None

    record_consumed(store, rank=0, world_size=1, shards=[0, 1, 2], step=3)
    assert delete_consumed(store) == [0, 1, 2]
    rc, out, _ = cli_out(capsys, "status", store_uri, "--json")
    c = json.loads(out)["consumption"]
    assert rc == 0 and json.loads(out)["complete"]
    left = [tallies[s] for s in range(3, 7)]
    assert c["shards"] == 3 and c["samples"] == sum(tallies[s]["records"] for s in range(3))
    assert (c["backlog_shards"], c["backlog_samples"], c["backlog_bytes"]) == \
        (4, sum(t["records"] for t in left), sum(t["bytes"] for t in left))
    assert c["training"] == {"samples_per_h": None, "bytes_per_h": None}  # one burst of markers: no rate yet
    rc, out, _ = cli_out(capsys, "status", store_uri, "--shards")
    assert "consumed 3 shards" in out and "backlog  4 shards" in out
    assert "training no rate (3 shard(s) in one burst: a rate needs two)" in out  # not "yet": it had all there was
    assert [line.split()[1] for line in out.splitlines() if line.startswith("  00000")] == \
        ["consumed"] * 3 + ["done"] * 4

    rc, out, _ = cli_out(capsys, "verify", store_uri, "--json")
    assert rc == 0 and json.loads(out) | {"bad": []} == {"checked": 4, "ok": 4, "bad": [], "withdrawn": 0,
                                                        "orphans_deleted": 0, "consumed": 3}
    rc, out, _ = cli_out(capsys, "verify", store_uri)
    assert rc == 0 and "3 more consumed by training" in out
    assert len(list(store.list(layout.COMMITS))) == 7  # nothing withdrawn


def test_verify_counts_a_shard_consumed_while_it_reads_it(store_uri, monkeypatch):
    """`verify` beside `train --delete-consumed`: the trainer marks and deletes a shard while
    verify reads it (its size, then ranged GETs). The shard counts as consumed, the others are
    still checked, nothing is withdrawn. (It stopped verify with ObjectNotFound before.)"""
    store = open_store(store_uri)
    fake_worker.work(store_uri)
    real_size = store.size

    def size_after_the_trainer_deleted_it(key):
        if key.startswith(f"{layout.SHARDS}000002-"):
            record_consumed(store, rank=0, world_size=1, shards=[2], step=10)
            assert delete_consumed(store) == [2]
        return real_size(key)

    monkeypatch.setattr(store, "size", size_after_the_trainer_deleted_it)
    result = verify_run(store).to_json()
    assert result | {"bad": []} == {"checked": 6, "ok": 6, "bad": [], "withdrawn": 0, "orphans_deleted": 0,
                                    "consumed": 1}
    assert len(list(store.list(layout.COMMITS))) == 7


def test_rates_leave_out_the_oldest_burst():
    """Markers come in bursts (one per training checkpoint): what the oldest burst counts was done
    before it, so the rate is of the later ones over the time since the oldest."""
    times = {0: 1000.0, 1: 1003.0, 2: 1100.0, 3: 1200.0, 9: 1500.0}
    values = {0: 10, 1: 10, 2: 30, 3: 50}  # shard 9 has no numbers (no tally): left out
    assert burst_rate(times, values) == pytest.approx(80 / 200)
    assert burst_rate({0: 1000.0, 1: 1005.0}, {0: 10, 1: 10}) is None
    assert burst_rate(times, values, window_s=150) == pytest.approx(50 / 100)  # the last 150 s: 2 and 3
    assert burst_rate({}, {}) is None


def cli_out(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow
def test_sigterm_while_waiting_on_the_window_is_a_preemption(tmp_path):
    """A worker waiting for training is stopped at once by SIGTERM (exit 143), holding no lease."""
    from test_extract import REPO, write_chats
    from tiny_models import tiny_model_dir

    out, logs = str(tmp_path / "run"), tmp_path / "logs"
    args = [sys.executable, "-m", "layertap", "extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
            write_chats(tmp_path / "chats.jsonl", 20), "--out", out, "--layers", "1,3", "--max-length", "32",
            "--shard-bytes", "20KB", "--window", "1B", "--log-dir", str(logs)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    log_file, deadline = logs / "extract-rank0.log", time.time() + 300
    while proc.poll() is None and time.time() < deadline and \
            not (log_file.exists() and "window full:" in log_file.read_text()):
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    store = open_store(out)
    status = run_status(store)
    assert status["shards_done"] == 1 < status["shards_total"] and status["shards_running"] == 0
    assert not list(store.list(layout.LEASES))


def test_window_setting_takes_a_size():
    from layertap.extract.config import ExtractConfig
    from layertap.storage.errors import ConfigError

    assert ExtractConfig(out="o").window is None
    assert ExtractConfig(out="o", window="200GB").window == 200 * 10**9  # as a --config file gives it
    with pytest.raises(ConfigError, match="--window: invalid size 'lots'"):
        ExtractConfig(out="o", window="lots")


def test_a_stream_leaves_out_consumed_shards_with_one_warning(store_uri, caplog):
    """A plain (not follow) ShardStream over a run a window run consumed: the deleted shards are
    left out, named once in a warning; when every shard is gone it says so instead of fetching."""
    from layertap.storage.errors import InputError
    from layertap.train import ShardStream

    store = open_store(store_uri)
    fake_worker.work(store_uri)
    records = {s: t["records"] for s, t in (layout.parse_tally(o.key) for o in store.list(layout.TALLY))}
    record_consumed(store, rank=0, world_size=1, shards=[0, 2], step=1)
    assert delete_consumed(store) == [0, 2]
    with caplog.at_level("WARNING", logger="layertap.train.stream"):
        stream = ShardStream(store_uri, rank=0, world_size=1)
        samples = list(stream)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert f"2 committed shard(s) ({records[0] + records[2]} samples)" in warnings[0]
    assert "cannot be trained on again" in warnings[0]
    assert [s.shard for s in stream.shards] == [1, 3, 4, 5, 6]
    assert len(samples) == sum(records[s] for s in (1, 3, 4, 5, 6)) == stream.total_samples

    # a follow stream (a new trainer, or one whose checkpoint was lost) leaves them out too, instead
    # of fetching them and calling them corrupt; it pads for them, as for shards never committed
    from layertap.train import StreamConfig

    caplog.clear()
    with caplog.at_level("WARNING", logger="layertap.train.stream"):
        follow = list(ShardStream(store_uri, config=StreamConfig(follow=True, follow_poll_s=0.5), rank=0,
                                  world_size=1))
    real = [x["sample_id"] for x in follow if not x["padding"]]
    assert sorted(real) == sorted(s["sample_id"] for s in samples)
    assert len(follow) == sum(records.values())
    assert any("leaving them out of the follow epoch" in r.getMessage() for r in caplog.records)

    record_consumed(store, rank=0, world_size=1, shards=list(range(7)), step=2)
    delete_consumed(store)
    with pytest.raises(InputError, match=r"every committed shard with samples is gone: 7 committed shard\(s\)"):
        ShardStream(store_uri, rank=0, world_size=1)


def test_a_follow_trainer_waiting_on_a_full_window_says_it_is_stalled(store_uri, caplog):
    """Extraction waits for training (its window is full) while training waits for data, on two
    looks in a row: the follow watcher's waiting line is joined by one naming the stall, the rule
    and the knobs. One look is not yet a stall: a waiting trainer checkpoints to open the window."""
    from layertap.manifests.consumption import WindowGate, claim_consumer, recorded_window
    from layertap.manifests.manifest import load_manifest
    from layertap.train.follow import CommitWatcher

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])  # 3 of 7 committed; the rest pending
    assert recorded_window(store) is None
    WindowGate(store, 10_000).record()
    assert recorded_window(store) == 10_000
    claim_consumer(store, "out")  # a --delete-consumed trainer (this one): the stall is the window's size
    watcher = CommitWatcher(store, load_manifest(store), poll_s=0.1, deletes_consumed=True)
    watcher.poll()
    caplog.set_level("INFO", logger="layertap.train.follow")
    assert watcher._extraction_over() is False
    assert "waiting for extraction: 3 of 7 shards committed" in caplog.text
    assert "STALLED" not in caplog.text  # the first sign: a waiting `layertap train` checkpoints here
    watcher._logged = 0.0  # the next look, 30 s later: still stalled, for good
    assert watcher._extraction_over() is False
    assert "STALLED" in caplog.text and "--window" in caplog.text and "--shuffle-buffer" in caplog.text
    # ... and on the store, where `layertap status` of the run shows it (it said workers wait "as training consumes")
    from layertap.manifests.consumption import recent_stall

    assert "STALLED: extraction waits for training to consume" in recent_stall(store)["message"]
    # a rank with no share of the shards at rest read none of their commit records: the largest is the listing's
    from layertap.storage.units import size

    largest = max(o.size for o in store.list(layout.SHARDS))
    other = CommitWatcher(store, load_manifest(store), poll_s=0.1, deletes_consumed=True, wants=lambda s, n: False)
    other.poll()
    caplog.clear()
    for _ in range(2):
        other._logged = 0.0
        assert other._extraction_over() is False
    assert f"the largest shard ({size(largest)} here)" in caplog.text and "(0 B here)" not in caplog.text

    caplog.clear()  # extraction moved in between: the next stall starts counting again
    fake_worker.work(store_uri, shards=[3])
    assert [r.shard for r in watcher.poll()] == [3]
    watcher._logged = 0.0
    assert watcher._extraction_over() is False
    assert "STALLED" not in caplog.text and recent_stall(store) is None  # its report gone with it

    caplog.clear()  # a window the backlog does not fill: waiting, not stalled
    WindowGate(store, 10**9).record()
    for _ in range(2):
        watcher._logged = 0.0
        assert watcher._extraction_over() is False
    assert "waiting for extraction" in caplog.text and "STALLED" not in caplog.text


def test_a_stall_that_lasts_stops_the_trainer_with_its_reason(store_uri, caplog):
    """A stall neither side can end (a hunt: a --window smaller than the trainer's shuffle buffers,
    both processes waiting until killed, 10+ minutes): after STALL_GIVE_UP_S of it the watcher
    raises, so `layertap train` exits 2 with the STALLED reason; new commits start the clock over."""
    from layertap.manifests.consumption import WindowGate, claim_consumer
    from layertap.manifests.manifest import load_manifest
    from layertap.train import follow
    from layertap.train.follow import CommitWatcher, Stalled

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    WindowGate(store, 10_000).record()
    claim_consumer(store, "out")
    watcher = CommitWatcher(store, load_manifest(store), poll_s=0.1, deletes_consumed=True)  # that trainer's
    watcher.poll()
    for _ in range(3):  # stalled, but not for long yet
        watcher._logged = 0.0
        assert watcher._extraction_over() is False
    watcher._stalled_since -= follow.STALL_GIVE_UP_S - 60  # a minute short
    watcher._logged = 0.0
    assert watcher._extraction_over() is False
    fake_worker.work(store_uri, shards=[3])  # extraction moved: the clock starts over
    assert [r.shard for r in watcher.poll()] == [3]
    watcher._logged = 0.0
    assert watcher._extraction_over() is False
    watcher._stalled_since -= follow.STALL_GIVE_UP_S - 60
    watcher._logged = 0.0
    assert watcher._extraction_over() is False
    watcher._stalled_since -= 61
    watcher._logged = 0.0
    with pytest.raises(Stalled, match="STALLED: extraction waits for training to consume .* Stopping after 10 min"):
        watcher._extraction_over()


def test_no_stall_is_reported_while_a_shard_is_being_extracted(store_uri, caplog):
    """A worker that passed the window's gate before it filled is still extracting a shard: its
    commit will come, and training goes on with it, so nothing is stalled. Such looks restarted
    the give-up clock but still counted towards the STALLED line, logged (at ERROR, every 30 s of
    a long shard) with the advice to restart extraction, which would throw that shard's work away.
    Once no shard is extracted, the stall is counted from the next look: STALLED a look later."""
    from layertap.manifests.consumption import claim_consumer
    from layertap.manifests.manifest import load_manifest
    from layertap.train.follow import CommitWatcher

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])  # 3 of 7 committed
    WindowGate(store, 10_000).record()  # ... and they fill the window
    claim_consumer(store, "out")
    manifest = load_manifest(store)
    watcher = CommitWatcher(store, manifest, poll_s=0.1, deletes_consumed=True)  # the trainer claimed as "out"
    watcher.poll()
    caplog.set_level("INFO", logger="layertap.train.follow")

    def looks(n: int, watcher: CommitWatcher = watcher) -> None:
        for _ in range(n):
            watcher._logged = 0.0  # each a look 30 s after the last
            assert watcher._extraction_over() is False

    with next(iter(WorkQueue(store, manifest, Producer.current(1), ttl_s=60.0, shards=[3]))):  # shard 3 running
        looks(3)
        assert "(1 running," in caplog.text and "STALLED" not in caplog.text
    looks(1)  # its worker stopped without committing it (and now waits in the gate): the first sign
    assert "STALLED" not in caplog.text
    looks(1)
    assert "STALLED" in caplog.text

    # A second trainer, which deletes nothing, on the same window: the full window is the first one's to
    # open at its next checkpoint (maybe more than the 10 min give-up away). While that one runs, no stall
    # of this one's: it exited 2 ("Stopping after 10 min") with nothing stuck.
    caplog.clear()
    other = CommitWatcher(store, manifest, poll_s=0.1)
    other.poll()
    looks(3, other)
    assert "STALLED" not in caplog.text


def test_a_waiting_worker_sweeps_the_stale_records_of_killed_ones(store_uri, monkeypatch):
    """A worker SIGKILLed while it waited left its `waiting/` record for good (every reader ignores
    it once stale); a waiting worker removes such records as it looks for a trainer, and not a
    live worker's."""
    import layertap.manifests.consumption as consumption

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    store.put(layout.waiting_key("killed"), b"{}")
    monkeypatch.setattr(consumption, "WAITING_STALE_S", 3.0)  # "alive" below stays fresh for the gate's looks
    monkeypatch.setattr(consumption, "TRAINER_LOOK_S", 0.0)
    assert until_stale(lambda: consumption.waiting_records(store) == [])
    store.put(layout.waiting_key("alive"), b"{}")
    keys = lambda: sorted(o.key for o in store.list(layout.WAITING))  # noqa: E731
    seen: list[list[str]] = []

    def on_wait(rest: AtRest | None) -> None:
        if rest is not None:
            seen.append(keys())
            if layout.waiting_key("killed") not in seen[-1] or len(seen) > 100:
                record_consumed(store, rank=0, world_size=1, shards=[0, 1, 2], step=1)
                delete_consumed(store)

    gate = WindowGate(store, at_rest(store).bytes, producer=Producer.current(0), poll_s=0.02, max_poll_s=0.05,
                      log_every_s=0.0, on_wait=on_wait)
    assert gate(3, lambda shard: False) is Gate.WAITED
    assert layout.waiting_key("killed") not in seen[-1] and len(seen) <= 100
    assert layout.waiting_key("alive") in seen[-1]
    assert keys() == [layout.waiting_key("alive")]  # the gate removed its own on going on


def test_a_window_run_no_trainer_deletes_from_is_named_as_such(tmp_path, capsys, caplog):
    """A follow trainer without --delete-consumed never frees the window: the STALLED line advised a
    larger --window, and status said training deletes what it trained on. Both, and the trainer's
    start, now name the missing --delete-consumed trainer and the fix."""
    from layertap.manifests.consumption import claim_consumer
    from layertap.manifests.manifest import load_manifest
    from layertap.train.follow import CommitWatcher
    from tiny_models import tiny_model_dir

    store_uri = str(tmp_path / "run")
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])  # 3 of 7 committed; the rest pending
    WindowGate(store, 10_000).record()
    watcher = CommitWatcher(store, load_manifest(store), poll_s=0.1)
    watcher.poll()
    caplog.set_level("INFO")
    for _ in range(2):
        watcher._logged = 0.0
        assert watcher._extraction_over() is False
    assert "no `layertap train --delete-consumed` has claimed" in caplog.text
    assert "--delete-consumed (--resume continues it)" in caplog.text and "larger --window" not in caplog.text
    out = cli_out(capsys, "status", store_uri)[1]
    assert "NO TRAINER DELETES" in out and "as training consumes and deletes" not in out
    # nor that a rerun of the extraction finishes the pending shards: it would wait behind the full window too
    assert "finishes the pending shards" not in out and "nothing is running, and the window is full" in out, out

    caplog.clear()
    fake_worker.work(store_uri)  # the trainer's start warns, whatever is committed
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    assert cli(["train", "--data", store_uri, "--model", target, "--out", str(tmp_path / "out"), "--follow",
                "--steps", "1", "--batch-size", "2", "--block-size", "4", "--max-anchors", "8"]) == 0
    assert "no --delete-consumed trainer has claimed it" in caplog.text

    # a deleting trainer: the advice is the window's size again, to it (another counts no stall while it runs)
    claim_consumer(store, "elsewhere")
    watcher.deletes_consumed = True
    caplog.clear()
    for _ in range(2):
        watcher._logged = 0.0
        watcher._extraction_over()
    assert "larger --window" in caplog.text and "has claimed" not in caplog.text
    assert "NO TRAINER DELETES" not in cli_out(capsys, "status", store_uri)[1]


def test_a_deleting_trainer_is_warned_at_its_start_of_a_window_its_buffers_can_fill(tmp_path, caplog):
    """`submit --train-while-extracting` warned of a --window below `window_floor`; `train --follow
    --delete-consumed` started by hand was told only by its STALLED lines, a minute or more in."""
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    for window, name in ((10**12, "roomy"), (10_000, "tight")):
        store_uri = str(tmp_path / name)
        fake_worker.work(store_uri)
        WindowGate(open_store(store_uri), window).record()
        caplog.clear()
        with caplog.at_level("WARNING"):
            assert cli(["train", "--data", store_uri, "--model", target, "--out", str(tmp_path / f"{name}-out"),
                        "--follow", "--delete-consumed", "--batch-size", "2", "--shuffle-buffer", "2", "--block-size",
                        "4", "--max-anchors", "8"]) == 0
        assert ("is below" in caplog.text) == (name == "tight"), caplog.text
    assert "--window 9.77 KiB is below" in caplog.text
    assert "= 1 training ranks x (--shuffle-buffer 2 + 3 x --batch-size 2) x shards of" in caplog.text


def test_an_extraction_without_a_window_removes_an_earlier_ones_record(tmp_path):
    """A `consumed/window.json` left by an earlier --window extraction made the follow trainer of a
    later one without --window take stall checkpoints, and status report a window."""
    from layertap.manifests.consumption import recorded_window
    from test_extract import REPO, write_chats
    from tiny_models import tiny_model_dir

    uri = str(tmp_path / "run")
    store = open_store(uri)
    WindowGate(store, 8_000).record()
    args = [sys.executable, "-m", "layertap", "extract", "--model", tiny_model_dir(tmp_path, "llama"), "--dataset",
            write_chats(tmp_path / "chats.jsonl", 8), "--out", uri, "--layers", "1,3", "--max-length", "32",
            "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert recorded_window(store) is None


def test_a_follow_resume_missing_a_withdrawn_shard_under_a_full_window_gets_it_redone(tmp_path):
    """A follow trainer's shard withdrawn by `layertap verify` (as a corrupt record's error tells):
    the resume refuses until extraction redoes it. With the --window full, nothing is consumed
    while the trainer waits, and the workers waited in the window's gate, redoing nothing: the run
    was stuck. A withdrawn shard's redo passes the gate: the worker redoes it (and nothing else),
    its redo marker goes, and the resume then goes on."""
    from layertap.manifests.records import decode_commit
    from layertap.manifests.status import _withdraw
    from layertap.storage.errors import InputError
    from layertap.train import ShardStream, StreamConfig

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    window = 24_000
    WindowGate(store, window).record()
    cfg = StreamConfig(follow=True, follow_poll_s=0.1, shuffle_buffer=4, seed=3)
    stream = ShardStream(uri, config=cfg, rank=0, world_size=1)
    it = iter(stream)
    for _ in range(8):
        next(it)
    state = stream.state_dict()
    victim = next(s for s in state["taken"][0] if s not in stream.consumed_shards(state))
    it.close()
    key = layout.commit_key(victim)
    _withdraw(store, victim, "record 2: hash mismatch", decode_commit(store.get(key), key).data_key, [])
    assert layout.redo_key(victim) in [o.key for o in store.list(layout.REDO)]
    resumed = ShardStream(uri, config=cfg, rank=0, world_size=1)
    resumed.load_state_dict(state)
    with pytest.raises(InputError, match=rf"shard\(s\) {victim} .* no longer committed .* runs under --window "
                                         r"24000: .* redo withdrawn shards all the same"):
        next(iter(resumed))

    assert at_rest(store).bytes >= window  # the window is full: only the redo may pass
    redone: list[int] = []
    worker = threading.Thread(target=lambda: redone.extend(fake_worker.work(uri, window=window)), daemon=True)
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "the worker waited behind the full window instead of redoing the withdrawn shard"
    assert redone == [victim] and run_status(store)["complete"]
    assert list(store.list(layout.REDO)) == []
    resumed = ShardStream(uri, config=cfg, rank=0, world_size=1)
    resumed.load_state_dict(state)
    assert next(iter(resumed)) is not None


def test_a_worker_waiting_behind_a_full_window_redoes_a_shard_withdrawn_meanwhile(store_uri):
    """Workers already waiting in the gate when `verify` withdraws a shard: the gate lists the
    redo markers while it waits and lets its worker redo that shard (one worker: the other finds
    it leased), then both wait again; nothing else is claimed until training consumes. A marker
    left beside a shard committed again (a redo killed before removing it) is passed over."""
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2, 3])
    sizes = {layout.shard_of(o.key, layout.SHARDS): o.size for o in store.list(layout.SHARDS)}
    window = sizes[0] + sizes[2] + sizes[3]  # full, and still full once shard 1 is withdrawn
    waits: list[list[AtRest | None]] = [[], []]
    gates = [WindowGate(store, window, poll_s=0.02, max_poll_s=0.1, on_wait=waits[r].append) for r in range(2)]
    done: list[int] = []
    threads = [threading.Thread(target=window_worker, args=(store_uri, r, gates[r], done), daemon=True)
               for r in range(2)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while not all(waits) and time.time() < deadline:
        time.sleep(0.05)  # until both wait
    assert done == [] and all(waits)
    bad = corrupt(store, 1)
    assert [b["shard"] for b in verify_run(store).bad] == [1] and not store.exists(bad)
    while 1 not in done and time.time() < deadline:
        time.sleep(0.05)
    assert done == [1], f"the waiting workers redid {done} (want [1], once)"
    assert list(store.list(layout.REDO)) == []
    time.sleep(0.5)  # both wait again: the window is as full as before the withdrawal
    assert done == [1] and sorted(listed(store, layout.COMMITS)) == [0, 1, 2, 3]

    store.put(layout.redo_key(2), b"")  # stale: shard 2 is committed
    time.sleep(0.5)
    assert done == [1] and listed(store, layout.REDO) == [2]

    consumed = [0, 1, 2, 3]  # training consumes: the workers finish the run
    record_consumed(store, rank=0, world_size=1, shards=consumed, step=1)
    delete_consumed(store)
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), (done, [len(w) for w in waits], waits[0][-3:], waits[1][-3:])
    assert sorted(done) == [1, 4, 5, 6] and run_status(store)["complete"]


def test_a_worker_starting_under_a_full_window_redoes_withdrawn_shards_first(store_uri):
    """A worker whose order puts other unfinished shards first (rank 1 of 2 starts half way): it
    walks the withdrawn shard first and redoes it without the gate; walked in order, the gate
    before the first shard answered REDO, the pass rescanned, and the withdrawn shard was never
    reached. A redo marker without a withdrawal record (a run's failures/ cleaned by hand) counts
    as a redo to the queue as to the gate: before, the gate woke the queue, which did not take it
    for one, and rescanned the run without pause, ~600 times a second."""
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2, 3])
    sizes = {layout.shard_of(o.key, layout.SHARDS): o.size for o in store.list(layout.SHARDS)}
    window = sizes[0] + sizes[2] + sizes[3]  # full, and still full once shard 1 is withdrawn
    bad = corrupt(store, 1)
    assert [b["shard"] for b in verify_run(store).bad] == [1] and not store.exists(bad)
    store.put(layout.redo_key(5), b"")  # no withdrawal record
    gate = WindowGate(store, window, poll_s=0.02, max_poll_s=0.1)
    done: list[int] = []
    worker = threading.Thread(target=window_worker, args=(store_uri, 1, gate, done), daemon=True)  # walks 5, 6, 1, 4
    worker.start()
    deadline = time.time() + 30
    while len(done) < 2 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    assert sorted(done) == [1, 5] and listed(store, layout.REDO) == []  # and nothing else: the window is full
    record_consumed(store, rank=0, world_size=1, shards=list(range(7)), step=1)
    delete_consumed(store)
    worker.join(60)
    assert not worker.is_alive() and sorted(done) == [1, 4, 5, 6]


def test_verify_restores_the_redo_marker_a_killed_verify_left_out(store_uri):
    """`verify` writes a withdrawn shard's redo marker last, once the commit is gone: one killed in
    between left a redo that workers waiting behind a full window never see (they list only the
    markers), and a second verify, which reads only committed shards, did not see it either."""
    from layertap.manifests.records import decode_commit
    from layertap.manifests.status import _withdraw

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    key = layout.commit_key(1)
    _withdraw(store, 1, "record 2: hash mismatch", decode_commit(store.get(key), key).data_key, [])
    store.delete(layout.redo_key(1))  # killed before the marker
    result = verify_run(store)
    assert result.ok == 2 and result.bad == [] and listed(store, layout.REDO) == [1]
    fake_worker.work(store_uri, shards=[1])  # the redo removes it
    assert listed(store, layout.REDO) == [] and listed(store, layout.COMMITS) == [0, 1, 2]


def listed(store, prefix: str) -> list[int]:
    return [layout.shard_of(o.key, prefix) for o in store.list(prefix)]


def test_data_a_killed_attempt_left_before_its_commit_does_not_shut_the_window_for_good(store_uri, monkeypatch):
    """A worker killed between its shard object's completion and its commit left data at rest that
    only that shard's commit removes; the window counted it and held every claim back, that
    shard's redo too: extraction waited for training, and training for data, for good. A waiting
    worker marks such a shard for redo (no live lease, no commit) and redoes it first."""
    from layertap.manifests import consumption

    monkeypatch.setattr(consumption, "TRAINER_LOOK_S", 0.0)
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=40)
    dead = next(iter(WorkQueue(store, manifest, Producer.current(0), ttl_s=0.5, shards=[0], poll_s=0.1)))
    meta = ShardMeta(run_id=manifest.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    with ShardWriter(store.open_writer(dead.data_key), meta) as w:
        for i in range(dead.plan.start, dead.plan.end):
            w.write_sample(fake_worker.make_sample(i))
        w.close()  # ... and killed here, before its commit: its lease goes stale
    time.sleep(1.0)
    left = at_rest(store)
    looks = []

    def sleep(s):
        looks.append(s)
        assert len(looks) < 50, "still waiting for the window"

    gate = WindowGate(store, left.bytes, poll_s=0.01, max_poll_s=0.01, log_every_s=0.0, sleep=sleep)
    queue = WorkQueue(open_store(store_uri), manifest, Producer.current(1), ttl_s=60, poll_s=0.1, before_claim=gate)
    claim = next(iter(queue))
    assert claim.shard == 0 and claim.data_key != dead.data_key  # the leftover's shard, redone
    with claim:
        with ShardWriter(store.open_writer(claim.data_key), meta) as w:
            for i in range(claim.plan.start, claim.plan.end):
                w.write_sample(fake_worker.make_sample(i))
            assert claim.commit(w.close())
    assert [o.key for o in store.list(layout.SHARDS)] == [claim.data_key]  # the commit removed the leftover
    assert not list(store.list(layout.REDO))


def test_a_consumer_starting_from_step_0_forgets_the_watermarks_of_an_earlier_start(store_uri):
    """An earlier start of the run's --delete-consumed trainer (its checkpoints removed, the same
    --out and world size) left rank 1's watermark naming shard 2; the new start's rank 0 naming it
    too made it consumed everywhere, and a sweep deleted it before the new rank 1 had read it."""
    from types import SimpleNamespace

    from layertap.manifests.consumption import claim_consumer, watermarks
    from layertap.train.trainer import _check_consumer

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2, 3])
    run_id = fake_worker.plan(store).run_id
    claim_consumer(store, "out")
    record_consumed(store, rank=0, world_size=2, shards=[0], step=4, run_id=run_id, output="out")
    record_consumed(store, rank=1, world_size=2, shards=[0, 2], step=4, run_id=run_id, output="out")
    assert delete_consumed(store, run_id=run_id) == [0]  # the earlier start's own agreement: gone, and marked
    cfg = SimpleNamespace(delete_consumed=True, follow=True)
    _check_consumer(cfg, store, "out", rank=0, world=1, shard_bytes=1, fresh=False)  # a resume keeps them: they are its own
    assert set(watermarks(store)) == {0, 1}
    _check_consumer(cfg, store, "out", rank=0, world=1, shard_bytes=1, fresh=True)
    assert watermarks(store) == {}
    record_consumed(store, rank=0, world_size=2, shards=[2], step=4, run_id=run_id, output="out")  # the new rank 0
    assert consumed_everywhere(store) == {0} and delete_consumed(store, run_id=run_id) == []
    assert 2 in data_shards(store)


def test_a_waiting_gate_records_its_window_again_after_another_extraction_removed_it(store_uri):
    """An extraction started without --window on the same run removes the window's record
    (`forget_window`); the --window workers wrote it only before their first claim, so trainers
    saw no window while those workers waited, and no stall. Each wait records it again."""
    from layertap.manifests.consumption import forget_window, recorded_window

    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])  # ~22 kB at rest: a window of 10 kB is full

    def commit_shard_3(_seconds: float) -> None:  # the wait's first pause: another worker commits shard 3
        fake_worker.work(store_uri, shards=[3])

    gate = WindowGate(store, 10_000, sleep=commit_shard_3)
    assert recorded_window(store) is None
    gate.record()
    gate._recorded = True  # as its first claim did
    forget_window(store)  # a worker of another job, started without --window
    assert recorded_window(store) is None
    assert gate(3, lambda shard: False) is Gate.WAITED
    assert recorded_window(store) == 10_000


def test_a_trainer_stopped_by_a_stall_before_its_first_checkpoint_withdraws_its_claim(store_uri, tmp_path):
    """It stopped (exit 2, STALLED) with its output empty: its claim read as a trainer still running (not
    seen from here), so the extraction behind the full window waited for good without its warning, and
    `status` said training consumed. A trainer that checkpointed keeps its claim (it may have deleted data)."""
    from layertap.manifests.consumption import claim_consumer, trainer_state
    from layertap.train.trainer import _give_up_claim

    data, out = open_store(store_uri), open_store(str(tmp_path / "drafter"))
    fake_worker.work(store_uri, shards=[0])
    claim_consumer(data, out.uri)
    assert trainer_state(data) == "running"  # an output with nothing in it: not seen from here
    _give_up_claim(data, out)
    assert trainer_state(data) == "none"
    claim_consumer(data, out.uri)
    out.put("checkpoints/latest.json", b'{"step": 4, "prefix": "checkpoints/step-00000004"}')
    _give_up_claim(data, out)
    assert trainer_state(data) == "stopped"


def test_train_that_gives_up_on_a_stall_before_a_checkpoint_leaves_the_run_unclaimed(store_uri, tmp_path, monkeypatch,
                                                                                      capsys):
    """The whole path: `layertap train --follow --delete-consumed` whose shuffle buffer the window cannot
    fill stalls, gives up (exit 2, STALLED) and withdraws its claim; `status` then says no trainer deletes."""
    from layertap.manifests.consumption import claim_consumer, trainer_state
    from layertap.train import follow
    from tiny_models import tiny_model_dir

    monkeypatch.setattr(follow, "STALL_GIVE_UP_S", 1.0)
    monkeypatch.setattr(follow, "LOG_EVERY_S", 0.3)
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    WindowGate(store, 10_000).record()  # full: the rest waits for training to consume
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    out = str(tmp_path / "drafter")
    assert cli(["train", "--data", store_uri, "--model", target, "--out", out, "--follow", "--delete-consumed",
                "--follow-poll-s", "0.2", "--shuffle-buffer", "64", "--batch-size", "4", "--block-size", "4",
                "--max-anchors", "8", "--num-workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "STALLED" in err and "Stopping after" in err
    assert trainer_state(store) == "none" and not open_store(out).exists("checkpoints/latest.json")
    claim_consumer(store, out)  # a new trainer may claim it
