"""A drafter's learning curve: loss and held-out tau against training steps, drawn to a PNG.

    python bench/learning_curve.py [--work DIR] [--limit 300] [--steps 200] [--every 50] [--prompts 8]
                                   [--write-docs] [-- extra `layertap train` arguments]

Trains one drafter (bench/_dflash.py's CPU target, data and settings unless overridden after
`--`), keeping every checkpoint (--save-every EVERY, --keep-checkpoints 0), then evaluates tau on
the same held-out prompts at each kept checkpoint (`layertap eval --step N`), with an untrained
drafter as the baseline. A recipe change then shows its effect along the run, not only at its end.
Writes docs/train_curve.png (loss and tau against steps), docs/bench/learning_curve.json and, with
--write-docs, the table in docs/benchmarks.md. A rerun keeps finished steps (extraction, training,
each eval). Run it with OMP_NUM_THREADS=1 on a shared CPU (see bench/_dflash.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from bench._dflash import CPU_TRAIN_ARGS, evaluate, kept_steps, layertap, plot, setup, smoothed  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-curve")
    ap.add_argument("--limit", type=int, default=300)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--png", default=str(ROOT / "docs" / "train_curve.png"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "learning_curve.json"))
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--section", default="learning_curve", help="docs/benchmarks.md section --write-docs replaces")
    ap.add_argument("--model", help="target folder (default: the embedded SmolLM2), e.g. on a GPU host without it")
    ap.add_argument("--gguf-file", help="GGUF file inside --model")
    ap.add_argument("--dataset", help="JSON lines of ShareGPT rows (default: the embedded ShareGPT): the first "
                                      "--limit train, held-out prompts come after them")
    ap.add_argument("--max-length", type=int, default=256, help="extraction's max length (default 256)")
    ap.add_argument("train_args", nargs="*", help="after --: more `layertap train` arguments (they win)")
    args = ap.parse_args()
    after = args.limit if args.dataset else max(1000, args.limit)
    work, log, model, prompts = setup(args.work, args.prompts, after, args.model, args.gguf_file, args.dataset)
    run, out = work / "run", work / "drafter"
    data = ["--dataset", args.dataset] if args.dataset else []
    layertap("extract", *model, *data, "--out", str(run), "--dtype", "float32", "--max-length", str(args.max_length),
             "--limit", str(args.limit), "--shard-bytes", "32MB", "--log-dir", str(work / "logs"), log=log)
    resume = ["--resume"] if (out / "checkpoints" / "latest.json").exists() else []
    base = [a for i, a in enumerate(CPU_TRAIN_ARGS) if "--save-every" not in CPU_TRAIN_ARGS[max(0, i - 1):i + 1]]
    train = [*base, "--save-every", str(args.every), "--keep-checkpoints", "0", *args.train_args]
    layertap("train", "--data", str(run), *model, "--out", str(out), "--steps", str(args.steps), *train, *resume,
             log=log)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = kept_steps(out)
    points = []
    for i, step in enumerate(kept):
        r = evaluate(out, model, prompts, args.max_new_tokens, work / f"eval-step{step:06d}.json", log, step=step,
                     baseline=i == 0)
        points.append({"step": step, "tau": r["tau"], "acceptance_per_position": r["acceptance_per_position"],
                       "matches_greedy": r["matches_greedy"], "tau_untrained": r.get("tau_untrained")})
        print(f"step {step}: tau {r['tau']:.3f}", flush=True)
    untrained = points[0]["tau_untrained"]
    loss = [m["loss"] for m in metrics]
    target = Path(args.model).name if args.model else "SmolLM2-135M-Instruct"
    title = (f"{target} drafter, {args.limit} ShareGPT chats, {' '.join(train)}; "
             f"tau on {args.prompts} held-out prompts x {args.max_new_tokens} tokens")
    plot(Path(args.png), [m["step"] for m in metrics], loss, points, untrained, title)
    result = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "machine": machine(), "limit": args.limit,
              "steps": args.steps, "train_args": train, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "tau_untrained": untrained, "points": points,
              "loss_mean10": [{"step": m["step"], "loss": s} for m, s in zip(metrics, smoothed(loss, 10))
                              if m["step"] in kept]}
    Path(args.json).write_text(json.dumps(result, indent=1))
    rows = "\n".join(f"| {p['step']} | {next(x['loss'] for x in result['loss_mean10'] if x['step'] == p['step']):.3f} "
                     f"| {p['tau']:.3f} | {' / '.join(f'{a:.2f}' for a in p['acceptance_per_position'][:3])} "
                     f"| {p['matches_greedy']} |" for p in points)
    png = os.path.relpath(args.png, ROOT / "docs")
    extra = "" if args.section == "learning_curve" else (f" --work {args.work} --png {args.png} --json {args.json} "
                                                         f"--section {args.section}")
    md = f"""## Learning curve: loss and tau against steps, {args.limit} conversations x {args.steps} steps (issue 24)

`python bench/learning_curve.py --limit {args.limit} --steps {args.steps} --every {args.every} --prompts {args.prompts}{extra} --write-docs`
({result['date']}, {machine()}; raw: {os.path.relpath(args.json, ROOT)})

![loss and tau against steps]({png})

{target} target, the first {args.limit} ShareGPT conversations (max length {args.max_length}),
`{' '.join(train)}`; tau on {args.prompts} held-out prompts, {args.max_new_tokens} new tokens each,
greedy, at every kept checkpoint (`layertap eval --step N`). Untrained drafter: tau {untrained:.3f}.

| step | loss (mean of last 10 steps) | tau | acceptance, draft positions 1..3 | output == greedy |
|---:|---:|---:|---|---|
{rows}
"""
    print(md)
    if args.write_docs:
        write_section(args.section, md)


if __name__ == "__main__":
    main()
