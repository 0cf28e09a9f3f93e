"""Reliability: S3 faults, crashes, memory budgets, bad input and security, each promise of
docs/reliability.md proven against real processes and a real S3 server (moto over HTTP, behind
the fault-injecting proxy of tests/faultproxy.py where faults are wanted)."""

from __future__ import annotations

import ast
import json
import logging
import os
import random
import re
import shutil
import struct
import sys
import time
import tracemalloc
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
import torch
import xxhash

import fake_worker
import forked_cli
from layertap.cli import main as cli
from faultproxy import FAULTS, FaultProxy
from layertap.manifests import layout
from layertap.manifests.manifest import ManifestError
from layertap.manifests.records import decode_commit
from layertap.manifests.status import run_status
from layertap.storage.s3 import READ_SLICE
from layertap.storage.format import FRAME, PREAMBLE, TRAILER, ShardError, UnsupportedShard
from layertap.storage.reader import ShardReader, verify_shard
from layertap.storage.store import ObjectNotFound, StoreError, open_store
from tiny_models import tiny_model_dir
from layertap.train import ShardStream, StreamConfig

pytestmark = pytest.mark.slow  # SIGKILL and fault-injection trials over many real processes

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
    settings that make each shard on S3 a multipart upload (5 MiB parts, shards of 6-7 MB)."""
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
    # next end removes once it is older than the lease TTL (test_the_end_of_a_run_sweeps_...).
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
            # the window is one shard's parts in flight: the kill must land within milliseconds
            wait_for(lambda: store.list_pending_uploads() or not victim.is_alive(), 60, period=0.005)
            victim.join(rng.uniform(0, 0.005))
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
        if left := [o.key for o in store.list(layout.LEASES)]:
            # Killed between a commit and its lease's release: the lease may still be fresh when
            # the rerun ends, and a live lease is never swept (its holder may be finishing). It is
            # a committed shard's, and the next run to end after it went stale removes it.
            committed = {layout.shard_of(o.key, layout.COMMITS) for o in store.list(layout.COMMITS)}
            assert {layout.shard_of(k, layout.LEASES) for k in left} <= committed, left  # leases and their beats
            time.sleep(2 + 2.5)  # --lease-ttl 2, and S3's whole seconds: the Date header and LastModified
            again = forked_cli.start(args(uri, *extra), logfile)  # nothing to do but the sweep
            again.join(300)
            assert again.exitcode == 0, logfile.read_text()[-3000:]
            outcomes["lease swept by the next run"] += 1
        assert_complete_and_clean(store, want)
        if name == "s3":
            drop(store)
    return outcomes


def test_sigkill_at_random_points_then_a_rerun_completes_exactly_once(job, s3_bucket, tmp_path):
    """20 trials, 8 on S3 (a multipart shard) and 12 on a local folder, the two backends side by
    side: start an extraction, SIGKILL it, rerun it; each rerun must complete with every sample
    stored once and equal to a clean run's, every hash verifying, no upload pending, no lease or
    orphaned object left (a lease a kill left fresh between a commit and its release: once the
    next run has ended after it went stale). Most kills come after a random delay; every third
    trial waits for a window worth aiming at (an upload open, a commit just written) and kills
    inside it."""
    forked_cli.warm()
    lanes = {"s3": (f"s3://{s3_bucket}/crash", ["--shard-bytes", "7MB", "--limit", "12"], range(0, 8)),
             "local": (str(tmp_path / "crash"), ["--shard-bytes", "2MB"], range(8, 20))}
    with ThreadPoolExecutor(len(lanes)) as pool:
        futures = [pool.submit(crash_lane, name, base, extra, list(trials), job["args"], tmp_path)
                   for name, (base, extra, trials) in lanes.items()]
        outcomes = sum((f.result() for f in futures), Counter())
    log.info("kill outcomes: %s", dict(outcomes))
    assert outcomes["mid-run"] >= 6 and outcomes["s3 upload pending"] >= 2, outcomes


def test_the_end_of_a_run_sweeps_what_killed_attempts_left(tmp_path):
    """What a SIGKILL leaves at the wrong moment, planted by hand: the next worker to find every
    shard committed removes the stale ones and leaves anything that may still be in use."""
    prefix = str(tmp_path / "run")
    fake_worker.work(prefix)
    store = open_store(prefix)
    commit = decode_commit(store.get(layout.commit_key(1)), "commit")
    root = Path(prefix)
    old = time.time() - 3600
    planted = {
        "orphan": root / "shards" / "000001-0123456789ab.lts",  # completed, then killed before its commit
        "upload": root / "shards" / ".000002-0123456789ab.lts.0f0f.part",  # killed mid-write
        "lease": root / "leases" / "000003" / "000007.ttl60",  # killed after its commit, before release
        "stale put": root / "leases" / "000004" / ".000008.ttl60.0f0f.part",
        "fresh put": root / "tally" / ".000005.r1.t1.b1.x1.s0.0f0f.part",  # a put in flight elsewhere
    }
    for path in planted.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    for name in ("orphan", "upload", "lease", "stale put"):
        os.utime(planted[name], (old, old))
    assert fake_worker.work(prefix) == []  # nothing to do but the sweep
    assert [name for name, path in planted.items() if path.exists()] == ["fresh put"]
    assert store.exists(commit.data_key) and run_status(store)["complete"]


# -- S3 faults -------------------------------------------------------------------------------------


def stream_digests(uri: str, **options) -> list[tuple[str, str]]:
    """(sample id, xxh3-64 of every tensor's bytes) in the order a ShardStream yields them; the
    stream's buffers stay within its 4 MiB budget plus one 1 MiB range."""
    out = []
    stream = ShardStream(uri, config=StreamConfig(seed=3, shuffle_buffer=2, range_bytes=MiB, memory_budget=4 * MiB),
                         **options)
    for s in stream:
        h = xxhash.xxh3_64()
        for name in ("input_ids", "loss_mask", "hidden_states", "final_state"):
            h.update(s[name].contiguous().view(torch.uint8).numpy().tobytes())
        out.append((s["sample_id"], h.hexdigest()))
    assert 0 < stream.metrics()["peak_buffered_bytes"] <= 5 * MiB
    return out


@pytest.fixture(scope="module")
def clean_run(job, s3_endpoint):
    """The job extracted on S3 without faults: 24 samples in 4 shards, each a multipart upload."""
    bucket = f"t-clean-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    forked_cli.warm()
    logfile = job["root"] / "clean.log"
    proc = forked_cli.start(job["args"](f"s3://{bucket}/clean"), logfile)
    proc.join(300)
    assert proc.exitcode == 0, logfile.read_text()[-3000:]
    return f"s3://{bucket}/clean"


def test_extraction_and_loading_at_a_10_percent_fault_rate_equal_a_fault_free_run(job, clean_run, s3_endpoint,
                                                                                      s3_bucket, tmp_path):
    """Every kind of fault (500, 503 SlowDown, resets before and after the server applied the
    request, bodies cut short, stalls) on 10% of requests: the extraction completes with the same
    records, byte for byte, as without faults; streaming it back through the same faults yields
    the same samples in the same order, within the memory budget; no upload is left pending."""
    clean, faulty = clean_run, f"s3://{s3_bucket}/faulty"

    with FaultProxy(s3_endpoint, rate=0.1, seed=5, stall_s=0.3) as proxy:
        proc = forked_cli.start(job["args"](faulty), tmp_path / "faulty.log", env={"AWS_ENDPOINT_URL": proxy.url})
        proc.join(600)
        assert proc.exitcode == 0, (tmp_path / "faulty.log").read_text()[-3000:]
        extract_faults = proxy.counts
    with FaultProxy(s3_endpoint, rate=0.1, seed=6, stall_s=0.3) as proxy:
        got = stream_digests(faulty, store_options={"endpoint_url": proxy.url})
        load_faults = proxy.counts
    log.info("faults injected: extraction %s, loading %s", dict(extract_faults), dict(load_faults))
    # one request in ten fails, so ~100 extraction requests and ~40 loading ones see at least:
    assert sum(extract_faults[f] for f in FAULTS) >= 8, extract_faults
    assert sum(load_faults[f] for f in FAULTS) >= 3, load_faults

    want_store, got_store = open_store(clean), open_store(faulty)
    assert run_status(got_store)["complete"]
    assert record_hashes(got_store) == record_hashes(want_store)
    assert got_store.list_pending_uploads() == []
    assert got == stream_digests(clean) and len(got) == 24


@pytest.mark.parametrize("range_bytes", [64, MiB])  # records read by ranges; shards read whole
def test_a_read_damaged_on_its_way_is_read_again_not_taken_for_a_corrupt_shard(s3_endpoint, s3_bucket, range_bytes,
                                                                                monkeypatch, capsys, caplog):
    """One byte flipped in an answer (a NIC, a proxy), the object sound: the loader failed the shard
    (training stopped, advised to run verify) and `verify` withdrew it and deleted its data (a full
    redo). A range or shard that does not verify is read again, and the second read decides. (botocore
    checks a whole object's stored checksum where the server keeps one: not on every server, nor on
    ranges; off here.)"""
    monkeypatch.setenv("AWS_RESPONSE_CHECKSUM_VALIDATION", "when_required")
    uri = f"s3://{s3_bucket}/runs/flipped"
    fake_worker.work(uri)
    config = StreamConfig(seed=3, shuffle_buffer=2, range_bytes=range_bytes)

    def digests(stream):
        return [(s["sample_id"], xxhash.xxh3_64(s["hidden_states"].view(torch.uint8).numpy().tobytes()).hexdigest())
                for s in stream]

    want = digests(ShardStream(uri, config=config))
    shard_gets = lambda method, path: method == "GET" and "/shards/" in path  # noqa: E731
    seen = Counter()

    def a_record(method: str, path: str) -> bool:
        """A shard's first GET of records, not its second (the read again): a shard read by ranges is
        opened by two (its HEAD and its footer)."""
        if shard_gets(method, path):
            seen[path] += 1
            return seen[path] == (1 if range_bytes == MiB else 3)
        return False

    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=a_record, limit=3) as proxy:
        stream = ShardStream(uri, config=config, store_options={"endpoint_url": proxy.url})
        assert digests(stream) == want
        assert proxy.counts["flip"] == 3 and stream.metrics()["rereads"] == 3, stream.metrics()
    store, commits = open_store(uri), sorted(o.key for o in open_store(uri).list("commits/"))
    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=shard_gets, limit=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        caplog.clear()
        assert cli(["verify", uri]) == 0 and proxy.counts["flip"] == 1
    assert "a first read did not verify (" in caplog.text
    assert sorted(o.key for o in store.list("commits/")) == commits
    # the same damage on both reads: the shard is refused, as a corrupt one
    first = lambda method, path: shard_gets(method, path) and "/shards/000000-" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=first) as proxy:
        with pytest.raises(ShardError, match="shard 0 .* is corrupt"):
            digests(ShardStream(uri, config=config, store_options={"endpoint_url": proxy.url}))
    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=first, limit=2) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert cli(["verify", uri]) == 1
    assert "WITHDRAWN shard 0" in capsys.readouterr().out


@pytest.mark.parametrize("end", ["close", "abort"])
def test_a_lost_answer_to_create_multipart_upload_leaves_no_upload_pending(s3_endpoint, s3_bucket, end):
    """The server started the upload but the client never heard: botocore retries and starts a
    second one. The writer must abort the first, or it stays pending (and billed) forever: also
    when the writer is aborted (a checkpoint's write that failed), which left it."""
    is_create = lambda method, path: method == "POST" and path.endswith("?uploads")  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("reset-after",), match=is_create, limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        data = os.urandom(11 * MiB)
        with store.open_writer("x.bin") as w:
            w.write(data)
            if end == "abort":
                w.abort()
        assert proxy.counts["reset-after"] == 1
    assert store.exists("x.bin") == (end == "close") and (end == "abort" or store.get("x.bin") == data)
    assert store.list_pending_uploads() == []


def _creates_then(method: str, then):
    """A `match` for FaultProxy: the first CreateMultipartUpload, then the requests `then` picks."""
    created = []

    def match(m: str, path: str) -> bool:
        if m == "POST" and path.endswith("?uploads") and not created:
            created.append(path)
            return True
        return bool(created) and m == method and then(path)
    return match


def test_a_written_object_closes_though_the_sweep_of_an_unheard_upload_fails(s3_endpoint, s3_bucket, caplog):
    """After a retried create the writer lists the key's uploads to abort the unheard one. That
    listing failing (an outage, a policy without s3:ListBucketMultipartUploads) failed the close
    of an object already written: extraction took its shard for failed, deleted it and redid it."""
    match = _creates_then("GET", lambda path: "uploads" in path)
    with FaultProxy(s3_endpoint, rate=1.0, faults=("reset-after", "501"), in_turn=True, match=match,
                    limit=2) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        data = os.urandom(11 * MiB)
        with caplog.at_level(logging.WARNING, logger="layertap.storage.s3"), store.open_writer("x.bin") as w:
            w.write(data)
        assert proxy.counts["reset-after"] == proxy.counts["501"] == 1
    assert store.get("x.bin") == data
    assert "could not abort the unheard upload" in caplog.text
    assert len(store.list_pending_uploads()) == 1  # the unheard one: left for a sweep, named in the warning


@pytest.mark.parametrize("inside", [None, KeyboardInterrupt])
def test_an_abort_that_fails_leaves_the_error_or_stop_that_caused_it(s3_endpoint, s3_bucket, inside):
    """The writer aborts its upload on the way out of an error or a stop; an abort that failed too
    raised its own error instead: the user saw "abort upload ... failed", not why the write
    failed, and a stop became a StoreError (a shard failure, not a preemption)."""
    if inside is None:  # a part's upload fails, then the abort
        match = lambda method, path: method in ("PUT", "DELETE") and "uploadId=" in path  # noqa: E731
    else:
        match = lambda method, path: method == "DELETE" and "uploadId=" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("501",), match=match) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        with pytest.raises(StoreError if inside is None else inside) as raised:
            with store.open_writer("x.bin") as w:
                w.write(os.urandom(11 * MiB))
                if inside is not None:
                    raise inside
        assert proxy.counts["501"] >= 1 + (inside is None)
    assert inside is not None or str(raised.value).startswith("upload part of"), raised.value
    assert not store.exists("x.bin")


def test_a_create_retried_then_failed_leaves_no_upload_pending(s3_endpoint, s3_bucket):
    """The first create landed unheard, its retry failed: the writer did not know it had retried
    (the flag was set only when the create returned), and the unheard upload stayed pending."""
    is_create = lambda method, path: method == "POST" and path.endswith("?uploads")  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("reset-after", "501"), in_turn=True, match=is_create,
                    limit=2) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        with pytest.raises(StoreError, match="create multipart upload"):
            with store.open_writer("x.bin") as w:
                w.write(os.urandom(11 * MiB))
        assert proxy.counts["reset-after"] == proxy.counts["501"] == 1
    assert store.list_pending_uploads() == [] and not store.exists("x.bin")


@pytest.mark.parametrize("first", ["reset-after", "reset"])
def test_a_retried_complete_answered_no_such_upload_counts_as_done_only_if_the_object_landed(s3_endpoint, s3_bucket,
                                                                                            first):
    """MinIO answers a retried CompleteMultipartUpload with 404 NoSuchUpload once the first try
    completed the upload (minio/minio#13318). After a first try that landed unheard (reset-after)
    the object is there, whole: the writer closes. After one that never reached the server
    (reset) it is not: the close fails, and leaves nothing."""
    is_complete = lambda method, path: method == "POST" and "uploadId=" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=(first, "404"), in_turn=True, match=is_complete, limit=2) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, part_size=5 * MiB)
        data = os.urandom(11 * MiB)
        w = store.open_writer("x.bin")
        w.write(data)
        if first == "reset-after":
            w.close()
            assert store.get("x.bin") == data
        else:  # named as what it is: not a missing object ("no object at ...", before)
            with pytest.raises(StoreError, match="its multipart upload was aborted meanwhile") as failed:
                w.close()
            assert not isinstance(failed.value, ObjectNotFound) and not store.exists("x.bin")
        assert proxy.counts[first] == proxy.counts["404"] == 1
        assert store.list_pending_uploads() == []


def test_stalls_longer_than_the_read_timeout_are_retried(s3_endpoint, s3_bucket):
    with FaultProxy(s3_endpoint, rate=0.5, seed=2, faults=("stall",), stall_s=1.5) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, read_timeout_s=0.5)
        for i in range(6):
            store.put(f"k{i}", bytes([i]) * 1000)
        assert [store.get_range(f"k{i}", 10, 20) for i in range(6)] == [bytes([i]) * 10 for i in range(6)]
        assert [o.key for o in store.list()] == [f"k{i}" for i in range(6)]
        assert proxy.counts["stall"] >= 3


def test_a_request_retried_long_after_its_first_try_is_a_warning(s3_endpoint, s3_bucket, monkeypatch, caplog):
    """A server that stopped answering: 60 s to each read timeout, retries logged at debug only, and
    an extraction's log went silent for as long as it lasted (a hang, to the user). A quick retry
    stays quiet; one made long after the request's first try is a warning naming the failure."""
    import logging

    from layertap.storage import retry

    monkeypatch.setattr(retry, "SLOW_RETRY_S", 0.4)
    with FaultProxy(s3_endpoint, rate=1.0, faults=("stall",), stall_s=1.5, limit=1) as proxy:
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url, read_timeout_s=0.5)
        with caplog.at_level(logging.DEBUG, logger="layertap.storage.retry"):
            store.put("k", b"x")
        assert proxy.counts["stall"] == 1 and store.get("k") == b"x"
    (told,) = [r for r in caplog.records if r.name == "layertap.storage.retry"]
    assert told.levelno == logging.WARNING and "timeout" in told.getMessage().lower()
    assert "(try 2 of 8, " in told.getMessage()

    caplog.clear()
    with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), limit=1) as proxy:  # answered at once: routine
        store = open_store(f"s3://{s3_bucket}/p", endpoint_url=proxy.url)
        with caplog.at_level(logging.DEBUG, logger="layertap.storage.retry"):
            store.put("k", b"y")
    assert [r.levelno for r in caplog.records if r.name == "layertap.storage.retry"] == [logging.DEBUG]


# -- memory budgets --------------------------------------------------------------------------------


def test_writer_memory_stays_within_k_parts_while_the_producer_outruns_the_upload(s3_bucket):
    """64 MiB handed over as fast as memory allows, K=2 buffers of 5 MiB: every byte Python holds
    for the writer (tracemalloc, botocore's included) stays within K x P, not the object's size."""
    store = open_store(f"s3://{s3_bucket}/p", part_size=5 * MiB, max_parts_in_memory=2)
    chunk = os.urandom(MiB)
    store.put("warm-up", b"")  # the client's own first-use allocations are not the writer's
    # The GIL handed over every microsecond: the threads interleave as on a busy CPU, where a part's
    # buffer outliving its slot let the producer fill one more (15.2 MiB, seen in CI; 7 of 8 runs
    # here fail that way with this switch interval, 0 with the buffer freed first).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        with store.open_writer("big") as w:
            for _ in range(64):
                w.write(chunk)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        sys.setswitchinterval(switch)
    assert w.peak_buffered_bytes <= 10 * MiB
    assert peak <= 10 * MiB + MiB, f"{peak / MiB:.1f} MiB held for a 2 x 5 MiB writer"
    assert store.size("big") == 64 * MiB


@pytest.mark.parametrize("decode_threads", [0, 2])
def test_loader_memory_stays_within_its_budget_behind_a_slow_consumer(clean_run, decode_threads):
    """A consumer slower than the store, a 4 MiB budget over a 20 MB run: bytes fetched and held
    (counted by the stream) stay within budget + one range, and everything Python holds for the
    stream (tracemalloc: GET buffers, decoded samples) within that plus the samples being decoded
    (the one the consumer holds and 2 x decode_threads decoded ahead) and the slice each fetch
    thread's GET body passes through on its way into the range's buffer."""
    stream = ShardStream(clean_run, config=StreamConfig(seed=1, shuffle_buffer=2, memory_budget=4 * MiB, range_bytes=MiB,
                                                        fetch_threads=4, decode_threads=decode_threads))
    store = open_store(clean_run)
    record = max(e.length for s in stream.shards for e in ShardReader(store, s.key, size=s.bytes).entries)
    run_bytes = sum(s.bytes for s in stream.shards)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        n = 0
        for _ in stream:
            n += 1
            time.sleep(0.02)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    m = stream.metrics()
    assert n == 24 and run_bytes > 4 * 4 * MiB
    assert 2 * MiB < m["peak_buffered_bytes"] <= 5 * MiB
    bound = 5 * MiB + (2 * decode_threads + 2) * record + 4 * READ_SLICE + MiB  # + footers, headers, Python objects
    log.info("loader: %.1f MiB traced at peak (bound %.1f), %.1f MiB counted, run %.1f MiB", peak / MiB,
             bound / MiB, m["peak_buffered_bytes"] / MiB, run_bytes / MiB)
    assert peak <= bound, f"{peak / MiB:.1f} MiB held by a loader with a 4 MiB budget"


# -- bad input -------------------------------------------------------------------------------------


def objects(uri: str) -> list:
    """Everything stored under `uri`, uploads left open included (with this test's credentials)."""
    store = open_store(uri)
    return sorted((o.key, o.size) for o in store.list()) + sorted(u.key for u in store.list_pending_uploads())


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def local_run(job):
    """The job extracted into a local folder, 4 shards; tests copy it before changing anything."""
    out = str(job["root"] / "local-run")
    assert cli(job["args"](out, "--shard-bytes", "4MB")) == 0
    return out


def _unwritable(tmp_path: Path) -> str:
    if os.geteuid() == 0:  # root writes through permission bits; sysfs refuses even root
        return "/sys/layertap-test/run"
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return str(locked / "run")


BAD_EXTRACT = [  # name, (problem, fix) fragments the error must hold
    ("empty dataset", ("has no rows", "give a dataset with at least one row")),
    ("token id outside the vocabulary", ("token id 700 at position 1 is outside the vocabulary [0,",
                                         "Tokenize them with this model's tokenizer")),
    ("missing column", ("neither 'loss_mask' nor 'labels'", "add one so the drafter knows")),
    ("unknown row shape", ("rows match no accepted shape; columns found: ['id', 'text']", "Accepted: pre-tokenized")),
    ("unknown model path", ("target model", "does not exist", "give a model folder")),
    ("layer id out of range", ("capture layer 2 is out of range", "ids 0..1")),
    ("layer id not a number", ("invalid id list '0,x'", "use comma-separated integers")),
    ("unknown codec", ("unknown codec 'zip'", "choose one of bf16, bf16-zstd, fp8")),
    ("bucket missing", ("bucket 'layertap-no-such-bucket' does not exist", "create it or fix the URI")),
    ("no credentials", ("no S3 credentials found", "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")),
    ("wrong endpoint", ("cannot reach the S3 endpoint http://127.0.0.1:9", "check AWS_ENDPOINT_URL")),
    ("another run at the prefix", ("made with a different configuration", "layers: run has [0, 1], now [1]",
                                   "write the new run to another prefix")),
    ("output path under a file", ("a part of that path is a file, not a folder", "choose another output folder")),
    ("unwritable output", ("permission denied", "choose a writable output folder")),
]


@pytest.mark.parametrize("name,fragments", BAD_EXTRACT, ids=[c[0] for c in BAD_EXTRACT])
def test_bad_input_to_extract_is_a_clear_error_and_leaves_the_store_as_it_was(
        name, fragments, job, local_run, s3_bucket, tmp_path, monkeypatch, capsys):
    """Exit code 2, one `error:` line naming the problem and the fix, no traceback, and nothing
    written: a new output stays empty, an existing run is unchanged (and still complete)."""
    out, extra, env = f"s3://{s3_bucket}/run", [], {}
    ok_rows = [{"id": "a", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}]
    if name == "empty dataset":
        extra = ["--dataset", jsonl(tmp_path / "empty.jsonl", [])]
    elif name == "token id outside the vocabulary":
        extra = ["--dataset", jsonl(tmp_path / "ids.jsonl", ok_rows + [{"id": "b", "input_ids": [1, 700],
                                                                        "loss_mask": [1, 1]}])]
    elif name == "missing column":
        extra = ["--dataset", jsonl(tmp_path / "nomask.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])]
    elif name == "unknown row shape":
        extra = ["--dataset", jsonl(tmp_path / "text.jsonl", [{"id": "a", "text": "hello"}])]
    elif name == "unknown model path":
        extra = ["--model", str(tmp_path / "no-such-model")]
    elif name == "layer id out of range":
        extra = ["--layers", "0,2"]
    elif name == "layer id not a number":
        extra = ["--layers", "0,x"]
    elif name == "unknown codec":  # a config file's value (the --codec flag is checked by argparse, below)
        (tmp_path / "codec.json").write_text(json.dumps({"codec": "zip"}))
        extra = ["--config", str(tmp_path / "codec.json")]
    elif name == "bucket missing":
        out = "s3://layertap-no-such-bucket/run"
    elif name == "no credentials":
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
            env[var] = None
        env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_EC2_METADATA_DISABLED="true")
    elif name == "wrong endpoint":
        (tmp_path / "s3.json").write_text(json.dumps({"s3": {"max_attempts": 2, "connect_timeout_s": 1}}))
        extra, env = ["--config", str(tmp_path / "s3.json")], {"AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    elif name == "another run at the prefix":
        out, extra = local_run, ["--layers", "1", "--shard-bytes", "4MB"]
    elif name == "output path under a file":
        (tmp_path / "file").write_text("not a folder")
        out = str(tmp_path / "file" / "run")
    elif name == "unwritable output":
        out = _unwritable(tmp_path)
    before = objects(out) if name not in ("bucket missing", "output path under a file", "unwritable output") else []
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.delenv(k, raising=False) if v is None else m.setenv(k, v)
        argv = job["args"](out, *extra)
        if name == "unknown codec":
            del argv[argv.index("--codec"): argv.index("--codec") + 2]  # flags win over the config file
        code = cli(argv)
    err = capsys.readouterr().err
    assert code == (5 if name == "wrong endpoint" else 2), err  # 5: a store that did not answer, as status says
    assert "error: " in err and "Traceback" not in err, err
    message = err[err.rindex("error: "):]  # the last thing printed: progress bars come before it
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    if name in ("bucket missing", "no credentials", "wrong endpoint"):
        assert "Loading weights" not in err  # refused before the model loads (minutes for a 27B model)
    if name == "bucket missing":
        assert "layertap-no-such-bucket" not in [b["Name"] for b in boto3.client("s3").list_buckets()["Buckets"]]
    elif name in ("output path under a file", "unwritable output"):
        assert not Path(out).exists()
    else:
        assert objects(out) == before
    if out == local_run:
        assert run_status(open_store(local_run))["complete"]


def test_argparse_refuses_an_unknown_codec_before_anything_runs(job, capsys):
    with pytest.raises(SystemExit) as e:
        cli(job["args"]("/nonexistent/run", "--codec", "zip"))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --codec: invalid choice: 'zip'" in err and "bf16-zstd" in err


def test_empty_and_overlong_samples_are_skipped_or_cut_with_reasons_not_fatal(job, tmp_path, capsys):
    """Per-sample problems must not stop a run over a million conversations: an empty sample and
    one with nothing to learn within --max-length are skipped with their reason in the commit; an
    overlong sample is cut to --max-length and counted; status shows the skips; exit code 0."""
    rows = [{"id": "ok", "input_ids": list(range(1, 41)), "loss_mask": [0] * 8 + [1] * 32},
            {"id": "empty", "input_ids": [], "loss_mask": []},
            {"id": "long", "input_ids": [5] * 300, "loss_mask": [1] * 300},
            {"id": "late", "input_ids": [5] * 300, "loss_mask": [0] * 280 + [1] * 20}]
    out = str(tmp_path / "run")
    assert cli(job["args"](out, "--dataset", jsonl(tmp_path / "rows.jsonl", rows), "--max-length", "256",
                           "--batch-tokens", "1024")) == 0
    printed = capsys.readouterr().out
    store = open_store(out)
    commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
    skipped = {s["sample_id"]: s for c in commits for s in c.skipped}
    assert {k: v["reason"] for k, v in skipped.items()} == {"1-empty": "empty", "3-late": "answer_past_max_length"}
    assert "within max_length=256: the first pair is tokens 280 and 281 (--max-length 282 or more keeps it)" in skipped["3-late"]["detail"]
    assert sorted(i for c in commits for i in c.sample_ids) == ["0-ok", "2-long"]
    assert sum(c.truncated for c in commits) == 1
    assert ShardStream(out, config=StreamConfig(shuffle=False)).__iter__().__next__()["input_ids"].numel() in (40, 256)
    status = run_status(store)
    assert status["complete"] and (status["samples_done"], status["samples_skipped"]) == (2, 2)
    assert "2/2 stored (of 4 rows: the plan found 2 yield no sample), 2 skipped" in printed


def rewrite_shard(store, shard: int, *, version: int | None = None, head: tuple[bytes, bytes] | None = None) -> str:
    """Change a committed shard as a newer layertap could have written it (another format version,
    another codec in the header) with every hash made consistent again: intact, not corrupt."""
    ckey = layout.commit_key(shard)
    commit = json.loads(store.get(ckey))
    data = bytearray(store.get(commit["data_key"]))

    def rehash_frame(offset: int, edit=lambda payload: payload) -> None:
        n = FRAME.unpack_from(data, offset)[1]
        start = offset + FRAME.size
        payload = edit(bytes(data[start : start + n]))
        assert len(payload) == n
        data[start : start + n] = payload
        struct.pack_into("<Q", data, offset + 12, xxhash.xxh3_64_intdigest(payload))

    if version is not None:
        struct.pack_into("<I", data, 8, version)
    if head is not None:
        rehash_frame(PREAMBLE.size, lambda payload: payload.replace(*head))
    footer = TRAILER.unpack_from(data, len(data) - TRAILER.size)[0]
    old = json.loads(data[footer + FRAME.size : len(data) - TRAILER.size])["content_xxh3_128"]
    new = xxhash.xxh3_128_hexdigest(bytes(data[:footer]))
    rehash_frame(footer, lambda payload: payload.replace(old.encode(), new.encode()))
    store.put(commit["data_key"], bytes(data))
    store.put(ckey, json.dumps(dict(commit, xxh3_128=xxhash.xxh3_128_hexdigest(bytes(data)))).encode())
    return commit["data_key"]


BAD_STORE = [  # name, what the loader raises (type, fragments), `layertap verify`: exit code, fragments
    ("corrupted shard", (ShardError, "shard 1 ", "checksum mismatch", "run `layertap verify "),
     (1, "WITHDRAWN shard 1", "checksum mismatch", "the next `layertap extract` redoes it")),
    ("truncated shard", (ShardError, "shard 1 ", "shorter than its commit says", "run `layertap verify "),
     (1, "WITHDRAWN shard 1", "truncated", "the next `layertap extract` redoes it")),
    ("shard of a newer format version", (UnsupportedShard, "format version 9 is not supported", "upgrade layertap"),
     (2, "format version 9 is not supported", "upgrade layertap")),
    ("shard with an unknown codec", (UnsupportedShard, "codec 'zf16' is not known", "upgrade layertap"),
     (2, "codec 'zf16' is not known", "upgrade layertap")),
    ("manifest from another run", (ShardError, "the object says run", "the commit says run 'f00000000000'"),
     (2, "but the manifest is run 'f00000000000'", "restore the run's own manifest.json")),
    ("manifest of a newer version", (ManifestError, "manifest version 2", "use a matching layertap release"),
     (2, "manifest version 2", "use a matching layertap release")),
    ("commit record of a newer version", (ManifestError, "commit record version 2", "use a matching layertap release"),
     (2, "commit record version 2", "use a matching layertap release")),
]


@pytest.mark.parametrize("name,loader,verify", BAD_STORE, ids=[c[0] for c in BAD_STORE])
def test_bad_stored_objects_are_refused_with_the_fix_and_never_lost(name, loader, verify, job, local_run, tmp_path,
                                                                    capsys):
    """Damage is refused by the loader, withdrawn by `layertap verify` (status then shows the
    shard failed, and a rerun of the extraction redoes it); what a newer layertap wrote, or a run
    whose manifest is not its own, is refused by both with the fix, and nothing is changed."""
    run = str(tmp_path / "run")
    shutil.copytree(local_run, run)
    store = open_store(run)
    want = record_hashes(store)
    commit = decode_commit(store.get(layout.commit_key(1)), "commit")
    data = store.get(commit.data_key)
    if name == "corrupted shard":
        entry = ShardReader(store, commit.data_key).entries[0]
        store.put(commit.data_key, data[: entry.offset + 40] + bytes([data[entry.offset + 40] ^ 1])
                  + data[entry.offset + 41 :])
    elif name == "truncated shard":
        store.put(commit.data_key, data[:-100])
    elif name == "shard of a newer format version":
        rewrite_shard(store, 1, version=9)
    elif name == "shard with an unknown codec":
        rewrite_shard(store, 1, head=(b'"codec": "bf16"', b'"codec": "zf16"'))
    elif name == "manifest from another run":
        manifest = json.loads(store.get(layout.MANIFEST))
        store.put(layout.MANIFEST, json.dumps(dict(manifest, run_id="f00000000000")).encode())
    elif name == "manifest of a newer version":
        manifest = json.loads(store.get(layout.MANIFEST))
        store.put(layout.MANIFEST, json.dumps(dict(manifest, format_version=2)).encode())
    elif name == "commit record of a newer version":
        store.put(layout.commit_key(1), json.dumps(dict(json.loads(store.get(layout.commit_key(1))),
                                                        version=2)).encode())
    before = objects(run)

    error, *fragments = loader
    with pytest.raises(error) as e:
        for _ in ShardStream(run, config=StreamConfig(range_bytes=MiB)):
            pass
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)

    code, *fragments = verify
    assert cli(["verify", run]) == code
    printed = capsys.readouterr()
    for fragment in fragments:
        assert fragment in (printed.out if code == 1 else printed.err), printed
    if code == 2:  # refused: not one object changed, not one shard withdrawn (the loader's derived index aside)
        def data(objs):
            return [o for o in objs if o[0] != layout.COMMIT_INDEX]
        assert data(objects(run)) == data(before) and "Traceback" not in printed.err
        return
    status = run_status(store)
    assert status["shards_failed"] == 1 and status["failed"][0]["shard"] == 1
    assert "VerifyFailed" in status["failed"][0]["error"] and not status["complete"]
    assert cli(job["args"](run, "--shard-bytes", "4MB")) == 0
    assert_complete_and_clean(store, want)


# -- security --------------------------------------------------------------------------------------

DATA_PATH = ("storage", "manifests", "extract", "train")
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve"}


def pickle_uses(source: str, filename: str = "<source>") -> list[str]:
    """Where `source` imports a pickling module, calls torch.load without weights_only=True, or
    loads numpy arrays with allow_pickle=True."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "load" for a in node.names):
            found.append(f"{where}: from torch import load")
        elif isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            kw = {k.arg: k.value for k in node.keywords}
            safe = isinstance(kw.get("weights_only"), ast.Constant) and kw["weights_only"].value is True
            if name in ("torch.load", "torch.serialization.load") and not safe:
                found.append(f"{where}: {name} without weights_only=True")
            allow = kw.get("allow_pickle")
            if allow is not None and not (isinstance(allow, ast.Constant) and allow.value is False):
                found.append(f"{where}: {name}(allow_pickle=...)")
    return found


def test_no_pickle_on_the_data_path():
    """Activations, records, manifests and checkpoints are read without ever unpickling: a file
    from the store can carry data, never code."""
    for bad in ("import pickle", "import dill as d", "from cloudpickle import loads", "torch.load(f)",
                "torch.load(f, weights_only=False)", "from torch import load", "np.load(f, allow_pickle=True)"):
        assert pickle_uses(bad), f"the check misses {bad!r}"
    assert pickle_uses("torch.load(f, weights_only=True)\nnp.load(f)") == []
    root = Path(__file__).resolve().parents[1]
    files = sorted(p for package in DATA_PATH for p in (root / package).rglob("*.py"))
    assert len(files) > 20
    found = [hit for p in files for hit in pickle_uses(p.read_text(), str(p.relative_to(root)))]
    assert found == [], "pickle on the data path:\n" + "\n".join(found)


FAKE_KEYS = {"AWS_ACCESS_KEY_ID": "AKIALAYERTAPFAKE0001", "AWS_SECRET_ACCESS_KEY": "layertapFakeSecret/DoNotLeak+1",
             "AWS_SESSION_TOKEN": "layertapFakeSessionToken0123456789"}


def test_credentials_appear_in_no_output_log_record_or_error(job, s3_bucket, tmp_path):
    """Recognisable fake keys, debug logging on: the extraction's console and log files, status
    (text and JSON), verify, inspect, an error message, and every object written to the store
    (manifest, commits, tallies, shard headers) hold none of them."""
    forked_cli.warm()
    run, logs = f"s3://{s3_bucket}/secrets", tmp_path / "logs"
    commands = [
        ["-v", *job["args"](run, "--limit", "6", "--log-dir", str(logs))],
        ["-v", "status", run], ["status", run, "--json"], ["verify", run],
        ["-v", "extract", "--out", "s3://layertap-no-such-bucket/run", "--model", job["model"],
         "--dataset", job["data"], "--layers", "0,1", "--log-dir", str(logs)],
    ]
    codes = []
    for i, argv in enumerate(commands):
        proc = forked_cli.start(argv, tmp_path / f"out-{i}.txt", env=FAKE_KEYS)
        proc.join(300)
        codes.append(proc.exitcode)
    store = open_store(run)
    shard = next(o.key for o in store.list(layout.SHARDS))
    proc = forked_cli.start(["inspect", f"{run}/{shard}"], tmp_path / "out-inspect.txt", env=FAKE_KEYS)
    proc.join(120)
    assert codes == [0, 0, 0, 0, 2] and proc.exitcode == 0, codes
    assert "bucket 'layertap-no-such-bucket' does not exist" in (tmp_path / "out-4.txt").read_text()
    outputs = {str(p): p.read_bytes() for p in [*tmp_path.glob("out-*.txt"), *logs.iterdir()]}
    outputs.update({f"{run}/{o.key}": o.key.encode() + store.get(o.key) for o in store.list()})
    assert len(outputs) >= 10
    assert b"INFO botocore.credentials: Found credentials in environment variables" in outputs[str(tmp_path / "out-0.txt")]
    for where, text in outputs.items():
        for name, secret in FAKE_KEYS.items():
            assert secret.encode() not in text, f"{name} appears in {where}"


def test_sample_ids_and_shard_names_never_become_paths_outside_the_output(job, local_run, tmp_path, capsys):
    """Row ids shaped like paths are stored as clean ids and create nothing anywhere; a commit
    record pointing outside the run is refused as corrupt by the loader, withdrawn by verify
    (the file it names is neither read nor deleted) and redone by the next extraction."""
    nasty = ["../../../../tmp/evil", "/etc/passwd", "a/../../b", "..", "C:\\\\x\\\\y", "nul\x00byte", "~/x", "x" * 300]
    rows = [{"id": sid, "input_ids": [1 + i, 2, 3, 4], "loss_mask": [0, 1, 1, 1]} for i, sid in enumerate(nasty)]
    watched = tmp_path / "watched"
    (watched / "out").mkdir(parents=True)
    data = jsonl(tmp_path / "nasty.jsonl", rows)
    before = {p for p in tmp_path.rglob("*")}
    assert cli(job["args"](str(watched / "out"), "--dataset", data, "--log-dir", str(watched / "out" / "logs"))) == 0
    created = {p for p in tmp_path.rglob("*")} - before
    assert created and all(watched / "out" in p.parents for p in created)
    store = open_store(str(watched / "out"))
    ids = [i for o in store.list(layout.COMMITS) for i in decode_commit(store.get(o.key), o.key).sample_ids]
    assert len(ids) == len(nasty)
    assert all(re.fullmatch(r"\d+-[A-Za-z0-9._-]{1,40}", i) for i in ids), ids

    run = str(tmp_path / "run")
    shutil.copytree(local_run, run)
    victim = tmp_path / "outside.lts"
    victim.write_bytes(b"not layertap's to read or delete")
    store = open_store(run)
    want = record_hashes(store)
    record = json.loads(store.get(layout.commit_key(2)))
    store.put(layout.commit_key(2), json.dumps(dict(record, data_key="../outside.lts")).encode())
    with pytest.raises(ManifestError, match=r"corrupt commit record \(data_key '../outside.lts'.*layertap verify"):
        ShardStream(run)
    assert cli(["verify", run]) == 1
    assert "WITHDRAWN shard 2" in capsys.readouterr().out
    assert victim.read_bytes() == b"not layertap's to read or delete"
    assert cli(job["args"](run, "--shard-bytes", "4MB")) == 0
    assert_complete_and_clean(store, want)


def test_a_commit_record_naming_another_shard_is_corrupt_not_read_twice(job, local_run, tmp_path, capsys):
    """Shard 3's commit key holding shard 2's record (a copy gone wrong, a hand edit) was read as
    shard 3 committed with shard 2's object: the loader read 2 twice and 3 never. It is refused as
    corrupt, withdrawn by verify, and redone by the next extraction."""
    run = str(tmp_path / "run")
    shutil.copytree(local_run, run)
    store = open_store(run)
    want = record_hashes(store)
    store.put(layout.commit_key(3), store.get(layout.commit_key(2)))
    with pytest.raises(ManifestError, match=r"commits/000003.json: corrupt commit record \(it names shard 2, its key "
                                            r"shard 3\).*layertap verify"):
        ShardStream(run)
    assert cli(["verify", run]) == 1
    assert "WITHDRAWN shard 3" in capsys.readouterr().out
    assert cli(job["args"](run, "--shard-bytes", "4MB")) == 0
    assert_complete_and_clean(store, want)


def test_a_claim_rides_out_a_store_failing_its_lease_requests(s3_endpoint, s3_bucket):
    """The claim's own requests (the lease's create, the commit HEAD, the lease listing) ride out
    an outage as the scans do: a 503 there, past the store's retries, ended the worker (and with
    srun's --kill-on-bad-exit its node's others). A create that the store applied but whose answer
    was lost ('reset-after') is found on the retry and is this claim's own: the shard is claimed
    once, under that one lease, not left to go stale behind a second try."""
    from layertap.manifests.records import Producer
    from layertap.manifests.state import scan
    from layertap.manifests.work import WorkQueue

    prefix = f"s3://{s3_bucket}/claim-outage"
    manifest = fake_worker.plan(open_store(prefix))
    lease_put = lambda method, path: method == "PUT" and "/leases/" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("503", "reset-after"), match=lease_put, limit=2,
                    in_turn=True) as proxy:
        store = open_store(prefix, endpoint_url=proxy.url, max_attempts=1)
        claim = next(iter(WorkQueue(store, manifest, Producer.current(), poll_s=0.05, retries=0)))
        assert (proxy.counts["503"], proxy.counts["reset-after"]) == (1, 1)
    leases = scan(open_store(prefix), manifest).leases[claim.shard]
    assert [lease.key for lease in leases] == [claim.lease_key]  # the applied create is this claim's


    def after_the_lease(method: str, path: str, wanted: str) -> bool:
        """The claim's own requests of that kind: those after its lease's create (the scans
        before it make their own, and ride out faults on their own)."""
        if method == "PUT" and "/leases/" in path:
            leased.append(path)
        return bool(leased) and method in ("HEAD", "GET") and wanted in path

    for wanted in ("/commits/", "prefix=claim-outage%2Fleases%2F"):
        leased: list[str] = []
        match = lambda method, path: after_the_lease(method, path, wanted)  # noqa: E731
        with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), match=match, limit=2) as proxy:
            store = open_store(prefix, endpoint_url=proxy.url, max_attempts=1)
            other = next(iter(WorkQueue(store, manifest, Producer.current(), poll_s=0.05, retries=0)))
            assert other.shard != claim.shard and proxy.counts["503"] == 2


def test_a_worker_rides_out_a_store_throttling_past_its_retries(s3_endpoint, s3_bucket):
    """A store throttling longer than a request's own retries (here: one try) is an outage, not
    the worker's end nor the shard's fault: the queue looks again after a pause and claims, and a
    commit failing that way is recorded as an attempt stopped from outside, not counted against
    --retries (two such bursts gave a shard up, with every worker's rescans making the bursts)."""
    from layertap.manifests.state import scan
    from layertap.manifests.records import Producer
    from layertap.manifests.work import WorkQueue
    from layertap.storage.store import TransientStoreError

    prefix = f"s3://{s3_bucket}/throttled"
    manifest = fake_worker.plan(open_store(prefix))
    is_list = lambda method, path: method == "GET" and "list-type=2" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), match=is_list, limit=3) as proxy:
        store = open_store(prefix, endpoint_url=proxy.url, max_attempts=1)
        queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.05, retries=0)
        claim = next(iter(queue))  # raised TransientStoreError (SlowDown) out of the scan before
        assert proxy.counts["503"] == 3
    with claim:
        claim.fail(TransientStoreError("put of commits/000000.json failed: SlowDown (tried 8 times)"))
    (key,) = scan(open_store(prefix), manifest).failures[claim.shard]
    assert key.endswith(layout.STOPPED)
    assert next(iter(WorkQueue(open_store(prefix), manifest, Producer.current(), retries=0))).shard == claim.shard
