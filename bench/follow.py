"""Follow mode against extract-then-train, on CPU, with real `layertap extract` and `layertap train`
processes over a moto S3 server (issue 20).

    python bench/follow.py [--tiny] [--json OUT] [--write-docs]
    python bench/follow.py --report OUT [--write-docs]     # the docs section of a report written before

The same work three ways, one after the other in one invocation, each on a fresh prefix of one
bucket:
  - extract-then-train: `layertap extract` to completion, then `layertap train` over the run;
  - follow: `layertap train --follow` started together with `layertap extract`;
  - follow + window: `layertap extract --window W` and `layertap train --follow --delete-consumed`.
Same target (a tiny random-init llama from tests/tiny_models.py), same rows, same shards, the same
training settings (batch, steps from the plan, a checkpoint every --save-every steps) in each.

The extraction rate is controlled: a tiny target extracts a shard in milliseconds, so each extract
process runs through this script (`--paced-extract S -- extract ARGS`), which is the real command
with `start_shard` delayed by S seconds per shard: a slower GPU, nothing else changed. The
window's waits (`WindowGate`: 2 s doubling to 10 s between looks) and the trainer's
`--follow-poll-s` are scaled down with the shards (--gate-poll, --follow-poll-s), as their
defaults are sized for shards of minutes, not of a second.

Reported per mode: wall time (first process start to last exit), extraction's and training's own
seconds, the trainer's data wait (sum of the per-step waits in its metrics.jsonl over the sum of
its step times) and its seconds from start to the end of step 1's data wait (start-up, plus the
wait for the first shard in follow mode), and the peak bytes at rest: the data objects under
`shards/`, listed by a watcher thread every --watch-s seconds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "tests"))  # tests/tiny_models.py and tests/test_extract.py import their neighbours

T0 = time.perf_counter()
MODES = ("extract_then_train", "follow", "follow_window")
LABELS = {"extract_then_train": "extract, then train", "follow": "train --follow",
          "follow_window": "train --follow --delete-consumed, extract --window"}


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# the paced extractor: the real command, each shard delayed


def paced_extract(delay_s: float, gate_poll_s: float | None, argv: list[str]) -> int:
    """`layertap extract ARGV` with `delay_s` more per shard (before its forward passes), and the
    window gate's looks every `gate_poll_s` doubling to 5x that (None: its defaults)."""
    from layertap.cli import main as cli
    from layertap.extract import run as extract_run
    from layertap.manifests import consumption

    real = extract_run.start_shard

    def slow_start_shard(*args, **kwargs):
        time.sleep(delay_s)
        return real(*args, **kwargs)

    extract_run.start_shard = slow_start_shard
    if gate_poll_s is not None:
        gate = consumption.WindowGate

        class ScaledGate(gate):
            def __init__(self, store, window, **kw):
                kw.setdefault("poll_s", gate_poll_s)
                kw.setdefault("max_poll_s", 5 * gate_poll_s)
                super().__init__(store, window, **kw)

        extract_run.WindowGate = ScaledGate
    return cli(argv)


# ---------------------------------------------------------------------------------------------
# the run


class Watcher(threading.Thread):
    """Lists `prefix/shards/` every `every_s` seconds: the bytes of the data objects at rest."""

    def __init__(self, s3, bucket: str, prefix: str, every_s: float):
        super().__init__(daemon=True)
        self.s3, self.bucket, self.prefix, self.every_s = s3, bucket, prefix.rstrip("/") + "/shards/", every_s
        self.peak = self.peak_objects = self.looks = 0
        self.series: list[tuple[float, int]] = []
        self._done = threading.Event()
        self.t0 = time.perf_counter()

    def at_rest(self) -> tuple[int, int]:
        total = count = 0
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for o in page.get("Contents", []):
                total, count = total + o["Size"], count + 1
        return total, count

    def run(self) -> None:
        while True:
            try:
                total, count = self.at_rest()
            except Exception:  # a failed listing is one missed look, not the end of the watch
                total, count = 0, 0
            self.looks += 1
            if total > self.peak:
                self.peak, self.peak_objects = total, count
            self.series.append((round(time.perf_counter() - self.t0, 2), total))
            if self._done.wait(self.every_s):
                return

    def stop(self) -> None:
        self._done.set()
        self.join()


class Proc:
    """A `python ...` child with its output in a log file, its start and end times."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], logs: Path):
        self.name, self.cmd = name, cmd
        self.log = logs / f"{name}.log"
        self._f = open(self.log, "w")
        self.start = time.perf_counter()
        self.wall_start = time.time()
        self.p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._f, stderr=subprocess.STDOUT)
        self.end: float | None = None

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            rc = 124
        self.end = time.perf_counter()
        self._f.close()
        if rc != 0:
            say(f"{self.name}: exit status {rc}; its log's tail:\n{self.log.read_text(errors='replace')[-3000:]}")
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    @property
    def seconds(self) -> float:
        return round((self.end or time.perf_counter()) - self.start, 2)


def trainer_numbers(s3, bucket: str, out_prefix: str, train: Proc) -> dict[str, Any]:
    """From the trainer's metrics.jsonl: steps, step seconds, data wait, and the time from its
    start to the end of step 1's data wait."""
    body = s3.get_object(Bucket=bucket, Key=f"{out_prefix}/metrics.jsonl")["Body"].read().decode()
    records = [json.loads(line) for line in body.splitlines() if line]
    step_s = sum(r["step_s"] for r in records)
    wait_s = sum(r["step_s"] * r["data_wait_fraction"] for r in records)
    first = records[0]
    # `time` is taken when a step's record is made, after the step: step 1 began step_s before it
    # and computed (step_s - its wait) of that
    first_data = first["time"] - first["step_s"] * (1 - first["data_wait_fraction"]) - train.wall_start
    return {"steps": len(records), "step_s_sum": round(step_s, 2), "data_wait_s": round(wait_s, 2),
            "data_wait_fraction": round(wait_s / step_s, 3) if step_s else None,
            "first_batch_s": round(first_data, 2), "loss_final": round(records[-1]["loss"], 4),
            "samples_digests": [r["samples_digest"] for r in records]}


def one_mode(mode: str, args: argparse.Namespace, ctx: dict[str, Any], window: int | None) -> dict[str, Any]:
    s3, bucket, env, logs = ctx["s3"], ctx["bucket"], ctx["env"], ctx["logs"]
    run_prefix, out_prefix = f"{mode}/run", f"{mode}/drafter"
    data, out = f"s3://{bucket}/{run_prefix}", f"s3://{bucket}/{out_prefix}"
    logdir = str(logs / f"{mode}-layertap-logs")
    gate = None if args.gate_poll == "default" else float(args.gate_poll)
    extract = [sys.executable, str(Path(__file__).resolve()), "--paced-extract", str(args.shard_s),
               *(["--gate-poll", str(gate)] if gate is not None else []), "--",
               "extract", "--model", ctx["model"], "--dataset", ctx["dataset"], "--out", data, "--layers", "1,3",
               "--max-length", str(args.max_length), "--shard-bytes", args.shard_bytes, "--log-dir", logdir]
    train = [sys.executable, "-m", "layertap", "train", "--data", data, "--model", ctx["model"], "--out", out,
             "--batch-size", str(args.batch_size), "--block-size", str(args.block_size), "--max-anchors",
             str(args.max_anchors), "--save-every", str(args.save_every), "--num-workers", "1",
             "--config", ctx["train_config"], "--log-dir", logdir]
    if mode != "extract_then_train":
        train += ["--follow", "--follow-poll-s", str(args.follow_poll_s)]
    if mode == "follow_window":
        extract += ["--window", f"{window}B"]
        train += ["--delete-consumed"]
    say(f"{mode}: start")
    watcher = Watcher(s3, bucket, run_prefix, args.watch_s)
    watcher.start()
    t0, deadline = time.perf_counter(), time.perf_counter() + args.mode_timeout
    procs: list[Proc] = []
    try:
        if mode == "extract_then_train":
            procs.append(Proc(f"{mode}-extract", extract, env, logs))
            rc_x = procs[0].wait(deadline - time.perf_counter())
            procs.append(Proc(f"{mode}-train", train, env, logs))
            rc_t = procs[1].wait(deadline - time.perf_counter())
        else:  # the trainer first (it waits for the manifest), the extractor right after
            procs.append(Proc(f"{mode}-train", train, env, logs))
            procs.append(Proc(f"{mode}-extract", extract, env, logs))
            rc_x = procs[1].wait(deadline - time.perf_counter())
            rc_t = procs[0].wait(deadline - time.perf_counter())
    finally:
        for p in procs:
            p.kill()
        watcher.stop()
    wall = round(time.perf_counter() - t0, 2)
    x = next(p for p in procs if p.name.endswith("extract"))
    t = next(p for p in procs if p.name.endswith("train"))
    result: dict[str, Any] = {"wall_s": wall, "extract_rc": rc_x, "train_rc": rc_t, "extract_s": x.seconds,
                              "train_s": t.seconds, "peak_bytes_at_rest": watcher.peak,
                              "peak_shards_at_rest": watcher.peak_objects, "looks": watcher.looks,
                              "final_bytes_at_rest": watcher.series[-1][1] if watcher.series else None,
                              "at_rest_series": watcher.series[:: max(1, len(watcher.series) // 200)]}
    if window is not None and mode == "follow_window":
        result["window_bytes"] = window
        log_file = Path(logdir) / "extract-rank0.log"
        result["window_full_lines"] = log_file.read_text().count("window full:") if log_file.exists() else 0
    if rc_t == 0:
        result.update(trainer_numbers(s3, bucket, out_prefix, t))
    shards = [o["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{run_prefix}/tally/")
              for o in page.get("Contents", [])]
    result["tallies"] = len(shards)
    say(f"{mode}: wall {wall:.1f} s (extract {x.seconds:.1f} s, train {t.seconds:.1f} s), "
        f"peak at rest {watcher.peak / 1e6:.2f} MB in {watcher.peak_objects} shard(s), "
        f"data wait {result.get('data_wait_fraction')}, rc {rc_x}/{rc_t}")
    return result


def run_shard_sizes(s3, bucket: str, prefix: str) -> list[int]:
    return [o["Size"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/shards/")
            for o in page.get("Contents", [])]


def write_rows(path: Path, n: int, seed: int = 0) -> str:
    """`n` chats of varied lengths (tests/test_extract.py's), each with an assistant turn."""
    from test_extract import write_chats

    write_chats(path, n, seed)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(line for line in lines if '"no-answer"' not in line) + "\n")
    return str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The three modes on a tiny model of its own, in a scratch folder removed at the end (the logs
    stay beside --json)."""
    work = Path(tempfile.mkdtemp(prefix="bench-follow-"))
    try:
        return _run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import boto3
    import torch

    from bench._report import machine
    from bench.cli_e2e import _commit
    from tests.s3server import bench_server
    from tiny_models import tiny_model_dir

    logs = Path(args.json).with_name(Path(args.json).stem + "-logs") if args.json else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    load = [round(x, 2) for x in os.getloadavg()]
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "load_avg_start": load, "nproc": os.cpu_count(), "commit": _commit(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "command": "python bench/follow.py " + " ".join(a for a in sys.argv[1:] if not a.startswith("--json")
                                                        and not a.endswith(".json")),
        "settings": {k: getattr(args, k) for k in ("samples", "hidden", "max_length", "shard_bytes", "shard_s",
                                                   "batch_size", "block_size", "max_anchors", "save_every",
                                                   "shuffle_buffer", "window_shards", "follow_poll_s",
                                                   "gate_poll", "watch_s")},
        "modes": {},
    }
    model = tiny_model_dir(work / "models", "llama", hidden_size=args.hidden)
    dataset = write_rows(work / "chats.jsonl", args.samples)
    train_config = work / "train.json"
    train_config.write_text(json.dumps({"shuffle_buffer": args.shuffle_buffer}))
    with bench_server(args.endpoint) as srv:
        report["server"] = srv.description
        env = dict(os.environ, AWS_ENDPOINT_URL=srv.endpoint, AWS_DEFAULT_REGION="us-east-1",
                   PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
                   HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
                   OMP_NUM_THREADS=str(args.threads))
        if not args.endpoint:
            env.setdefault("AWS_ACCESS_KEY_ID", "bench")
            env.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
        s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                          aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
                          aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"))
        bucket = f"follow-{uuid.uuid4().hex[:12]}"
        s3.create_bucket(Bucket=bucket)
        ctx = dict(s3=s3, bucket=bucket, env=env, logs=logs, model=model, dataset=dataset,
                   train_config=str(train_config))
        window = None
        for mode in MODES:
            if mode == "follow_window":
                sizes = run_shard_sizes(s3, bucket, "extract_then_train/run")
                if not sizes:
                    report["modes"][mode] = {"skipped": "extract-then-train left no shard to size the window by"}
                    continue
                window = int(args.window_shards * sum(sizes) / len(sizes))
                report["run"] = {"shards": len(sizes), "bytes": sum(sizes), "largest_shard": max(sizes)}
                # A shard is deleted once a checkpoint covers every one of its samples; a trainer that waits for
                # data while the window is full checkpoints at once, so what it trained on is freed. What it
                # cannot free: the samples still in the shuffle buffer and in the batches in flight (the partial
                # one and the loader's prefetch, ~3), and the oldest shard, part of which may linger in the
                # buffer: below that, extraction waits for a deletion and training for a shard, for ever (seen,
                # before the trainer checkpointed when stalled, with a window of 3 shards of 16 samples, a
                # 16-sample buffer and a checkpoint every 4 steps of 4). A rule of thumb: a sample can linger longer.
                per_shard = args.samples / len(sizes)
                held = args.window_shards * per_shard
                needed = args.shuffle_buffer + 3 * args.batch_size + per_shard
                report["run"].update(window_samples=round(held, 1), window_samples_needed=round(needed, 1))
                if held <= needed:
                    report["modes"][mode] = {"skipped": f"the window holds ~{held:.0f} samples, not more than the "
                                                        f"~{needed:.0f} training may hold back from deletion: "
                                                        "extraction and training could wait on each other for ever"}
                    continue
            report["modes"][mode] = one_mode(mode, args, ctx, window)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    report["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    summarise(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


def summarise(r: dict[str, Any]) -> None:
    m = r["modes"]
    base = m.get("extract_then_train", {})
    for mode in MODES:
        got = m.get(mode, {})
        if "wall_s" in got and base.get("wall_s"):
            got["vs_extract_then_train"] = round(got["wall_s"] / base["wall_s"], 3)
    ok = [mode for mode in MODES if m.get(mode, {}).get("train_rc") == 0 and m[mode].get("extract_rc") == 0]
    steps = {m[mode].get("steps") for mode in ok}
    r["same_steps"] = len(steps) == 1 and len(ok) == len(MODES)
    r["ok"] = r["same_steps"]
    # informational: follow's order is a function of the discovery order, so it may differ between runs
    if {"follow", "follow_window"} <= set(ok):
        r["follow_and_window_same_batches"] = m["follow"]["samples_digests"] == m["follow_window"]["samples_digests"]
    if "run" in r and "follow_window" in ok:
        bound = m["follow_window"]["window_bytes"] + r["run"]["largest_shard"]
        r["window_bound_bytes"] = bound
        r["window_peak_under_bound"] = m["follow_window"]["peak_bytes_at_rest"] < bound
        r["ok"] = r["ok"] and r["window_peak_under_bound"]


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f} MB"


def markdown(r: dict[str, Any]) -> str:
    s, m = r["settings"], r["modes"]
    run = r.get("run", {})
    lines = [
        "## Follow mode against extract-then-train (CPU, tiny target, paced extraction)", "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}; commit {r.get('commit') or '?'}  ",
        f"Machine: {r['machine']}; load average {r['load_avg_start'][0]} at the start, {r['load_avg_end'][0]} at the "
        f"end (1 min); Python {r['python']}, torch {r['torch']}; server: {r.get('server', '?')}  ",
        f"Work: {s['samples']} chats through a random-init llama (hidden {s['hidden']}, 6 layers, layers 1,3 "
        f"captured, --max-length {s['max_length']}), {run.get('shards', '?')} shards of ~{s['shard_bytes']} "
        f"({_mb(run.get('bytes'))} in all); each shard delayed {s['shard_s']} s in the real `layertap extract` "
        f"(`--paced-extract`). Training: batch {s['batch_size']}, block {s['block_size']}, {s['max_anchors']} anchors, "
        f"one epoch, a checkpoint every {s['save_every']} steps, shuffle buffer {s['shuffle_buffer']}, 1 loader "
        f"worker, `--follow-poll-s {s['follow_poll_s']}`; window gate looks every {s['gate_poll']} s (doubling to "
        f"5x); OMP_NUM_THREADS=1 for every process; the modes run one after the other.", "",
        "| mode | wall s | vs extract-then-train | extract s | train s | steps | trainer data wait | "
        "start to 1st batch s | peak at rest |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        g = m.get(mode, {})
        if "wall_s" not in g:
            lines.append(f"| {LABELS[mode]} | {g.get('skipped', 'not run')} | | | | | | | |")
            continue
        fail = "" if g["extract_rc"] == 0 and g["train_rc"] == 0 else f" (**rc {g['extract_rc']}/{g['train_rc']}**)"
        wait = g.get("data_wait_fraction")
        peak = f"{_mb(g['peak_bytes_at_rest'])} ({g['peak_shards_at_rest']} shards)"
        if mode == "follow_window":
            peak += f"; window {_mb(g.get('window_bytes'))}"
        lines.append(f"| {LABELS[mode]}{fail} | {g['wall_s']:.1f} | {g.get('vs_extract_then_train', 0):.2f} | "
                     f"{g['extract_s']:.1f} | {g['train_s']:.1f} | {g.get('steps', '-')} | "
                     f"{'-' if wait is None else f'{100 * wait:.0f}%'} | {g.get('first_batch_s', '-')} | {peak} |")
    lines += ["", reading(r)]
    return "\n".join(lines)


def reading(r: dict[str, Any]) -> str:
    m = r["modes"]
    b, f, w = (m.get(k, {}) for k in MODES)
    if not all("wall_s" in g for g in (b, f, w)):
        return "Not every mode ran; see the JSON."
    parts = [
        f"Follow mode took {f['vs_extract_then_train']:.2f}x the wall time of extract-then-train "
        f"({f['wall_s']:.1f} s against {b['wall_s']:.1f} s), with the window {w['vs_extract_then_train']:.2f}x. "
        f"Extract-then-train is the sum of the two commands (extraction {b['extract_s']:.1f} s, then training "
        f"{b['train_s']:.1f} s, start-up included); follow overlaps them, so its best case is the longer of the two "
        f"plus the trainer's tail after the last shard. The two processes share the machine's cores: extraction "
        f"took {f['extract_s']:.1f} s beside the trainer against {b['extract_s']:.1f} s alone."]
    if f.get("data_wait_fraction") is not None:
        parts.append(
            f"The price is the trainer's idling: {100 * f['data_wait_fraction']:.0f}% of its step time waiting for "
            f"data in follow mode ({100 * (b.get('data_wait_fraction') or 0):.0f}% over a finished run), and "
            f"{f.get('first_batch_s', 0):.1f} s from its start to its first batch (against "
            f"{b.get('first_batch_s', 0):.1f} s of start-up alone): here extraction is the slower side, so the "
            f"trainer trains at extraction's pace.")
    if "window_bytes" in w and w["train_rc"] != 0:
        parts.append(
            f"**The window run did not finish** (rc {w['extract_rc']}/{w['train_rc']} after {w['wall_s']:.0f} s; "
            f"124: killed at the mode's time limit): with `--window {w['window_bytes']}` the extractor waited for "
            f"a deletion ({w.get('window_full_lines', 0)} 'window full' lines) while the trainer waited for a shard; "
            "samples held in the shuffle buffer and since the last checkpoint kept every shard in the window from "
            "being consumed.")
    elif "window_bytes" in w:
        parts.append(
            f"At rest: extract-then-train and plain follow keep the whole run ({_mb(b['peak_bytes_at_rest'])}, "
            f"{_mb(f['peak_bytes_at_rest'])}); with `--window {w['window_bytes']}` "
            f"({r['settings']['window_shards']:g} mean shards) and `--delete-consumed` the peak was "
            f"{_mb(w['peak_bytes_at_rest'])}, {'under' if r.get('window_peak_under_bound') else '**over**'} the "
            f"documented bound window + one shard per worker ({_mb(r.get('window_bound_bytes'))}); the extractor "
            f"logged {w.get('window_full_lines', 0)} 'window full' wait(s). A shard is deleted only after a "
            f"checkpoint covering all its samples (every {r['settings']['save_every']} steps), so extraction stalls "
            "while the trainer works through the window. The window must also hold more than training keeps "
            "from deletion (the shuffle buffer, the loader's prefetch, the samples since the last checkpoint, and an "
            "oldest shard a lingering sample pins): below that, extraction waits for a deletion and training for a "
            "shard, until one side changes. A trainer with `--delete-consumed` that waits for data while the window is "
            "full checkpoints at that step boundary to free what it trained on; what the shuffle buffers and batches in flight hold it "
            "cannot free, and it logs STALLED with the sizing rule (docs/ARCHITECTURE.md, \"The storage window\") "
            "when that persists; the bench refuses a window below the rule.")
    if r.get("load_avg_start", [0])[0] > r.get("nproc", 1):
        parts.append(f"The machine was busy (load {r['load_avg_start'][0]} on {r['nproc']} cores at the start): "
                     "seconds are inflated and noisy; the ratios were measured side by side in one invocation.")
    if not r.get("same_steps"):
        parts.append("**The modes did not all train the same number of steps**: see the JSON.")
    return " ".join(parts)


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--paced-extract":  # a child: the real extract, paced
        rest = sys.argv[2:]
        delay = float(rest.pop(0))
        gate = None
        if rest[0] == "--gate-poll":
            gate = float(rest[1])
            rest = rest[2:]
        assert rest[0] == "--", rest
        return paced_extract(delay, gate, rest[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true",
                    help="the smallest run that shows the modes (~1 min): 96 chats, 300KB shards, 0.5 s a shard, a "
                         "checkpoint every 2 steps, a window of 4 shards")
    ap.add_argument("--samples", type=int, default=384, help="chats to extract (default 384)")
    ap.add_argument("--hidden", type=int, default=256, help="the target's hidden size (default 256)")
    ap.add_argument("--max-length", type=int, default=64, help="extract --max-length (default 64)")
    ap.add_argument("--shard-bytes", default="1MB", help="extract --shard-bytes (default 1MB: ~32 samples a shard)")
    ap.add_argument("--shard-s", type=float, default=1.0, help="seconds added to each shard's extraction (default 1)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-anchors", type=int, default=128)
    ap.add_argument("--save-every", type=int, default=4, help="train --save-every, every mode (default 4)")
    ap.add_argument("--shuffle-buffer", type=int, default=4,
                    help="the trainer's shuffle buffer in samples, every mode (default 4: with a window, samples "
                         "lingering in the buffer keep their shards from deletion)")
    ap.add_argument("--window-shards", type=float, default=2.5,
                    help="--window as a multiple of the run's mean shard size (default 2.5; --tiny: 4)")
    ap.add_argument("--follow-poll-s", type=float, default=1.0, help="train --follow-poll-s (default 1)")
    ap.add_argument("--gate-poll", default="0.2",
                    help="the window gate's first wait in seconds, doubling to 5x; 'default': its own 2 s to 30 s")
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every process (default 1)")
    ap.add_argument("--watch-s", type=float, default=0.2, help="seconds between listings of the data at rest")
    ap.add_argument("--mode-timeout", type=float, default=900, help="seconds before a mode's processes are killed")
    ap.add_argument("--endpoint", help="an S3 server to use instead of starting moto (credentials from env)")
    ap.add_argument("--json", help="write the report here; the processes' logs go to <stem>-logs/ beside it")
    ap.add_argument("--write-docs", action="store_true", help="put the section into docs/benchmarks.md")
    ap.add_argument("--report", metavar="JSON", help="no run: the section of a report written before")
    args = ap.parse_args()
    from bench._report import publish

    if args.report:
        publish("follow", markdown(json.loads(Path(args.report).read_text())), args.write_docs)
        return 0
    if args.tiny:
        args.samples, args.shard_bytes, args.shard_s, args.save_every, args.window_shards = 96, "300KB", 0.5, 2, 4
        args.mode_timeout = min(args.mode_timeout, 300)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)
    report = run(args)
    publish("follow", markdown(report), args.write_docs)
    say(f"{'ok' if report['ok'] else 'NOT OK'}" + (f"; report at {args.json}" if args.json else ""))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
