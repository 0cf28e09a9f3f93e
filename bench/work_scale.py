"""Requests a large run costs its workers, submit and trainer ranks, side by side in one run.

A synthetic run of `--shards` shards (the real manifest, commit records, tally and feed keys,
live leases of other workers) in a local folder; store calls are counted, LIST pages as S3 would
serve them (1,000 keys a page). Measured side by side:

- a worker's pass: the full scan every pass made before `CommitView` vs its look between full
  looks (the feed keys since the last pass);
- a trainer rank's start: reading the commits itself vs taking rank 0's (`committed=`);
- what a rank holds of the run's shards (every rank holds them all): each shard's sample ids
  (before) vs their digest, as JSON handed over and as Python objects (tracemalloc);
- `submit extract`: matching queued static tasks to the remaining shards by range vs shard by shard.

    python bench/work_scale.py --shards 20000 --json docs/bench/work_scale.json
    python bench/work_scale.py --shards 20000 --samples-per-shard 45  # 900K samples, the BRIEF's dataset
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import threading
import time
import tracemalloc
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

from layertap.manifests import layout
from layertap.manifests.manifest import create_or_resume
from layertap.manifests.records import CommitRecord, Producer, decode_commit, encode
from layertap.manifests.state import scan
from layertap.manifests.work import CommitView
from layertap.slurm.queued import QueuedTask, leave_to_queued
from layertap.slurm.work import Remaining
from layertap.storage.local import LocalStore
from layertap.storage.store import open_store
from layertap.train.fetch import CommittedShard
from layertap.train.stream import ShardStream


class Counted:
    """Store calls of every LocalStore, LIST pages counted as S3 serves them."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        real_list, real_get = LocalStore.list, LocalStore.get
        counted = self

        def listing(store, prefix: str = "", start_after: str = ""):
            found = list(real_list(store, prefix, start_after))
            with counted._lock:
                counted.calls["LIST pages"] += max(1, math.ceil(len(found) / 1000))
            return iter(found)

        def get(store, key: str) -> bytes:
            with counted._lock:
                counted.calls["GET"] += 1
            return real_get(store, key)

        LocalStore.list, LocalStore.get = listing, get

    def measure(self, what) -> dict:
        self.calls.clear()
        t = time.perf_counter()
        what()
        return {"s": round(time.perf_counter() - t, 3), **self.calls}


def make_run(uri: str, shards: int, done: float, leased: int, per_shard: int) -> None:
    store = open_store(uri)
    manifest, _ = create_or_resume(store, config={"model": "synthetic", "layers": [1, 2], "codec": "bf16-zstd",
                                                  "max_length": 64, "final_state": "none"},
                                   dataset={"fingerprint": "f"}, token_counts=[100] * (shards * per_shard),
                                   bytes_per_token=1.0, shard_bytes=100 * per_shard)
    producer = asdict(Producer.current(0))
    committed = int(shards * done)
    now = int(time.time() * 1000)

    def commit(s: int) -> None:
        plan = manifest.shards[s]
        key = layout.data_key(s, uuid.uuid4().hex[:20])
        store.put(key, b"")
        store.put(layout.commit_key(s), encode(CommitRecord(
            shard=s, data_key=key, bytes=1, xxh3_128=uuid.uuid4().hex, num_records=plan.num_samples,
            num_tokens=100 * plan.num_samples, raw_bytes=2, sample_ids=[f"s{i:09d}" for i in range(plan.start, plan.end)],
            skipped=[], truncated=0, relative_error=0.0, producer=producer, attempt=1, started_at=0.0,
            committed_at=time.time())))
        store.put(layout.tally_key(s, plan.num_samples, 100 * plan.num_samples, 1, 2, 0, 0), b"")
        store.put(layout.feed_key(now - (committed - s) * 20, s, plan.num_samples, 0), b"")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(commit, range(committed), chunksize=256))
        list(pool.map(lambda s: store.put(layout.lease_key(s, 1, 600), b"{}"), range(committed, committed + leased)))


def held(records_json: str, build) -> dict:
    """A rank's shard list built from the JSON handed to it: the JSON's MiB and the list's (traced
    Python allocations that outlive the parse)."""
    def make():
        return [build(r) for r in json.loads(records_json)]

    tracemalloc.start()
    shards = make()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del shards
    return {"json_MiB": round(len(records_json) / 2**20, 2), "held_MiB": round(kept / 2**20, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=20_000)
    p.add_argument("--done", type=float, default=0.9, help="fraction of the shards committed")
    p.add_argument("--leased", type=int, default=500, help="shards under other workers' live leases")
    p.add_argument("--tasks", type=int, default=1000, help="static tasks queued, for submit's matching")
    p.add_argument("--samples-per-shard", type=int, default=9)
    p.add_argument("--json", help="write the result here")
    args = p.parse_args()
    counted = Counted()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        make_run(tmp, args.shards, args.done, args.leased, args.samples_per_shard)
        built = time.perf_counter() - t
        store = open_store(tmp)
        from layertap.manifests.manifest import load_manifest

        manifest = load_manifest(store)
        view = CommitView(store, manifest)
        view.scan()
        result = {
            "shards": args.shards, "samples_per_shard": args.samples_per_shard,
            "committed": int(args.shards * args.done), "leased": args.leased,
            "built_s": round(built, 1),
            "worker_pass": {"full scan (every pass before)": counted.measure(
                                lambda: scan(store, manifest, with_tallies=False)),
                            "CommitView between full looks": counted.measure(view.scan)},
        }
        first = ShardStream(tmp, rank=0, world_size=2)
        first.refresh_index()  # as `layertap train` does on rank 0: the others find the commit index
        records = json.loads(json.dumps(first.shard_records))
        result["trainer_rank_start"] = {
            "reads the commits itself (before)": counted.measure(lambda: ShardStream(tmp, rank=1, world_size=2)),
            "takes rank 0's (committed=)": counted.measure(
                lambda: ShardStream(tmp, rank=1, world_size=2, committed=records)),
        }
        ids = {c.shard: c.sample_ids for c in (decode_commit(store.get(o.key), o.key)
                                                for o in store.list(layout.COMMITS))}
        with_ids = json.dumps([[*r[:4], ids[r[0]]] for r in records])  # what ranks were handed before
        result["rank_holds"] = {
            "every sample id (before)": held(with_ids, lambda r: (int(r[0]), r[1], int(r[2]), r[3], tuple(r[4]))),
            "a digest of each shard's ids": held(json.dumps(records), lambda r: CommittedShard(
                int(r[0]), r[1], int(r[2]), r[3], int(r[4]), r[5])),
        }
    todo = list(range(args.shards))
    per_task = max(1, args.shards // args.tasks)
    queued = [QueuedTask(f"7_{i}", per_task, None) for i in range(args.tasks)]
    remaining = Remaining(run_id="r", total=args.shards, selected=None, done=0, running=[], failed=[],
                          interrupted=[], todo=todo, leases={})

    def shard_by_shard() -> None:  # what leave_to_queued did before: every shard against every task
        static = [t for t in queued if any(t.owns(s) for s in todo)]
        [s for s in todo if any(t.owns(s) for t in static)]

    result["submit_queued_static"] = {
        "tasks": args.tasks,
        "shard by shard (before)": counted.measure(shard_by_shard),
        "by range (now)": counted.measure(lambda: leave_to_queued(remaining, queued)),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "command": "python bench/work_scale.py "
                       f"--shards {args.shards} --samples-per-shard {args.samples_per_shard} --done {args.done} "
                       f"--leased {args.leased} --tasks {args.tasks}",
                       **result}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
