"""What claiming a shard costs a worker in a large run: store requests and seconds per claim.

    python bench/claims.py [--samples 913786] [--committed 10000] [--claims 30] [--endpoint URL]
                           [--window-run [--at-rest 200] [--trainer-ranks 16]] [--label TEXT] [--write-docs]

Plans the 913,786-sample run (25,412 shards of 1 GB), writes synthetic commit records for the
first `--committed` shards as earlier workers would have, then lets one worker (rank 3 of 8)
claim and commit `--claims` shards through `WorkQueue`, counting the store requests by kind. On a 27B target a 1 GB shard is ~28,000 tokens, about 4 s of one H200: a claim
must cost far less than that, and its requests must not grow with the size of the run.
Without --endpoint a moto server is started; with it, that server (e.g. radosgw from .ci/rgw.sh).

--window-run measures a `--window` run, where the storage window's gate (`WindowGate`) runs
before every claim: training has consumed all but the last `--at-rest` committed shards (their
consumption markers, and a watermark per training rank naming them all), the others have a
1 kB data object each, and the window (1 PB) stays open, the common case. `--label` names the
code measured (e.g. "before"/"after", run from a worktree of each); rows of one section are
kept, one per label.
"""

from __future__ import annotations

import argparse
import os
import random
import re
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
from layertap.manifests.consumption import WindowGate, record_consumed  # noqa: E402
from layertap.manifests.manifest import create_or_resume  # noqa: E402
from layertap.manifests.records import CommitRecord, Producer, encode  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.writer import ShardInfo  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.s3server import bench_server  # noqa: E402

WINDOW, DATA = 10**15, b"x" * 1000  # --window-run: an open 1 PB window; a stand-in data object


def synthetic_info(plan) -> ShardInfo:
    """What the writer reports of a shard of `plan` of a 27B target (no data written)."""
    raw = plan.est_tokens * 51_200
    return ShardInfo(key="", bytes=int(raw / 1.45), xxh3_128="0" * 32, num_records=plan.num_samples,
                     num_tokens=plan.est_tokens, raw_bytes=raw,
                     sample_ids=[str(i) for i in range(plan.start, plan.end)], relative_error=None)


def commit_as_earlier_worker(store, plan) -> None:
    """What an earlier worker left of `plan`: its commit record and its tally marker."""
    i = synthetic_info(plan)
    rec = CommitRecord(shard=plan.id, data_key=layout.data_key(plan.id, "bench"), bytes=i.bytes,
                       xxh3_128=i.xxh3_128, num_records=i.num_records, num_tokens=i.num_tokens,
                       raw_bytes=i.raw_bytes, sample_ids=i.sample_ids, producer=asdict(Producer.current()),
                       attempt=1, started_at=0.0, committed_at=time.time())
    store.put_if_absent(layout.commit_key(plan.id), encode(rec))
    store.put(layout.tally_key(plan.id, i.num_records, i.num_tokens, i.bytes, i.raw_bytes, 0, 0), b"")


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
    ap.add_argument("--window-run", action="store_true", help="claims of a --window run, through its gate")
    ap.add_argument("--at-rest", type=int, default=200, help="--window-run: committed shards not consumed yet")
    ap.add_argument("--trainer-ranks", type=int, default=16, help="--window-run: training ranks' watermarks")
    ap.add_argument("--label", help="names the row (the code measured); one row per label in the section")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    command = shlex.join(["python", "bench/claims.py", *sys.argv[1:]])

    with bench_server(args.endpoint) as server:
        store, manifest = plan_large_run(server.endpoint, args.samples, "bench-claims")
        committed = manifest.shards[: args.committed]
        consumed, resting = committed[: len(committed) - args.at_rest], committed[len(committed) - args.at_rest:]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda p: commit_as_earlier_worker(store, p), committed))
            if args.window_run:  # training consumed all but the last --at-rest; their data is deleted
                list(pool.map(lambda p: store.put(layout.consumed_marker_key(p.id), b""), consumed))
                list(pool.map(lambda p: store.put(layout.data_key(p.id, "bench"), DATA), resting))
                list(pool.map(lambda r: record_consumed(store, rank=r, world_size=args.trainer_ranks,
                                                        shards=[p.id for p in consumed], step=1000),
                              range(args.trainer_ranks)))
        setup_s = time.perf_counter() - t0

        calls = count_requests(store)
        gate = WindowGate(store, WINDOW) if args.window_run else None
        queue = WorkQueue(store, manifest, Producer.current(rank=3), world_size=8, before_claim=gate)
        per_claim, claimed = [], []
        t0, c0, s0 = time.perf_counter(), cpu_s(), cpu_s(server.pid)
        last = t0
        for claim in queue:
            now = time.perf_counter()
            per_claim.append(now - last)
            with claim:
                if args.window_run:
                    store.put(claim.data_key, DATA)
                claim.commit(synthetic_info(claim.plan))
            claimed.append(claim.shard)
            last = time.perf_counter()
            if len(claimed) == args.claims:
                break
        wall, client, srv = time.perf_counter() - t0, cpu_s() - c0, cpu_s(server.pid) - s0
        description = server.description

    n = len(claimed)
    total = sum(calls.values()) / n
    calls = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(calls.items()))
    row = (f"| {n} | {sorted(per_claim)[n // 2]:.3f} | {per_claim[0]:.2f} | {client / n:.3f} | {srv / n:.3f} | "
           f"{total:.1f} | {calls} |")
    name = server.section("claims-window" if args.window_run else "claims")
    header = ("| claims | s per claim (median) | first claim s | client CPU s per claim | server CPU s per claim "
              "| S3 requests per claim | by operation, per claim |")
    rows = [row]
    if args.label:  # one row per label: this one replaces its own, the others stay
        header, row = "| code " + header, f"| {args.label} {row}"
        rows = [*earlier_rows(ROOT / "docs" / "benchmarks.md", name, args.label), row]
    window = (f" Through the storage window's gate: training consumed all but the last {args.at_rest} committed "
              f"shards (a consumption marker each, a watermark from each of {args.trainer_ranks} training ranks naming "
              "them all); the others have a 1 kB data object each; the 1 PB window stays open."
              if args.window_run else "")
    text = "\n".join([
        f"## Claiming shards in a large run{' through the storage window' if args.window_run else ''}"
        f"{'' if server.kind == 'moto' else f' ({server.kind})'}",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {description}  ",
        f"Run: {args.samples:,} samples planned as {len(manifest.shards):,} shards of 1 GB; {args.committed:,} "
        f"committed by earlier workers (written in {setup_s:.0f} s). One worker, rank 3 of 8, claims and commits "
        f"{n} shards (its first: {claimed[0]}).{window}",
        "",
        header,
        "|" + "---|" * (header.count("|") - 1 - 7) + "---:|" * 6 + "---|",
        *rows,
        "",
        f"Wall time of the latest run's {n} claims and commits: {wall:.1f} s; a claim's seconds run from the end of the "
        "previous commit to the next claim handed out. Requests include the commit's own (create of the commit "
        "record, its tally, the lease's release, the leftover-upload sweep). A ListObjectsV2 page holds up to "
        "1,000 keys.",
    ])
    print(text)
    if args.write_docs:
        write_section(name, text, ROOT / "docs" / "benchmarks.md")


def earlier_rows(path: Path, section: str, label: str) -> list[str]:
    """The table rows of `section` in `path` written by runs of other labels (first cell)."""
    text = path.read_text() if path.exists() else ""
    found = re.search(f"<!-- bench:{re.escape(section)}:start -->(.*?)<!-- bench:{re.escape(section)}:end -->",
                      text, re.DOTALL)
    rows = [line for line in (found.group(1).splitlines() if found else [])
            if line.startswith("| ") and not line.startswith("| code ")]
    return [r for r in rows if r.split("|")[1].strip() != label]


if __name__ == "__main__":
    main()
