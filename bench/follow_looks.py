"""What a follow-mode consumer waiting for data costs the store: requests per minute, and how soon
it sees each new commit.

    python bench/follow_looks.py [--samples 913786] [--committed 10000] [--every 0.25] [--seconds 60]
                                 [--endpoint URL] [--label TEXT] [--write-docs]

Plans the 27B run of bench/claims.py (25,412 shards of 1 GB) with `--committed` shards committed by
earlier workers. One worker (the real `WorkQueue`, rank 3 of 8) then commits a shard every
`--every` s, while a consumer that trains faster than extraction (the common case under a
storage window) waits for each: the real `CommitWatcher.wait()`, as `ShardStream` calls it in
follow mode, at the default follow_poll_s of 30 s. Counted from the consumer's first new commit
on: its S3 requests by operation (each ListObjectsV2 page counts) and the delay from each commit's
return to the consumer having it. Every consumer of a training job does the same: at 1,000 ranks
x 4 loader workers, multiply by 4,000. Without --endpoint a moto server is started; with it, that
server (e.g. radosgw from .ci/rgw.sh). `--label` names the code measured ("before"/"after", run
from a worktree of each); a section keeps one row per label.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from bench.claims import (commit_as_earlier_worker, count_requests, earlier_rows, plan_large_run,  # noqa: E402
                          synthetic_info)
from layertap.manifests.manifest import load_manifest  # noqa: E402
from layertap.manifests.records import Producer  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from layertap.train.follow import CommitWatcher  # noqa: E402
from tests.s3server import bench_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=913_786)
    ap.add_argument("--committed", type=int, default=10_000)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between the worker's commits")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the consumer is measured")
    ap.add_argument("--endpoint", help="the S3 server to measure (credentials from env); default: a moto server")
    ap.add_argument("--label", help="names the row (the code measured); one row per label in the section")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    command = shlex.join(["python", "bench/follow_looks.py", *sys.argv[1:]])

    with bench_server(args.endpoint) as server:
        store, manifest = plan_large_run(server.endpoint, args.samples, "bench-follow-looks")
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda p: commit_as_earlier_worker(store, p), manifest.shards[: args.committed]))
        setup_s = time.perf_counter() - t0

        consumer = open_store(store.uri, threads=16)  # its own client: only its requests are counted
        watcher = CommitWatcher(consumer, load_manifest(consumer), poll_s=30.0)
        first = watcher.poll()  # the first look: the whole listing (and the commit index), once per start
        committed_at: dict[int, float] = {}
        stop = threading.Event()

        def extract() -> None:
            queue = WorkQueue(store, manifest, Producer.current(rank=3), world_size=8)
            for claim in queue:
                with claim:
                    claim.commit(synthetic_info(claim.plan))
                committed_at[claim.shard] = time.monotonic()
                if stop.wait(args.every):
                    return

        worker = threading.Thread(target=extract, daemon=True)
        worker.start()
        seen: dict[int, float] = {}
        while not seen:  # the worker's first claim scans the run; measuring starts at its first commit
            seen.update((r.shard, time.monotonic()) for r in watcher.wait())
        calls = count_requests(consumer)
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            seen.update((r.shard, time.monotonic()) for r in watcher.wait())
        minutes = (time.monotonic() - start) / 60
        stop.set()
        worker.join()
        description = server.description

    delays = [seen[s] - committed_at[s] for s in seen if s in committed_at]
    lists, gets = calls.get("ListObjectsV2", 0), calls.get("GetObject", 0)
    row = (f"| {len(seen)} | {lists / minutes:.0f} | {gets / minutes:.0f} | {sum(calls.values()) / minutes:.0f} | "
           f"{statistics.median(delays):.2f} | {max(delays):.2f} | "
           + ", ".join(f"{k} {v / minutes:.0f}" for k, v in sorted(calls.items())) + " |")
    header = ("| commits seen | LIST pages / min | GETs / min | requests / min | delay median s | delay max s "
              "| by operation, per min |")
    name = server.section("follow-looks")
    rows = [row]
    if args.label:
        header, row = "| code " + header, f"| {args.label} {row}"
        rows = [*earlier_rows(ROOT / "docs" / "benchmarks.md", name, args.label), row]
    text = "\n".join([
        f"## A follow consumer waiting for commits{server.heading()}",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {description}  ",
        f"Run: {args.samples:,} samples planned as {len(manifest.shards):,} shards of 1 GB; {args.committed:,} "
        f"committed by earlier workers (written in {setup_s:.0f} s; the consumer's first look found {len(first):,}). "
        f"One worker commits a shard every {args.every:g} s (plus its claim's own time); one consumer waits for "
        f"each (`CommitWatcher.wait()`, follow_poll_s 30 s), measured for {minutes:.1f} min from its first new "
        "commit.",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1 - 7) + "---:|" * 6 + "---|",
        *rows,
        "",
        "Delay: from the worker's commit returning to the consumer's wait() returning it. A ListObjectsV2 page "
        "holds up to 1,000 keys. Every consumer of a follow job (ranks x loader workers) makes these requests.",
    ])
    print(text)
    if args.write_docs:
        write_section(name, text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
