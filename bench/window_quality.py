"""A window run against the same samples trained offline: loss, acc and tau on SmolLM2 (issue 20).

    python bench/window_quality.py [--work DIR] [--rows 96] [--json OUT] [--write-docs]
    python bench/window_quality.py --report OUT [--write-docs]   # the docs section of a saved run

Every run goes through the `layertap` command line, on CPU, with the real SmolLM2-135M-Instruct
and the first --rows ShareGPT conversations (both from their wheels), into local folders:

1. offline: `layertap extract` (no window), then `layertap train --epochs 1` and `layertap eval`;
2. window: `layertap train --follow --delete-consumed --steps S` started first, S the offline run's
   step count, then `layertap extract --window W` beside it (same rows, same training settings and
   seed), then `layertap eval`;
3. window, planned steps (skipped with --no-planned): the same without --steps, as a user runs it.
   Follow mode sizes its epoch from the samples the manifest's plan stores (known before any shard
   exists: its rows less those the planner found extraction skips), so it should take the offline
   run's steps; before plans counted skips, those rows became padding, the last steps padding
   alone, and the learning-rate schedule was stretched over them.

The window is sized to delete for real and still not stall: a shard counts as consumed only once
every sample of it left the consumers' shuffle buffers and a checkpoint covers it, so W must
exceed consumers x (shuffle buffer + samples per checkpoint) x the largest shard. With one
consumer, --shuffle-buffer 4, --save-every 2 and batch 4 that is 12 shards; --shard-bytes 1MB puts
one sample in a shard (up to ~3 MB at 512 tokens), so --window 48MB is about a third of the
96-row run (~145 MB).

Reported: each run's loss curve and final loss / slot-1 accuracy, tau on held-out prompts, the
steps and tokens each trained on (metrics.jsonl) against the run's committed samples and tokens,
the peak bytes at rest under shards/ of the window runs (a watcher thread sums the data objects
every 0.5 s) against the offline run's total, and wall times. The runs see the same samples in a
different order (follow mode's order comes from the commit order, offline's from the seeded
shuffle of the complete run), so their losses differ by order effects; one seed per run cannot
say more than that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import machine, write_section  # noqa: E402
from bench._dflash import held_out_prompts  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def log(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def start(args: list[str], logfile: Path) -> subprocess.Popen:
    f = open(logfile, "a")
    f.write(f"\n$ layertap {' '.join(args)}\n")
    f.flush()
    return subprocess.Popen([sys.executable, "-m", "layertap", *args], stdout=f, stderr=subprocess.STDOUT, env=ENV)


def finish(p: subprocess.Popen, what: str, logfile: Path) -> None:
    if p.wait() != 0:
        raise SystemExit(f"{what} failed (rc {p.returncode}); see {logfile}")


class AtRest:
    """Peak of the bytes of the data objects (*.lts) under `run/shards/`, polled every `every` s."""

    def __init__(self, run: Path, every: float = 0.5):
        self.dir, self.every = run / "shards", every
        self.peak = self.peak_objects = self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def measure(self) -> tuple[int, int]:
        total = n = 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            return 0, 0
        for e in entries:
            if e.name.endswith(".lts"):
                try:
                    total += e.stat().st_size
                    n += 1
                except FileNotFoundError:  # deleted since the listing
                    pass
        return total, n

    def _poll(self) -> None:
        while True:
            b, n = self.measure()
            self.samples += 1
            if b > self.peak:
                self.peak, self.peak_objects = b, n
            if self._stop.wait(self.every):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def run_facts(run: Path) -> dict:
    """Samples, tokens and stored bytes of an extraction, from its tally names
    (`{shard}.r{records}.t{tokens}.b{bytes}...`), and the consumed markers."""
    samples = tokens = stored = shards = 0
    for p in (run / "tally").iterdir():
        fields = {f[0]: f[1:] for f in p.name.split(".")[1:] if f[:1] in "rtb"}
        samples += int(fields["r"])
        tokens += int(fields["t"])
        stored += int(fields["b"])
        shards += 1
    consumed = run / "consumed" / "shards"
    largest = max((int(f[1:]) for p in (run / "tally").iterdir() for f in p.name.split(".")[1:] if f[:1] == "b"),
                  default=0)
    return {"shards": shards, "samples": samples, "tokens": tokens, "bytes_stored": stored, "largest_shard": largest,
            "consumed_markers": len(list(consumed.iterdir())) if consumed.exists() else 0,
            "data_objects_left": len(list((run / "shards").glob("*.lts")))}


def train_facts(out: Path) -> dict:
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    state = json.loads((out / latest["prefix"] / "state.json").read_text())
    # each rank's position in a file of its own (in state.json before)
    loader = state.get("loader") or [json.loads(p.read_text()) for p in
                                     sorted((out / latest["prefix"] / state["loader_states"]).glob("rank-*.json"))]
    data = [m for m in metrics if m["loss"] is not None]  # a step of padding alone has no loss (null)
    last = data[-4:]
    return {
        "steps": len(metrics),
        "padding_only_steps": len(metrics) - len(data),
        "loss_curve": [round(m["loss"], 4) if m["loss"] is not None else None for m in metrics],
        "acc_curve": [round(m["acc_first"], 4) for m in metrics],
        "loss_first": data[0]["loss"],
        "loss_final": data[-1]["loss"],
        "loss_last4": sum(m["loss"] for m in last) / len(last),
        "acc_final": data[-1]["acc_first"],
        "acc_last4": sum(m["acc_first"] for m in last) / len(last),
        "tokens_trained": sum(m["tokens"] for m in metrics),
        "train_s_steps": sum(m["step_s"] for m in metrics),
        "data_wait_s": sum(m["data_wait_fraction"] * m["step_s"] for m in metrics),
        "loader_state": loader,
    }


def evaluate(out: Path, prompts: Path, args, logfile: Path) -> dict:
    report = out.parent / f"eval-{out.name}.json"
    t0 = time.perf_counter()
    with open(report, "w") as f, open(logfile, "a") as err:
        p = subprocess.run([sys.executable, "-m", "layertap", "eval", "--drafter", str(out), "--prompts", str(prompts),
                            "--max-new-tokens", str(args.max_new_tokens), "--json", "--no-baseline"],
                           stdout=f, stderr=err, env=ENV)
    if p.returncode != 0:
        raise SystemExit(f"eval of {out} failed (rc {p.returncode}); see {logfile}")
    ev = json.loads(report.read_text())
    ev["wall_s"] = time.perf_counter() - t0
    return ev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/tmp/layertap-bench-window-quality")
    ap.add_argument("--rows", type=int, default=96, help="ShareGPT rows extracted (default 96)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--shuffle-buffer", type=int, default=4)
    ap.add_argument("--shard-bytes", default="1MB")
    ap.add_argument("--window", default="48MB")
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--no-planned", action="store_true",
                    help="skip the third run: the window run with follow mode's own step count")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--write-docs", action="store_true")
    ap.add_argument("--report", help="no run: print (and with --write-docs write) the section of a saved --json")
    args = ap.parse_args()
    if args.report:
        res = json.loads(Path(args.report).read_text())
        md = markdown(res, argparse.Namespace(**res["args"]))
        print(md)
        if args.write_docs:
            write_section("window_quality", md)
        return
    work = Path(args.work)
    if work.exists() and any(work.iterdir()):
        raise SystemExit(f"{work} is not empty: give a fresh --work (both runs start from nothing)")
    work.mkdir(parents=True, exist_ok=True)
    logfile = work / "log.txt"
    load_start = os.getloadavg()
    t_all = time.perf_counter()
    prompts = work / "prompts.jsonl"
    # the benches' held-out prompts (first exchanges of conversations 1000..); it looks at only 4 rows
    # per prompt asked and keeps fewer than asked for small counts: ask for 4x, keep the first --prompts
    held_out_prompts(prompts, 4 * args.prompts)
    prompts.write_text("".join(prompts.read_text().splitlines(keepends=True)[:args.prompts]))

    extract_args = ["--limit", str(args.rows), "--max-length", str(args.max_length), "--dtype", "float32",
                    "--shard-bytes", args.shard_bytes, "--log-dir", str(work / "logs")]
    train_args = ["--epochs", "1", "--seed", str(args.seed), "--batch-size", str(args.batch_size), "--block-size", "4",
                  "--max-anchors", "24", "--lr", "1e-3", "--save-every", str(args.save_every), "--log-every", "4",
                  "--shuffle-buffer", str(args.shuffle_buffer), "--drafter-layers", str(args.drafter_layers),
                  "--log-dir", str(work / "logs")]
    res: dict = {"args": vars(args), "extract_args": extract_args, "train_args": train_args,
                 "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                 "omp_num_threads": ENV["OMP_NUM_THREADS"], "load_start": load_start, "code_start": code_version()}

    # 1. offline
    run, out = work / "offline-run", work / "offline-drafter"
    log("offline: extract")
    t0 = time.perf_counter()
    finish(start(["extract", "--out", str(run), *extract_args], logfile), "offline extract", logfile)
    t_extract = time.perf_counter() - t0
    log(f"offline: extract {t_extract:.0f} s; train")
    t0 = time.perf_counter()
    finish(start(["train", "--data", str(run), "--out", str(out), *train_args], logfile), "offline train", logfile)
    t_train = time.perf_counter() - t0
    log(f"offline: train {t_train:.0f} s; eval")
    off = {"run": run_facts(run), "train": train_facts(out), "extract_wall_s": t_extract, "train_wall_s": t_train}
    off["eval"] = evaluate(out, prompts, args, logfile)
    off["peak_at_rest"] = off["run"]["bytes_stored"]  # everything stays
    log(f"offline: tau {off['eval']['tau']:.3f}, loss {off['train']['loss_final']:.3f}")
    res["offline"] = off

    # 2. window, with the offline run's step count (same samples, same learning-rate schedule), and
    # 3. window with the step count follow mode takes by itself (the manifest's planned samples)
    res["window"] = window_run(work, "window", extract_args, train_args + ["--steps", str(off["train"]["steps"])],
                               prompts, args, logfile)
    if not args.no_planned:
        res["window_planned"] = window_run(work, "window-planned", extract_args, train_args, prompts, args, logfile)
    res["stalled_logged"] = "STALLED" in logfile.read_text()
    res["wall_s"] = time.perf_counter() - t_all
    res["load_end"] = os.getloadavg()
    res["code_end"] = code_version()
    if res["code_end"] != res["code_start"]:
        log(f"WARNING: the code changed during the runs ({res['code_start']} -> {res['code_end']}): not comparable")
    for name in ("offline", "window", "window_planned"):
        if name not in res:
            continue
        r = res[name]
        r["samples_trained"] = samples_trained(r["train"]["loader_state"], r["train"]["steps"], args.batch_size,
                                               r["run"]["samples"])
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1) + "\n")
    md = markdown(res, args)
    print(md)
    if args.write_docs:
        write_section("window_quality", md)


def window_run(work: Path, name: str, extract_args: list[str], train_args: list[str], prompts: Path, args,
               logfile: Path) -> dict:
    """The trainer first (it waits for the manifest), `extract --window` beside it, then eval."""
    run, out = work / f"{name}-run", work / f"{name}-drafter"
    watcher = AtRest(run)
    log(f"{name}: train --follow --delete-consumed and extract --window {args.window}")
    t0 = time.perf_counter()
    trainer = start(["train", "--data", str(run), "--out", str(out), *train_args, "--follow", "--follow-poll-s", "2",
                     "--delete-consumed"], logfile)
    extractor = start(["extract", "--out", str(run), *extract_args, "--window", args.window], logfile)
    t_extract_end = t_train_end = None
    while t_extract_end is None or t_train_end is None:
        if t_extract_end is None and extractor.poll() is not None:
            t_extract_end = time.perf_counter() - t0
            log(f"{name}: extract done ({t_extract_end:.0f} s, rc {extractor.returncode})")
        if t_train_end is None and trainer.poll() is not None:
            t_train_end = time.perf_counter() - t0
            log(f"{name}: train done ({t_train_end:.0f} s, rc {trainer.returncode})")
        if extractor.returncode not in (None, 0) or trainer.returncode not in (None, 0):
            for p in (extractor, trainer):
                if p.poll() is None:
                    p.terminate()
            raise SystemExit(f"{name} run failed (extract rc {extractor.returncode}, train rc {trainer.returncode}); "
                             f"see {logfile}")
        time.sleep(0.5)
    watcher.stop()
    win = {"train_args": train_args, "run": run_facts(run), "train": train_facts(out), "extract_wall_s": t_extract_end,
           "train_wall_s": t_train_end, "both_wall_s": max(t_extract_end, t_train_end),
           "peak_at_rest": watcher.peak, "peak_at_rest_objects": watcher.peak_objects, "watch_polls": watcher.samples}
    win["moved_without_data"] = moved_without_data(out, win["train"])
    win["eval"] = evaluate(out, prompts, args, logfile)
    log(f"{name}: tau {win['eval']['tau']:.3f}, loss {win['train']['loss_final']:.3f}, peak at rest "
        f"{win['peak_at_rest'] / 1e6:.1f} MB")
    return win


def moved_without_data(out: Path, train: dict) -> dict | None:
    """The largest weight change between the two newest kept checkpoints when both come after the
    last step that had data (steps of padding alone), else None."""
    from safetensors.torch import load_file

    last_data = train["steps"] - train["padding_only_steps"]
    kept = sorted(p for p in (out / "checkpoints").glob("step-*") if (p / "drafter.safetensors").exists())
    steps = [int(p.name.removeprefix("step-")) for p in kept]
    if len(kept) < 2 or steps[-2] < last_data or train["padding_only_steps"] == 0:
        return None
    a, b = load_file(kept[-2] / "drafter.safetensors"), load_file(kept[-1] / "drafter.safetensors")
    return {"from_step": steps[-2], "to_step": steps[-1], "last_data_step": last_data,
            "max_abs": max(float((a[k] - b[k]).abs().max()) for k in a)}


def samples_trained(loader: list[dict], steps: int, batch: int, committed: int) -> dict:
    """Samples taken by the steps (steps x batch, padding included), what the final checkpoint's
    loader state holds (a finished epoch: its sample count; a follow epoch stopped by --steps: the
    samples each consumer yielded), and the run's committed samples."""
    st = loader[0]
    return {"steps_x_batch": steps * batch, "state_num_samples": st.get("num_samples"),
            "state_consumer_yielded": st.get("consumed"), "state_epoch": st.get("epoch"), "committed": committed}


def code_version() -> str:
    """HEAD of the checkout the `layertap` subprocesses import, with +dirty when train/, extract/,
    manifests/ or storage/ differ from it (the runs must all use the same code)."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = git("status", "--porcelain", "--", "train", "extract", "manifests", "storage")
    return git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


COLUMNS = (("offline", "offline"), ("window", "window, --steps = offline's"),
           ("window_planned", "window, follow mode's own step count"))


TIMES = (" Times are from a shared 2-core machine (load averages above); a window run's extraction and training "
         "share the cores, so its wall times are not a speed comparison.")


def reading(res: dict) -> str:
    """What the comparison shows, from the numbers."""
    off, win = res["offline"], res["window"]
    o, w = off["train"], win["train"]
    slots = o["steps"] * res["args"]["batch_size"]
    extra = w["tokens_trained"] - win["run"]["tokens"]
    if o["steps"] == w["steps"] and o["tokens_trained"] == off["run"]["tokens"] and off["run"]["samples"] == win["run"]["samples"]:
        once = (f"The offline run and the window run with the same --steps took the same {o['steps']} steps: "
                f"{slots} batch slots for {off['run']['samples']} committed samples, the rest padding. Offline's "
                "tokens summed over metrics.jsonl equal the committed tokens; "
                + ("so do the window run's (its padding is a zero-weighted stand-in of no counted tokens)"
                   if extra == 0 else f"the window run's exceed them by {extra:,}"
                   + (", one padding slot (a zero-weighted repeat of a sample, whose tokens are counted)"
                      if 0 < extra <= res["args"]["max_length"] * (slots - win["run"]["samples"]) else ""))
                + ". That is what training every committed sample once gives (a repeat or a miss would change the "
                "sums); the sample ids themselves are not compared (metrics.jsonl keeps only an order-dependent "
                "digest per step).")
    else:
        once = "The offline run and the window run did NOT take the same steps or samples (see the table)."
    ratio = win["peak_at_rest"] / off["peak_at_rest"] if off["peak_at_rest"] else float("nan")
    dl = w["loss_last4"] - o["loss_last4"]
    def accepted(ev: dict) -> str:
        return f"{round((ev['tau'] - 1) * ev['verify_steps'])}" if "verify_steps" in ev else "?"  # tau - 1 per step

    tau = (f"tau is {off['eval']['tau']:.3f} offline and {win['eval']['tau']:.3f} in the window run (an untrained "
           f"drafter scores 1.000): {accepted(off['eval'])} and {accepted(win['eval'])} accepted draft tokens in "
           f"{off['eval'].get('verify_steps', '?')} and {win['eval'].get('verify_steps', '?')} verify steps. At "
           f"this size (a 1-layer drafter, {o['steps']} steps of {res['args']['batch_size']} samples) neither drafter "
           "is meaningfully trained, so this neither shows nor rules out a quality cost of the window; it shows both "
           "drafters load, draft and keep the output equal to greedy decoding. Comparing tau needs trained drafters "
           "(hundreds of steps) and several seeds, to see the spread order alone causes.")
    text = (f"Reading. {once} The order differs: follow mode feeds its shuffle buffer in commit order, offline "
            "shuffles the complete run with the seed, so the batches differ step by step and so do the loss "
            f"curves; the mean loss of the last 4 steps differs by {dl:+.3f} (window minus offline). With one seed "
            "and one order per run this cannot separate an order effect from anything else; what the window "
            "changes by construction is the order only (same samples, steps, learning-rate schedule and initial "
            f"weights). {tau} The window run held at most {win['peak_at_rest'] / 1e6:.1f} MB of shard data at rest "
            f"({100 * ratio:.0f}% of the offline run's {off['peak_at_rest'] / 1e6:.1f} MB), deleted "
            f"{win['run']['consumed_markers']} of {win['run']['shards']} shards' data, and "
            + ("never stalled (no STALLED in the logs)." if not res["stalled_logged"]
               else "a STALLED line is in the logs (the window was too small for what training holds back)."))
    if "window_planned" in res:
        p = res["window_planned"]
        t = p["train"]
        if not t["padding_only_steps"]:
            return text + (f"\n\nThe third column is what a user gets without --steps: follow mode sizes its epoch "
                           f"by the samples the manifest's plan stores ({p['run']['samples']} of "
                           f"{res['args']['rows']} rows: the planner tokenizes as extraction does, so it knows the rows "
                           f"extraction skips), so it takes {t['steps']} steps (offline: {o['steps']}), none of padding "
                           "alone." + TIMES)
        text += (f"\n\nThe third column is what a user gets without --steps: follow mode sizes its epoch from the "
                 f"manifest's planned samples ({res['args']['rows']} rows), not the committed ones "
                 f"({p['run']['samples']}: extraction skips rows it cannot use), so it takes {t['steps']} steps, "
                 f"the last {t['padding_only_steps']} of them padding alone (loss NaN in metrics.jsonl, "
                 f"{t['tokens_trained'] - p['run']['tokens']:,} padding tokens counted as trained), and its "
                 "cosine learning-rate schedule is stretched over them. Those steps have zero gradients, but AdamW "
                 "still moves the weights with its momentum")
        moved = p.get("moved_without_data")
        text += (f" (between checkpoints {moved['from_step']} and {moved['to_step']}, both after the last data step, "
                 f"the largest weight change is {moved['max_abs']:.2e})." if moved else ".")
    return text + TIMES


def markdown(res: dict, args) -> str:
    cols = [(k, label) for k, label in COLUMNS if k in res]
    runs = [res[k] for k, _ in cols]
    mb = 1e6

    def row(name: str, cell) -> str:
        return f"| {name} | " + " | ".join(cell(r) for r in runs) + " |"

    def loss_at(r: dict, s: int) -> str:
        c = r["train"]["loss_curve"]
        return "–" if s > len(c) else ("none (padding)" if c[s - 1] is None else f"{c[s - 1]:.3f}")

    longest = max(len(r["train"]["loss_curve"]) for r in runs)
    every = max(1, len(res["offline"]["train"]["loss_curve"]) // 10)
    curve = "\n".join(f"| {s} | " + " | ".join(loss_at(r, s) for r in runs) + " |"
                       for s in range(every, longest + 1, every))
    rows = [
        row("samples committed / tokens", lambda r: f"{r['run']['samples']} / {r['run']['tokens']:,}"),
        row("steps (of them padding alone)", lambda r: f"{r['train']['steps']} ({r['train']['padding_only_steps']})"),
        row("tokens trained (metrics.jsonl)", lambda r: f"{r['train']['tokens_trained']:,}"),
        row("loss, first step", lambda r: f"{r['train']['loss_first']:.3f}"),
        row("loss, last step with data / mean of last 4", lambda r: f"{r['train']['loss_final']:.3f} / "
            f"{r['train']['loss_last4']:.3f}"),
        row("slot-1 accuracy, last step with data / last 4", lambda r: f"{r['train']['acc_final']:.3f} / "
            f"{r['train']['acc_last4']:.3f}"),
        row("**tau** (held-out)", lambda r: f"**{r['eval']['tau']:.3f}**"),
        row("acceptance by draft position 1..3",
            lambda r: " / ".join(f"{x:.2f}" for x in r["eval"].get("acceptance_per_position", [])[:3])),
        row("speculative output == greedy", lambda r: str(r["eval"]["matches_greedy"])),
        row("shards; data deleted; data objects left", lambda r: f"{r['run']['shards']}; {r['run']['consumed_markers']}; "
            f"{r['run']['data_objects_left']}"),
        row("**peak bytes at rest** under shards/", lambda r: f"**{r['peak_at_rest'] / mb:.1f} MB**"
            + (" (all of it)" if r is res["offline"] else f" ({r['peak_at_rest_objects']} objects)")),
        row("wall s: extract / train / eval", lambda r: f"{r['extract_wall_s']:.0f} / {r['train_wall_s']:.0f} / "
            f"{r['eval']['wall_s']:.0f}" + (" (in turn)" if r is res["offline"] else " (first two at once)")),
    ]
    largest = max(r["run"]["largest_shard"] for r in runs)
    return f"""## A window run against the same samples trained offline: SmolLM2 (issue 20)

`python bench/window_quality.py --rows {args.rows} --json docs/bench/window_quality.json --write-docs`
({res['date'][:10]}, {res['machine']}; load average {res['load_start'][0]:.2f} at the start,
{res['load_end'][0]:.2f} at the end; OMP_NUM_THREADS={res['omp_num_threads']}; every step through the `layertap`
command line; {res['wall_s'] / 60:.1f} min in all; code {res.get('code_start')}{'' if res.get('code_end') == res.get('code_start') else f" -> {res.get('code_end')}: CHANGED DURING THE RUNS, not comparable"})

Extraction: the first {args.rows} ShareGPT conversations, max length {args.max_length}, float32 forward,
`--shard-bytes {args.shard_bytes}` (one sample per shard, the largest {largest / mb:.1f} MB). Training, every run:
`{' '.join(res['train_args'][:-2])}`. The window runs start `layertap train --follow --delete-consumed`,
then `layertap extract --window {args.window}` beside it: above 1 consumer x (shuffle buffer
{args.shuffle_buffer} + {args.save_every} x {args.batch_size} samples per checkpoint) x the largest shard, so it
must not stall, and well below the run, so data must be deleted. Eval (`--no-baseline`):
{res['offline']['eval']['prompts']} held-out conversations, {args.max_new_tokens} new tokens each, greedy.

| | {' | '.join(label for _, label in cols)} |
|---|{'---|' * len(cols)}
{chr(10).join(rows)}

Loss every {every} steps:

| step | {' | '.join(label for _, label in cols)} |
|---|{'---:|' * len(cols)}
{curve}

{reading(res)}
"""


if __name__ == "__main__":
    main()
