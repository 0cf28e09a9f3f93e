"""The drafter recipe (issue 24): extract, train, tau along the run, and the fp8 check, through the CLI.

    python bench/train_dflash.py [--work DIR] [--limit 6000] [--max-length 512] [--dtype bfloat16]
        [--epochs 2 | --steps N] [--every 500] [--prompts 32] [--max-new-tokens 64]
        [--codecs bf16-zstd,fp8] [--json docs/bench/train_dflash.json] [--png docs/train_curve_recipe.png]
        [--write-docs] [-- more `layertap train` arguments, which win over RECIPE]

1. `layertap extract` the first --limit ShareGPT conversations once per codec (lossless first),
   with the target's pre-norm final state (the `kl` objective's teacher);
2. `layertap train` a drafter on each with RECIPE, the same seed and batches, keeping a checkpoint
   every --every steps;
3. `layertap eval` the lossless drafter at every kept checkpoint (the learning curve, an untrained
   drafter as the baseline) and each codec's drafter at its last step, on --prompts held-out
   conversations (first exchange, taken after the training rows), --max-new-tokens each, greedy.
Every step goes through the command line; a rerun keeps what is finished in --work. Writes the raw
result (--json), the curve (--png) and, with --write-docs, the "train_dflash" section of
docs/benchmarks.md. On a shared CPU run it with OMP_NUM_THREADS set to the cores it may use.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._dflash import evaluate, kept_steps, layertap, plot, setup, smoothed, tau_se  # noqa: E402
from bench._report import cores, machine, write_section  # noqa: E402

# What measured best on CPU (docs/benchmarks.md "The drafter recipe"); bf16 autocast runs the
# drafter's step ~2x faster than fp32 on a CPU with AVX512-BF16 at the same loss curve.
RECIPE = ["--batch-size", "8", "--block-size", "4", "--max-anchors", "48", "--lr", "1e-3", "--objective", "ce+kl",
          "--mixed-precision", "bf16"]


def run_stats(run: Path) -> dict:
    """Samples and tokens a run stored, from `layertap status --json`."""
    p = subprocess.run([sys.executable, "-m", "layertap", "status", "--json", str(run)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    s = json.loads(p.stdout)
    return {"samples": s["samples_done"], "tokens": s["tokens_done"], "bytes_stored": s["bytes_stored"],
            "extract_tokens_per_s": s["tokens_per_s_average"]}


def train_stats(out: Path) -> dict:
    """The training's own metrics: time, input tokens/s, loss at the start and the end."""
    m = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train_s = sum(r["step_s"] for r in m)  # from the run's own metrics: a resumed run counts too
    return {"steps": m[-1]["step"], "train_s": train_s, "tokens_per_s": sum(r["tokens"] for r in m) / train_s,
            "loss_first10": sum(r["loss"] for r in m[:10]) / min(10, len(m)),
            "loss_last10": sum(r["loss"] for r in m[-10:]) / min(10, len(m)), "metrics": m}


def extract_run(work: Path, codec: str, model: list[str] | None, dataset: str | None, dtype: str, max_length: int,
                limit: int, log: Path, threads: int | None = None) -> Path:
    """`layertap extract` of the recipe's run in `codec` into work/run-CODEC (a rerun finds it done).
    With `model` None the embedded target goes unnamed, as a user's first extraction runs it."""
    run = work / f"run-{codec}"
    layertap("extract", *(model or []), *(["--dataset", dataset] if dataset else []), "--out", str(run), "--codec",
             codec, "--dtype", dtype, "--max-length", str(max_length), "--limit", str(limit), "--final-state",
             "prenorm", "--shard-bytes", "128MB", "--log-dir", str(work / f"logs-{codec}"), log=log, threads=threads)
    return run


def point(step: int, ev: dict) -> dict:
    return {"step": step, "tau": ev["tau"], "tau_se": tau_se(ev), "acceptance_per_position": ev["acceptance_per_position"],
            "matches_greedy": ev["matches_greedy"], "eval_s": ev["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-recipe")
    ap.add_argument("--limit", type=int, default=6000, help="ShareGPT conversations to extract (default 6000)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", help="the extraction's forward dtype (default bfloat16)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, help="optimizer steps instead of --epochs")
    ap.add_argument("--every", type=int, default=500, help="steps between checkpoints, each evaluated")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--eval-dtype", default="float32",
                    help="`layertap eval --dtype` (default float32: in bf16 a verified block and one-token steps round "
                         "differently, so greedy output can differ at near ties; 13 of 32 prompts did on CPU)")
    ap.add_argument("--codecs", default="bf16-zstd,fp8", help="lossless first; the others are checked against it")
    ap.add_argument("--model", help="target folder (default: the embedded SmolLM2)")
    ap.add_argument("--gguf-file", help="GGUF file inside --model")
    ap.add_argument("--dataset", help="JSON lines of ShareGPT rows (default: the embedded ShareGPT)")
    ap.add_argument("--json", default=str(ROOT / "docs" / "bench" / "train_dflash.json"))
    ap.add_argument("--png", default=str(ROOT / "docs" / "train_curve_recipe.png"))
    ap.add_argument("--side-by-side", action="store_true",
                    help="extract and train the codecs at once, each with OMP_NUM_THREADS = cores / codecs")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("train_args", nargs="*", help="after --: more `layertap train` arguments (they win)")
    args = ap.parse_args()
    work, log, model, prompts = setup(args.work, args.prompts, args.limit, args.model, args.gguf_file, args.dataset)
    schedule = ["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]
    train_args = [*RECIPE, *schedule, "--save-every", str(args.every), "--keep-checkpoints", "0", *args.train_args]
    evals = ["--dtype", args.eval_dtype]
    codecs = args.codecs.split(",")
    result: dict = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "machine": machine(),
                    "target": Path(args.model).name if args.model else "SmolLM2-135M-Instruct",
                    "recipe": {"limit": args.limit, "max_length": args.max_length, "extract_dtype": args.dtype,
                               "final_state": "prenorm", "train_args": train_args},
                    "eval": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "dtype": args.eval_dtype,
                             "greedy": True}, "codecs": {}}
    threads = max(1, cores() // len(codecs)) if args.side_by_side else None

    def prepare(codec: str) -> None:
        """Extract the run of `codec` and train its drafter (a rerun resumes both)."""
        out, codec_log = work / f"drafter-{codec}", work / f"log-{codec}.txt"
        run = extract_run(work, codec, model if args.model else None, args.dataset, args.dtype, args.max_length,
                          args.limit, codec_log, threads)
        resume = ["--resume"] if (out / "checkpoints" / "latest.json").exists() else []
        layertap("train", "--data", str(run), *model, "--out", str(out), *train_args, *resume, log=codec_log,
                 threads=threads)

    with ThreadPoolExecutor(len(codecs) if args.side_by_side else 1) as pool:
        list(pool.map(prepare, codecs))
    for codec in codecs:
        run, out = work / f"run-{codec}", work / f"drafter-{codec}"
        r = result["codecs"][codec] = {**run_stats(run), **train_stats(out)}
        metrics = r.pop("metrics")
        kept = kept_steps(out)  # every --every-th and the last; one just before the last is left out
        steps = [s for s in kept if s == kept[-1] or kept[-1] - s >= args.every // 2] if codec == codecs[0] else kept[-1:]
        r["curve"] = []
        for i, step in enumerate(steps):
            first = codec == codecs[0] and i == 0
            ev = evaluate(out, model, prompts, args.max_new_tokens, work / f"eval-{codec}-step{step:06d}.json", log,
                          step=step, baseline=first, extra=tuple(evals))
            if first:
                result["tau_untrained"] = ev["tau_untrained"]
            r["curve"].append(point(step, ev))
            print(f"{codec} step {step}: tau {ev['tau']:.3f}", flush=True)
        if codec == codecs[0]:
            loss = [m["loss"] for m in metrics]
            mean10 = dict(zip((m["step"] for m in metrics), smoothed(loss, 10)))
            for p in r["curve"]:
                p["loss_mean10"] = mean10[p["step"]]
            plot(Path(args.png), [m["step"] for m in metrics], loss, r["curve"], result["tau_untrained"],
                 f"{result['target']} drafter, {r['samples']} samples ({r['tokens']:,} tokens), "
                 f"{' '.join(train_args)}; tau on {args.prompts} held-out prompts x {args.max_new_tokens} tokens")
    lossless = result["codecs"][codecs[0]]
    last = lossless["curve"][-1]
    result.update(tau=last["tau"], tau_se=last["tau_se"], matches_greedy=all(
        p["matches_greedy"] for c in result["codecs"].values() for p in c["curve"]), steps=lossless["steps"],
        samples=lossless["samples"], tokens=lossless["tokens"])
    for codec in codecs[1:]:
        c = result["codecs"][codec]
        c["tau_vs_lossless"] = c["curve"][-1]["tau"] / last["tau"]
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "codecs"}, indent=1))
    if args.write_docs:
        write_section("train_dflash", markdown(result, args, codecs))


def markdown(result: dict, args: argparse.Namespace, codecs: list[str]) -> str:
    lossless = result["codecs"][codecs[0]]
    rows = "\n".join(f"| {p['step']} | {p['loss_mean10']:.3f} | **{p['tau']:.3f}** ± {p['tau_se']:.3f} | "
                     f"{' / '.join(f'{a:.2f}' for a in p['acceptance_per_position'][:3])} | {p['matches_greedy']} |"
                     for p in lossless["curve"])
    codec_rows = "\n".join(
        f"| {codec} | {c['bytes_stored'] / 2**30:.2f} GiB | {c['train_s'] / 60:.1f} min | {c['tokens_per_s']:,.0f} | "
        f"{c['loss_last10']:.3f} | {c['curve'][-1]['tau']:.3f} ± {c['curve'][-1]['tau_se']:.3f} | "
        f"{c.get('tau_vs_lossless', 1.0):.3f} | {c['curve'][-1]['matches_greedy']} |"
        for codec, c in result["codecs"].items())
    command = " ".join(["python bench/train_dflash.py", *(["--limit", str(args.limit)] if args.limit != 6000 else []),
                        *(["--steps", str(args.steps)] if args.steps else ["--epochs", str(args.epochs)]),
                        "--every", str(args.every), *(["--codecs", args.codecs] if args.codecs != "bf16-zstd,fp8" else []),
                        "--write-docs", *(["--", *args.train_args] if args.train_args else [])])
    rel_png = os.path.relpath(args.png, ROOT / "docs")
    return f"""## The drafter recipe: SmolLM2-135M-Instruct, ShareGPT, on CPU (issue 24)

`{command}`
({result['date']}, {result['machine']}; every step through the `layertap` command line; raw:
{os.path.relpath(args.json, ROOT)})

![loss and tau against steps]({rel_png})

Extraction: the first {args.limit} ShareGPT conversations, max length {args.max_length}, {args.dtype} forward,
`--final-state prenorm`: {lossless['samples']:,} samples with an answer token inside the max length,
{lossless['tokens']:,} tokens. Training: `{' '.join(result['recipe']['train_args'])}`
({lossless['steps']:,} steps). Eval: {args.prompts} held-out conversations (first exchange, after the training
rows), {args.max_new_tokens} new tokens each, greedy, target in {args.eval_dtype}. Untrained drafter: tau
{result['tau_untrained']:.3f}.

| step | loss (mean of 10 steps) | tau ± s.e. | acceptance, draft positions 1..3 | output == greedy |
|---:|---:|---:|---|---|
{rows}

| states stored as | stored | training time | input tokens/s | loss, last 10 steps | tau at the end | vs lossless | == greedy |
|---|---:|---:|---:|---:|---:|---:|---|
{codec_rows}
"""


if __name__ == "__main__":
    main()
