"""Does training on the target's own answers help? regenerate -> extract -> train -> eval on CPU,
with the real SmolLM2-135M-Instruct and ShareGPT, against the same pipeline on the original answers.

    python bench/regenerate_quality.py [--work DIR] [--limit 200] [--steps 120] [--prompts 12] [--write-docs]

1. The first --limit ShareGPT conversations, each cut to its first exchange (user, assistant).
2. `layertap regenerate --serve 'transformers serve SmolLM2 ...'`: the target, served on this
   CPU, answers every prompt (greedy, at most --max-answer-tokens new tokens).
3. `layertap extract` both datasets (original answers, regenerated answers) with the same settings.
4. `layertap train` a drafter on each: same drafter, steps and seed (bench/_dflash.py's CPU settings).
5. `layertap eval` both on the same held-out prompts (tau: mean accepted length per verify step).
Every step goes through the command line; a rerun skips what is done in --work. Run it with
OMP_NUM_THREADS=1 on a shared machine (see bench/_dflash.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from bench._dflash import CPU_TRAIN_ARGS, layertap, setup  # noqa: E402
from layertap.extract.embedded import sharegpt_conversations, smollm2_gguf  # noqa: E402


def first_exchanges(path: Path, n: int) -> int:
    """The first `n` conversations that open with a user turn and an answer, cut to that exchange."""
    kept = 0
    with open(path, "w") as f:
        for row in sharegpt_conversations(4 * n):
            turns = row["conversations"]
            if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
                f.write(json.dumps({"id": row["id"], "conversations": turns[:2]}) + "\n")
                kept += 1
                if kept == n:
                    break
    return kept


def served_model(work: Path) -> Path:
    """SmolLM2 as a plain transformers folder (the embedded GGUF, dequantized) for `transformers serve`."""
    folder = work / "smollm2-hf"
    if not (folder / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src, gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf)
        model.hf_quantizer = None  # dequantized on load: the same weights extract and eval use, as plain tensors
        del model.config.quantization_config
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(src, gguf_file=gguf).save_pretrained(folder)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-regenerate")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-answer-tokens", type=int, default=96)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    work, log, model, prompts = setup(args.work, args.prompts)
    original = work / "original.jsonl"
    rows = first_exchanges(original, args.limit)

    served, regenerated, port = served_model(work), work / "regenerated", free_port()
    serve = (f"{sys.executable} -m transformers.cli.transformers serve {served} --device cpu --dtype float32 "
             f"--host 127.0.0.1 --port {port}")
    timing = work / "regenerate-time.json"  # a rerun (e.g. with --write-docs) keeps the first run's time
    if timing.exists():
        regen_s = json.loads(timing.read_text())["wall_s"]
    elif (work / "result.json").exists():
        regen_s = json.loads((work / "result.json").read_text())["regenerate"]["wall_s"]
    else:
        regen_s = layertap("regenerate", "--dataset", str(original), "--out", str(regenerated), "--endpoint",
                           f"http://127.0.0.1:{port}/v1", "--model", str(served), "--serve", serve, "--serve-log",
                           str(work / "server.log"), "--max-tokens", str(args.max_answer_tokens), "--concurrency",
                           "2", "--rows-per-part", "25", log=log)
        timing.write_text(json.dumps({"wall_s": regen_s}))
    stats = [json.loads(p.read_text()) for p in sorted((regenerated / "stats").glob("*.json"))]
    generated = sum(s["completion_tokens"] for s in stats)
    results: dict[str, dict] = {"regenerate": {"rows": rows, "wall_s": regen_s, "generated_tokens": generated,
                                               "refused": sum(len(s["refused"]) for s in stats),
                                               "truncated": sum(s["truncated_turns"] for s in stats)}}
    for name, data in (("original", original), ("regenerated", regenerated)):
        run, out = work / f"run-{name}", work / f"drafter-{name}"
        layertap("extract", *model, "--dataset", str(data), "--out", str(run), "--dtype", "float32",
                 "--max-length", "256", "--shard-bytes", "32MB", "--log-dir", str(work / "logs"), log=log)
        resume = ["--resume"] if (out / "checkpoints" / "latest.json").exists() else []
        layertap("train", "--data", str(run), *model, "--out", str(out), "--steps", str(args.steps), *CPU_TRAIN_ARGS,
                 *resume, log=log)
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        r = results[name] = {"loss_first10": sum(m["loss"] for m in metrics[:10]) / 10,
                             "loss_last10": sum(m["loss"] for m in metrics[-10:]) / 10,
                             "acc1_last10": sum(m["acc_first"] for m in metrics[-10:]) / 10,
                             "train_tokens": sum(m["tokens"] for m in metrics)}
        report = work / f"eval-{name}-{args.prompts}p-{args.max_new_tokens}t.json"
        baseline = [] if name == "original" else ["--no-baseline"]
        if not report.exists() or not report.read_text().strip():
            with open(report, "w") as f:
                subprocess.run([sys.executable, "-m", "layertap", "eval", "--drafter", str(out), *model,
                                "--prompts", str(prompts), "--max-new-tokens", str(args.max_new_tokens), "--json",
                                *baseline], stdout=f, stderr=open(log, "a"), env=dict(os.environ, PYTHONPATH=str(ROOT)))
        r["eval"] = json.loads(report.read_text())
        print(name, json.dumps({k: v for k, v in r.items() if k != "eval"}), "tau", r["eval"]["tau"], flush=True)
    (work / "result.json").write_text(json.dumps(results, indent=1))
    reg, orig, new = results["regenerate"], results["original"], results["regenerated"]
    md = f"""## Regenerated answers vs the dataset's own: SmolLM2-135M-Instruct, ShareGPT, CPU (issue 22)

`python bench/regenerate_quality.py --limit {args.limit} --steps {args.steps} --prompts {args.prompts} --write-docs`
({datetime.now(timezone.utc):%Y-%m-%d}, {machine()}; every step through the `layertap` command line)

The first {rows} ShareGPT conversations, each cut to its first exchange, were regenerated by SmolLM2
itself (`layertap regenerate --serve 'transformers serve ...'` on this CPU, greedy, at most
{args.max_answer_tokens} new tokens: {reg['generated_tokens']:,} tokens generated in {reg['wall_s']:.0f} s,
{reg['generated_tokens'] / reg['wall_s']:.0f} tokens/s from a CPU server answering one request at a time, beside other
jobs; {reg['truncated']} answers cut at the limit, {reg['refused']} rows refused). Both datasets were extracted
and trained on with the same settings (max length 256; `{' '.join(CPU_TRAIN_ARGS)}`, {args.steps} steps, seed 0),
and evaluated on the same {orig['eval']['prompts']} held-out prompts ({args.max_new_tokens} new tokens, greedy).

| trained on | loss, first 10 steps | loss, last 10 steps | slot-1 accuracy, last 10 | **tau** (held-out) | speculative == greedy |
|---|---:|---:|---:|---:|---|
| the dataset's answers | {orig['loss_first10']:.3f} | {orig['loss_last10']:.3f} | {orig['acc1_last10']:.3f} | **{orig['eval']['tau']:.3f}** | {orig['eval']['matches_greedy']} |
| the target's own answers | {new['loss_first10']:.3f} | {new['loss_last10']:.3f} | {new['acc1_last10']:.3f} | **{new['eval']['tau']:.3f}** | {new['eval']['matches_greedy']} |

An untrained drafter scores tau {orig['eval']['tau_untrained']:.3f}. The drafters saw {orig['train_tokens']:,} and
{new['train_tokens']:,} input tokens (the regenerated answers are shorter: cut at {args.max_answer_tokens}).
One seed and {args.steps} CPU steps: both drafters are barely trained, so a difference of this size
is within what the order of batches alone changes; the comparison needs trained drafters (a GPU
and the recipe of issue 24) to show the effect the public pipelines regenerate for.
"""
    print(md)
    if args.write_docs:
        write_section("regenerate_quality", md)


if __name__ == "__main__":
    main()
