#!/usr/bin/env python
"""What a fresh buffer costs: allocate, fill and free buffers the loader's sizes, under glibc's
defaults and under the MALLOC_* settings of docs/LOADER.md ("Memory allocator").

    python bench/page_faults.py [--rounds 20] [--label NAME] [--write-docs]

Each setting runs in its own process (glibc reads them at start). GB/s = bytes filled per second,
in the main thread and in 2 threads at once; minor faults per buffer from getrusage.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._report import machine, publish  # noqa: E402
from layertap.slurm.scripts import MALLOC_SETTINGS  # noqa: E402

SIZES = {"1.5 MB (a decoded sample)": 1_500_000, "47 MiB (a one-GET shard)": 47 << 20,
         "200 MiB (a 4K-token 27B sample)": 200 << 20}
SETTINGS = {"glibc defaults": {}, "MALLOC_* settings": MALLOC_SETTINGS}  # the latter: what training jobs export


def fill(size: int, rounds: int) -> None:
    for _ in range(rounds):
        b = bytearray(size)  # zero-filled: every page is touched
        del b


def measure(rounds: int) -> dict:
    out = {}
    for name, size in SIZES.items():
        n = max(2, rounds * (47 << 20) // max(size, 47 << 20))
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        fill(size, n)
        main = n * size / (time.perf_counter() - t0) / 1e9
        faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n
        threads = [threading.Thread(target=fill, args=(size, n)) for _ in range(2)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[name] = {"main": main, "threads": 2 * n * size / (time.perf_counter() - t0) / 1e9, "faults": faults}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--label", help="a name for this machine, e.g. gpu-host: its own docs section 'page_faults-LABEL'")
    p.add_argument("--write-docs", action="store_true", help="write the 'page_faults' section of docs/benchmarks.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return 0
    rows = ["| setting | buffer | main thread GB/s | 2 threads GB/s | minor faults per buffer (main) |",
            "|---|---|---:|---:|---:|"]
    for setting, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | extra
        res = json.loads(subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)],
                                        env=env, capture_output=True, text=True, check=True).stdout)
        for name, r in res.items():
            rows.append(f"| {setting} | {name} | {r['main']:.1f} | {r['threads']:.1f} | {r['faults']:,.0f} |")
    md = "\n".join([
        "## Fresh vs reused buffers (page faults)" + (f" ({args.label})" if args.label else ""), "",
        f"Command: `{shlex.join(['python', 'bench/page_faults.py', *sys.argv[1:]])}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ",
        f"Machine: {machine()}  ",
        "Each buffer is allocated, zero-filled (every page touched) and freed, over and over; each "
        "setting in its own process. MALLOC_* settings: " + " ".join(f"{k}={v}" for k, v in
                                                                    SETTINGS["MALLOC_* settings"].items()) + ".",
        "", *rows])
    publish("page_faults" + (f"-{args.label}" if args.label else ""), md, args.write_docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
