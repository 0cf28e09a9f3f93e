"""A stand-in extraction worker for manifest tests: real leases, shards and commits, synthetic
activations (deterministic per sample index), run as a real process.

    python tests/fake_worker.py PREFIX --rank R [--ttl S] [--fail-shard N] [--hang-shard N] [--slow S]
                                [--samples N] [--window BYTES]

`--window`: the storage window, as `layertap extract --window` applies it (manifests.consumption.
WindowGate before each claim, polling faster than the real worker's 2 s so tests stay short).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from layertap.manifests.consumption import WindowGate
from layertap.manifests.manifest import create_or_resume
from layertap.manifests.records import Producer
from layertap.manifests.work import WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.records import Sample
from layertap.storage.writer import ShardWriter
from layertap.storage.store import open_store

LAYERS, HIDDEN = [0, 2], 32
CONFIG = {"model": "synthetic", "layers": LAYERS, "codec": "bf16-zstd", "max_length": 64, "final_state": "none"}
DATASET = {"fingerprint": "synthetic-v1", "path": "synthetic"}


def token_counts(n: int) -> list[int]:
    return [5 + i % 7 for i in range(n)]


def make_sample(i: int) -> Sample:
    n = token_counts(i + 1)[i]
    g = torch.Generator().manual_seed(i)
    return Sample(f"s{i:05d}", torch.arange(n) + i, torch.ones(n, dtype=torch.uint8),
                  torch.randn(n, len(LAYERS), HIDDEN, generator=g).to(torch.bfloat16))


def plan(store, samples: int = 40, shard_bytes: int = 4000):
    return create_or_resume(store, config=CONFIG, dataset=DATASET, token_counts=token_counts(samples),
                            bytes_per_token=len(LAYERS) * HIDDEN * 2 / 1.3, shard_bytes=shard_bytes)[0]


def work(prefix: str, rank: int = 0, world: int = 1, ttl: float = 60.0, fail_shard: int = -1,
         hang_shard: int = -1, slow: float = 0.0, shards: list[int] | None = None, samples: int = 40,
         window: int | None = None) -> list[int]:
    """Extract every shard this worker can claim; returns the ids it committed."""
    store = open_store(prefix)
    manifest = plan(store, samples)
    done = []
    gate = WindowGate(store, window, poll_s=0.05, max_poll_s=0.2) if window is not None else None
    queue = WorkQueue(store, manifest, Producer.current(rank), ttl_s=ttl, world_size=world, shards=shards,
                      poll_s=0.2, before_claim=gate)
    for claim in queue:
        try:
            with claim:
                meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic",
                                 layers=LAYERS, hidden_size=HIDDEN, codec="bf16-zstd")
                with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                    for i in range(claim.plan.start, claim.plan.end):
                        if claim.shard == fail_shard:
                            raise RuntimeError(f"injected failure in shard {claim.shard}")
                        if claim.shard == hang_shard:
                            print(f"hanging in shard {claim.shard}", flush=True)
                            time.sleep(3600)
                        w.write_sample(make_sample(i))
                        time.sleep(slow)
                    info = w.close()
                if claim.commit(info):
                    done.append(claim.shard)
        except RuntimeError:
            continue  # recorded as a failure by the claim; go on with other shards
    return done


def copy_run(src: str, dst: str) -> None:
    """Every object of the run at `src` put under `dst`, as `aws s3 sync` or `cp -r` copies one:
    how a run comes to lie inside another's prefix, where layertap plans none."""
    source, target = open_store(src), open_store(dst)
    for o in source.list():
        target.put(o.key, source.get(o.key))


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("prefix")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--ttl", type=float, default=60.0)
    p.add_argument("--fail-shard", type=int, default=-1)
    p.add_argument("--hang-shard", type=int, default=-1)
    p.add_argument("--slow", type=float, default=0.0)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--window", type=int, default=None)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    committed = work(a.prefix, a.rank, a.world, a.ttl, a.fail_shard, a.hang_shard, a.slow, samples=a.samples,
                     window=a.window)
    print("committed", " ".join(map(str, committed)), flush=True)
