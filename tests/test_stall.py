"""A worker that hangs while it holds a shard (a faulted GPU, a kernel or a call that never
returns): its heartbeat thread kept renewing the lease, so the shard was never taken over and the
run never ended. Past --stall-timeout without progress it stops renewing, and `extract` dumps every
thread's stack and exits 6. Real stores (a folder, moto over HTTP) and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fake_worker
from layertap.manifests import layout
from layertap.manifests.records import Producer
from layertap.manifests.work import WorkQueue
from layertap.storage.store import open_store
from test_extract import write_chats
from test_user_paths import committed_ids, extract_args
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def _watched(store_uri: str) -> tuple[WorkQueue, list[tuple[float, int]]]:
    """A queue on a planned run with a 1 s stall timeout, and the stalls it tells of."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=16)
    stalls: list[tuple[float, int]] = []
    return WorkQueue(store, manifest, Producer.current(0), ttl_s=2.0, stall_s=1.0, poll_s=0.05,
                     on_stall=lambda seconds, shard: stalls.append((seconds, shard))), stalls


def test_a_worker_without_progress_stops_renewing_and_its_shard_is_taken_over(store_uri):
    hung, stalls = _watched(store_uri)
    claim = next(iter(hung))
    with pytest.raises(RuntimeError), claim:
        assert claim.lost.wait(30), "the lease was renewed on and on without progress"
        [(seconds, shard)] = stalls  # told once, by the first heartbeat to see it
        assert seconds >= 1.0 and shard == claim.shard
        other = WorkQueue(hung.store, hung.manifest, Producer.current(1), ttl_s=2.0, poll_s=0.05, shards=[claim.shard])
        taken = next(iter(other))  # while the hung one still holds it: its lease went stale
        with taken:
            assert taken.shard == claim.shard and taken.generation == claim.generation + 1
        taken.release()
        raise RuntimeError("the hung attempt, woken at last, finds its lease gone")
    assert len(stalls) == 1


def test_a_worker_that_makes_progress_keeps_its_lease_past_the_stall_timeout(store_uri):
    queue, stalls = _watched(store_uri)
    claim = next(iter(queue))
    with claim:
        deadline = time.monotonic() + 3.0  # three stall timeouts, one progress every 0.2 s
        while time.monotonic() < deadline:
            queue.progress()
            time.sleep(0.2)
        assert not claim.lost.is_set() and not stalls
    claim.release()


HANG = """
import os, sys, time
from transformers.models.llama import modeling_llama

forward = modeling_llama.LlamaDecoderLayer.forward

def hanging_forward(self, *args, **kwargs):
    while os.path.exists(sys.argv[1]):  # a forward that never returns, as on a faulted GPU
        time.sleep(0.1)
    return forward(self, *args, **kwargs)

modeling_llama.LlamaDecoderLayer.forward = hanging_forward
from layertap.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_extract_hung_in_a_forward_dumps_its_stacks_exits_6_and_a_rerun_takes_its_shard_at_once(tmp_path):
    model = tiny_model_dir(tmp_path, "llama")
    data = write_chats(tmp_path / "chats.jsonl", 12)
    out, logs, flag = tmp_path / "run", tmp_path / "logs", tmp_path / "hang"
    argv = extract_args(model, data, out, logs)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    flag.touch()
    hung = subprocess.run([sys.executable, "-c", HANG, str(flag), *argv, "--stall-timeout", "3"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert hung.returncode == 6, hung.stderr[-3000:]
    assert "has made no progress for" in hung.stderr and "--stall-timeout 3" in hung.stderr
    assert "exiting 6: every thread's stack follows" in hung.stderr
    for where in (hung.stderr, (logs / "extract-rank0.log").read_text()):  # the stuck frame, on both
        assert "Thread 0x" in where or "Current thread" in where, where[-3000:]
        assert "hanging_forward" in where
    store = open_store(str(out))
    assert list(store.list(layout.LEASES)) and not list(store.list(layout.COMMITS))  # it held a shard, none done

    flag.unlink()
    started = time.monotonic()
    rerun = subprocess.run([sys.executable, "-m", "layertap", *argv], capture_output=True, text=True, env=env,
                           timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "has exited: taking the shard over now" in (logs / "extract-rank0.log").read_text()  # not a ttl later
    ids = committed_ids(store)
    assert len(ids) == 12 and set(ids.values()) == {1}
    assert not list(store.list(layout.LEASES))
    assert time.monotonic() - started < 300
