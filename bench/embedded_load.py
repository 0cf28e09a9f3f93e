"""A `layertap extract` on the embedded SmolLM2: reading its GGUF vs its converted folder, side by side.

    python bench/embedded_load.py [--rounds 2] [--limit 8] [--json OUT] [--write-docs]

The real command (`--limit` ShareGPT rows, float32, 128 tokens, into a fresh local folder), once
with `LAYERTAP_CACHE_DIR=off` (every command reads the GGUF) and once with layertap's cache (the
folder converted once, on first use: see extract/embedded.py), alternated per round. Reported:
each command's wall (median), and the ratio. The cache's one-time conversion is timed first, in a
fresh cache folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, publish  # noqa: E402


def extract(out: Path, cache: str, limit: int) -> float:
    cmd = [sys.executable, "-m", "layertap", "extract", "--out", str(out), "--limit", str(limit),
           "--max-length", "128", "--dtype", "float32", "--log-dir", str(out.parent / "logs")]
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, LAYERTAP_CACHE_DIR=cache))
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return wall


def markdown(r: dict) -> str:
    return "\n".join([
        "## Loading the embedded SmolLM2: its GGUF vs the converted folder", "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}; machine: {r['machine']}", "",
        f"A whole `layertap extract --limit {r['limit']}` (float32, 128 tokens, local folder), {r['rounds']} "
        "rounds alternated:", "",
        "| reading | command wall (median) |", "|---|---:|",
        f"| the GGUF (`LAYERTAP_CACHE_DIR=off`) | {r['gguf_s']:.1f} s |",
        f"| the converted folder (default) | {r['folder_s']:.1f} s |", "",
        f"**{r['ratio']:.1f}x** faster from the folder. The one-time conversion (the first command on a "
        f"machine, included in its wall): {r['first_s']:.1f} s, {r['cache_mb']:.0f} MB on disk "
        "(float32: the GGUF's Q4_1 blocks dequantize to values bfloat16 cannot hold exactly).", ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--json")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        first = extract(Path(tmp) / "first" / "run", str(cache), args.limit)  # converts
        walls: dict[str, list[float]] = {"gguf": [], "folder": []}
        for i in range(args.rounds):
            for kind in ("gguf", "folder") if i % 2 == 0 else ("folder", "gguf"):
                walls[kind].append(extract(Path(tmp) / f"{kind}{i}" / "run", "off" if kind == "gguf" else str(cache),
                                           args.limit))
        cache_mb = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 1e6
    r = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
         "command": "python bench/embedded_load.py " + " ".join(sys.argv[1:]), "limit": args.limit,
         "rounds": args.rounds, "walls": walls, "gguf_s": statistics.median(walls["gguf"]),
         "folder_s": statistics.median(walls["folder"]), "first_s": first, "cache_mb": cache_mb}
    r["ratio"] = r["gguf_s"] / r["folder_s"]
    print(json.dumps(r, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    publish("embedded-load", markdown(r), args.write_docs)


if __name__ == "__main__":
    main()
