"""The I/O path's own ceiling: real activations replayed by a producer that costs nothing,
through pack, compress, hash and write, into a local folder and into an S3 server.

    python bench/io_ceiling.py [--mb 512] [--codec bf16-zstd] [--endpoint URL] [--write-docs]

On CPU the forward is so slow that I/O never shows; on an H200 a 27B target makes ~370 MB/s of
raw activations per GPU. This measures raw MB/s per encode core (one encode thread), and into S3
the ratio to a plain boto3 upload of the same stored bytes. Without --endpoint a moto server is
started on loopback: it shares the 2 CPUs with the client, so its S3 numbers are a floor.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import torch  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402

from bench._report import machine, write_section  # noqa: E402
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.records import Sample, encode_record  # noqa: E402
from layertap.storage.writer import ShardWriter  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.activations import smollm2_activations  # noqa: E402
from tests.s3server import start_bench_server, stop  # noqa: E402

H200_RAW_MB_S = 550.0  # per GPU, Qwen3.6-27B at 5 capture layers: measured 549.6 (gpu_extract.json, 2026-12-04; issue 4 guessed 370)


def samples_of(mb: float) -> list[Sample]:
    """Real SmolLM2 activations, repeated until the stream holds `mb` MB of raw bf16."""
    acts = smollm2_activations(n_samples=16, max_tokens=256)
    out, raw, i = [], 0, 0
    while raw < mb * 1e6:
        x = acts[i % len(acts)]
        out.append(Sample(f"s{i}", torch.arange(x.shape[0]), torch.ones(x.shape[0], dtype=torch.uint8), x))
        raw += x.numel() * 2
        i += 1
    return out


def replay(store, samples, meta) -> tuple[float, float, int, int]:
    """Pack + compress + hash + write with one encode thread.

    Returns (wall s, CPU s of this process over all its threads, raw bytes, stored bytes). CPU
    time is what a core has to give; wall time also holds waiting for the disk (fsync) or server.
    """
    t0, c0 = time.perf_counter(), time.process_time()
    with ShardWriter(store.open_writer(f"replay-{uuid.uuid4().hex[:8]}.lts"), meta) as w:
        for s in samples:
            w.append_encoded(encode_record(s, meta))
        info = w.close()
    return time.perf_counter() - t0, time.process_time() - c0, info.raw_bytes, info.bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=512)
    ap.add_argument("--codec", default="bf16-zstd")
    ap.add_argument("--endpoint")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)

    samples = samples_of(args.mb)
    meta = ShardMeta(run_id="bench", shard_id=0, model="SmolLM2-135M-Instruct", layers=[1, 8, 15, 22, 27],
                     hidden_size=samples[0].hidden_states.shape[-1], codec=args.codec)
    rows = []

    tmp = tempfile.mkdtemp(prefix="io-ceiling-")
    try:
        dt, cpu, raw, stored = replay(open_store(tmp), samples, meta)
        rows.append(("local folder (disk, fsync)", dt, cpu, raw, stored, None))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    proc = None
    if args.endpoint:
        endpoint = args.endpoint
    else:
        proc, endpoint = start_bench_server()
    try:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
        client.create_bucket(Bucket=bucket)
        store = open_store(f"s3://{bucket}/io")
        dt, cpu, raw, stored = replay(store, samples, meta)
        blob = os.urandom(1 << 20) * max(1, stored >> 20)
        t0 = time.perf_counter()
        client.upload_fileobj(io.BytesIO(blob), bucket, "plain.bin",
                              Config=TransferConfig(multipart_chunksize=16 << 20, max_concurrency=8))
        plain = time.perf_counter() - t0
        rows.append((f"S3 ({'moto on loopback' if proc else endpoint})", dt, cpu, raw, stored, len(blob) / plain))
    finally:
        if proc:
            stop(proc)

    lines = [
        "## I/O path ceiling: replayed activations through pack, compress, hash and write",
        "",
        f"Command: `python bench/io_ceiling.py --mb {args.mb:g} --codec {args.codec}"
        f"{' --write-docs' if args.write_docs else ''}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}  ",
        f"Workload: {len(samples)} records of real SmolLM2 activations [S, 5, 576] (~{args.mb:g} MB raw bf16), "
        f"codec {args.codec}, one encode thread (the producer costs nothing).",
        "",
        "| into | raw MB/s per core (CPU time) | raw MB/s wall | stored MB/s wall | ratio "
        "| cores per H200 (370 MB/s raw) | vs plain upload |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for where, dt, cpu, raw, stored, plain in rows:
        vs = f"{(stored / dt) / plain:.2f}x of {plain / 1e6:.0f} MB/s" if plain else "-"
        lines.append(f"| {where} | {raw / cpu / 1e6:,.0f} | {raw / dt / 1e6:,.0f} | {stored / dt / 1e6:,.0f} "
                     f"| {raw / stored:.3f} | {H200_RAW_MB_S / (raw / cpu / 1e6):.2f} | {vs} |")
    lines += ["", "Per core = raw bytes / CPU seconds of this process (all its threads: encode, hash, write, "
              "upload); wall rates also include waiting for the disk's fsync or the server. Targets "
              "(issue 4): >= 400 MB/s raw per core into a local folder; into S3 >= 0.9x a plain upload of "
              "the same bytes. moto runs on the same 2 CPUs, so the S3 wall numbers are a floor."]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        write_section("io_ceiling", text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
