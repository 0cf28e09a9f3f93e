"""One recipe knob at a time (issue 24): tau at one step of the recipe's schedule, each knob changed alone.

    python bench/recipe_knobs.py [--work /tmp/layertap-bench-recipe] [--at 420]
        [--variant "--lr 3e-3" --variant "--max-anchors 96" ...] [--json docs/bench/recipe_knobs.json]

Uses the lossless run that bench/train_dflash.py extracts into --work (extracted here with the same
arguments when missing). Each variant trains the recipe (bench/train_dflash.py's RECIPE, --epochs 2,
the same seed, so the same data order and learning-rate schedule) with its arguments added, is
stopped by SIGTERM once its checkpoint at step --at is written (as a preemption stops it), and is
evaluated there on the recipe's held-out prompts. The baseline is the recipe's own point at --at,
read from --recipe-json (docs/bench/train_dflash.json): same run, schedule and prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._dflash import evaluate, setup  # noqa: E402
from bench._report import machine  # noqa: E402
from bench.train_dflash import RECIPE, extract_run, point  # noqa: E402

VARIANTS = ["--lr 3e-3", "--max-anchors 96", "--drafter-layers 4"]


def train_until(run: Path, model: list[str], out: Path, args: list[str], at: int, log: Path) -> dict:
    """`layertap train` with `args`, stopped by SIGTERM once the checkpoint at step `at` exists
    (a rerun finds it and trains nothing); its step times up to `at`."""
    latest = out / "checkpoints" / "latest.json"

    def reached() -> bool:
        return latest.exists() and json.loads(latest.read_text())["step"] >= at

    if not reached():
        resume = ["--resume"] if latest.exists() else []
        with open(log, "a") as f:
            cmd = ["train", "--data", str(run), *model, "--out", str(out), *args, *resume]
            f.write(f"\n$ layertap {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.Popen([sys.executable, "-m", "layertap", *cmd], stdout=f, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
            while p.poll() is None and not reached():
                time.sleep(2)
            p.send_signal(signal.SIGTERM)
            if p.wait() not in (0, 143):
                raise SystemExit(f"layertap train failed ({p.returncode}); see {log}")
    if not (out / "checkpoints" / f"step-{at:08d}").exists():
        raise SystemExit(f"{out} has no checkpoint at step {at}: give --at a multiple of the checkpoint interval")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    upto = [m for m in metrics if m["step"] <= at]
    return {"step_s_mean": sum(m["step_s"] for m in upto) / len(upto),
            "loss_mean10": sum(m["loss"] for m in upto[-10:]) / min(10, len(upto))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-recipe")
    ap.add_argument("--at", type=int, default=420, help="the step compared (a checkpoint step of the recipe run)")
    ap.add_argument("--variant", action="append", help=f"`layertap train` arguments added to the recipe "
                    f"(repeatable; default: {' | '.join(VARIANTS)})")
    ap.add_argument("--recipe-json", default=str(ROOT / "docs" / "bench" / "train_dflash.json"))
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "recipe_knobs.json"))
    args = ap.parse_args()
    recipe = json.loads(Path(args.recipe_json).read_text())
    base = next((p for p in recipe["codecs"]["bf16-zstd"]["curve"] if p["step"] == args.at), None)
    if base is None:
        raise SystemExit(f"{args.recipe_json} has no lossless point at step {args.at}")
    limit, prompts_n, new_tokens = recipe["recipe"]["limit"], recipe["eval"]["prompts"], recipe["eval"]["max_new_tokens"]
    work, log, model, prompts = setup(args.work, prompts_n, limit)
    run = extract_run(work, "bf16-zstd", model=None, dataset=None, dtype=recipe["recipe"]["extract_dtype"],
                      max_length=recipe["recipe"]["max_length"], limit=limit, log=log)
    epochs = recipe["recipe"]["train_args"][recipe["recipe"]["train_args"].index("--epochs") + 1]
    result = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "machine": machine(), "at_step": args.at,
              "recipe": [*RECIPE, "--epochs", epochs], "eval": recipe["eval"],
              "baseline": {"args": "", "tau": base["tau"], "tau_se": base["tau_se"], "loss_mean10": base["loss_mean10"],
                           "acceptance_per_position": base["acceptance_per_position"],
                           "matches_greedy": base["matches_greedy"], "source": os.path.relpath(args.recipe_json, ROOT)},
              "variants": []}
    for variant in args.variant or VARIANTS:
        slug = variant.strip("-").replace(" ", "-").replace("--", "")
        out = work / f"knob-{slug}"
        train = train_until(run, model, out, [*RECIPE, "--epochs", epochs, "--save-every", str(args.at),
                                              "--keep-checkpoints", "0", *variant.split()], args.at, log)
        ev = evaluate(out, model, prompts, new_tokens, work / f"eval-knob-{slug}-step{args.at:06d}.json", log,
                      step=args.at, extra=("--dtype", recipe["eval"]["dtype"]))
        row = {"args": variant, **point(args.at, ev), **train}
        row["tau_vs_baseline"] = row["tau"] - base["tau"]
        result["variants"].append(row)
        print(f"{variant}: tau {row['tau']:.3f} ± {row['tau_se']:.3f} (recipe {base['tau']:.3f}), "
              f"{row['step_s_mean']:.2f} s/step", flush=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")  # after each variant: each takes ~30 min on CPU
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=1))


if __name__ == "__main__":
    main()
