"""Reliability: S3 faults, crashes, memory budgets, bad input and security, each promise of
docs/reliability.md proven against real processes and a real S3 server (moto over HTTP, behind
the fault-injecting proxy of tests/faultproxy.py where faults are wanted)."""

from __future__ import annotations

import json
import logging
import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import xxhash

import forked_cli
from faultproxy import FAULTS, FaultProxy
from manifests import layout
from manifests.records import decode_commit
from manifests.status import run_status
from storage.shard import ShardReader, verify_shard
from storage.store import open_store
from tiny_models import tiny_model_dir
from train import ShardStream

log = logging.getLogger(__name__)
MiB = 1 << 20


# -- a small extraction job ------------------------------------------------------------------------


def write_rows(path: Path, n: int, seed: int = 0) -> str:
    """Pre-tokenized rows of 60-200 tokens (no chat template to render: cheap to tokenize)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = rng.randint(60, 200)
            f.write(json.dumps({"id": f"r{i}", "input_ids": [rng.randrange(300) for _ in range(k)],
                                "loss_mask": [int(j >= 8) for j in range(k)]}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A 2-layer llama 1024 wide (6 KiB stored per token at little compute), 24 rows, and the
    settings that make each shard on S3 a multipart upload of two 5 MiB parts' worth."""
    root = tmp_path_factory.mktemp("job")
    model = tiny_model_dir(root, "llama", num_layers=2, hidden_size=1024)
    data = write_rows(root / "rows.jsonl", 24)
    config = root / "s3.json"
    config.write_text(json.dumps({"s3": {"part_size": 5 * MiB, "max_parts_in_memory": 2}}))

    def args(out: str, *extra: str) -> list[str]:
        """`layertap extract` on the job; flags in `extra` override the defaults (the last wins)."""
        return ["extract", "--model", model, "--dataset", data, "--out", out, "--layers", "0,1", "--codec", "bf16",
                "--final-state", "prenorm", "--dtype", "float32", "--max-length", "256", "--batch-tokens", "1024",
                "--shard-bytes", "6MB", "--lease-ttl", "2", "--log-dir", str(root / "logs"),
                "--config", str(config), *extra]

    return {"root": root, "model": model, "data": data, "args": args, "ids": [f"{i}-r{i}" for i in range(24)]}


def record_hashes(store) -> dict[str, str]:
    """sample id -> the xxh3-64 of its record, over the committed shards; each sample once, every
    committed object verified (frames, footer, whole-object hash against its commit)."""
    out: dict[str, str] = {}
    for o in store.list(layout.COMMITS):
        c = decode_commit(store.get(o.key), o.key)
        report = verify_shard(store, c.data_key, expected_xxh3_128=c.xxh3_128)
        assert report.ok, report.error
        for e in ShardReader(store, c.data_key, size=c.bytes).entries:
            assert e.sample_id not in out, f"{e.sample_id} stored twice"
            out[e.sample_id] = e.xxh3_64
    return out


def assert_complete_and_clean(store, want: dict[str, str]) -> None:
    """Complete, every sample once with the reference content, nothing left behind."""
    status = run_status(store)
    assert status["complete"] and status["shards_running"] == 0, status
    assert record_hashes(store) == want
    # S3: no multipart upload pending. A local folder: no shard writer's temp file; a SIGKILLed
    # small put (a lease, a tally) may leave a hidden temp file of a few bytes, which the run's
    # next end removes once it is older than the lease TTL (test_stale_temp_files_are_swept).
    pending = store.list_pending_uploads()
    assert [u for u in pending if u.key.startswith(layout.SHARDS) or store.uri.startswith("s3://")] == []
    assert list(store.list(layout.LEASES)) == []
    committed = {decode_commit(store.get(o.key), o.key).data_key for o in store.list(layout.COMMITS)}
    assert {o.key for o in store.list(layout.SHARDS)} == committed  # no orphaned data objects


def drop(store) -> None:
    """Free the trial's objects: moto holds everything in RAM."""
    store.abort_pending_uploads()
    for o in store.list():
        store.delete(o.key)


# -- crashes -------------------------------------------------------------------------------------


def wait_for(predicate, timeout: float, period: float = 0.02) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return False


def crash_lane(name: str, base: str, extra: list[str], trials: list[int], args, tmp_path: Path) -> Counter:
    """A clean reference run, then one trial per entry of `trials` (its number seeds the trial)."""
    t0 = time.time()
    ref = forked_cli.start(args(f"{base}-ref", *extra), tmp_path / f"{name}-ref.log")
    ref.join(300)
    assert ref.exitcode == 0, (tmp_path / f"{name}-ref.log").read_text()[-3000:]
    duration = time.time() - t0
    store = open_store(f"{base}-ref")
    want = record_hashes(store)
    if name == "s3":
        drop(store)
    outcomes: Counter[str] = Counter()
    for trial in trials:
        rng = random.Random(trial)
        uri, logfile = f"{base}-{trial}", tmp_path / f"{name}-{trial}.log"
        store = open_store(uri)
        aim = ("delay", "upload open" if name == "s3" else "commit written", "delay")[trial % 3]
        victim = forked_cli.start(args(uri, *extra), logfile)
        if aim == "delay":
            victim.join(rng.uniform(0.1, 0.9) * duration)
        elif aim == "upload open":
            wait_for(lambda: store.list_pending_uploads() or not victim.is_alive(), 60)
            victim.join(rng.uniform(0, 0.05))
        else:
            wait_for(lambda: any(store.list(layout.COMMITS)) or not victim.is_alive(), 60, period=0.005)
            victim.join(rng.uniform(0, 0.05))
        if victim.is_alive():
            victim.kill()
            victim.join()
        commits = len(list(store.list(layout.COMMITS)))
        pending = len(store.list_pending_uploads())
        outcome = ("finished" if victim.exitcode == 0 else "before manifest" if not store.exists(layout.MANIFEST)
                   else "mid-run")
        outcomes[outcome] += 1
        outcomes[f"{name} upload pending"] += pending > 0
        log.info("trial %d (%s, %s): %s, %d commits, %d uploads pending", trial, name, aim, outcome, commits, pending)

        rerun = forked_cli.start(args(uri, *extra), logfile)
        rerun.join(300)
        assert rerun.exitcode == 0, logfile.read_text()[-3000:]
        assert_complete_and_clean(store, want)
        if name == "s3":
            drop(store)
    return outcomes


def test_sigkill_at_random_points_then_a_rerun_completes_exactly_once(job, s3_bucket, tmp_path):
    """20 trials, 10 on S3 (a multipart shard) and 10 on a local folder, the two backends side by
    side: start an extraction, SIGKILL it, rerun it; each rerun must complete with every sample
    stored once and equal to a clean run's, every hash verifying, no upload pending, no lease or
    orphaned object left. Most kills come after a random delay; every third trial waits for a
    window worth aiming at (an upload open, a commit just written) and kills inside it."""
    forked_cli.warm()
    lanes = {"s3": (f"s3://{s3_bucket}/crash", ["--shard-bytes", "7MB", "--limit", "12"], range(0, 20, 2)),
             "local": (str(tmp_path / "crash"), ["--shard-bytes", "2MB"], range(1, 20, 2))}
    with ThreadPoolExecutor(len(lanes)) as pool:
        futures = [pool.submit(crash_lane, name, base, extra, list(trials), job["args"], tmp_path)
                   for name, (base, extra, trials) in lanes.items()]
        outcomes = sum((f.result() for f in futures), Counter())
    log.info("kill outcomes: %s", dict(outcomes))
    assert outcomes["mid-run"] >= 6 and outcomes["s3 upload pending"] >= 2, outcomes


# -- S3 faults -------------------------------------------------------------------------------------


def stream_digests(uri: str, **options) -> list[tuple[str, str]]:
    """(sample id, xxh3-64 of every tensor's bytes) in the order a ShardStream yields them."""
    out = []
    for s in ShardStream(uri, seed=3, shuffle_buffer=4, range_bytes=MiB, memory_budget=4 * MiB, **options):
        h = xxhash.xxh3_64()
        for name in ("input_ids", "loss_mask", "hidden_states", "final_state"):
            h.update(s[name].contiguous().view(torch.uint8).numpy().tobytes())
        out.append((s["sample_id"], h.hexdigest()))
    return out


def test_extraction_and_loading_at_a_10_percent_fault_rate_equal_a_fault_free_run(job, s3_endpoint, s3_bucket,
                                                                                      tmp_path):
    """Every kind of fault (500, 503 SlowDown, resets before and after the server applied the
    request, bodies cut short, stalls) on 10% of requests: the extraction completes with the same
    records, byte for byte, as without faults; streaming it back through the same faults yields
    the same samples in the same order; no upload is left pending."""
    forked_cli.warm()
    clean, faulty = f"s3://{s3_bucket}/clean", f"s3://{s3_bucket}/faulty"
    proc = forked_cli.start(job["args"](clean), tmp_path / "clean.log")
    proc.join(300)
    assert proc.exitcode == 0, (tmp_path / "clean.log").read_text()[-3000:]

    with FaultProxy(s3_endpoint, rate=0.1, seed=5, stall_s=0.3) as proxy:
        proc = forked_cli.start(job["args"](faulty), tmp_path / "faulty.log", env={"AWS_ENDPOINT_URL": proxy.url})
        proc.join(600)
        assert proc.exitcode == 0, (tmp_path / "faulty.log").read_text()[-3000:]
        extract_faults = dict(proxy.counts)
        got = stream_digests(faulty, store_options={"endpoint_url": proxy.url})
        load_faults = dict(proxy.counts)
    log.info("faults injected: extraction %s, extraction + loading %s", extract_faults, load_faults)
    assert sum(extract_faults.get(f, 0) for f in FAULTS) >= 8, extract_faults
    assert sum(load_faults.get(f, 0) for f in FAULTS) - sum(extract_faults.get(f, 0) for f in FAULTS) >= 4

    want_store, got_store = open_store(clean), open_store(faulty)
    assert run_status(got_store)["complete"]
    assert record_hashes(got_store) == record_hashes(want_store)
    assert got_store.list_pending_uploads() == []
    assert got == stream_digests(clean) and len(got) == 24


def test_a_lost_answer_to_create_multipart_upload_leaves_no_upload_pending(s3_endpoint, s3_bucket):
    """The server started the upload but the client never heard: botocore retries and starts a
    second one. The writer must abort the first, or it stays pending (and billed) forever."""
    is_create = lambda method, path: method == "POST" and path.endswith("?uploads")  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("reset-after",), match=is_create, limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        data = os.urandom(11 * MiB)
        with store.open_writer("x.bin") as w:
            w.write(data)
        assert proxy.counts["reset-after"] == 1
    assert store.get("x.bin") == data
    assert store.list_pending_uploads() == []


def test_stalls_longer_than_the_read_timeout_are_retried(s3_endpoint, s3_bucket):
    with FaultProxy(s3_endpoint, rate=0.5, seed=2, faults=("stall",), stall_s=1.5) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, read_timeout_s=0.5)
        for i in range(6):
            store.put(f"k{i}", bytes([i]) * 1000)
        assert [store.get_range(f"k{i}", 10, 20) for i in range(6)] == [bytes([i]) * 10 for i in range(6)]
        assert [o.key for o in store.list()] == [f"k{i}" for i in range(6)]
        assert proxy.counts["stall"] >= 3
