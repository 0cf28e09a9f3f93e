"""End-to-end proof of the trainer on CPU: the real SmolLM2-135M-Instruct, real ShareGPT chats.

    python bench/train_dflash.py [--work DIR] [--limit 300] [--steps 200] [--prompts 12] [--write-docs]

1. `layertap extract` the first --limit conversations twice: bf16-zstd (lossless) and fp8;
2. `layertap train` a drafter on each with the same settings and seed;
3. `layertap eval` both on held-out conversations (the --prompts after the first 1,000, each cut
   to its first exchange; the answer is dropped), with an untrained drafter as the baseline.
Every step goes through the command line, as a user would run it. Re-running skips finished
extractions, trainings and evaluations in --work (the first two resume from the store). On a
shared machine run it with OMP_NUM_THREADS=1: torch's spinning thread pool is many times slower
when other processes hold the cores (a 4-token verify step: 5.3 s with 2 threads, 0.8 s with 1).
Targets (issue 6): the loss falls well below its start; tau clearly above the untrained drafter's;
fp8's tau within 3% of the lossless one; speculative output equal to plain greedy decoding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from layertap.extract.embedded import sharegpt_conversations, smollm2_gguf  # noqa: E402

# The drafter and schedule for a CPU budget: blocks of 4 and 24 anchors per sample keep the
# 49k-token head's share of a step small; the full recipe is block 16 and 512 anchors.
TRAIN_ARGS = ["--batch-size", "4", "--block-size", "4", "--max-anchors", "24", "--lr", "1e-3", "--save-every", "50"]


def layertap(*args: str, log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "a") as f:
        f.write(f"\n$ layertap {' '.join(args)}\n")
        f.flush()
        p = subprocess.run([sys.executable, "-m", "layertap", *args], stdout=f, stderr=subprocess.STDOUT,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if p.returncode not in (0, 1):
        raise SystemExit(f"layertap {args[0]} failed ({p.returncode}); see {log}")
    return time.perf_counter() - t0


def held_out_prompts(path: Path, n: int, after: int = 1000, source: str | None = None) -> None:
    """`n` first exchanges of ShareGPT conversations from row `after` on: past every training row.
    `source`: a JSON-lines file of ShareGPT rows instead of the embedded ones (a GPU host without them)."""
    if source is None:
        rows = list(sharegpt_conversations(after + 4 * n))[after:]
    else:
        with open(source) as f:
            rows = [json.loads(line) for i, line in enumerate(f) if after <= i < after + 4 * n]
    with open(path, "w") as f:
        kept = 0
        for row in rows:
            turns = row["conversations"]
            if len(turns) >= 2 and turns[0]["from"] == "human" and len(turns[0]["value"]) < 600:
                f.write(json.dumps({"conversations": turns[:2]}) + "\n")
                kept += 1
            if kept == n:
                break


def setup(work_dir: str, prompts: int, after: int = 1000, model: str | None = None, gguf_file: str | None = None,
          source: str | None = None) -> tuple[Path, Path, list[str], Path]:
    """The work folder, its log, the target's `--model/--gguf-file` arguments (the embedded SmolLM2
    unless `model` is given) and `prompts` held-out prompts taken after the first `after`
    conversations (the training rows) of the embedded ShareGPT or of `source`."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    folder, gguf = (model, gguf_file) if model else smollm2_gguf()
    held_out = work / "prompts.jsonl"
    held_out_prompts(held_out, prompts, after, source)
    return work, work / "log.txt", ["--model", folder, *(["--gguf-file", gguf] if gguf else [])], held_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-train")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    work, log, model, prompts = setup(args.work, args.prompts)
    results: dict[str, dict] = {}
    for codec in ("bf16-zstd", "fp8"):
        run, out = work / f"run-{codec}", work / f"drafter-{codec}"
        r = results[codec] = {}
        layertap("extract", *model, "--out", str(run), "--codec", codec, "--dtype", "float32",
                                  "--max-length", "256", "--limit", str(args.limit), "--shard-bytes", "32MB",
                                  "--log-dir", str(work / "logs"), log=log)
        resume = ["--resume"] if (out / "checkpoints" / "latest.json").exists() else []
        layertap("train", "--data", str(run), *model, "--out", str(out), "--steps", str(args.steps),
                                *TRAIN_ARGS, *resume, log=log)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        r["loss_first10"] = sum(m["loss"] for m in metrics[:10]) / 10
        r["loss_last10"] = sum(m["loss"] for m in metrics[-10:]) / 10
        r["acc1_last10"] = sum(m["acc_first"] for m in metrics[-10:]) / 10
        r["train_s"] = sum(m["step_s"] for m in metrics)  # from the run's own metrics: a resumed run counts too
        r["tok_s"] = sum(m["tokens"] for m in metrics) / r["train_s"]
        r["data_wait"] = sum(m["data_wait_fraction"] * m["step_s"] for m in metrics) / sum(m["step_s"] for m in metrics)
        report = work / f"eval-{codec}-{args.prompts}p-{args.max_new_tokens}t.json"
        baseline = [] if codec == "bf16-zstd" else ["--no-baseline"]
        if not report.exists() or not report.read_text().strip():  # a finished eval is kept, like the rest
            with open(report, "w") as f:
                subprocess.run([sys.executable, "-m", "layertap", "eval", "--drafter", str(out), *model,
                                "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--json",
                                *baseline], stdout=f, stderr=open(log, "a"), env=dict(os.environ, PYTHONPATH=str(ROOT)))
        r["eval"] = json.loads(report.read_text())
        print(codec, json.dumps({k: v for k, v in r.items() if k != "eval"}), "tau", r["eval"]["tau"], flush=True)
    lossless, fp8 = results["bf16-zstd"], results["fp8"]
    ev, ev8 = lossless["eval"], fp8["eval"]
    ratio = ev8["tau"] / ev["tau"]
    md = f"""## DFlash trainer on CPU: SmolLM2-135M-Instruct, ShareGPT (issue 6)

`python bench/train_dflash.py --limit {args.limit} --steps {args.steps} --prompts {args.prompts} --write-docs`
({datetime.now(timezone.utc):%Y-%m-%d}, {machine()}; every step through the `layertap` command line)

Extraction: the first {args.limit} ShareGPT conversations, max length 256, float32 forward; drafter:
defaults sized from the target (2 layers, width 576, 9 heads), `{' '.join(TRAIN_ARGS)}`,
{args.steps} steps, seed 0. Eval: {ev['prompts']} held-out conversations (first exchange, the answer
dropped), {args.max_new_tokens} new tokens each, greedy.

| | lossless (bf16-zstd) | fp8 |
|---|---|---|
| training time, sum of {args.steps} step times | {lossless['train_s']:.0f} s | {fp8['train_s']:.0f} s |
| loss, mean of first 10 steps | {lossless['loss_first10']:.3f} | {fp8['loss_first10']:.3f} |
| loss, mean of last 10 steps | {lossless['loss_last10']:.3f} | {fp8['loss_last10']:.3f} |
| slot-1 accuracy, last 10 steps | {lossless['acc1_last10']:.3f} | {fp8['acc1_last10']:.3f} |
| training tokens/s (input tokens) | {lossless['tok_s']:,.0f} | {fp8['tok_s']:,.0f} |
| time waiting on data | {100 * lossless['data_wait']:.1f}% | {100 * fp8['data_wait']:.1f}% |
| **tau** (held-out) | **{ev['tau']:.3f}** | **{ev8['tau']:.3f}** ({ratio:.3f}x of lossless) |
| tau of the untrained drafter | {ev['tau_untrained']:.3f} | – |
| acceptance by draft position 1..3 | {' / '.join(f'{x:.2f}' for x in ev['acceptance_per_position'][:3])} | {' / '.join(f'{x:.2f}' for x in ev8['acceptance_per_position'][:3])} |
| speculative output == greedy | {ev['matches_greedy']} | {ev8['matches_greedy']} |

Times are from a machine shared with other jobs (load 5-7 on 2 cores), with
`OMP_NUM_THREADS=1` for the fp8 training and both evals and 2 threads for the lossless training:
compare the loss and tau columns, not the speeds. The eval took {ev['wall_s']:.0f} s (lossless,
with the untrained baseline) and {ev8['wall_s']:.0f} s (fp8). tau is low in absolute terms: 200 CPU
steps of a 2-layer drafter with blocks of 4 (the recipe trains 6 epochs of 800K samples with
blocks of 16); what this shows is the whole path working and the learning signal, lossless and fp8 alike.

Targets: loss well below its start; tau clearly above untrained; fp8 tau within 3% of lossless
({'met' if abs(1 - ratio) <= 0.03 else 'MISSED'}: {100 * (ratio - 1):+.1f}%); output equal to greedy.
"""
    print(md)
    if args.write_docs:
        write_section("train_dflash", md)


if __name__ == "__main__":
    main()
