"""Planning's tokenization of a whole dataset: in this process vs in worker processes, side by side.

    python bench/plan_tokenize.py [--rows 4000] [--workers N] [--template FILE] [--json OUT] [--write-docs]

`token_statistics` over `--rows` embedded ShareGPT rows with SmolLM2's tokenizer (and its chat
template, or `--template`'s), read back from a JSON-lines file as the planner reads a dataset
(memory-mapped Arrow), once in this process and once in `--workers` processes (default: what
`layertap plan` would use here, `LAYERTAP_PLAN_WORKERS` or the CPUs up to 32). The parallel wall
includes the workers' start-up. Both results must be identical (counts, stats, skips), or the
bench fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench._report import machine, publish  # noqa: E402


def timed(rows, tok, max_length: int, workers: int):
    from layertap.extract.measure import token_statistics

    t = time.perf_counter()
    stats = token_statistics(rows, tok, max_length, workers=workers)
    return stats, time.perf_counter() - t


def same(a, b) -> bool:
    keys = ("counts", "rows_read", "samples_read", "tokens_read", "supervised_read", "truncated", "skipped")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def markdown(r: dict) -> str:
    return "\n".join([
        f"## Planning's tokenization: one process vs {r['workers']} ({r['template']})", "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}; machine: {r['machine']}", "",
        f"`token_statistics` over {r['rows']:,} ShareGPT rows ({r['tokens']:,} tokens at --max-length "
        f"{r['max_length']}), SmolLM2's tokenizer, the rows memory-mapped from a JSON-lines file as the planner "
        "reads them; the processes' wall includes their start-up. Identical counts, stats and skips: "
        f"{'yes' if r['identical'] else 'NO'}.", "",
        "| tokenized in | wall | rows/s | speed-up |", "|---|---:|---:|---:|",
        f"| this process | {r['serial_s']:.1f} s | {r['serial_rows_per_s']:,.0f} | 1.00x |",
        f"| {r['workers']} worker processes | {r['parallel_s']:.1f} s | {r['parallel_rows_per_s']:,.0f} | "
        f"{r['speedup']:.2f}x |", "",
        f"The speed-up is bounded by the workers and the free cores ({r['machine'].split(',')[0]} here), less "
        "each worker's start-up (2-4 s: a fresh interpreter imports torch and transformers): less than "
        f"{r['workers']}x.", ""])


def main() -> None:
    from layertap.extract.embedded import sharegpt_conversations
    from layertap.extract.inputs import load_rows
    from layertap.extract.measure import MIN_ROWS_PER_WORKER, plan_workers, tokenize_processes
    from tiny_models import smollm2_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=plan_workers(), help="at most; the rows may ask fewer")
    ap.add_argument("--template", help="a chat template file to render with instead of SmolLM2's")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--json")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    tok = smollm2_tokenizer()
    if args.template:
        tok.chat_template = Path(args.template).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sharegpt.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in sharegpt_conversations(args.rows)))
        rows = load_rows(str(path))
        workers = tokenize_processes(len(rows), args.workers)
        if workers < 2:
            raise SystemExit(f"{len(rows)} rows are tokenized in one process: give --rows {2 * MIN_ROWS_PER_WORKER} "
                             "or more, and --workers 2 or more")
        serial, serial_s = timed(rows, tok, args.max_length, 1)
        parallel, parallel_s = timed(rows, tok, args.max_length, workers)
    r = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
         "command": "python bench/plan_tokenize.py " + " ".join(sys.argv[1:]), "rows": len(rows),
         "tokens": serial.tokens_read, "max_length": args.max_length, "workers": workers,
         "template": f"template {Path(args.template).name}" if args.template else "SmolLM2's template",
         "serial_s": serial_s, "parallel_s": parallel_s, "serial_rows_per_s": len(rows) / serial_s,
         "parallel_rows_per_s": len(rows) / parallel_s, "speedup": serial_s / parallel_s,
         "identical": same(serial, parallel)}
    print(json.dumps(r, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2) + "\n")
    name = "plan-tokenize" + (f"-{Path(args.template).stem}" if args.template else "")
    publish(name, markdown(r), args.write_docs)
    if not r["identical"]:
        raise SystemExit("the worker processes' result differs from this process's")


if __name__ == "__main__":
    main()
