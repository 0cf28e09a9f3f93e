"""What a follow-mode consumer waiting for data costs the store: requests per minute, and how soon
it sees each new commit.

    python bench/follow_looks.py [--samples 913786] [--committed 10000] [--every 0.25] [--seconds 60]
                                 [--consumers 1] [--first-looks] [--endpoint URL] [--label TEXT] [--write-docs]

Plans the 27B run of bench/claims.py (25,412 shards of 1 GB) with `--committed` shards committed by
earlier workers. One worker (the real `WorkQueue`, rank 3 of 8) then commits a shard every
`--every` s, while a consumer that trains faster than extraction (the common case under a
storage window) waits for each: the real `CommitWatcher.wait()`, as `ShardStream` calls it in
follow mode, at the default follow_poll_s of 30 s. Counted from the consumer's first new commit
on: its S3 requests by operation (each ListObjectsV2 page counts) and the delay from each commit's
return to the consumer having it. Every consumer of a training job does the same: at 1,000 ranks
x 4 loader workers, multiply by 4,000. `--consumers C` (> 1) measures C consumers of one follow
epoch (consumer i of C, each with its share of every shard, as `ShardStream` builds them): after
each wait of the first, the others look once each (16 at a time); what is counted is theirs
together, in a section of its own. `--first-looks` measures only the C consumers' first looks at
the run, with no commit index (a follow trainer's consumers at a restart late in an extraction:
nothing refreshes the index while a follow trainer runs), one after the other. Without --endpoint a moto server is started; with it, that
server (e.g. radosgw from .ci/rgw.sh). `--label` names the code measured ("before"/"after", run
from a worktree of each); a section keeps one row per label.
"""

from __future__ import annotations

import argparse
import inspect
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
from layertap.manifests.commit_index import read_commits, write_index  # noqa: E402
from layertap.manifests.manifest import load_manifest  # noqa: E402
from layertap.manifests.records import Producer  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from layertap.train.follow import CommitWatcher  # noqa: E402
from layertap.train.order import follow_share  # noqa: E402
from tests.s3server import bench_server  # noqa: E402


def _watcher(store, manifest, consumer: int, consumers: int) -> CommitWatcher:
    """Consumer `consumer` of `consumers` of a follow epoch, as `ShardStream` builds it (the code
    before the feed's counts takes no `wants`: it reads every record)."""
    if "wants" not in inspect.signature(CommitWatcher).parameters:
        return CommitWatcher(store, manifest, poll_s=30.0)
    return CommitWatcher(store, manifest, poll_s=30.0,
                         wants=lambda shard, n: follow_share(n, shard, consumers, consumer)[1] > 0)


def _first_looks(args, command: str, server, consumer, shards: int, setup_s: float) -> None:
    """The `--first-looks` measurement and its section."""
    calls = count_requests(consumer)
    manifest = load_manifest(consumer)
    t = time.perf_counter()
    found = sum(len(_watcher(consumer, manifest, i, args.consumers).poll()) for i in range(args.consumers))
    per_look = (time.perf_counter() - t) / args.consumers
    c = args.consumers
    row = (f"| {c} | {found // c:,} | {calls.get('GetObject', 0) / c:,.1f} | {calls.get('ListObjectsV2', 0) / c:.1f} | "
           f"{per_look:.3f} |")
    header = "| consumers | commits each finds | GETs per consumer | LIST pages per consumer | s per first look |"
    name = server.section("follow-first-looks")
    rows = [row]
    if args.label:
        header, row = "| code " + header, f"| {args.label} {row}"
        rows = [*earlier_rows(ROOT / "docs" / "benchmarks.md", name, args.label), row]
    text = "\n".join([
        f"## The first looks of follow consumers restarted late in an extraction{server.heading()}",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {server.description}  ",
        f"Run: {args.samples:,} samples planned as {shards:,} shards of 1 GB; {args.committed:,} committed by earlier "
        f"workers (written in {setup_s:.0f} s), no commit index. {c} consumers of one follow epoch (consumer i of "
        f"{c}) each take their first look (`CommitWatcher.poll()`), one after the other, on one client.",
        "",
        header,
        ("|---" if args.label else "") + "|" + "---:|" * 5,
        *rows,
    ])
    print(text)
    if args.write_docs:
        write_section(name, text, ROOT / "docs" / "benchmarks.md")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=913_786)
    ap.add_argument("--committed", type=int, default=10_000)
    ap.add_argument("--every", type=float, default=0.25, help="seconds between the worker's commits")
    ap.add_argument("--seconds", type=float, default=60.0, help="how long the consumer is measured")
    ap.add_argument("--consumers", type=int, default=1, help="consumers of one follow epoch, measured together")
    ap.add_argument("--first-looks", action="store_true", help="measure the consumers' first looks alone, no index")
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
        index = None if args.first_looks else read_commits(store).new_index  # as a plain trainer's rank 0 stores it
        if index is not None:
            write_index(store, index)
        setup_s = time.perf_counter() - t0

        consumer = open_store(store.uri, threads=16)  # its own client: only its requests are counted
        if args.first_looks:
            _first_looks(args, command, server, consumer, len(manifest.shards), setup_s)
            return
        watchers = [_watcher(consumer, load_manifest(consumer), i, args.consumers) for i in range(args.consumers)]
        watcher, others = watchers[0], watchers[1:]
        first = watcher.poll()  # the first look: the whole listing (and the commit index), once per start
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda w: w.poll(), others))
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
        for w in others:
            w.poll()
        calls, before = count_requests(consumer), len(seen)
        rounds: list[float] = []  # seconds each round of the other consumers' looks took
        found = 0  # commits found, summed over the consumers: what each consumer's GETs are per
        start = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            while time.monotonic() - start < args.seconds:
                new = watcher.wait()
                seen.update((r.shard, time.monotonic()) for r in new)
                t = time.monotonic()
                found += len(new) + sum(pool.map(lambda w: len(w.poll()), others))
                rounds.append(time.monotonic() - t)
        minutes = (time.monotonic() - start) / 60
        stop.set()
        worker.join()
        description = server.description

    delays = [seen[s] - committed_at[s] for s in seen if s in committed_at]
    lists, gets = calls.get("ListObjectsV2", 0), calls.get("GetObject", 0)
    fleet = args.consumers > 1
    if fleet:  # the looks' rate is this harness's (a round after each wait of the first): not reported
        per_found = gets / max(1, found)
        row = (f"| {len(seen) - before} | {found} | {per_found:.3f} | {per_found * args.consumers:.1f} | "
               f"{len(rounds)} | {statistics.median(rounds):.2f} | {max(rounds):.2f} |")
        header = ("| commits taken by the first | commits found by all | GETs per commit a consumer finds | "
                  "GETs per commit, all consumers | rounds of looks | round median s | round max s |")
        align = "|" + "---:|" * (header.count("|") - 1)
    else:
        row = (f"| {len(seen)} | {lists / minutes:.0f} | {gets / minutes:.0f} | {sum(calls.values()) / minutes:.0f} | "
               f"{statistics.median(delays):.2f} | {max(delays):.2f} | "
               + ", ".join(f"{k} {v / minutes:.0f}" for k, v in sorted(calls.items())) + " |")
        header = ("| commits seen | LIST pages / min | GETs / min | requests / min | delay median s | delay max s "
                  "| by operation, per min |")
        align = "|" + "---|" * (header.count("|") - 1 - 7) + "---:|" * 6 + "---|"
    name = server.section("follow-consumers" if fleet else "follow-looks")
    rows = [row]
    if args.label:
        header, row = "| code " + header, f"| {args.label} {row}"
        rows = [*earlier_rows(ROOT / "docs" / "benchmarks.md", name, args.label), row]
    text = "\n".join([
        (f"## Commit records read by {args.consumers} follow consumers" if fleet
         else "## A follow consumer waiting for commits") + server.heading(),
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}; server: {description}  ",
        f"Run: {args.samples:,} samples planned as {len(manifest.shards):,} shards of 1 GB; {args.committed:,} "
        f"committed by earlier workers (written in {setup_s:.0f} s; the consumer's first look found {len(first):,}). "
        f"One worker commits a shard every {args.every:g} s (plus its claim's own time); one consumer waits for "
        f"each (`CommitWatcher.wait()`, follow_poll_s 30 s)"
        + (f", and after each of its waits the other {args.consumers - 1} consumers of the follow epoch (consumer "
           f"i of {args.consumers}, each with its share of every shard) look once each, 16 at a time; all "
           "their requests counted together" if fleet else "")
        + f", measured for {minutes:.1f} min from its first new commit.",
        "",
        header,
        align if not args.label else "|---" + align,
        *rows,
        "",
        ("GETs: those of all the consumers (a look GETs commit records only), per commit a consumer's look "
         "returned while counting (summed over the consumers); x consumers, per commit. "
         "A round: the other consumers' looks after one wait of the first, 16 at a time on one client; its "
         "pace is this harness's, so LIST rates are not reported here (the single-consumer section has them). "
         f"The plan's shards hold {args.samples / len(manifest.shards):.0f} samples on average."
         if fleet else
         "Delay: from the worker's commit returning to the consumer's wait() returning it. A ListObjectsV2 page "
         "holds up to 1,000 keys. Every consumer of a follow job (ranks x loader workers) makes these requests."),
    ])
    print(text)
    if args.write_docs:
        write_section(name, text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
