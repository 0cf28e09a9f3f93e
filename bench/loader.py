#!/usr/bin/env python
"""The streaming loader against raw boto3 GETs of the same shard objects, from one S3 server.

    python bench/loader.py [--mb 384] [--codecs bf16-zstd,bf16] [--shard-mb 48] [--threads 8]
                           [--rounds 3] [--workers 0] [--endpoint URL | --conn-mbps 90] [--write-docs]

For each codec a run of real SmolLM2 activations ([S, 5, 576] bf16, repeated to --mb MB raw) is
extracted into shards on the server through the real manifest / lease / commit path. Then, over
several rounds in alternating order, the same committed objects are read:

  boto3 GET x1      whole-object get_object().read(), one thread: the bytes and nothing else
  boto3 GET xT      the same on T threads (T = --threads)
  GET + decode      the naive in-RAM reader: whole GETs on one thread, then every record decoded
                    (storage.records.decode_record) on the same thread: no checks, no overlap
  loader            ShardStream in this process: commits, footers, ranged GETs into RAM under the
                    memory budget, every record's hashes checked, decoded to bf16 tensors, shuffled
  loader, 8 MiB     the same with 8 MiB ranges (ranged mode: moto copies the whole object for every
                    ranged GET, real S3 does not, so this row is a floor on moto)
  loader, W workers StreamLoader(num_workers=W) with the padding collate (only with --workers W)
  loader, N decode / fetch threads   the loader with other thread counts (--decode-threads, --fetch-threads)
  --stages rows     store GET xT (whole-object ranged GETs through layertap's S3 store on T threads),
                    fetch and checks only (the loader's fetch stage: GETs, hashes, hand-off, no
                    decoding), the loader with a 0.5 ms GIL switch interval

Reported: stored MB/s (object bytes over wall time; the loader's clock starts once the stream is
open: creating its S3 client and reading manifest and commits is the "open" column), decoded MB/s (bf16 activation bytes out), samples/s, CPU of this process and of the server,
peak buffered bytes against the budget, and bytes this process wrote to disk (/proc/self/io).
The target is loader >= 0.8x the faster boto3 row, in stored MB/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import torch  # noqa: E402
from botocore.config import Config  # noqa: E402

from bench._report import allocator, cores, cpu_s, machine, publish  # noqa: E402
from layertap.manifests.manifest import create_or_resume  # noqa: E402
from layertap.manifests.records import Producer  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.reader import ShardReader  # noqa: E402
from layertap.storage.records import Sample, decode_record, encode_record  # noqa: E402
from layertap.storage.writer import ShardWriter  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.activations import smollm2_activations  # noqa: E402
from tests.s3server import bench_server  # noqa: E402
from layertap.train import ShardStream, StreamLoader  # noqa: E402
from layertap.train.buffers import BufferPool  # noqa: E402
from layertap.train.fetch import Fetcher, Metrics  # noqa: E402
from layertap.train.stream import StreamConfig, auto_decode_threads, load_index  # noqa: E402

LAYERS = [1, 8, 15, 22, 27]
MiB = 1 << 20


def written_bytes() -> int:
    try:
        for line in open("/proc/self/io"):
            if line.startswith("write_bytes"):
                return int(line.split()[1])
    except OSError:
        pass
    return -1


def bench_samples(mb: float) -> list[torch.Tensor]:
    """The benchmark's samples: real SmolLM2 activations [S, 5, 576] bf16, 16 conversations repeated
    until `mb` MB raw. Sample i is `s{i:06d}` with input_ids arange(S) and an all-ones loss mask."""
    acts = smollm2_activations(n_samples=16, max_tokens=256)
    out, raw = [], 0
    while raw < mb * 1e6:
        out.append(acts[len(out) % len(acts)])
        raw += out[-1].numel() * 2
    return out


def make_run(uri: str, codec: str, mb: float, shard_mb: float) -> tuple[int, int, int]:
    """Extract real activations (repeated to `mb` MB raw) into a run; (samples, raw, stored bytes)."""
    acts = bench_samples(mb)
    counts = [x.shape[0] for x in acts]
    raw = sum(x.numel() * 2 for x in acts)
    store = open_store(uri)
    bpt = len(LAYERS) * 576 * 2 / (1.42 if codec == "bf16-zstd" else 2.3 if codec == "fp8" else 1.0)
    manifest, _ = create_or_resume(store, config={"model": "SmolLM2-135M-Instruct", "layers": LAYERS, "codec": codec},
                                   dataset={"fingerprint": f"bench-{mb}"}, token_counts=counts,
                                   bytes_per_token=bpt, shard_bytes=int(shard_mb * 1e6))
    stored = 0
    for claim in WorkQueue(store, manifest, Producer.current(), ttl_s=600):
        with claim:
            meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="SmolLM2-135M-Instruct",
                             layers=LAYERS, hidden_size=576, codec=codec)
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                for i in range(claim.plan.start, claim.plan.end):
                    x = acts[i]
                    w.append_encoded(encode_record(Sample(f"s{i:06d}", torch.arange(x.shape[0]),
                                                  torch.ones(x.shape[0], dtype=torch.uint8), x), meta))
                info = w.close()
            claim.commit(info)
            stored += info.bytes
    store.close()
    return len(counts), raw, stored


def boto3_gets(client, bucket: str, keys: list[str], threads: int) -> dict:
    def get(key: str) -> int:
        return len(client.get_object(Bucket=bucket, Key=key)["Body"].read())

    if threads == 1:
        got = sum(get(k) for k in keys)
    else:
        with ThreadPoolExecutor(threads) as pool:
            got = sum(pool.map(get, keys))
    return {"bytes": got, "gets": len(keys)}


def store_gets(store, shards, threads: int) -> dict:
    """Whole-object ranged GETs through layertap's S3 store (its client, config and retry path) on
    `threads` threads, nothing else: the fetch stage's GETs without its scheduling and hashing."""
    with ThreadPoolExecutor(threads) as pool:
        got = sum(pool.map(lambda s: len(store.get_range(s.key, 0, s.bytes)), shards))
    return {"bytes": got, "gets": len(shards)}


def get_and_decode(client, bucket: str, prefix: str, keys: list[str]) -> dict:
    """The naive in-RAM reader: whole GETs, then every record decoded, all on one thread."""
    samples = decoded = 0
    for key in keys:
        data = client.get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        reader = ShardReader.from_bytes(data, key)
        for e in reader.entries:
            s = decode_record(memoryview(data)[e.offset + 20 : e.offset + e.length], reader.meta)
            samples += 1
            decoded += s.hidden_states.numel() * 2
    return {"samples": samples, "decoded": decoded, "gets": len(keys)}


def open_loader(uri: str, seed: int, threads: int, range_mb: int | None, budget: int,
                decode_threads: int | None = None) -> ShardStream:
    """`threads`: the stream's fetch threads (concurrent ranged GETs)."""
    kw = {"range_bytes": range_mb * MiB} if range_mb else {}
    return ShardStream(uri, config=StreamConfig(seed=seed, shuffle_buffer=64, fetch_threads=threads,
                                                memory_budget=budget, decode_threads=decode_threads, **kw))


def run_loader(stream: ShardStream, workers: int) -> dict:
    samples = decoded = 0
    if not workers:
        for s in stream:
            samples += 1
            decoded += s["hidden_states"].numel() * 2
        m = stream.metrics()
    else:
        loader = StreamLoader(stream, batch_size=8, num_workers=workers)
        for b in loader:
            samples += len(b["sample_id"])
            decoded += int(b["lengths"].sum()) * b["hidden_states"].shape[2] * b["hidden_states"].shape[3] * 2
        m = loader.metrics()
    return {"samples": samples, "decoded": decoded, "peak": m["peak_buffered_bytes"], "gets": m["get_requests"],
            "wait": m["wait_s"]}


def open_fetcher(uri: str, threads: int, budget: int) -> Callable[[], tuple[Fetcher, int]]:
    """The loader's fetch stage alone, over every record in shard order: (opened) a function that
    starts it. What a pass costs without decoding: GETs, object and record hashes, hand-off."""
    store = open_store(uri)
    manifest, shards, _ = load_index(store)
    where = [(s, r) for s, shard in enumerate(shards) for r in range(shard.records)]
    c = StreamConfig(fetch_threads=threads, memory_budget=budget)  # the loader rows' settings
    pool = BufferPool()  # kept from pass to pass, as a stream keeps it from epoch to epoch
    return lambda: (Fetcher(store, shards, manifest.run_id, positions=[(p, s, r) for p, (s, r) in enumerate(where)],
                            budget=c.memory_budget, range_bytes=c.range_bytes, prefetch_shards=c.prefetch_shards,
                            threads=c.fetch_threads, on_corrupt=c.on_corrupt, metrics=Metrics(),
                            pool=pool),
                    len(where))


def run_fetcher(start: Callable[[], tuple[Fetcher, int]]) -> dict:
    fetcher, n = start()
    try:
        for pos in range(n):
            fetcher.release(fetcher.wait_for(pos))
        m = fetcher.metrics
        return {"samples": n, "gets": m.get_requests, "peak": m.peak_buffered_bytes, "wait": m.wait_s}
    finally:
        fetcher.close()


def once(open_fn: Callable[[int], Any]) -> Callable[[int], Any]:
    """`open_fn` called in the first round only; later rounds get what it opened, as a trainer
    reads one stream epoch after epoch (its GET buffers are then the previous epoch's)."""
    held: list = []

    def get(r: int):
        if not held:
            held.append(open_fn(r))
        return held[0]
    return get


def with_switch_interval(seconds: float, run: Callable[[Any], dict]) -> Callable[[Any], dict]:
    """`run` with the interpreter's GIL switch interval set to `seconds` (default 5 ms): a shorter
    one hands the GIL back sooner to threads returning from socket reads."""
    def timed(arg):
        old = sys.getswitchinterval()
        sys.setswitchinterval(seconds)
        try:
            return run(arg)
        finally:
            sys.setswitchinterval(old)
    return timed


def measure(args, endpoint: str, bucket: str, uri: str, server_pid: int | None) -> tuple[dict, dict]:
    store = open_store(uri)
    _, shards, _ = load_index(store)
    prefix = store.prefix
    stored = sum(s.bytes for s in shards)
    store.close()
    keys = [f"{prefix}/{s.key}" for s in shards]
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=Config(max_pool_connections=args.threads + 4))
    budget = args.budget_mb * MiB

    def loader(range_mb=None, workers=0, decode_threads=None, threads=args.threads):
        # (open: untimed, reported apart; run: timed)
        return (once(lambda r: open_loader(uri, r, threads, range_mb, budget, decode_threads)),
                lambda st: run_loader(st, workers))

    methods = {
        "boto3 GET x1": (None, lambda _: boto3_gets(client, bucket, keys, 1)),
        f"boto3 GET x{args.threads}": (None, lambda _: boto3_gets(client, bucket, keys, args.threads)),
        "GET + decode, serial": (None, lambda _: get_and_decode(client, bucket, prefix, [s.key for s in shards])),
        "loader": loader(),
        "loader, 8 MiB ranges": loader(range_mb=8),
    }
    if args.workers:
        methods[f"loader, {args.workers} DataLoader workers"] = loader(workers=args.workers)
    for n in args.decode_threads:
        methods[f"loader, {n} decode threads"] = loader(decode_threads=n)
    for n in args.fetch_threads:
        methods[f"loader, {n} fetch threads"] = loader(threads=n)
    if args.stages:
        methods[f"store GET x{args.threads}"] = (lambda _: open_store(uri),
                                                lambda st: store_gets(st, shards, args.threads))
        methods["fetch and checks only"] = (once(lambda _: open_fetcher(uri, args.threads, budget)), run_fetcher)
        opened, run = loader()
        methods["loader, GIL switch 0.5 ms"] = (opened, with_switch_interval(0.0005, run))
    boto3_gets(client, bucket, keys[:1], 1)  # warm-up: connections, lazy imports
    run_loader(open_loader(uri, 99, args.threads, None, budget), 0)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    last: dict[str, Any] = {}
    for r in range(args.rounds):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))
        for name in order:
            prepare, run = methods[name]
            gc.collect()
            t = time.perf_counter()
            arg = prepare(r) if prepare else None
            opened = time.perf_counter() - t if prepare and arg is not last.get(name) else None
            last[name] = arg
            w0, c0, s0, t0 = written_bytes(), cpu_s(), cpu_s(server_pid), time.perf_counter()
            row = run(arg)
            t1, c1, s1, w1 = time.perf_counter(), cpu_s(), cpu_s(server_pid), written_bytes()
            row.update(seconds=t1 - t0, cpu=c1 - c0, server_cpu=s1 - s0, written=w1 - w0, open=opened)
            results[name].append(row)
            print(f"  round {r + 1}/{args.rounds} {name:<28} {stored / 1e6 / (t1 - t0):8.1f} MB/s stored "
                  f"({t1 - t0:.2f} s, client CPU {c1 - c0:.2f} s, server CPU {s1 - s0:.2f} s)", flush=True)
    return results, {"stored": stored, "objects": len(keys)}


def table(results: dict, stored: int) -> tuple[list[str], dict]:
    rows = ["| method | stored MB/s | decoded MB/s | samples/s | client CPU s | server CPU s | peak buffered MB "
            "| GET requests | open s | consumer wait s | bytes written to disk |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    med = {}

    def cell(rs, key, fmt):
        return fmt(rs) if rs[0].get(key) is not None else "-"

    for name, rs in results.items():
        med[name] = stored / 1e6 / statistics.median(r["seconds"] for r in rs)
        rows.append(" | ".join([
            f"| {name}", f"{med[name]:,.0f}",
            cell(rs, "decoded", lambda rs: f"{statistics.median(r['decoded'] / r['seconds'] for r in rs) / 1e6:,.0f}"),
            cell(rs, "samples", lambda rs: f"{statistics.median(r['samples'] / r['seconds'] for r in rs):,.0f}"),
            f"{statistics.median(r['cpu'] for r in rs):.2f}", f"{statistics.median(r['server_cpu'] for r in rs):.2f}",
            cell(rs, "peak", lambda rs: f"{max(r['peak'] for r in rs) / 1e6:,.0f}"), str(rs[0]["gets"]),
            cell(rs, "open", lambda rs: f"{statistics.median(r['open'] for r in rs if r['open'] is not None):.2f}"),
            cell(rs, "wait", lambda rs: f"{statistics.median(r['wait'] for r in rs):.2f}"),
            f"{max(r['written'] for r in rs)} |"]))
    best = max((k for k in med if k.startswith("boto3")), key=med.get)
    cpu = {k: statistics.median(r["cpu"] + r["server_cpu"] for r in rs) for k, rs in results.items()}
    return rows, {"ratio": med["loader"] / med[best], "vs_naive": med["loader"] / med["GET + decode, serial"],
                  "cpu_ratio": cpu[best] / cpu["loader"], "best": best,
                  "extra_cpu": statistics.median(r["cpu"] for r in results["loader"])
                  - statistics.median(r["cpu"] for r in results[best])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=384, help="raw bf16 MB per run (default 384)")
    p.add_argument("--codecs", default="bf16-zstd,bf16", help="comma-separated (default bf16-zstd,bf16)")
    p.add_argument("--shard-mb", type=float, default=48, help="planned shard size in MB (default 48)")
    p.add_argument("--threads", type=int, default=StreamConfig().fetch_threads,
                   help="fetch threads of the loader and the boto3 pool (default: the loader's, %(default)s)")
    p.add_argument("--budget-mb", type=int, default=1024, help="loader memory budget in MiB (default 1024)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=int, default=0, help="also run StreamLoader(num_workers=W)")
    p.add_argument("--decode-threads", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="also run the loader with these decode thread counts, e.g. 2,4,8 (default: by codec and cores)")
    p.add_argument("--fetch-threads", type=lambda v: [int(x) for x in v.split(",")], default=[],
                   help="also run the loader with these fetch thread counts, e.g. 4,16 (default: --threads only)")
    p.add_argument("--stages", action="store_true",
                   help="also time GETs through layertap's store, the fetch stage alone (no decoding) and the "
                        "loader with a 0.5 ms GIL switch interval: where a pass's time goes")
    p.add_argument("--endpoint", help="an S3 server to use instead of starting moto (credentials from env)")
    p.add_argument("--conn-mbps", type=float,
                   help="cap each connection of the moto server at this many MB/s (kernel pacing), as S3 "
                        "serves one connection at ~85-90 MB/s: the network, not this machine's CPU, sets the pace")
    p.add_argument("--label", help="a name for this machine, e.g. gpu-host: its own docs section 'loader-LABEL'")
    p.add_argument("--write-docs", action="store_true", help="write the 'loader' section of docs/benchmarks.md")
    args = p.parse_args(argv)
    command = shlex.join(["python", "bench/loader.py", *(sys.argv[1:] if argv is None else argv)])
    torch.set_num_threads(1)
    n_cores = cores()

    if args.conn_mbps is not None and args.endpoint:
        p.error("--conn-mbps paces the moto server this benchmark starts; it does not apply to --endpoint")
    with bench_server(args.endpoint, args.conn_mbps) as srv:
        endpoint, server_pid, server = srv.endpoint, srv.pid, srv.description
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        sections = []
        load_before = os.getloadavg()[0]
        bucket = f"bench-loader-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        for codec in args.codecs.split(","):
            uri = f"s3://{bucket}/runs/{codec}"
            print(f"writing {args.mb:g} MB raw of SmolLM2 activations as {codec} to {uri} ...", flush=True)
            n, raw, stored = make_run(uri, codec, args.mb, args.shard_mb)
            results, facts = measure(args, endpoint, bucket, uri, server_pid)
            rows, k = table(results, facts["stored"])
            sections += [f"### codec {codec}: {n} samples, {raw / 1e6:,.0f} MB raw, {stored / 1e6:,.0f} MB stored "
                         f"in {facts['objects']} objects", "", *rows, "",
                         f"- loader / faster boto3 GET row ({k['best']}), stored MB/s: **{k['ratio']:.2f}x** "
                         f"(target >= 0.8x: {'met' if k['ratio'] >= 0.8 else 'MISSED'}); loader / serial GET + "
                         f"decode: {k['vs_naive']:.2f}x",
                         f"- CPU: the loader spends {k['extra_cpu']:.2f} client CPU-s per pass more than those GETs "
                         f"(checks, decoding, buffering); with the server on the same {n_cores} cores, the ratio "
                         f"of their client + server CPU-s, {k['cpu_ratio']:.2f}x, is what the loader can reach when both "
                         "keep the cores busy", ""]

    md = "\n".join([
        f"## Streaming loader vs raw boto3 GETs{srv.heading(args.label)}",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {machine()}; torch {torch.__version__}, boto3 {boto3.__version__}; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after  ",
        f"Server: {server}  ",
        f"Client allocator: {allocator()} (the server keeps glibc's defaults)  ",
        f"Loader: in-process ShardStream, {args.threads} fetch threads, decode threads by codec and cores "
        f"(bf16 on the consumer's thread, compressed codecs on {auto_decode_threads('bf16-zstd')}), shuffle buffer 64, "
        f"memory budget {args.budget_mb} MiB, default 64 MiB ranges (shards this size are read in one GET); "
        f"{args.rounds} rounds in alternating order, medians.",
        "",
        "Stored MB/s = object bytes / wall time (10^6 B/s). The loader's time covers every check (commit vs "
        "footer, frame and index hashes of every record, the whole-object hash of one-GET shards), decoding and "
        "the shuffle buffer; opening the stream (S3 client, manifest, commit listing, one GET per commit) is "
        "the open column, paid once per stream: each loader row opens its stream once and reads it every "
        "round, an epoch a round as a trainer does, so from the second round on the stream reuses its GET "
        "buffers. Decoded MB/s = bf16 activation bytes yielded per second. "
        "Bytes written to disk: this process's /proc/self/io write_bytes over the pass.",
        "",
        *sections,
        f"Caveat: the server runs on the same {n_cores} cores as the client, so every row shares the CPUs with it; "
        "the loader also decodes (zstd) on them. On moto a ranged GET costs a copy of the "
        "whole object on the server, which real S3 does not do. MosaicML `streaming` is compared in "
        "bench/loader_vs_mds.py (its own section).",
    ])
    publish(srv.section("loader", args.label), md, args.write_docs, ROOT / "docs" / "benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
