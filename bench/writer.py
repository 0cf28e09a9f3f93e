#!/usr/bin/env python
"""Throughput of layertap's streaming S3 writer against boto3's own transfer manager.

    python bench/writer.py [--mb 512] [--part-mb 16] [--k 4] [--threads 8] [--rounds 3]
                           [--endpoint URL] [--write-docs]

Uploads the same N MiB of random bytes three ways, interleaved over several rounds (the order
alternates every round) and reports the median MiB/s of each:

  writer        `store.open_writer(key)` fed 1 MiB writes, as the shard writer feeds it, then close()
  upload_file   boto3 `upload_file` from a local file written before timing starts
  upload_fileobj boto3 `upload_fileobj` from an in-memory BytesIO (for reference)

The boto3 transfers use the store's own client (same connection pool, retry and checksum
settings) with TransferConfig(multipart_chunksize=part size, max_concurrency=threads), so the only
difference is the upload machinery. Every uploaded object's size is checked, the writer's first
object is read back in full and its hash compared with the source's, and the run fails if any
multipart upload is left pending. botocore event hooks on the shared client record, for every
method alike, how many UploadPart requests were in flight at most and how long
CompleteMultipartUpload took.

Without --endpoint a moto server is started on 127.0.0.1 in a child process with fake
credentials; with --endpoint (e.g. a Ceph radosgw) credentials come from the environment.
"""

from __future__ import annotations

import argparse
import gc
import io
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import boto3  # noqa: E402
import botocore  # noqa: E402
import s3transfer  # noqa: E402
import xxhash  # noqa: E402
from boto3.s3.transfer import TransferConfig  # noqa: E402

from bench._report import cpu_s, write_section  # noqa: E402
from layertap.storage.s3 import S3Store  # noqa: E402
from layertap.storage.store import join_key, open_store  # noqa: E402
from tests.s3server import BenchServer, bench_server  # noqa: E402

MiB = 1 << 20
WRITE_CHUNK = 1 * MiB  # what the shard writer hands the object writer per record, roughly
METHODS = ("writer", "upload_file", "upload_fileobj")
LABELS = {
    "writer": "layertap `S3Writer` (1 MiB writes)",
    "upload_file": "boto3 `upload_file` (local file)",
    "upload_fileobj": "boto3 `upload_fileobj` (BytesIO)",
}


# -- the three uploads -------------------------------------------------------------------------


class RequestProbe:
    """Counts UploadPart requests in flight and times CompleteMultipartUpload, through botocore's
    event hooks on the shared client, so every method is observed the same way."""

    def __init__(self, client):
        self._lock = threading.Lock()
        self.reset()
        ev = client.meta.events
        ev.register("before-call.s3.UploadPart", self._part_start)
        ev.register("after-call.s3.UploadPart", self._part_end)
        ev.register("after-call-error.s3.UploadPart", self._part_end)
        ev.register("before-call.s3.CompleteMultipartUpload", self._complete_start)
        ev.register("after-call.s3.CompleteMultipartUpload", self._complete_end)

    def reset(self) -> None:
        with self._lock:
            self.in_flight = self.max_in_flight = self.parts = 0
            self.complete_s = 0.0

    def _part_start(self, **kw) -> None:
        with self._lock:
            self.in_flight += 1
            self.parts += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _part_end(self, **kw) -> None:
        with self._lock:
            self.in_flight -= 1

    def _complete_start(self, context, **kw) -> None:
        context["bench_t0"] = time.perf_counter()

    def _complete_end(self, context, **kw) -> None:
        self.complete_s += time.perf_counter() - context.get("bench_t0", time.perf_counter())


@dataclass
class Sample:
    seconds: float
    client_cpu_s: float
    server_cpu_s: float
    peak_buffered: int
    max_in_flight: int
    complete_s: float


@dataclass
class Results:
    samples: dict[str, list[Sample]] = field(default_factory=lambda: {m: [] for m in METHODS})
    rounds: list[list[str]] = field(default_factory=list)  # the order of each round
    objects_checked: int = 0
    hashes_checked: list[str] = field(default_factory=list)


def upload(method: str, store: S3Store, key: str, data: bytes, path: str, tc: TransferConfig) -> int:
    """One upload of `data` under the store-relative `key`; returns the writer's peak buffer."""
    full_key = join_key(store.prefix, key)
    if method == "writer":
        view = memoryview(data)
        with store.open_writer(key) as w:
            for off in range(0, len(view), WRITE_CHUNK):
                w.write(view[off : off + WRITE_CHUNK])
        return w.peak_buffered_bytes
    if method == "upload_file":
        store.client.upload_file(path, store.bucket, full_key, Config=tc)
        return 0
    if method == "upload_fileobj":
        store.client.upload_fileobj(io.BytesIO(data), store.bucket, full_key, Config=tc)
        return 0
    raise ValueError(method)


def full_get_hash(store: S3Store, key: str) -> str:
    body = store.client.get_object(Bucket=store.bucket, Key=join_key(store.prefix, key))["Body"]
    h = xxhash.xxh3_128()
    for chunk in iter(lambda: body.read(8 * MiB), b""):
        h.update(chunk)
    return h.hexdigest()


def run(args, store: S3Store, server_pid: int | None, data: bytes, path: str) -> Results:
    tc = TransferConfig(
        multipart_threshold=args.part_mb * MiB, multipart_chunksize=args.part_mb * MiB,
        max_concurrency=args.threads, use_threads=True,
    )
    want_hash = xxhash.xxh3_128_hexdigest(data)
    res = Results()
    probe = RequestProbe(store.client)

    # Warm-up: connections, lazily imported botocore modules, the thread pools (not timed).
    small = data[: 2 * args.part_mb * MiB + 1]
    with tempfile.NamedTemporaryFile(dir=os.path.dirname(path)) as f:
        f.write(small)
        f.flush()
        for m in METHODS:
            upload(m, store, f"warmup-{m}", small, f.name, tc)
            store.delete(f"warmup-{m}")

    for r in range(args.rounds):
        order = list(METHODS) if r % 2 == 0 else list(reversed(METHODS))
        res.rounds.append(order)
        for m in order:
            key = f"round{r}-{m}"
            gc.collect()
            probe.reset()
            c0, s0, t0 = cpu_s(), cpu_s(server_pid), time.perf_counter()
            peak = upload(m, store, key, data, path, tc)
            t1, c1, s1 = time.perf_counter(), cpu_s(), cpu_s(server_pid)
            res.samples[m].append(Sample(t1 - t0, c1 - c0, s1 - s0, peak, probe.max_in_flight, probe.complete_s))
            size = store.size(key)
            if size != len(data):
                raise SystemExit(f"{m} round {r}: object is {size} bytes, expected {len(data)}")
            res.objects_checked += 1
            if r == 0 and m == "writer":  # the object under test is read back in full once
                got = full_get_hash(store, key)
                if got != want_hash:
                    raise SystemExit(f"{m} round {r}: xxh3-128 of the object {got} != source {want_hash}")
                res.hashes_checked.append(m)
            store.delete(key)  # moto keeps objects in memory
            print(f"  round {r + 1}/{args.rounds} {m:<15} {len(data) / MiB / (t1 - t0):8.1f} MiB/s "
                  f"({t1 - t0:.2f} s, of which CompleteMultipartUpload {probe.complete_s:.2f} s; "
                  f"client CPU {c1 - c0:.2f} s, server CPU {s1 - s0:.2f} s)", flush=True)
    return res


# -- report ------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def fmt_bytes(n: float) -> str:
    return f"{n / MiB:.1f} MiB"


def report(args, res: Results, nbytes: int, server_desc: str, pending: int, command: str) -> tuple[str, float]:
    mb = nbytes / MiB
    gb = nbytes / (1 << 30)
    med = {m: statistics.median(mb / s.seconds for s in res.samples[m]) for m in METHODS}
    ratio = med["writer"] / med["upload_file"]
    bound = args.k * args.part_mb * MiB
    peak = max(s.peak_buffered for s in res.samples["writer"])

    rows = [
        "| method | median MiB/s | min – max MiB/s | client CPU s/GiB | server CPU s/GiB "
        "| CompleteMultipartUpload s | max parts in flight |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in METHODS:
        rates = [mb / s.seconds for s in res.samples[m]]
        ccpu = statistics.median(s.client_cpu_s for s in res.samples[m]) / gb
        scpu = statistics.median(s.server_cpu_s for s in res.samples[m]) / gb
        scpu_s = "n/a" if scpu != scpu else f"{scpu:.2f}"
        complete = statistics.median(s.complete_s for s in res.samples[m])
        in_flight = max(s.max_in_flight for s in res.samples[m])
        rows.append(f"| {LABELS[m]} | {med[m]:.1f} | {min(rates):.1f} – {max(rates):.1f} | {ccpu:.2f} | {scpu_s} "
                    f"| {complete:.2f} | {in_flight} |")
    per_round = "; ".join(
        f"round {i + 1} ({' → '.join(order)}): "
        + ", ".join(f"{m} {mb / res.samples[m][i].seconds:.0f}" for m in METHODS)
        for i, order in enumerate(res.rounds)
    )
    verdict = "meets" if ratio >= 0.9 else "is below"
    notes = []
    med_complete = {m: statistics.median(s.complete_s for s in res.samples[m]) for m in METHODS}
    med_server = {m: statistics.median(s.server_cpu_s for s in res.samples[m]) / gb for m in METHODS}
    if med_complete["upload_file"] > 0 and med_complete["writer"] > 1.25 * med_complete["upload_file"]:
        notes.append(
            f"- note: the writer's CompleteMultipartUpload took {med_complete['writer'] / med_complete['upload_file']:.1f}x "
            f"as long as upload_file's"
            + (f" (server CPU {med_server['writer']:.1f} vs {med_server['upload_file']:.1f} s/GiB)"
               if med_server["writer"] == med_server["writer"] else "") + ": "
            "the server does more work to finish the writer's uploads, so that part of the gap is not client overhead."
        )
    md = "\n".join([
        f"Command: `{command}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M %Z')}  ",
        f"Machine: {os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {cpu_model()}, "
        f"{platform.system()} {platform.release()}, Python {platform.python_version()}, "
        f"boto3 {boto3.__version__}, botocore {botocore.__version__}, s3transfer {s3transfer.__version__}  ",
        f"Server: {server_desc}  ",
        f"Workload: {mb:.0f} MiB of random bytes per upload, part size {args.part_mb} MiB, "
        f"{args.threads} threads, writer K = {args.k} parts in memory, {args.rounds} rounds in alternating "
        f"order, median reported.",
        "",
        "MiB/s is wall time from the first byte handed over to the object being visible (close() / "
        "upload_file returning). CPU columns are process CPU (all threads) per GiB uploaded, medians; "
        "the CompleteMultipartUpload column is the median time of that one request.",
        "",
        *rows,
        "",
        f"- writer / upload_file: **{ratio:.2f}x** (target >= 0.9x: {verdict} it)",
        f"- writer peak buffered: {fmt_bytes(peak)} vs bound K x P = {args.k} x {args.part_mb} MiB = "
        f"{fmt_bytes(bound)} ({'within' if peak <= bound else 'EXCEEDS'} bound)",
        f"- verified: {res.objects_checked} objects of the right size (HEAD); a full GET of the "
        f"{' and '.join(res.hashes_checked)} object matched the source's xxh3-128; multipart uploads left "
        f"pending: {pending}",
        f"- per round (MiB/s): {per_round}",
        *notes,
        "",
        "Caveat: moto is a single-process Python server reached over loopback on the same machine, so "
        "these numbers measure the client-side overhead of layertap's writer relative to boto3's own "
        "transfer manager (both sharing the CPUs with the server), not network or storage throughput; "
        "run with `--endpoint` against a real server (e.g. radosgw) for that.",
    ])
    return md, ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=512, help="MiB per upload (default 512)")
    p.add_argument("--part-mb", type=int, default=16, help="part size in MiB (default 16)")
    p.add_argument("--k", type=int, default=4, help="writer's max parts in memory (default 4)")
    p.add_argument("--threads", type=int, default=8, help="upload threads for all methods (default 8)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, order alternating (default 3)")
    p.add_argument("--endpoint", help="use this S3 server instead of starting moto (credentials from env)")
    p.add_argument("--bucket", help="existing bucket to use (default: create a fresh one, deleted after)")
    p.add_argument("--addressing-style", default="auto", choices=("auto", "path", "virtual"))
    p.add_argument("--checksum-mode", choices=("when_supported", "when_required"))
    p.add_argument("--label", help="a name for this machine, e.g. gpu-host: its own docs section 'writer-LABEL'")
    p.add_argument("--write-docs", action="store_true", help="write the results into docs/benchmarks.md")
    args = p.parse_args(argv)
    command = shlex.join(["python", *(sys.argv if argv is None else ["bench/writer.py", *argv])])

    with bench_server(args.endpoint) as srv:
        return measure_and_report(args, command, srv)


def measure_and_report(args, command: str, srv: BenchServer) -> int:
    endpoint, server_pid, server_desc = srv.endpoint, srv.pid, srv.description
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    bucket = args.bucket or f"layertap-bench-{uuid.uuid4().hex[:12]}"
    store: S3Store | None = None
    try:
        opts = dict(endpoint_url=endpoint, threads=args.threads, part_size=args.part_mb * MiB,
                    max_parts_in_memory=args.k, addressing_style=args.addressing_style)
        if args.checksum_mode:
            opts["checksum_mode"] = args.checksum_mode
        store = open_store(f"s3://{bucket}/bench-writer/{uuid.uuid4().hex[:8]}", **opts)
        if not args.bucket:
            store.client.create_bucket(Bucket=bucket)

        nbytes = args.mb * MiB
        print(f"generating {args.mb} MiB of random bytes ...", flush=True)
        data = os.urandom(nbytes)
        with tempfile.TemporaryDirectory(prefix="layertap-bench-") as tmp:
            path = os.path.join(tmp, "payload.bin")
            with open(path, "wb") as f:
                f.write(data)
            print(f"uploading to {store.uri} at {endpoint}: {args.rounds} rounds x {len(METHODS)} methods",
                  flush=True)
            res = run(args, store, server_pid, data, path)

        pending = store.client.list_multipart_uploads(Bucket=bucket, Prefix=store.prefix).get("Uploads", [])
        md, ratio = report(args, res, nbytes, server_desc, len(pending), command)
        print()
        print(md)
        if pending:
            print(f"\nERROR: {len(pending)} multipart uploads left pending", file=sys.stderr)
            return 1
        if args.write_docs:
            section = srv.section("writer", args.label)
            write_section(section, f"## Streaming writer vs boto3 transfer manager{srv.heading(args.label)}\n\n"
                          + md + "\n", path=str(ROOT / "docs" / "benchmarks.md"))
            print(f"\nwrote section {section!r} of {ROOT / 'docs' / 'benchmarks.md'}")
        return 0
    finally:
        if store is not None:
            try:
                store.abort_pending_uploads()
                if not args.bucket:
                    for info in list(store.list()):
                        store.delete(info.key)
                    store.client.delete_bucket(Bucket=bucket)
            except Exception as e:  # cleanup must not hide the real error
                print(f"cleanup: {type(e).__name__}: {e}", file=sys.stderr)
            store.close()


if __name__ == "__main__":
    sys.exit(main())
