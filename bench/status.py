"""`layertap status` at scale: a 913,786-sample plan and 10,000 committed shards on a moto server.

    python bench/status.py [--samples 913786] [--shards 10000] [--write-docs]

Plans the run from synthetic token counts (~800 tokens per sample), writes synthetic commit
records and tallies for `--shards` shards (as workers would), then times `run_status`, which must
cost a few paginated listings and no GET per shard. Target (issue 3): <= 5 s.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402

from bench._report import machine, write_section  # noqa: E402
from manifests import layout  # noqa: E402
from manifests.manifest import create_or_resume  # noqa: E402
from manifests.records import CommitRecord, Producer, encode  # noqa: E402
from manifests.status import run_status  # noqa: E402
from storage.store import open_store  # noqa: E402
from tests.s3server import start_bench_server, stop  # noqa: E402


class CountingStore:
    """Counts the store calls `run_status` makes (listings vs GETs)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, {"list": 0, "get": 0}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in self.calls:
            def counted(*a, **kw):
                self.calls[name] += 1
                return attr(*a, **kw)
            return counted
        return attr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=913_786)
    ap.add_argument("--shards", type=int, default=10_000)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    proc, endpoint = start_bench_server()
    try:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bench")
        store = open_store("s3://bench/run", threads=32)
        rng = random.Random(0)
        counts = [max(16, int(rng.gauss(800, 300))) for _ in range(args.samples)]
        t0 = time.perf_counter()
        manifest, _ = create_or_resume(store, config={"model": "synthetic-27b", "layers": [1, 16, 31, 46, 61],
                                                      "codec": "bf16-zstd"},
                                       dataset={"fingerprint": "synthetic"}, token_counts=counts,
                                       bytes_per_token=51_200 / 1.45, shard_bytes=1_000_000_000)
        plan_s = time.perf_counter() - t0
        shards = manifest.shards[: args.shards]
        producer = Producer.current()

        def commit(plan):
            raw = plan.est_tokens * 51_200
            rec = CommitRecord(shard=plan.id, data_key=layout.data_key(plan.id, "bench"), bytes=int(raw / 1.45),
                               xxh3_128="0" * 32, num_records=plan.num_samples, num_tokens=plan.est_tokens,
                               raw_bytes=raw, sample_ids=[str(i) for i in range(plan.start, plan.end)],
                               producer=asdict(producer), attempt=1, started_at=0.0, committed_at=time.time())
            store.put_if_absent(layout.commit_key(plan.id), encode(rec))
            store.put(layout.tally_key(plan.id, rec.num_records, rec.num_tokens, rec.bytes, raw, 0), b"")

        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(commit, shards))
        write_s = time.perf_counter() - t0

        counting = CountingStore(store)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            status = run_status(counting, manifest)
            times.append(time.perf_counter() - t0)
        assert status["shards_done"] == len(shards)
    finally:
        stop(proc)

    best = min(times)
    text = "\n".join([
        "## `layertap status` at scale",
        "",
        f"Command: `python bench/status.py --samples {args.samples} --shards {args.shards}"
        f"{' --write-docs' if args.write_docs else ''}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; moto server on loopback  ",
        f"Plan: {args.samples:,} samples (synthetic, ~800 tokens each), 1 GB shards at bf16-zstd's 1.45x "
        f"-> {len(manifest.shards):,} shards, planned and written in {plan_s:.2f} s; {len(shards):,} synthetic commits "
        f"(+ tallies) written in {write_s:.1f} s with 32 threads.",
        "",
        "| status calls | best s | all runs s | listings per call | GETs per call |",
        "|---|---:|---|---:|---:|",
        f"| 3 | **{best:.2f}** | {', '.join(f'{t:.2f}' for t in times)} | {counting.calls['list'] // 3} "
        f"| {counting.calls['get'] // 3} |",
        "",
        f"Target (issue 3): <= 5 s: {'met' if best <= 5 else 'missed'}. GETs: the manifest only "
        "(failed shards would add one GET each for their reason).",
    ])
    print(text)
    if args.write_docs:
        write_section("status", text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
