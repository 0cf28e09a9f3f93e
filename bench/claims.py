"""What claiming a shard costs a worker in a large run: store requests and seconds per claim.

    python bench/claims.py [--samples 913786] [--committed 10000] [--claims 30] [--endpoint URL]
                           [--write-docs]

Plans the 913,786-sample run (25,412 shards of 1 GB), writes synthetic commit records for the
first `--committed` shards as earlier workers would have, then lets one worker (rank 3 of 8)
claim and commit `--claims` shards through `WorkQueue`, counting the store requests by kind. On a 27B target a 1 GB shard is ~28,000 tokens, about 4 s of one H200: a claim
must cost far less than that, and its requests must not grow with the size of the run.
Without --endpoint a moto server is started; with it, that server (e.g. radosgw from .ci/rgw.sh).
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402

from bench._report import cpu_s, machine, write_section  # noqa: E402
from layertap.manifests import layout  # noqa: E402
from layertap.manifests.manifest import create_or_resume  # noqa: E402
from layertap.manifests.records import CommitRecord, Producer, encode  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.writer import ShardInfo  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.s3server import bench_server  # noqa: E402

def count_requests(store) -> Counter:
    """S3 requests the store's client sends from now on, by operation (each listing page counts)."""
    calls: Counter = Counter()
    store.client.meta.events.register("before-call.s3", lambda model, **_: calls.update([model.name]))
    return calls


def plan_large_run(endpoint: str, samples: int, bucket_prefix: str):
    """(store, manifest) of a new run in a new bucket of `endpoint`: `samples` of ~800 tokens (a
    ShareGPT-like spread) planned as shards of 1 GB of a 27B target's states."""
    rng = random.Random(0)
    counts = [max(16, int(rng.gauss(800, 300))) for _ in range(samples)]
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    bucket = f"{bucket_prefix}-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=bucket)
    store = open_store(f"s3://{bucket}/run", threads=32)
    manifest, _ = create_or_resume(store, config={"model": "synthetic-27b", "layers": [1, 16, 31, 46, 61],
                                                  "codec": "bf16-zstd"},
                                   dataset={"fingerprint": "synthetic"}, token_counts=counts,
                                   bytes_per_token=51_200 / 1.45, shard_bytes=1_000_000_000)
    return store, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=913_786)
    ap.add_argument("--committed", type=int, default=10_000)
    ap.add_argument("--claims", type=int, default=30)
    ap.add_argument("--endpoint", help="the S3 server to measure (credentials from env); default: a moto server")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    command = shlex.join(["python", "bench/claims.py", *sys.argv[1:]])

    with bench_server(args.endpoint) as server:
        store, manifest = plan_large_run(server.endpoint, args.samples, "bench-claims")
        producer = Producer.current()

        def info(plan) -> ShardInfo:
            raw = plan.est_tokens * 51_200
            return ShardInfo(key="", bytes=int(raw / 1.45), xxh3_128="0" * 32, num_records=plan.num_samples,
                             num_tokens=plan.est_tokens, raw_bytes=raw,
                             sample_ids=[str(i) for i in range(plan.start, plan.end)], relative_error=None)

        def commit(plan):  # what an earlier worker left: a commit record and its tally
            i = info(plan)
            rec = CommitRecord(shard=plan.id, data_key=layout.data_key(plan.id, "bench"), bytes=i.bytes,
                               xxh3_128=i.xxh3_128, num_records=i.num_records, num_tokens=i.num_tokens,
                               raw_bytes=i.raw_bytes, sample_ids=i.sample_ids, producer=asdict(producer), attempt=1,
                               started_at=0.0, committed_at=time.time())
            store.put_if_absent(layout.commit_key(plan.id), encode(rec))
            store.put(layout.tally_key(plan.id, i.num_records, i.num_tokens, i.bytes, i.raw_bytes, 0), b"")

        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(commit, manifest.shards[: args.committed]))
        setup_s = time.perf_counter() - t0

        calls = count_requests(store)
        queue = WorkQueue(store, manifest, Producer.current(rank=3), world_size=8)
        per_claim, claimed = [], []
        t0, c0, s0 = time.perf_counter(), cpu_s(), cpu_s(server.pid)
        last = t0
        for claim in queue:
            now = time.perf_counter()
            per_claim.append(now - last)
            with claim:
                claim.commit(info(claim.plan))
            claimed.append(claim.shard)
            last = time.perf_counter()
            if len(claimed) == args.claims:
                break
        wall, client, srv = time.perf_counter() - t0, cpu_s() - c0, cpu_s(server.pid) - s0
        description = server.description

    n = len(claimed)
    total = sum(calls.values()) / n
    calls = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(calls.items()))
    text = "\n".join([
        f"## Claiming shards in a large run{'' if server.kind == 'moto' else f' ({server.kind})'}",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {description}  ",
        f"Run: {args.samples:,} samples planned as {len(manifest.shards):,} shards of 1 GB; {args.committed:,} "
        f"committed by earlier workers (written in {setup_s:.0f} s). One worker, rank 3 of 8, claims and commits "
        f"{n} shards (its first: {claimed[0]}).",
        "",
        "| claims | s per claim (median) | first claim s | client CPU s per claim | server CPU s per claim "
        "| S3 requests per claim | by operation, per claim |",
        "|---:|---:|---:|---:|---:|---:|---|",
        f"| {n} | {sorted(per_claim)[n // 2]:.3f} | {per_claim[0]:.2f} | {client / n:.3f} | {srv / n:.3f} | "
        f"{total:.1f} | {calls} |",
        "",
        f"Wall time of the {n} claims and commits: {wall:.1f} s; a claim's seconds run from the end of the "
        "previous commit to the next claim handed out. Requests include the commit's own (create of the commit "
        "record, its tally, the lease's release, the leftover-upload sweep). A ListObjectsV2 page holds up to "
        "1,000 keys.",
    ])
    print(text)
    if args.write_docs:
        write_section(server.section("claims"), text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
