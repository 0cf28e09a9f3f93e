"""`layertap extract --overlap-shards on` vs `off`, side by side.

    python bench/shard_overlap.py [--rounds 2] [--limit 64] [--shard-bytes 2MB] [--json OUT]

The real command on the embedded SmolLM2 and ShareGPT rows, into a moto server on loopback
(started here), each round once per mode, alternated, each into a fresh prefix. Per run: the
claim loop's wall and the forward's share of it, from the worker's own summary line
(`extract-rank0.log`); reported as medians, and the serial/overlapped ratio of the walls.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.s3server import bench_server  # noqa: E402

SUMMARY = re.compile(r"([\d,.]+) s.{0,20} from the start to the last shard's end, ([\d,]+) tokens/s.*forward ([\d.]+) s")
SHARDS = re.compile(r"(\d+) shard\(s\) committed")


def run(prefix: str, serial: bool, args, log_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "layertap", "extract", "--out", prefix, "--limit", str(args.limit),
           "--max-length", str(args.max_length), "--shard-bytes", args.shard_bytes, "--dtype", args.dtype,
           "--log-dir", str(log_dir), "--overlap-shards", "off" if serial else "on"]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    total = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    text = (log_dir / "extract-rank0.log").read_text()
    m, shards = SUMMARY.findall(text)[-1], SHARDS.findall(text)[-1]
    wall = float(m[0].replace(",", ""))
    return {"serial": serial, "loop_s": wall, "tokens_per_s": int(m[1].replace(",", "")), "forward_s": float(m[2]),
            "shards": int(shards), "command_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--shard-bytes", default="2MB")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with bench_server(None) as srv, tempfile.TemporaryDirectory() as tmp:
        os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bench")
        for r in range(args.rounds):
            for serial in (False, True) if r % 2 == 0 else (True, False):
                row = run(f"s3://bench/r{r}-{'serial' if serial else 'overlap'}", serial, args, Path(tmp) / f"logs{r}{serial}")
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        server = srv.description
    med = {mode: {k: statistics.median(x[k] for x in rows if x["serial"] == (mode == "serial"))
                  for k in ("loop_s", "forward_s", "tokens_per_s")} for mode in ("overlap", "serial")}
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": os.cpu_count(), "server": server,
              "args": vars(args), "shards": rows[0]["shards"], "runs": rows, "median": med,
              "serial_over_overlap": med["serial"]["loop_s"] / med["overlap"]["loop_s"]}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
