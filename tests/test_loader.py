"""The streaming loader against real runs on both backends (local folder, moto S3 over HTTP):
coverage across ranks x workers, determinism, exact resume, the memory budget, no local writes,
corruption, refused states, codecs, retries, batching."""

from __future__ import annotations

import json
import math
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import fake_worker
from faultproxy import FaultProxy
from layertap.manifests import layout
from layertap.manifests.manifest import create_or_resume
from layertap.manifests.records import Producer, decode_commit
from layertap.manifests.work import WorkQueue
from layertap.storage.errors import ConfigError, InputError
from layertap.storage.local import LocalStore
from layertap.storage.s3 import S3Store
from layertap.storage.format import ShardError, ShardMeta
from layertap.storage.reader import ShardReader
from layertap.storage.records import Sample
from layertap.storage.writer import ShardWriter
from layertap.storage.store import StoreError, TransientStoreError, open_store
from layertap.train import ShardStream, StreamConfig, StreamLoader, collate, pack
from layertap.train.fetch import Fetcher, Metrics, Record

ROOT = Path(__file__).resolve().parent.parent
N = 43  # samples in the default test run: not a multiple of 2 ranks x 2 workers


def make_sample(i: int, final: bool = False) -> Sample:
    s = fake_worker.make_sample(i)
    if final:
        s.final_state = (s.hidden_states[:, -1] * 0.5).contiguous()
    return s


def make_run(uri: str, samples: int = N, shard_bytes: int = 3000, codec: str = "bf16-zstd",
             final: bool = False, hidden: bool = False) -> list[int]:
    """A complete run through the real manifest/lease/commit path: `samples` synthetic samples in
    shards of uneven record counts. Returns the records per committed shard. `hidden`: the manifest
    records hidden_size, as a real extraction's does (a synthetic one may lack it)."""
    store = open_store(uri)
    config = dict(fake_worker.CONFIG, codec=codec, final_state="prenorm" if final else "none")
    if hidden:
        config["hidden_size"] = fake_worker.HIDDEN
    manifest, _ = create_or_resume(
        store, config=config, dataset=fake_worker.DATASET,
        token_counts=fake_worker.token_counts(samples), shard_bytes=shard_bytes,
        bytes_per_token=len(fake_worker.LAYERS) * fake_worker.HIDDEN * 2 / 1.3)
    for claim in WorkQueue(store, manifest, Producer.current(), ttl_s=60, poll_s=0.2):
        with claim:
            meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic",
                             layers=fake_worker.LAYERS, hidden_size=fake_worker.HIDDEN, codec=codec,
                             final_state="prenorm" if final else "none")
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                for i in range(claim.plan.start, claim.plan.end):
                    w.write_sample(make_sample(i, final))
                claim.commit(w.close())
    store.close()
    return [p.num_samples for p in manifest.shards]


def ids_of(batches) -> list[str]:
    return [sid for b in batches for sid in b["sample_id"]]


def check_content(batch: dict) -> None:
    for row, (sid, pad) in enumerate(zip(batch["sample_id"], batch["padding"].tolist())):
        want = make_sample(int(sid[1:]))
        n = want.num_tokens
        assert int(batch["lengths"][row]) == n
        assert torch.equal(batch["input_ids"][row, :n], want.input_ids)
        assert torch.equal(batch["hidden_states"][row, :n], want.hidden_states)
        assert batch["loss_mask"][row].sum() == (0 if pad else n)


@pytest.fixture
def run(store_uri):
    per_shard = make_run(store_uri)
    assert len(set(per_shard)) > 1 and len(per_shard) % 4  # uneven: counts differ, shards do not divide
    return store_uri


# -- coverage, determinism, resume -------------------------------------------------------------


def test_every_sample_once_per_epoch_across_2_ranks_x_2_workers(run):
    real, pads, batches = Counter(), [], []
    for rank in range(2):
        stream = ShardStream(run, config=StreamConfig(seed=3, shuffle_buffer=4), rank=rank, world_size=2)
        loader = StreamLoader(stream, batch_size=3, num_workers=2)
        got = list(loader)
        assert len(got) == len(loader) == stream.num_batches(3, 2)
        batches.append(len(got))
        for b in got:
            check_content(b)
            for sid, pad in zip(b["sample_id"], b["padding"].tolist()):
                (pads.append(sid) if pad else real.update([sid]))
        assert loader.metrics()["samples"] == stream.num_samples == 22
    assert batches[0] == batches[1]
    assert real == Counter(f"s{i:05d}" for i in range(N))  # each exactly once in the loss
    assert len(pads) == 2 * 22 - N  # one zero-weighted repeat evens the ranks out


def test_ranks_stream_the_shards_rank_0_chose_though_one_committed_since(run, monkeypatch):
    """Ranks open a run still being extracted one after the other; `layertap train` hands rank 0's
    shards to the others (`committed=`), so a shard committed in between changes no rank's epoch,
    and they read no commit of their own (1,000 ranks each listed commits/ and parsed the index:
    ~90 LIST pages and 10 MB apiece at 90,000 shards)."""
    store = open_store(run)
    late = layout.commit_key(max(s.shard for s in ShardStream(run).shards))
    record = store.get(late)
    store.delete(late)  # not committed yet
    config = StreamConfig(seed=3, shuffle_buffer=4)
    first = ShardStream(run, config=config, rank=0, world_size=2)
    store.put(late, record)  # ... and now it is
    looked: list[str] = []
    for cls in (LocalStore, S3Store):
        for name in ("list", "get"):
            monkeypatch.setattr(cls, name, lambda self, key="", *a, _real=getattr(cls, name), **kw:
                                looked.append(key) or _real(self, key, *a, **kw))
    second = ShardStream(run, config=config, rank=1, world_size=2, committed=json.loads(json.dumps(first.shard_records)))
    assert looked == [layout.MANIFEST]  # the run's plan: one GET
    monkeypatch.undo()
    assert (second.fingerprint, second.total_samples) == (first.fingerprint, first.total_samples) and \
        first.total_samples < N
    trained = Counter(s["sample_id"] for stream in (first, second) for s in stream if not s["padding"])
    assert len(trained) == first.total_samples and set(trained.values()) == {1}
    store.close()


def test_uneven_drop_gives_equal_ranks_and_no_repeats(tmp_path):
    make_run(str(tmp_path))
    drop = StreamConfig(uneven="drop")
    seen = [[s["sample_id"] for s in ShardStream(str(tmp_path), config=drop, rank=r, world_size=2)] for r in range(2)]
    assert len(seen[0]) == len(seen[1]) == N // 2
    assert len(set(seen[0]) | set(seen[1])) == 2 * (N // 2)


def test_order_is_a_function_of_seed_and_epoch(run):
    def order(seed: int, epoch: int, **fetching):
        stream = ShardStream(run, config=StreamConfig(seed=seed, shuffle_buffer=8, **fetching))
        stream.set_epoch(epoch)
        return [s["sample_id"] for s in stream]

    a = order(seed=5, epoch=0)
    assert a == order(seed=5, epoch=0)
    assert sorted(a) == [f"s{i:05d}" for i in range(N)]
    assert order(seed=5, epoch=1) != a and sorted(order(seed=5, epoch=1)) == sorted(a)
    assert order(seed=6, epoch=0) != a
    # Fetch settings change how bytes arrive, never the order.
    assert a == order(seed=5, epoch=0, range_bytes=1500, memory_budget=5000, decode_threads=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_mid_epoch_equals_the_uninterrupted_order(run, num_workers):
    def loader():
        stream = ShardStream(run, config=StreamConfig(seed=7, shuffle_buffer=8))
        return StreamLoader(stream, batch_size=4, num_workers=num_workers)

    full = ids_of(loader())
    first = loader()
    it = iter(first)
    head = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    assert state["version"] == 1 and sum(state["consumed"]) == 12

    resumed = loader()
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert ids_of(head) + ids_of(rest) == full
    check_content(rest[0])
    if num_workers:
        return
    m = resumed.metrics()  # consumed records are neither verified nor decoded again
    assert m["records_decoded"] == m["records_verified"] == N - 12

    # A finished epoch saves as the start of the next one, and the next pass is that epoch.
    done = resumed.state_dict()
    assert (done["epoch"], done["consumed"]) == (1, [])
    again = loader()
    again.load_state_dict(done)
    assert again.epoch == 1
    nxt = ids_of(again)
    assert again.epoch == 2 and sorted(nxt) == sorted(full) and nxt != full
    epoch_1 = loader()
    epoch_1.set_epoch(1)
    assert nxt == ids_of(epoch_1)


def test_training_loop_with_a_checkpoint_every_step(tmp_path):
    """The README idiom: `while loader.epoch < E`, state saved after every batch, resumed mid-epoch 1."""
    make_run(str(tmp_path))

    def loader():
        stream = ShardStream(str(tmp_path), config=StreamConfig(seed=1, shuffle_buffer=8))
        return StreamLoader(stream, batch_size=5, num_workers=2)

    seen, states, first = [], [], loader()
    while first.epoch < 2:
        epoch = first.epoch
        for batch in first:
            seen.append((epoch, batch["sample_id"]))
            states.append(first.state_dict())
    epochs = [[sid for e, ids in seen if e == k for sid in ids] for k in (0, 1)]
    assert [len(e) for e in epochs] == [N, N] and sorted(epochs[0]) == sorted(epochs[1]) != epochs[0]
    assert states[-1]["epoch"] == 2 and first.epoch == 2

    k = sum(1 for e, _ in seen if e == 0) + 3  # three batches into epoch 1
    resumed = loader()
    resumed.load_state_dict(json.loads(json.dumps(states[k - 1])))
    rest = []
    while resumed.epoch < 2:
        rest += ids_of(resumed)
    assert rest == [sid for _, ids in seen[k:] for sid in ids]


def test_stream_state_is_exact_in_process(tmp_path):
    make_run(str(tmp_path))
    full = [s["sample_id"] for s in ShardStream(str(tmp_path), config=StreamConfig(seed=2, shuffle_buffer=16))]
    stream = ShardStream(str(tmp_path), config=StreamConfig(seed=2, shuffle_buffer=16))
    it = iter(stream)
    head = [next(it)["sample_id"] for _ in range(17)]
    state = stream.state_dict()
    it.close()
    again = ShardStream(str(tmp_path), config=StreamConfig(seed=2, shuffle_buffer=16))
    again.load_state_dict(state)
    assert head + [s["sample_id"] for s in again] == full


# -- memory, disk --------------------------------------------------------------------------------


def test_memory_budget_holds(store_uri):
    make_run(store_uri, shard_bytes=8000)
    budget, rng = 6000, 2000
    stream = ShardStream(store_uri,
                         config=StreamConfig(seed=1, shuffle_buffer=3, memory_budget=budget, range_bytes=rng))
    ids = [s["sample_id"] for s in stream]
    m = stream.metrics()
    assert sorted(ids) == [f"s{i:05d}" for i in range(N)]
    assert budget / 2 < m["peak_buffered_bytes"] <= budget + rng
    assert m["buffered_bytes"] == 0
    assert m["get_requests"] > 2 * len(stream.shards)  # ranged reads, not whole objects


def test_a_consumer_that_never_waits_is_held_to_the_budget_itself(store_uri):
    """`test_memory_budget_holds` allows one range over the budget: a consumer blocked on a record
    (`Fetcher.wait_for`) lets the range that brings it go ahead even over the budget, so that a
    shuffle buffer cannot deadlock. A consumer that never blocks gets no such range: what is
    fetched and not released stays within the budget itself, ranges no larger than it. Here the
    consumer takes records only as they arrive (`take_if_ready`) and releases what it holds only
    once every range admitted has arrived and the scheduler waits for budget, so it holds as much
    as the budget lets in; a budget check that admitted a range while the bytes already held were
    within the budget, not the bytes with the range's, went over by up to a range and passed the
    bound above."""
    make_run(store_uri, shard_bytes=8000)
    budget, rng = 6000, 2000
    stream = ShardStream(store_uri, config=StreamConfig(memory_budget=budget, range_bytes=rng))
    records = [(s, r) for s, shard in enumerate(stream.shards) for r in range(shard.records)]
    positions = [(pos, s, r) for pos, (s, r) in enumerate(records)]  # in input order, as `needed` is
    assert sum(shard.bytes for shard in stream.shards) > 3 * budget  # the budget fills several times
    metrics = Metrics()
    fetcher = Fetcher(open_store(store_uri), stream.shards, stream.run_id, positions=positions, budget=budget,
                      range_bytes=rng, prefetch_shards=2, threads=2, on_corrupt="raise", metrics=metrics)
    held: list[Record] = []
    ids, stalls, deadline = [], 0, time.monotonic() + 60
    try:
        while len(ids) < len(positions):
            assert time.monotonic() < deadline, f"stuck at position {len(ids)}: {fetcher._error!r}"
            rec = fetcher.take_if_ready(len(ids))
            if rec is not None:
                held.append(rec)
                ids.append(rec.sample_id)
                continue
            with fetcher._cond:  # the scheduler is its only waiter: the consumer here never blocks
                holding = sum({id(r.buffer): r.buffer.array.size for r in held}.values())
                stalled = bool(fetcher._cond._waiters) and fetcher._in_use == holding
            if stalled:  # all that was let in has arrived, and nothing more comes until we release
                assert budget - rng < holding <= budget
                stalls += 1
                for r in held:
                    fetcher.release(r)
                held.clear()
            else:
                time.sleep(0.001)
        for r in held:
            fetcher.release(r)
    finally:
        fetcher.close()
    assert ids == [f"s{i:05d}" for i in range(N)]
    assert stalls >= 3 and budget - rng < metrics.peak_buffered_bytes <= budget
    assert metrics.buffered_bytes == 0


def test_a_budget_below_one_range_is_warned_of(tmp_path, caplog):
    """The budget holds whole ranges, so one below `range_bytes` is exceeded by every fetch; the
    warning looked only at the shuffle buffer's samples and stayed quiet (a read-only hunt)."""
    uri = str(tmp_path / "run")
    make_run(uri, shard_bytes=8000)
    with caplog.at_level("WARNING"):
        list(ShardStream(uri, config=StreamConfig(shuffle_buffer=1, memory_budget=1500, range_bytes=4000)))
    assert "a fetched range (3.91 KiB) exceeds the memory budget (1.46 KiB)" in caplog.text
    assert "raise the budget (--memory-budget), or lower range_bytes" in caplog.text  # flags train has, and no worker
    caplog.clear()
    # no range is larger than its shard: a range_bytes above the budget over shards below it holds the budget
    with caplog.at_level("WARNING"):
        list(ShardStream(uri, config=StreamConfig(shuffle_buffer=1, memory_budget=20_000, range_bytes=1 << 20)))
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    for poll in (0.0, float("nan"), float("inf")):  # NaN passed `<= 0` and waited forever
        with pytest.raises(ConfigError, match="follow_poll_s must be > 0 seconds"):
            StreamConfig(follow_poll_s=poll)


def test_the_ranges_a_shuffle_buffer_keeps_are_warned_of_where_they_exceed_the_budget(tmp_path, caplog):
    """A range stays in memory until its last sample leaves the shuffle buffer, so small samples
    in large ranges keep many ranges for a buffer whose samples alone fit the budget: the peak went
    to 1.9x the budget (the guarantee says budget + one range) with no warning, which compared
    only the buffer's samples with the budget. `buffer_footprint` counts the ranges: below it, a
    warning; at it, the guarantee holds."""
    from layertap.train.stream import buffer_footprint

    uri = str(tmp_path / "run")
    make_run(uri, samples=1200, shard_bytes=100_000)
    shards = ShardStream(uri).shards
    avg = sum(s.bytes for s in shards) / sum(s.records for s in shards)
    rng = int(32 * avg)
    held = buffer_footprint(64, avg, rng)
    assert 64 * avg < held / 2  # the samples alone fit either budget below
    for budget, warned in ((int(held / 2), True), (math.ceil(held), False)):
        caplog.clear()
        stream = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=64, memory_budget=budget, range_bytes=rng))
        with caplog.at_level("WARNING"):
            assert sum(1 for _ in stream) == 1200
        peak = stream.metrics()["peak_buffered_bytes"]
        assert ("keep ~" in caplog.text and "over the memory budget per worker" in caplog.text) == warned
        assert (peak > budget + rng) == warned, (budget, peak)


def test_streaming_writes_nothing_to_local_disk(s3_bucket, tmp_path):
    """A fresh process streams a whole epoch from S3 and reads its own /proc/self/io: not one
    byte written, in-process or in DataLoader workers (their I/O joins ours when they are reaped),
    and nothing appears in TMPDIR, HOME or the working directory. The worker case passes batches
    as plain objects: torch's tensor IPC goes through /dev/shm, which is RAM, but this kernel
    counts a few KiB of it as written."""
    uri = f"s3://{s3_bucket}/runs/nodisk"
    make_run(uri)
    dirs = {name: tmp_path / name for name in ("tmp", "home", "cwd")}
    for d in dirs.values():
        d.mkdir()
    script = r"""
import json, sys
from layertap.train import ShardStream, StreamConfig, StreamLoader

def written():
    for line in open("/proc/self/io"):
        if line.startswith("write_bytes"):
            return int(line.split()[1])

def plain(samples):  # batches cross the worker pipe pickled, not through torch's /dev/shm tensors
    return {"sample_id": [s["sample_id"] for s in samples],
            "bytes": sum(s["hidden_states"].numel() * 2 for s in samples)}

out = {}
for workers in (0, 2):
    loader = StreamLoader(ShardStream(sys.argv[1], config=StreamConfig(seed=1)), batch_size=4, num_workers=workers,
                          **({"collate_fn": plain} if workers else {}))
    before = written()
    n = sum(len(b["sample_id"]) for b in loader)
    out[workers] = {"samples": n, "write_bytes": written() - before}  # reaped workers' I/O included
print(json.dumps(out))
"""
    env = dict(os.environ, TMPDIR=str(dirs["tmp"]), HOME=str(dirs["home"]), PYTHONDONTWRITEBYTECODE="1",
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", script, uri], cwd=dirs["cwd"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"0": {"samples": N, "write_bytes": 0}, "2": {"samples": N, "write_bytes": 0}}
    assert all(not any(d.iterdir()) for d in dirs.values())


# -- integrity -----------------------------------------------------------------------------------


def corrupt_one_record(uri: str) -> tuple[str, list[str]]:
    """Flip a byte inside a record of a committed shard; returns its key and its sample ids."""
    store = open_store(uri)
    commit = decode_commit(store.get(layout.commit_key(2)), "commit")
    entry = ShardReader(store, commit.data_key).entries[1]
    data = bytearray(store.get(commit.data_key))
    data[entry.offset + entry.length - 5] ^= 0xFF
    store.put(commit.data_key, bytes(data))
    store.close()
    return commit.data_key, commit.sample_ids


@pytest.mark.parametrize("range_bytes", [1 << 20, 1500], ids=["whole-object", "ranged"])
def test_corrupt_record_raises_naming_the_shard(run, range_bytes):
    key, _ = corrupt_one_record(run)
    with pytest.raises(ShardError, match=key.replace(".", r"\.")) as err:
        for _ in ShardStream(run, config=StreamConfig(range_bytes=range_bytes)):
            pass
    assert "shard 2 " in str(err.value) and "on_corrupt='skip'" in str(err.value)


@pytest.mark.parametrize("range_bytes", [1 << 20, 1500], ids=["whole-object", "ranged"])
def test_corrupt_shard_is_skipped_and_counted(run, caplog, range_bytes):
    key, bad_ids = corrupt_one_record(run)
    stream = ShardStream(run, config=StreamConfig(on_corrupt="skip", seed=4, range_bytes=range_bytes))
    with caplog.at_level(logging.WARNING, logger="layertap.train.fetch"):
        got = list(stream)
    real = [s["sample_id"] for s in got if not s["padding"]]
    assert len(got) == N  # the count per rank is kept, so ranks stay in lockstep
    assert len(set(real)) == len(real) and bad_ids[1] not in real  # the damaged record never comes out
    assert all(s["loss_mask"].sum() == 0 for s in got if s["padding"])
    m = stream.metrics()
    assert m["corrupt_shards"] == 1 and m["skipped_samples"] == m["padding_samples"] == N - len(real)
    assert key in caplog.text
    # the damaged record alone, in one GET or in ranges: each other record verifies by its own hash
    assert sorted(real) == sorted(set(f"s{i:05d}" for i in range(N)) - {bad_ids[1]})


def test_skip_counts_and_says_a_shard_whose_object_hash_differs_though_every_record_holds(run, caplog):
    """A byte no record's hash covers (the preamble's) changed: under "raise" the whole-object hash
    refuses the shard; under "skip" its records went to training with no word and no count, so
    nothing prompted the `layertap verify` that withdraws it."""
    store = open_store(run)
    key = decode_commit(store.get(layout.commit_key(2)), "commit").data_key
    data = bytearray(store.get(key))
    data[12] ^= 0x01  # the preamble's reserved word
    store.put(key, bytes(data))
    with pytest.raises(ShardError, match="object hash"):
        list(ShardStream(run))
    stream = ShardStream(run, config=StreamConfig(on_corrupt="skip"))
    with caplog.at_level(logging.WARNING, logger="layertap.train.fetch"):
        got = list(stream)
    assert not any(s["padding"] for s in got) and len(got) == N  # every record verified by its own hash
    assert stream.metrics()["corrupt_shards"] == 1
    assert "object hash" in caplog.text and "layertap verify" in caplog.text and key in caplog.text


def test_a_resumed_epoch_stands_in_for_skipped_samples_as_one_run_through(run):
    """A skipped sample's stand-in was the last sample yielded, which a consumer resumed past it
    has not got (it took the next readable one): the resumed epoch's samples differed from one
    run through (zero-weighted: the same training, another samples_digest). It is one token of
    zeros in the run's shapes now, the same either way."""
    corrupt_one_record(run)
    config = StreamConfig(on_corrupt="skip", seed=4)
    whole = list(ShardStream(run, config=config))
    first_pad = next(i for i, s in enumerate(whole) if s["padding"])
    stream = ShardStream(run, config=config)
    it = iter(stream)
    for _ in range(first_pad):
        next(it)
    state = stream.state_dict()
    it.close()
    resumed = ShardStream(run, config=config)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert [s["sample_id"] for s in rest] == [s["sample_id"] for s in whole[first_pad:]]
    assert all(s["sample_id"] == "padding" and s["input_ids"].shape == (1,) for s in whole if s["padding"])


def test_skip_pads_with_zeros_a_consumer_none_of_whose_samples_is_readable(tmp_path):
    """A rank whose whole share lay in the failed shard raised ShardError ("every sample left ...
    is in a failed shard") instead of padding: one rank down, the others hung in DDP. It yields
    its count of zero-weighted stand-ins (one token of zeros in the run's shapes), as follow mode does."""
    from layertap.train.order import plan_consumer

    uri = str(tmp_path / "run")
    counts = make_run(uri, hidden=True)
    world = 20
    config = StreamConfig(seed=0, on_corrupt="skip")
    plans = {r: plan_consumer(counts, seed=0, epoch=0, shuffle=True, shuffle_buffer=64, rank=r, world=world,
                              worker=0, workers=1, uneven="pad") for r in range(world)}
    rank = next(r for r, p in plans.items() if len(set(p.shard.tolist())) == 1)
    stream = ShardStream(uri, config=config, rank=rank, world_size=world)
    shard = stream.shards[int(plans[rank].shard[0])]
    store = open_store(uri)
    data = bytearray(store.get(shard.key))
    data[-10] ^= 0xFF  # in its footer: none of its records can be found
    store.put(shard.key, bytes(data))
    got = list(stream)
    assert len(got) == stream.num_samples == len(plans[rank]) > 0  # lockstep with the other ranks
    for s in got:
        assert s["padding"] and s["loss_mask"].sum() == 0 and not s["hidden_states"].any()
        assert s["hidden_states"].shape[1:] == (len(fake_worker.LAYERS), fake_worker.HIDDEN)
    m = stream.metrics()
    assert m["skipped_samples"] == m["padding_samples"] == len(got) and m["corrupt_shards"] == 1


def test_ranks_hold_a_digest_of_each_shards_sample_ids_and_still_check_them(tmp_path):
    """Every rank holds every shard of the run, and held every sample id too: 57 MiB in each rank
    and DataLoader worker at 810K samples, 12 MiB of JSON in rank 0's hand-over. A shard record
    carries their digest; the object's footer must still list the commit's samples, in order."""
    uri = str(tmp_path / "run")
    make_run(uri)
    store = open_store(uri)
    first = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=2)
    handed = json.dumps(first.shard_records)
    assert "s00000" not in handed and len(handed) < 130 * len(first.shards)
    key = layout.commit_key(first.shards[0].shard)
    commit = json.loads(store.get(key))
    commit["sample_ids"][-2:] = commit["sample_ids"][-1:-3:-1]  # the same samples, in another order
    store.put(key, json.dumps(commit).encode())
    if store.exists(layout.COMMIT_INDEX):
        store.delete(layout.COMMIT_INDEX)
    reread = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=2)
    assert reread.fingerprint == first.fingerprint and reread.shard_records != first.shard_records
    second = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=1, world_size=2,
                         committed=json.loads(json.dumps(reread.shard_records)))
    with pytest.raises(ShardError, match="the footer index lists other samples than the commit record"):
        list(second)
    store.close()


def test_a_shard_deleted_while_the_stream_reads_says_who_deleted_it(tmp_path):
    """A run read by one trainer while a --delete-consumed trainer deletes what it trained on: the
    reader failed with "corrupt or unreadable ... run layertap verify", which sent users to the
    wrong place."""
    from layertap.manifests.consumption import claim_consumer

    uri = str(tmp_path / "run")
    make_run(uri)
    store = open_store(uri)
    stream = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1)
    first = stream.shards[0]
    claim_consumer(store, "s3://elsewhere/drafter")
    store.put(layout.consumed_marker_key(first.shard), b"")
    store.delete(first.key)
    with pytest.raises(ShardError, match=r"was deleted while this stream read the run: consumed by the "
                                         r"--delete-consumed trainer writing to s3://elsewhere/drafter") as e:
        list(stream)
    assert "layertap verify" not in str(e.value)
    store.delete(layout.consumed_marker_key(first.shard))
    # deleted before this stream started, by hand: it said "since this stream started" and "verify withdrew it"
    # (the commit stood); verify is what withdraws it, so the shard is redone
    with pytest.raises(ShardError, match="is gone: its commit stands but its data object is not there") as e:
        list(ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1))
    assert f"run `layertap verify {uri}`, which withdraws the commit" in str(e.value)
    from layertap.cli import main as cli

    assert cli(["verify", uri]) != 0
    rest = list(ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1))
    kept = [decode_commit(store.get(k := layout.commit_key(s.shard)), k) for s in stream.shards[1:]]
    assert sorted(x["sample_id"] for x in rest) == sorted(i for c in kept for i in c.sample_ids)
    # the whole run deleted under a reader (`layertap delete`): not "its commit stands ... run verify", which
    # then answered "no run"
    it = iter(ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1))
    for obj in list(store.list()):  # as `layertap delete` does (it refuses here: a trainer claimed the run)
        store.delete(obj.key)
    with pytest.raises(ShardError, match=rf"is gone, and so is the run's manifest: the run at {uri} was deleted "
                                         "while this stream read it") as e:
        list(it)
    assert "verify" not in str(e.value)


def test_a_stream_given_an_open_s3_store_reopens_it_in_each_dataloader_worker(s3_bucket):
    """A forked worker that used the S3 store it inherited shared its parent's sockets: two
    processes reading one connection can mix up their responses."""
    from torch.utils.data import get_worker_info

    uri = f"s3://{s3_bucket}/runs/given"
    make_run(uri)
    given = open_store(uri)
    stream = ShardStream(given, config=StreamConfig(seed=1), rank=0, world_size=1)
    assert stream._store() is given  # in this process, the store it was given

    def tag(samples):
        worker = get_worker_info().dataset
        return {"reopened": worker._store() is not worker._given, "ids": [x["sample_id"] for x in samples]}

    batches = list(StreamLoader(stream, batch_size=4, num_workers=2, collate_fn=tag))
    assert all(b["reopened"] for b in batches)
    assert sorted(i for b in batches for i in b["ids"]) == sorted(f"s{i:05d}" for i in range(N))
    assert any(given.list(layout.COMMITS))  # the parent's store still answers
    given.close()


def test_a_stream_given_an_open_s3_store_works_in_spawned_dataloader_workers(s3_bucket):
    """Under `multiprocessing_context="spawn"` the stream is sent to its workers whole, and the S3
    store it held (a boto3 client, locks, a thread pool) could not be: "cannot pickle
    '_thread.lock' object". It goes as its URI and options, as `reopen` rebuilds it."""
    uri = f"s3://{s3_bucket}/runs/spawned"
    make_run(uri)
    given = open_store(uri)
    loader = StreamLoader(ShardStream(given, config=StreamConfig(seed=1), rank=0, world_size=1), batch_size=4,
                          num_workers=1, multiprocessing_context="spawn")
    assert sorted(i for b in loader for i in b["sample_id"]) == sorted(f"s{i:05d}" for i in range(N))
    given.close()


def test_the_store_retries_and_the_loader_counts_its_retries(s3_bucket, s3_endpoint, tmp_path):
    """Retries live in one layer, the store: ranged GETs of shards that fail (503 SlowDown, bodies
    cut short) are retried there, and the loader's metrics count them; what the store gave up
    on reaches the consumer as it is, not tried again."""
    uri = f"s3://{s3_bucket}/runs/flaky"
    make_run(uri)
    shard_gets = lambda method, path: method == "GET" and "/shards/" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=0.5, seed=1, faults=("503", "cut"), match=shard_gets) as proxy:
        stream = ShardStream(uri, config=StreamConfig(range_bytes=1500), store_options={"endpoint_url": proxy.url})
        assert sorted(s["sample_id"] for s in stream) == [f"s{i:05d}" for i in range(N)]
        m = stream.metrics()
        assert m["retries"] == proxy.injected > 5 and m["get_requests"] > len(stream.shards)

    make_run(str(tmp_path))
    calls = []

    class GaveUp(LocalStore):
        def read_range_into(self, key, start, out):
            calls.append(key)
            raise TransientStoreError(f"ranged get of {key} failed: SlowDown (tried 8 times)")

    with pytest.raises(TransientStoreError, match="tried 8 times"):
        list(ShardStream(GaveUp(str(tmp_path)), config=StreamConfig(fetch_threads=1, prefetch_shards=1)))
    assert len(calls) == 1

    class Denied(LocalStore):
        def get_range(self, key, start, end):
            raise StoreError(f"access denied for ranged get of {key} (AccessDenied): check the credentials")

        def read_range_into(self, key, start, out):
            return self.get_range(key, start, start + len(out))

    with pytest.raises(StoreError, match="access denied"):
        list(ShardStream(Denied(str(tmp_path))))


def test_get_buffer_size_classes_waste_at_most_an_eighth():
    from layertap.train.buffers import POOLED_MIN, size_class

    assert size_class(1000) == 1000 and size_class(64 << 20) == 64 << 20  # small: as asked; powers of 2: exact
    for n in (POOLED_MIN, POOLED_MIN + 1, 47_123_456, (64 << 20) + 1, 10**9 + 7):
        assert n <= size_class(n) <= n + n // 8
    classes = {size_class(n) for n in range(32 << 20, (64 << 20) + 1, 1 << 16)}
    assert classes == {(32 + 4 * k) << 20 for k in range(9)}  # 8 steps per power of 2


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd"])
def test_reused_get_buffers_never_show_through_in_yielded_samples(tmp_path, monkeypatch, codec):
    from layertap import train
    from layertap.train import stream

    lent: list = []  # every buffer lent, kept alive so that equal ids mean the same buffer

    class Watched(train.buffers.BufferPool):
        def take(self, size, up_to):
            buf = super().take(size, up_to)
            lent.append(buf)
            return buf

    monkeypatch.setattr(train.buffers, "POOLED_MIN", 1)  # pool the test's small GETs too
    monkeypatch.setattr(train.stream, "BufferPool", Watched)
    make_run(str(tmp_path), codec=codec)
    stream = ShardStream(str(tmp_path), config=StreamConfig(seed=2, shuffle_buffer=4, memory_budget=16000,
                                                            prefetch_shards=1, fetch_threads=1))
    for epoch in range(2):
        first = len(lent)
        got = list(stream)  # every sample kept until the pass is over, while later GETs reuse the buffers
        assert len({id(b) for b in lent[first:]}) < len(lent) - first  # buffers were reused within the epoch
        assert sorted(s["sample_id"] for s in got) == [f"s{i:05d}" for i in range(N)]
        for s in got:
            want = make_sample(int(s["sample_id"][1:]))
            assert torch.equal(s["hidden_states"], want.hidden_states) and torch.equal(s["input_ids"], want.input_ids)
            assert torch.equal(s["loss_mask"], want.loss_mask)
        assert stream.metrics()["buffered_bytes"] == 0
    assert {id(b) for b in lent[first:]} & {id(b) for b in lent[:first]}  # the second epoch reused the first's


def test_state_from_another_world_seed_or_run_is_refused(run, tmp_path):
    stream = ShardStream(run, config=StreamConfig(seed=1), rank=0, world_size=2)
    it = iter(stream)
    next(it)
    state = stream.state_dict()
    it.close()
    with pytest.raises(ValueError, match="world_size: state has 2, this stream has 1"):
        ShardStream(run, config=StreamConfig(seed=1), rank=0, world_size=1).load_state_dict(state)
    with pytest.raises(ValueError, match="seed: state has 1"):
        ShardStream(run, config=StreamConfig(seed=2), rank=0, world_size=2).load_state_dict(state)
    # every setting the order depends on: a resume under another one would repeat or skip samples
    for other, field in ((dict(uneven="drop"), "uneven"), (dict(shuffle=False), "shuffle"),
                         (dict(shuffle_buffer=8), "shuffle_buffer")):
        with pytest.raises(ValueError, match=f"{field}: state has"):
            ShardStream(run, config=StreamConfig(seed=1, **other), rank=0, world_size=2).load_state_dict(state)
    other = str(tmp_path / "other")
    make_run(other)
    with pytest.raises(ValueError, match="run_id"):
        ShardStream(other, config=StreamConfig(seed=1), rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="version 99"):
        ShardStream(run, config=StreamConfig(seed=1), rank=0, world_size=2).load_state_dict(dict(state, version=99))
    ShardStream(run, config=StreamConfig(seed=1), rank=1, world_size=2).load_state_dict(state)  # the same on every rank
    with pytest.raises(ValueError, match="num_workers=0"):
        StreamLoader(ShardStream(run, config=StreamConfig(seed=1), rank=0, world_size=2), batch_size=2,
                     num_workers=2).load_state_dict(state)


def test_rank_and_world_come_from_the_environment(tmp_path, monkeypatch):
    make_run(str(tmp_path), samples=8, shard_bytes=2000)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    s = ShardStream(str(tmp_path))
    assert (s.rank, s.world_size, s.num_samples) == (1, 2, 4)
    assert ShardStream(str(tmp_path), rank=0, world_size=1).num_samples == 8


# -- codecs and batches --------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd", "fp8"])
def test_every_codec_decodes_with_final_state(tmp_path, codec):
    make_run(str(tmp_path), samples=6, shard_bytes=2000, codec=codec, final=True)
    for s in ShardStream(str(tmp_path)):
        want = make_sample(int(s["sample_id"][1:]), final=True)
        assert s["hidden_states"].dtype == torch.bfloat16 and s["hidden_states"].shape == want.hidden_states.shape
        for name, ref in (("hidden_states", want.hidden_states), ("final_state", want.final_state)):
            err = (s[name].float() - ref.float()).norm() / ref.float().norm()
            assert err == 0 if codec != "fp8" else err < 0.05  # e4m3 on gaussian data: ~0.03


def _fake(sid: str, n: int, pad: bool = False) -> dict:
    return {"sample_id": sid, "input_ids": torch.arange(1, n + 1), "loss_mask": torch.ones(n, dtype=torch.uint8),
            "hidden_states": torch.full((n, 2, 3), float(n), dtype=torch.bfloat16), "padding": pad}


def test_collate_pads_and_pack_packs():
    batch = collate([_fake("a", 3), _fake("b", 5, pad=True)], pad_to_multiple_of=4)
    assert batch["input_ids"].shape == (2, 8) and batch["hidden_states"].shape == (2, 8, 2, 3)
    assert batch["attention_mask"].sum(1).tolist() == [3, 5] and batch["lengths"].tolist() == [3, 5]
    assert batch["padding"].tolist() == [False, True] and batch["sample_id"] == ["a", "b"]

    packed = pack([_fake("a", 3), _fake("b", 5), _fake("c", 2), _fake("d", 9)], max_tokens=8)
    assert packed["input_ids"].shape == (3, 8)
    assert packed["sequence_ids"][0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert packed["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]
    assert packed["sequence_ids"][1].tolist() == [2, 2, -1, -1, -1, -1, -1, -1]
    assert packed["sequence_ids"][2].tolist() == [3] * 8 and packed["truncated_tokens"] == 1
    assert packed["loss_mask"].sum() == 3 + 5 + 2 + 8
    assert torch.equal(packed["hidden_states"][0, 3:8], torch.full((5, 2, 3), 5.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("cores,workers,local_ranks,bound,want", [
    (2, 1, None, True, 2),     # a small machine: 2, the best measured there
    (16, 1, None, True, 4),    # one per 4 cores
    (16, 2, None, True, 2),    # DataLoader workers share the rank's cores
    (128, 1, None, True, 8),   # at most 8
    (128, 1, "8", False, 4),   # 8 unbound ranks on a 128-core node: 16 cores each
    (16, 1, "8", True, 4),     # bound by the launcher: the mask already holds this rank's cores
])
def test_compressed_codecs_decode_on_threads_by_cores_and_bf16_on_the_consumer(monkeypatch, cores, workers,
                                                                                local_ranks, bound, want):
    import layertap.train.stream as stream

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(os, "cpu_count", lambda: cores * (2 if bound else 1))
    if local_ranks:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    else:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert stream.auto_decode_threads("bf16-zstd", workers) == want
    assert stream.auto_decode_threads("fp8", workers) == want
    assert stream.auto_decode_threads("bf16", workers) == 0


@pytest.mark.parametrize("workers", [0, 2])
def test_with_drop_last_the_epochs_last_full_batch_ends_it_and_its_state_resumes_in_the_next(tmp_path, workers):
    """With drop_last, the state taken with an epoch's last full batch still said "this epoch, N
    samples short of its end": that batch did not carry `ends_epoch` (the next epoch's first did),
    and a resume from it met an epoch with no batch at all."""
    from layertap.train.loader import Prefetcher

    uri = str(tmp_path / "run")
    make_run(uri)

    def loader() -> StreamLoader:
        stream = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1)
        return StreamLoader(stream, batch_size=5, num_workers=workers, drop_last=True)

    per_epoch = len(loader())
    assert per_epoch == (N // 5 if workers == 0 else sum(c // 5 for c in (N // 2 + 1, N // 2)))
    ends, states = [], []
    with Prefetcher(loader()) as p:
        for _ in range(per_epoch + 1):
            ends.append(p.wait_for_batch()["ends_epoch"])
            states.append(p.state_dict())
    assert ends == [False] * (per_epoch - 1) + [True, False]
    assert states[per_epoch - 1]["epoch"] == 1 and states[per_epoch]["epoch"] == 1
    resumed = loader()
    resumed.load_state_dict(states[per_epoch - 1])
    again = loader()
    again.set_epoch(1)
    assert ids_of(resumed) == ids_of(again)  # the whole next epoch, as a fresh start of it


def test_a_position_counts_per_consumer_and_a_finished_epoch_starts_the_next():
    from layertap.train.position import Position

    p = Position(per_rank=10)
    started = p.start(2)  # two consumers of 5 samples each
    p.batch_received(1, 3)
    assert p.state_dict() == {"epoch": 0, "num_workers": 2, "consumed": [0, 3], "next_worker": 0}
    p.batch_received(0, 5)
    assert p.consumer(0, 2) == 1 and p.consumed(0) == 5  # worker 1's batch is due next
    with pytest.raises(ValueError, match="saved with 2 DataLoader worker.*num_workers=2"):
        p.start(3)
    p.finish(started)  # a drop_last pass left 2 samples out: the epoch is complete all the same
    assert p.state_dict() == {"epoch": 1, "num_workers": None, "consumed": [], "next_worker": 0}

    overtaken = p.start(2)
    p.load_state_dict({"epoch": 4, "consumed": [1, 1], "next_worker": 1})
    p.finish(overtaken)  # the pass was overtaken by the loaded state, which stands
    assert (p.epoch, p.consumed(0), p.consumed(1)) == (4, 1, 1)


@pytest.mark.parametrize("consumed, workers, message", [
    ([-3], 1, r"worker 0 consumed -3 samples of epoch 0, whose share gives it 43"),  # hung in Fetcher.wait_for
    ([100], 1, r"worker 0 consumed 100 samples"),  # silently became the next epoch
    ([2.7], 1, r"consumed \[2.7\] is not a list of sample counts \(ints\)"),  # became 2
    ([True], 1, r"consumed \[True\] is not a list of sample counts"),
    ([3, 4], 1, r"num_workers 1 with 2 worker count\(s\)"),
])
def test_a_state_with_impossible_consumed_counts_is_refused(tmp_path, consumed, workers, message):
    uri = str(tmp_path / "run")
    make_run(uri)
    state = ShardStream(uri, config=StreamConfig(seed=1)).state_dict()
    stream = ShardStream(uri, config=StreamConfig(seed=1))
    with pytest.raises(InputError, match="corrupt ShardStream state: " + message):
        stream.load_state_dict(dict(state, consumed=consumed, num_workers=workers))
    stream.load_state_dict(dict(state, consumed=[3], num_workers=1))  # in range: taken
    assert len(list(stream)) == N - 3


@pytest.mark.parametrize("workers", ["x", 1.5, True])
def test_a_loader_given_a_state_with_a_damaged_worker_count_says_the_state_is_corrupt(tmp_path, workers):
    """StreamLoader compared the count before the stream checked it: "x" was a TypeError from its message."""
    uri = str(tmp_path / "run")
    make_run(uri)
    state = ShardStream(uri, config=StreamConfig(seed=1)).state_dict()
    loader = StreamLoader(ShardStream(uri, config=StreamConfig(seed=1)), batch_size=2, num_workers=2)
    with pytest.raises(InputError, match="corrupt ShardStream state"):
        loader.load_state_dict(dict(state, num_workers=workers))


def test_a_state_at_an_epoch_boundary_resumes_over_shards_committed_since_and_mid_epoch_is_refused(tmp_path):
    """A run extraction kept committing to: a state saved over 1 shard fewer could never be resumed
    ("num_shards: state has 6, this stream has 7"), even where the next epoch had not begun."""
    uri = str(tmp_path / "run")
    make_run(uri)
    store = open_store(uri)
    late = layout.commit_key(max(s.shard for s in ShardStream(uri).shards))
    record = store.get(late)
    store.delete(late)
    config = StreamConfig(seed=2, shuffle_buffer=4)
    before = ShardStream(uri, config=config)
    it = iter(before)
    next(it)
    mid = before.state_dict()
    it.close()
    for _ in before:
        pass
    boundary = before.state_dict()
    assert boundary["epoch"] == 1 and boundary["consumed"] == [] and boundary["num_samples"] < N
    store.put(late, record)  # ... committed since
    after = ShardStream(uri, config=config)
    after.load_state_dict(boundary)
    assert after.shards_changed == f"{boundary['num_shards']} shards, {boundary['num_samples']} samples"
    fresh = ShardStream(uri, config=config)
    fresh.set_epoch(1)
    assert [s["sample_id"] for s in after] == [s["sample_id"] for s in fresh]  # epoch 1 over every shard
    from layertap.train.stream import ShardsChanged

    with pytest.raises(ShardsChanged, match="mid-epoch: the committed shards of .* changed since the state was "
                                            "saved in epoch 0"):
        ShardStream(uri, config=config).load_state_dict(mid)
    with pytest.raises(InputError, match="seed: state has 2"):  # another difference still refused
        ShardStream(uri, config=StreamConfig(seed=3, shuffle_buffer=4)).load_state_dict(boundary)


def test_the_workers_peak_buffered_bytes_add_up_as_documented():
    """The workers are processes: each may hold its peak at once, so their peaks add up (the bound
    to compare with the budget they split); LOADER.md and the docstring said "maximum"."""
    from layertap.train.fetch import Metrics, merge_snapshots

    snaps = []
    for peak, elapsed in ((100, 2.0), (300, 5.0)):
        m = Metrics()
        m.peak_buffered_bytes, m.started, m.finished = peak, 0.0, elapsed
        snaps.append(m.snapshot())
    merged = merge_snapshots(snaps)
    assert merged["peak_buffered_bytes"] == 400 and merged["elapsed_s"] == 5.0
    doc = " ".join((ROOT / "docs" / "LOADER.md").read_text().split())
    assert "Its `peak_buffered_bytes` is the sum of the workers' peaks" in doc


def test_each_epoch_reads_the_shards_in_another_order():
    """The shard order is drawn per (seed, epoch): the same every time for one epoch, another the
    next (the shuffle buffer alone only mixes a few neighbouring samples)."""
    from layertap.train.order import shard_order

    orders = [tuple(shard_order(16, seed=3, epoch=e, shuffle=True)) for e in range(4)]
    assert len(set(orders)) == 4 and all(sorted(o) == list(range(16)) for o in orders)
    assert tuple(shard_order(16, seed=3, epoch=1, shuffle=True)) == orders[1]
    assert tuple(shard_order(16, seed=4, epoch=1, shuffle=True)) != orders[1]
    assert tuple(shard_order(16, seed=3, epoch=2, shuffle=False)) == tuple(range(16))


def test_which_samples_of_a_damaged_shard_are_skipped_does_not_depend_on_fetch_timing(tmp_path, monkeypatch):
    """on_corrupt='skip': a record failing its hash marked every position of its shard not yet
    taken as skipped, so its good records were trained on or not by which GETs came back first
    (1 of 27 one run, 26 the next, with the same seed): the damaged record alone is skipped now."""
    from layertap.train import fetch

    uri = str(tmp_path / "run")
    make_run(uri, shard_bytes=20000)
    store = open_store(uri)
    commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
    target = max(commits, key=lambda c: c.num_records)
    entries = ShardReader(store, target.data_key).entries
    assert len(entries) >= 4
    last = entries[-1]
    data = bytearray(store.get(target.data_key))
    data[last.offset + last.length // 2] ^= 0xFF  # the shard's last record
    store.put(target.data_key, bytes(data))
    real_read, delay = fetch.Fetcher._read_range, [0.0]

    def read_range(self, key, start, end, out=None):
        if key == target.data_key and start == last.offset:
            time.sleep(delay[0])  # the damaged record's GET comes back last, or first
        return real_read(self, key, start, end, out)

    monkeypatch.setattr(fetch.Fetcher, "_read_range", read_range)
    config = StreamConfig(seed=0, on_corrupt="skip", range_bytes=entries[1].offset - entries[0].offset,
                          fetch_threads=4, shuffle_buffer=1)
    runs = []
    for delay[0] in (0.0, 1.0):
        stream = ShardStream(uri, config=config)
        runs.append([s["sample_id"] for s in stream if not s["padding"]])
        assert stream.metrics()["skipped_samples"] == 1 and stream.metrics()["corrupt_shards"] == 1
    assert runs[0] == runs[1] and last.sample_id not in runs[0] and len(runs[0]) == N - 1


def test_a_shard_gone_under_a_reader_says_whether_its_commit_was_withdrawn_or_redone(tmp_path):
    """Its object missing, the error said "its commit stands ... run `layertap verify`" also where verify
    had withdrawn the commit meanwhile, or extraction redone the shard under another object."""
    uri = str(tmp_path / "run")
    make_run(uri)
    store = open_store(uri)
    stream = ShardStream(uri, config=StreamConfig(seed=1, shuffle_buffer=4), rank=0, world_size=1)
    first = stream.shards[0]
    commit = store.get(layout.commit_key(first.shard))
    store.delete(layout.commit_key(first.shard))  # verify's withdrawal: the commit, then the data
    store.delete(first.key)
    with pytest.raises(ShardError, match=rf"shard {first.shard} \(.*\) is gone, and so is its commit: `layertap "
                                         "verify` withdrew it while this stream read the run"):
        list(stream)
    redone = first.key.replace(first.key.rsplit("-", 1)[1].split(".")[0], "0" * 20)
    store.put(layout.commit_key(first.shard), json.dumps(dict(json.loads(commit), data_key=redone)).encode())
    with pytest.raises(ShardError, match=rf"was redone since this stream read the run: its commit now names {redone}"):
        list(stream)  # the stream read before the redo
