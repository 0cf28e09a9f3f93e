"""What the drafter benches share: the `layertap` command line as a user runs it, held-out prompts,
evaluation at a checkpoint, tau's standard error, and the loss/tau plot.

On a shared CPU run the benches with OMP_NUM_THREADS=1: torch's spinning thread pool is many times
slower when other processes hold the cores (a 4-token verify step: 5.3 s with 2 threads, 0.8 s with 1).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The drafter and schedule for a small CPU budget: blocks of 4 and 24 anchors per sample keep the
# 49k-token head's share of a step small; the full recipe is block 16 and 512 anchors.
CPU_TRAIN_ARGS = ["--batch-size", "4", "--block-size", "4", "--max-anchors", "24", "--lr", "1e-3", "--save-every", "50"]


def layertap(*args: str, log: Path, threads: int | None = None) -> float:
    """Run `layertap ARGS` with its output appended to `log` (and OMP_NUM_THREADS=`threads` when
    given); the wall seconds it took."""
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(ROOT), **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    with open(log, "a") as f:
        f.write(f"\n$ layertap {' '.join(args)}\n")
        f.flush()
        p = subprocess.run([sys.executable, "-m", "layertap", *args], stdout=f, stderr=subprocess.STDOUT, env=env)
    if p.returncode != 0:  # 1 too: an incomplete extraction, a traceback (its numbers would be an older run's)
        raise SystemExit(f"layertap {args[0]} failed ({p.returncode}); see {log}")
    return time.perf_counter() - t0


def held_out_prompts(path: Path, n: int, after: int = 1000, source: str | None = None) -> None:
    """`n` first exchanges of ShareGPT conversations from row `after` on: past every training row.
    `source`: a JSON-lines file of ShareGPT rows instead of the embedded ones (a GPU host without them).
    Rows whose first turn is not a short human message are passed over; too few rows is an error."""
    kept = 0
    with open(path, "w") as f:
        for row in _rows_from(after, source):
            turns = row["conversations"]
            if len(turns) >= 2 and turns[0]["from"] == "human" and len(turns[0]["value"]) < 600:
                f.write(json.dumps({"conversations": turns[:2]}) + "\n")
                kept += 1
                if kept == n:
                    return
    raise SystemExit(f"only {kept} of {n} held-out prompts after row {after} of {source or 'the embedded ShareGPT'}")


def _rows_from(after: int, source: str | None) -> Iterator[dict]:
    """ShareGPT rows from row `after` on, of `source` (JSON lines) or of the embedded ShareGPT."""
    if source is None:
        from layertap.extract.embedded import sharegpt_conversations

        yield from itertools.islice(sharegpt_conversations(), after, None)
        return
    with open(source) as f:
        for line in itertools.islice(f, after, None):
            yield json.loads(line)


def setup(work_dir: str, prompts: int, after: int = 1000, model: str | None = None, gguf_file: str | None = None,
          source: str | None = None) -> tuple[Path, Path, list[str], Path]:
    """The work folder, its log, the target's `--model/--gguf-file` arguments (the embedded SmolLM2
    unless `model` is given) and `prompts` held-out prompts taken after the first `after`
    conversations (the training rows) of the embedded ShareGPT or of `source`."""
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    if model:
        folder, gguf = model, gguf_file
    else:
        from layertap.extract.embedded import smollm2_gguf

        folder, gguf = smollm2_gguf()
    held_out = work / "prompts.jsonl"
    held_out_prompts(held_out, prompts, after, source)
    return work, work / "log.txt", ["--model", folder, *(["--gguf-file", gguf] if gguf else [])], held_out


def evaluate(drafter: Path, model: list[str], prompts: Path, max_new_tokens: int, report: Path, log: Path,
             step: int | None = None, baseline: bool = False, extra: tuple[str, ...] = ()) -> dict:
    """`layertap eval --json` of `drafter` (the checkpoint at `step` when given), kept in `report`:
    a rerun reads a finished report instead of evaluating again, if it was made with the same
    prompts and settings (the report's name carries their digest: another --prompts or
    --max-new-tokens in the same work folder reused the old tau)."""
    settings = [hashlib.sha256(prompts.read_bytes()).hexdigest(), max_new_tokens, step, baseline, *extra, *model]
    digest = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:12]
    report = report.with_name(f"{report.stem}-{digest}{report.suffix}")
    if not report.exists() or not report.read_text().strip():
        with open(report, "w") as f, open(log, "a") as err:
            subprocess.run([sys.executable, "-m", "layertap", "eval", "--drafter", str(drafter), *model, "--prompts",
                            str(prompts), "--max-new-tokens", str(max_new_tokens), "--json",
                            *([] if step is None else ["--step", str(step)]), *([] if baseline else ["--no-baseline"]),
                            *extra], stdout=f, stderr=err, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return json.loads(report.read_text())


def tau_se(ev: dict) -> float:
    """The standard error of tau: K, the drafts accepted per verify step, has P(K >= k) =
    acceptance_per_position[k-1], so E[K] = sum a_k and E[K^2] = sum (2k - 1) a_k."""
    a = ev["acceptance_per_position"]
    mean = sum(a)
    square = sum((2 * k + 1) * x for k, x in enumerate(a))
    return max(0.0, square - mean * mean) ** 0.5 / max(1, ev["verify_steps"]) ** 0.5


def kept_steps(drafter: Path) -> list[int]:
    """The steps of the checkpoints a training output kept, ascending."""
    return sorted(int(p.name.removeprefix("step-")) for p in (drafter / "checkpoints").glob("step-*"))


def smoothed(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` steps: per-step losses of small batches are noisy."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(path: Path, steps: list[int], loss: list[float], points: list[dict], untrained: float, title: str) -> None:
    """Two panels: the training loss per step (and its 10-step mean), held-out tau at each checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.plot(steps, loss, lw=1, alpha=0.35, label="loss per step")
    a.plot(steps, smoothed(loss, 10), lw=2, label="mean of 10 steps")
    a.set_xlabel("step"), a.set_ylabel("training loss"), a.legend(), a.grid(alpha=0.3)
    b.plot([p["step"] for p in points], [p["tau"] for p in points], "o-", lw=2, label="trained")
    b.axhline(untrained, color="grey", ls="--", label=f"untrained ({untrained:.3f})")
    b.set_xlabel("step"), b.set_ylabel("tau (held-out, greedy)"), b.legend(), b.grid(alpha=0.3)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
