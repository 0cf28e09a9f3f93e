"""What opening a large run costs a training rank: store requests and seconds, with and without
the commit index (manifests/commit_index.py).

    python bench/open.py [--samples 913786] [--rounds 3] [--endpoint URL] [--write-docs]

Plans the 913,786-sample run (25,412 shards of 1 GB) and writes a synthetic commit record for
every shard, as a finished extraction leaves them. Then, in alternating rounds, reads the run's
commits as `ShardStream` does when it opens (`train.stream.load_index`): once with the index
removed first (a GET per commit, then the index is written as `refresh_index()` does: what
the first start of rank 0 pays), once with the index in place (what every other rank and every later start pays), and
lists `commits/` alone (the part of a start the index cannot save).
Without --endpoint a moto server is started; with it, that server (e.g. radosgw from .ci/rgw.sh).
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import cpu_s, machine, publish  # noqa: E402
from bench.claims import count_requests, plan_large_run  # noqa: E402
from layertap.manifests import layout  # noqa: E402
from layertap.manifests.records import CommitRecord, Producer, encode  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.s3server import bench_server  # noqa: E402
from layertap.manifests.commit_index import write_index  # noqa: E402
from layertap.train.stream import load_index  # noqa: E402


def write_commits(store, manifest) -> float:
    """A commit record per planned shard, as the extraction's workers leave them; seconds taken."""
    producer = asdict(Producer.current())

    def commit(plan) -> None:
        raw = plan.est_tokens * 51_200
        rec = CommitRecord(shard=plan.id, data_key=layout.data_key(plan.id, uuid.uuid4().hex[:12]),
                           bytes=int(raw / 1.45), xxh3_128=f"{random.getrandbits(128):032x}",
                           num_records=plan.num_samples, num_tokens=plan.est_tokens, raw_bytes=raw,
                           sample_ids=[f"sharegpt-{i:07d}" for i in range(plan.start, plan.end)],
                           producer=producer, attempt=1, started_at=time.time() - 4.0, committed_at=time.time())
        store.put_if_absent(layout.commit_key(plan.id), encode(rec))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(commit, manifest.shards))
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=913_786)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--endpoint", help="the S3 server to measure (credentials from env); default: a moto server")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    command = shlex.join(["python", "bench/open.py", *sys.argv[1:]])

    with bench_server(args.endpoint) as server:
        store, manifest = plan_large_run(server.endpoint, args.samples, "bench-open")
        setup_s = write_commits(store, manifest)
        rows: dict[str, list[dict]] = {"without the index (rank 0's first start)": [], "with the index": [],
                                       "the listing of commits/ alone": []}
        for r in range(args.rounds):
            for name in (list(rows) if r % 2 == 0 else list(reversed(rows))):
                first = name.startswith("without")
                if first:
                    store.delete(layout.COMMIT_INDEX)
                reader = open_store(store.uri, threads=32)  # a fresh client per start, as a new rank has
                calls = count_requests(reader)
                t0, c0, s0 = time.perf_counter(), cpu_s(), cpu_s(server.pid)
                if name.startswith("the listing"):
                    shards = [o for o in reader.list(layout.COMMITS)]
                else:
                    _, shards, new_index = load_index(reader)
                    if first and new_index is not None:  # what rank 0's ShardStream.refresh_index() does
                        write_index(reader, new_index)
                rows[name].append({"s": time.perf_counter() - t0, "client": cpu_s() - c0, "server": cpu_s(server.pid) - s0,
                                   "calls": dict(calls), "shards": len(shards)})
                print(f"  round {r + 1}/{args.rounds} {name:<42} {rows[name][-1]['s']:7.2f} s  "
                      f"{sum(calls.values()):,} requests", flush=True)
        index_bytes = store.size(layout.COMMIT_INDEX)
        description = server.description

    table = ["| start | seconds (median) | client CPU s | server CPU s | S3 requests | by operation |",
             "|---|---:|---:|---:|---:|---|"]
    for name, rs in rows.items():
        calls = rs[-1]["calls"]
        table.append(f"| {name} | {statistics.median(x['s'] for x in rs):.2f} | "
                     f"{statistics.median(x['client'] for x in rs):.2f} | {statistics.median(x['server'] for x in rs):.2f} | "
                     f"{sum(calls.values()):,} | {', '.join(f'{k} {v:,}' for k, v in sorted(calls.items()))} |")
    without, with_, _ = (statistics.median(x["s"] for x in rs) for rs in rows.values())
    text = "\n".join([
        f"## Opening a large run for training{'' if server.kind == 'moto' else f' ({server.kind})'}",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {description}  ",
        f"Run: {args.samples:,} samples planned as {len(manifest.shards):,} shards of 1 GB, all committed "
        f"(synthetic commit records, written in {setup_s:.0f} s); the commit index is {index_bytes / 1e6:.1f} MB. "
        f"Each start reads the manifest and every commit as `ShardStream` does (`load_index`), with a new S3 "
        f"client; {args.rounds} rounds in alternating order.",
        "",
        *table,
        "",
        f"With the index a start takes {with_ / without:.3f}x the time of one without it. At 1,000 ranks a GET per "
        f"commit is {len(manifest.shards) * 1000 / 1e6:.1f} M GETs per start (S3 serves ~5,500 GETs/s per prefix: "
        f"{len(manifest.shards) * 1000 / 5500 / 60:.0f} min); with the index, rank 0 reads them once and every rank "
        "one listing and one GET.",
    ])
    publish(server.section("open"), text, args.write_docs, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
