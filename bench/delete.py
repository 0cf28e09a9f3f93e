"""`layertap delete` of a big run: one DeleteObjects request per 1,000 keys vs one DELETE per key.

    python bench/delete.py [--objects 20000] [--endpoint URL] [--write-docs]

Writes `--objects` small objects under two prefixes of one bucket, then deletes one prefix the
way `layertap delete` did before (16 threads, `store.delete` per key) and the other with
`manifests.delete.delete_all` (batches of 1,000 keys, 16 in flight), side by side on one server.
A 27B run of 25,383 shards holds ~100k objects (commit, tally, data, consumed marker per shard).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402

from bench._report import machine, publish  # noqa: E402
from layertap.manifests.delete import delete_all  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.s3server import bench_server  # noqa: E402


def fill(store, n: int) -> list[str]:
    keys = [f"commits/{i:08d}.json" for i in range(n)]
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(lambda k: store.put(k, b"{}"), keys))
    return keys


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=20_000)
    ap.add_argument("--endpoint", help="an S3 server to use instead of starting moto")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    with bench_server(args.endpoint) as server:
        os.environ["AWS_ENDPOINT_URL"] = server.endpoint
        bucket = f"bench-delete-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=bucket)
        one, batched = open_store(f"s3://{bucket}/one", threads=32), open_store(f"s3://{bucket}/batched", threads=32)
        keys_one, keys_batched = fill(one, args.objects), fill(batched, args.objects)

        def per_key() -> None:
            with ThreadPoolExecutor(16) as pool:
                list(pool.map(one.delete, keys_one))

        one_s = timed(per_key)
        batched_s = timed(lambda: delete_all(batched, keys_batched, threads=16))
        assert not list(one.list()) and not list(batched.list())
        n = args.objects
        md = "\n".join([
            f"## `layertap delete`: batched vs one request a key{server.heading()}",
            f"`python bench/delete.py --objects {n}{' --endpoint URL' if args.endpoint else ''}` on {machine()}, {server.description}: {n:,} objects "
            "deleted each way on one server, side by side.",
            "",
            "| way | requests | seconds | objects/s |",
            "|---|---:|---:|---:|",
            f"| one DELETE a key, 16 threads (before) | {n:,} | {one_s:.1f} | {n / one_s:,.0f} |",
            f"| DeleteObjects, 1,000 keys a request, 16 in flight (`delete_all`) | {-(-n // 1000)} | {batched_s:.1f} "
            f"| {n / batched_s:,.0f} |",
            "",
            f"Batched is **{one_s / batched_s:.1f}x** as fast here. A 27B run's ~100k objects: ~100 requests "
            "instead of ~100k DELETEs.",
        ])
        publish(server.section("delete"), md, args.write_docs)


if __name__ == "__main__":
    main()
