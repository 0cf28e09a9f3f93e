#!/usr/bin/env python
"""layertap's streaming loader against MosaicML `streaming` (MDS) on the same samples, same S3 server.

    python bench/loader_vs_mds.py [--mb 384] [--shard-mb 48] [--rounds 3] [--mds-python PATH] [--write-docs]

The samples of bench/loader.py (real SmolLM2 activations [S, 5, 576] bf16, repeated to --mb MB raw)
are written twice to one moto server: as a layertap run (codec bf16-zstd, --shard-mb MB shards,
through the real manifest / lease / commit path) and as an MDS dataset (MDSWriter, zstd
compression, `size_limit` set so its shards hold as many samples as layertap's). Then, over several
rounds in alternating order:

  boto3 GET x4, <format>   whole-object GETs of that format's objects on 4 threads: the bytes alone
  layertap loader          ShardStream in this process (shuffle buffer 64, 4 fetch threads, 2 decode
                           threads, 1 GiB budget): every record's hashes checked, bf16 tensors out
  MDS                      StreamingDataset(remote="s3://...", local=<fresh cache folder>,
                           shuffle=True, batch_size=8) with its defaults (predownload 8 batches, no hashes)
  MDS, xxh3_64 checked     the same over a copy written with hashes=["xxh3_64"] and read with
                           validate_hash="xxh3_64" (MDS checks whole shards as they land on disk)

Every reader yields each sample's hidden states as a bf16 tensor (MDS: a zero-copy view of its
numpy array). Reported: decoded MB/s (bf16 activation bytes out per second of iteration),
samples/s, CPU of the reading process and of the server, the open time (stream or dataset
construction), bytes the reading process wrote to disk (/proc/self/io write_bytes, open included)
and what its local cache holds at the end.

The MDS side runs in its own virtualenv, as a child process of this script: mosaicml-streaming
pulls a torch and torchvision that replace or break the CPU torch here. Set it up with

    python -m venv --system-site-packages /opt/mds-venv
    /opt/mds-venv/bin/pip install --no-deps mosaicml-streaming==0.13.0 brotli python-snappy cramjam zstd \\
        pillow catalogue

(streaming's `__init__` imports its vision, multimodal and text modules and with them torchvision,
whose wheels do not load against the CPU torch: the child stubs those three modules, which this
bench does not use). Without that venv the MDS rows are skipped with a message.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MDS_PYTHON = "/opt/mds-venv/bin/python"
MDS_COLUMNS = {"sample_id": "str", "input_ids": "ndarray:int32", "loss_mask": "ndarray:uint8",
               "hidden_states": "ndarray:uint16"}  # bf16 bits: numpy has no bfloat16
VARIANTS = {"MDS": ("mds", None), "MDS, xxh3_64 checked": ("mds-xxh3", "xxh3_64")}
NOTES = " ".join("""
What each checks: the layertap loader verifies every record's xxh3-64 (frame and footer index) and, for
shards read in one GET, the whole-object xxh3-128 against its commit, in RAM, before yielding. MDS by
default checks nothing; with validate_hash it hashes each shard file after download. How MDS reads: it
downloads each shard to the local folder (boto3 download_file with use_threads=False: 8 MB ranged GETs
in turn, each of which costs moto a copy of the whole object, hence its server CPU; real S3 has no such
cost), decompresses it there and reads samples from that file; its default predownload is 8 batches (64
samples). Caveat: moto shares the 2 CPUs with every reader.
""".split())


# -- the child: runs in the MDS virtualenv ---------------------------------------------------------


def _import_streaming():
    import types
    import warnings

    for name in ("streaming.vision", "streaming.multimodal", "streaming.text"):  # torchvision users
        sys.modules.setdefault(name, types.ModuleType(name))
    warnings.filterwarnings("ignore")
    import streaming

    return streaming


def child_convert(args) -> dict:
    """Write the bench's samples as MDS datasets in a local folder (the parent uploads them)."""
    import numpy as np
    import torch

    from bench.loader import bench_samples

    streaming = _import_streaming()
    samples = bench_samples(args.mb)
    for folder, hashes in {v[0]: v[1] for v in VARIANTS.values()}.items():
        with streaming.MDSWriter(out=str(Path(args.out) / folder), columns=MDS_COLUMNS, compression="zstd",
                                 hashes=[hashes] if hashes else None, size_limit=args.size_limit) as w:
            for i, x in enumerate(samples):
                s = x.shape[0]
                w.write({"sample_id": f"s{i:06d}", "input_ids": np.arange(s, dtype=np.int32),
                         "loss_mask": np.ones(s, dtype=np.uint8),
                         "hidden_states": x.contiguous().view(torch.int16).numpy().view(np.uint16)})
    return {"samples": len(samples), "version": streaming.__version__}


def child_read(args) -> dict:
    """One pass of StreamingDataset over the remote dataset, into a fresh local cache."""
    import resource

    import torch

    from bench.loader import written_bytes

    streaming = _import_streaming()
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()

    def cpu() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    w0, t0 = written_bytes(), time.perf_counter()
    ds = streaming.StreamingDataset(remote=args.remote, local=args.cache, shuffle=True, shuffle_seed=args.seed,
                                    batch_size=8, validate_hash=args.validate_hash)
    opened = time.perf_counter() - t0
    samples = decoded = 0
    c0, t1 = cpu(), time.perf_counter()
    for s in ds:
        hs = torch.from_numpy(s["hidden_states"]).view(torch.bfloat16)
        samples += 1
        decoded += hs.numel() * 2
    t2, c1 = time.perf_counter(), cpu()
    cache = sum(f.stat().st_size for f in Path(args.cache).rglob("*") if f.is_file())
    return {"samples": samples, "decoded": decoded, "seconds": t2 - t1, "cpu": c1 - c0, "open": opened,
            "written": written_bytes() - w0, "cache": cache}


# -- the parent ------------------------------------------------------------------------------------


def mds_available(python: str) -> str | None:
    """None if the MDS venv works, else why not."""
    if not Path(python).exists():
        return f"{python} not found"
    probe = "import sys; sys.path.insert(0, sys.argv[1]); from bench.loader_vs_mds import _import_streaming; " \
            "print(_import_streaming().__version__)"
    p = subprocess.run([python, "-c", probe, str(ROOT)], capture_output=True, text=True, timeout=300)
    return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["import failed"])[-1]


def run_child(python: str, *argv: str, env: dict | None = None) -> dict:
    p = subprocess.run([python, str(Path(__file__).resolve()), "--child", *argv], capture_output=True, text=True,
                       env=env, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"MDS child {argv[0]} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def upload_folder(client, bucket: str, folder: Path, prefix: str) -> tuple[int, int]:
    """(shard objects, their bytes) after putting every file of `folder` under `prefix`."""
    n = total = 0
    for f in sorted(folder.rglob("*")):
        if f.is_file():
            client.upload_file(str(f), bucket, f"{prefix}/{f.relative_to(folder).as_posix()}")
            if f.name != "index.json":
                n, total = n + 1, total + f.stat().st_size
    return n, total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=384, help="raw bf16 MB of samples (default 384)")
    p.add_argument("--shard-mb", type=float, default=48, help="layertap's planned shard size in MB (default 48)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mds-python", default=MDS_PYTHON, help=f"python of the MDS virtualenv (default {MDS_PYTHON})")
    p.add_argument("--write-docs", action="store_true", help="write the 'loader_vs_mds' section of docs/benchmarks.md")
    p.add_argument("--child", choices=["convert", "read"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--size-limit", type=int, help=argparse.SUPPRESS)
    p.add_argument("--remote", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--validate-hash", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child_convert(args) if args.child == "convert" else child_read(args)))
        return 0
    command = shlex.join(["python", "bench/loader_vs_mds.py", *(sys.argv[1:] if argv is None else argv)])

    import boto3
    import torch
    from botocore.config import Config

    from bench._report import machine, publish
    from bench.loader import boto3_gets, cpu_s, make_run, open_loader, run_loader, written_bytes
    from layertap.storage.store import open_store
    from tests.s3server import start_bench_server, stop
    from layertap.train.stream import load_index

    torch.set_num_threads(1)
    why_not = mds_available(args.mds_python)
    if why_not:
        print(f"MosaicML streaming is not usable ({why_not}): the MDS rows are skipped. Set up its virtualenv as "
              "the docstring of bench/loader_vs_mds.py says, or pass --mds-python.", flush=True)
    proc, endpoint = start_bench_server()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, S3_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
    import moto

    load_before = os.getloadavg()[0]
    results: dict[str, list[dict]] = {}
    objects: dict[str, tuple[int, int]] = {}
    scratch = Path(tempfile.mkdtemp(prefix="bench-mds-", dir=os.environ.get("BENCH_CACHE_DIR", "/var/tmp")))
    try:
        bucket = f"bench-mds-{uuid.uuid4().hex[:8]}"
        client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                              config=Config(max_pool_connections=8))
        client.create_bucket(Bucket=bucket)
        uri = f"s3://{bucket}/runs/layertap"
        print(f"writing {args.mb:g} MB raw of SmolLM2 activations as a layertap run (bf16-zstd) ...", flush=True)
        n, raw, stored = make_run(uri, "bf16-zstd", args.mb, args.shard_mb)
        store = open_store(uri)
        _, shards, _ = load_index(store)
        keys = {"layertap": [f"{store.prefix}/{s.key}" for s in shards]}
        objects["layertap"] = (len(shards), stored)
        store.close()
        if not why_not:
            size_limit = int(raw / len(shards) * 1.01) + (1 << 20)  # as many samples per shard as layertap's
            print(f"writing the same {n} samples as MDS (zstd, size_limit {size_limit:,} B) ...", flush=True)
            info = run_child(args.mds_python, "convert", "--mb", str(args.mb), "--out", str(scratch / "out"),
                             "--size-limit", str(size_limit))
            mds_version = info["version"]
            for folder, _ in VARIANTS.values():
                objects[folder] = upload_folder(client, bucket, scratch / "out" / folder, f"mds/{folder}")
            shutil.rmtree(scratch / "out")
            mds_keys = client.list_objects_v2(Bucket=bucket, Prefix="mds/mds/")["Contents"]
            keys["MDS"] = [o["Key"] for o in mds_keys if not o["Key"].endswith("index.json")]

        def layertap(r: int) -> dict:
            w0, t = written_bytes(), time.perf_counter()
            stream = open_loader(uri, r, 4, None, 1 << 30)
            c0, t0 = cpu_s(), time.perf_counter()
            row = run_loader(stream, 0)
            t1, c1 = time.perf_counter(), cpu_s()
            return dict(row, seconds=t1 - t0, cpu=c1 - c0, written=written_bytes() - w0, cache=0, open=t0 - t)

        def gets(fmt: str) -> dict:
            c0, t0 = cpu_s(), time.perf_counter()
            row = boto3_gets(client, bucket, keys[fmt], 4)
            return dict(row, seconds=time.perf_counter() - t0, cpu=cpu_s() - c0)

        def mds(folder: str, validate: str | None, r: int) -> dict:
            cache = scratch / f"cache-{folder}-{r}"
            argv = ["read", "--remote", f"s3://{bucket}/mds/{folder}", "--cache", str(cache), "--seed", str(r)]
            row = run_child(args.mds_python, *argv, *(["--validate-hash", validate] if validate else []))
            shutil.rmtree(cache, ignore_errors=True)
            return row

        methods = {"boto3 GET x4, layertap objects": lambda r: gets("layertap"), "layertap loader": layertap}
        if not why_not:
            methods["boto3 GET x4, MDS objects"] = lambda r: gets("MDS")
            for name, (folder, validate) in VARIANTS.items():
                methods[name] = lambda r, f=folder, v=validate: mds(f, v, r)
        gets("layertap")  # warm-up: connections, lazy imports
        for r in range(args.rounds):
            for name in (list(methods) if r % 2 == 0 else list(reversed(methods))):
                s0 = cpu_s(proc.pid)
                row = methods[name](r)
                row["server_cpu"] = cpu_s(proc.pid) - s0
                results.setdefault(name, []).append(row)
                rate = row.get("decoded", row.get("bytes", 0)) / row["seconds"] / 1e6
                print(f"  round {r + 1}/{args.rounds} {name:<32} {rate:8.1f} MB/s ({row['seconds']:.2f} s)", flush=True)
    finally:
        stop(proc)
        shutil.rmtree(scratch, ignore_errors=True)

    def med(rs, key):
        return statistics.median(r[key] for r in rs)

    rows = ["| method | objects | decoded MB/s | samples/s | object MB/s | client CPU s | server CPU s | open s "
            "| written to local disk | local cache at end |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    dec = {}
    for name, rs in results.items():
        fmt = "layertap" if "layertap" in name else VARIANTS.get(name, ("mds",))[0]
        nobj, nbytes = objects[fmt]
        reader = "bytes" not in rs[0]
        dec[name] = statistics.median(r["decoded"] / r["seconds"] for r in rs) / 1e6 if reader else None
        rows.append(" | ".join([
            f"| {name}", f"{nobj} x {nbytes / nobj / 1e6:.0f} MB",
            f"{dec[name]:,.0f}" if reader else "-",
            f"{statistics.median(r['samples'] / r['seconds'] for r in rs):,.0f}" if reader else "-",
            f"{statistics.median(nbytes / r['seconds'] for r in rs) / 1e6:,.0f}",
            f"{med(rs, 'cpu'):.2f}", f"{med(rs, 'server_cpu'):.2f}",
            f"{med(rs, 'open'):.2f}" if reader else "-",
            f"{max(r['written'] for r in rs) / 1e6:,.0f} MB" if reader else "-",
            f"{max(r['cache'] for r in rs) / 1e6:,.0f} MB |" if reader else "- |"]))
    notes = []
    for name in VARIANTS:
        if dec.get(name):
            notes.append(f"- layertap loader / {name}, decoded MB/s: **{dec['layertap loader'] / dec[name]:.2f}x**")
    mds_line = (f"MosaicML streaming {mds_version} in {args.mds_python} (a child process per pass, fresh cache "
                f"folder under {scratch.parent})" if not why_not else f"MosaicML streaming: skipped ({why_not})")
    md = "\n".join([
        "## Streaming loader vs MosaicML streaming (MDS)",
        "",
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {machine()}; torch {torch.__version__}, boto3 {boto3.__version__}; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after  ",
        f"Server: moto {moto.__version__} (`python tests/moto_s3.py`) on loopback, started by the benchmark  ",
        f"Data: {n} samples of SmolLM2 activations [S, 5, 576] bf16, {raw / 1e6:,.0f} MB raw; layertap codec "
        f"bf16-zstd, MDS zstd (level 3) with shards of as many samples  ",
        f"{mds_line}; {args.rounds} rounds in alternating order, medians.",
        "",
        "Decoded MB/s = bf16 activation bytes yielded per second of iteration (open excluded: stream or dataset "
        "construction, the open column). Written to local disk = the reading process's /proc/self/io "
        "write_bytes over open and iteration; local cache = bytes left in its local folder after the pass.",
        "",
        *rows,
        "",
        *notes,
        "",
        NOTES,
    ])
    publish("loader_vs_mds", md, args.write_docs, ROOT / "docs" / "benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
