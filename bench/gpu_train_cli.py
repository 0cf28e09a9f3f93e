"""`layertap train` end to end on one GPU, streaming a run from an S3 server on the same host.

    python bench/gpu_train_cli.py [--samples 40] [--steps 55] [--batch-size 2] [--endpoint URL] [--json OUT]
    python bench/gpu_train_cli.py --tiny        # tiny shapes on CPU: keeps the script tested

Two runs of the real command line (`python -m layertap train`, a subprocess), each on its own
synthetic run written through the real manifest, lease and commit path (codec bf16-zstd, samples
of 800-4,096 tokens with activation-like bf16 states) into an S3 server here (moto started by the
bench, or --endpoint), and a target folder holding only what training reads (embed_tokens and
lm_head as safetensors, config.json, a tokenizer):
  - at Qwen3.6-27B's shapes (hidden 5,120, vocab 248,320, 5 capture layers [1,16,31,46,61]), the
    default drafter for that target (5 layers);
  - a small target (hidden 512, 4 capture layers) with a 1-layer drafter, where the data path
    weighs most against the step.
Reported per run, from the trainer's own metrics.jsonl, over the steps after `--warmup` (the
first compiles flex-attention): tokens_per_s, data_wait_median, step_s_median, peak_gib, steps.
Few samples, several epochs: the loader still streams every epoch from the server. Progress
lines carry the seconds since start, so a run cut short by a timeout still says where it was.

The trainer writes metrics.jsonl into its --out folder at each checkpoint, metrics first: with
--save-every beyond --steps that is once, at the last step, before the final checkpoint (at 27B
shapes 22 GB of weights and AdamW moments, which took more than 45 s on an H200 and cut the first
run). So the bench watches that file: once it holds the requested steps the run is summarised and
the JSON saved at once; the trainer then gets --exit-grace seconds to exit on its own (the small
drafter's checkpoint is quick) before it is stopped (SIGTERM, then SIGKILL). Its `rc` is then 0,
and `trainer_exit` says what happened. Each run has its own time limit (--timeout-27b,
--timeout-small, from the trainer's start); a run killed there keeps what its log lines said
(`from_log`). The JSON is rewritten after each of these events, and a SIGTERM (a caller's time
limit) stops the trainer and moto and saves what there is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._report import save_json  # noqa: E402
from bench.gpu_extract import QWEN27B, TINY  # noqa: E402
from layertap.manifests.manifest import create_or_resume  # noqa: E402
from layertap.manifests.records import Producer  # noqa: E402
from layertap.manifests.work import WorkQueue  # noqa: E402
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.records import Sample, encode_record  # noqa: E402
from layertap.storage.writer import ShardWriter  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from tests.s3server import bench_server  # noqa: E402

SMALL = dict(QWEN27B, hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, vocab_size=49152, linear_num_key_heads=4,
             linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)
TINY_SMALL = dict(TINY, hidden_size=32, head_dim=8)
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def make_target(folder: Path, sizes: dict) -> None:
    """config.json (qwen3_5_text), embed_tokens and lm_head (random bf16) and a tokenizer: all that
    `layertap train` reads of a target. The GPU host has no hub access: the tiny test tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import tiny_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model("qwen3_5_text", **sizes).to_json_file(str(folder / "config.json"))
    vocab, hidden = sizes["vocab_size"], sizes["hidden_size"]
    g = torch.Generator().manual_seed(0)
    weights = {}
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        # 16,384 random rows tiled: drawing 1.3 G values would take longer than the training run
        rows = torch.empty(min(vocab, 16384), hidden, dtype=torch.bfloat16).normal_(0, 0.02, generator=g)
        weights[key] = rows.repeat(-(-vocab // rows.shape[0]), 1)[:vocab].contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    tiny_tokenizer().save_pretrained(str(folder))


def sample_lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi + 1, (n,), generator=g).tolist()


def activation_pool(tokens: int, layers: int, hidden: int, seed: int) -> torch.Tensor:
    """[tokens, layers, hidden] bf16 shaped like a transformer's residual stream: per-channel
    scales spread over two decades, a few outlier channels, magnitude growing with depth.
    Samples are slices of it at different offsets (each record is compressed on its own)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(layers, hidden, generator=g) * 0.8)
    scale[:, torch.randint(0, hidden, (max(1, hidden // 512),), generator=g)] *= 30.0
    scale *= torch.linspace(0.5, 4.0, layers)[:, None]
    pool = torch.empty(tokens, layers, hidden, dtype=torch.bfloat16)
    for i in range(0, tokens, 1024):  # in slices: the float32 draw of the whole pool would double its size
        block = torch.randn(min(1024, tokens - i), layers, hidden, generator=g)
        pool[i:i + block.shape[0]] = (block * scale).to(torch.bfloat16)
    return pool


def make_run(uri: str, target: str, sizes: dict, layers: list[int], lengths: list[int], seed: int,
             shard_bytes: int, writers: int = 4) -> dict:
    """A complete run of len(lengths) samples through the real manifest/lease/commit path, written by
    `writers` workers at once (as several extraction workers would)."""
    hidden, vocab = sizes["hidden_size"], sizes["vocab_size"]
    store = open_store(uri)
    config = {"model": target, "model_type": "qwen3_5_text", "layers": layers, "codec": "bf16-zstd",
              "hidden_size": hidden, "final_state": "none"}
    bpt = len(layers) * hidden * 2 / 1.4
    manifest, _ = create_or_resume(store, config=config, dataset={"fingerprint": f"synthetic-{seed}-{len(lengths)}"},
                                   token_counts=lengths, bytes_per_token=bpt, shard_bytes=shard_bytes)
    pool = activation_pool(max(lengths) + 512, len(layers), hidden, seed)
    g = torch.Generator().manual_seed(seed + 1)
    offsets = torch.randint(0, 512, (len(lengths),), generator=g).tolist()
    prompts = [int(n * f) for n, f in zip(lengths, (torch.rand(len(lengths), generator=g) * 0.3).tolist())]

    def sample(i: int, meta: ShardMeta):
        n = lengths[i]
        mask = torch.ones(n, dtype=torch.uint8)
        mask[:prompts[i]] = 0  # a prompt first: the loss is on the answer only
        ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed * 100003 + i))
        return encode_record(Sample(f"s{i:06d}", ids, mask, pool[offsets[i]:offsets[i] + n].contiguous()), meta)

    stored = []

    def worker(_: int) -> None:
        for claim in WorkQueue(store, manifest, Producer.current(), ttl_s=600, poll_s=0.2):
            with claim:
                meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model=target, layers=layers,
                                 hidden_size=hidden, codec="bf16-zstd")
                with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                    for i in range(claim.plan.start, claim.plan.end):
                        w.append_encoded(sample(i, meta))
                    info = w.close()
                claim.commit(info)
                stored.append(info.bytes)

    writers = max(1, min(writers, len(manifest.shards)))
    with ThreadPoolExecutor(writers) as ex:
        list(ex.map(worker, range(writers)))
    store.close()
    raw = sum(lengths) * len(layers) * hidden * 2
    return {"samples": len(lengths), "tokens": sum(lengths), "raw_bytes": raw, "stored_bytes": sum(stored),
            "shards": len(stored)}


STEP_LINE = re.compile(r"step (\d+)/(\d+)\s+loss ([\d.naif]+).*?([\d.]+) tok/s\s+data wait (\d+)%")
DRAFTER_LINE = re.compile(r"drafter: (\d+) layers")


def stop(p: subprocess.Popen, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after `grace_s`. The trainer takes SIGTERM as "stop at the next step
    boundary and checkpoint", which after its last step changes nothing: the kill ends it."""
    if p.poll() is None:
        p.terminate()
        try:
            return p.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
    return p.wait()


def train(data: str, target: str, out: Path, args: argparse.Namespace, extra: list[str], env: dict,
          label: str, timeout: float, on_metrics) -> dict:
    """The real command line; its log lines are echoed with this bench's clock. Returns how it
    ended: rc, wall_s, trainer_exit, the log lines it parsed (`from_log`), drafter layers; and
    calls on_metrics(summary) as soon as metrics.jsonl holds the requested steps."""
    cmd = [sys.executable, "-m", "layertap", "train", "--data", data, "--model", target, "--out", str(out),
           "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--save-every", str(10 * args.steps),
           "--log-dir", str(out.parent / f"{out.name}-logs"), "--log-every", "1", *extra]
    say(f"{label}: {' '.join(cmd[1:])} (time limit {timeout:.0f} s)")
    t = time.perf_counter()
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logged: list[dict] = []  # the trainer's "step N/M ..." lines: all that is left of a run killed mid-way
    drafter_layers: list[int] = []

    def echo() -> None:
        for line in p.stdout:
            say(f"{label} | {line.rstrip()}")
            if m := STEP_LINE.search(line):
                logged.append({"step": int(m[1]), "loss": float(m[3]), "tokens_per_s": float(m[4]),
                               "data_wait": int(m[5]) / 100})
            elif m := DRAFTER_LINE.search(line):
                drafter_layers.append(int(m[1]))

    reader = threading.Thread(target=echo, daemon=True)
    reader.start()
    ended: dict = {}
    summary_at = None
    try:
        while True:
            now = time.perf_counter()
            rc = p.poll()
            if rc is not None:
                ended = {"rc": rc, "trainer_exit": f"exited by itself, rc {rc}"}
                break
            if summary_at is None:
                summary = complete_metrics(out, args.steps, args.warmup)
                if summary is not None:
                    summary_at = now
                    summary["metrics_s"] = round(now - t, 1)
                    on_metrics(summary)
                    say(f"{label}: all {args.steps} steps are in metrics.jsonl after {now - t:.0f} s: summarised")
            elif now - summary_at >= args.exit_grace:
                rc = stop(p)
                ended = {"rc": 0, "trainer_exit": f"stopped by the bench {args.exit_grace:g} s after its {args.steps} "
                                                  f"steps were in metrics.jsonl (final checkpoint not waited for; "
                                                  f"rc {rc})"}
                break
            if now - t >= timeout:
                p.send_signal(signal.SIGUSR2)  # every thread's stack into the log: where it was
                time.sleep(2)
                rc = stop(p)
                ended = {"rc": rc, "trainer_exit": f"killed at the time limit ({timeout:.0f} s)"}
                say(f"{label}: still running after {timeout:.0f} s: killed")
                break
            time.sleep(0.5)
    finally:  # a SIGTERM of the bench (SystemExit) must not leave a trainer holding the GPU
        if p.poll() is None:
            stop(p)
        reader.join(timeout=5)
    ended["wall_s"] = round(time.perf_counter() - t, 1)
    if logged:
        ended["from_log"] = logged
    if drafter_layers:
        ended["drafter_layers"] = drafter_layers[-1]
    return ended


def complete_metrics(out: Path, steps: int, warmup: int) -> dict | None:
    """The summary once metrics.jsonl holds `steps` records (the trainer replaces it whole, by a
    rename: never half-written), else None."""
    try:
        if len((out / "metrics.jsonl").read_text().splitlines()) < steps:
            return None
        return summarize(out, warmup)
    except (OSError, ValueError, KeyError, ZeroDivisionError, statistics.StatisticsError):
        return None


def summarize(out: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    steady = records[warmup:] if len(records) > warmup else records
    step_s = [r["step_s"] for r in steady]
    result = {
        "steps": len(records),
        "tokens_per_s": round(sum(r["tokens"] for r in steady) / sum(step_s)),
        "data_wait_median": round(statistics.median(r["data_wait_fraction"] for r in steady), 4),
        "data_wait_max": round(max(r["data_wait_fraction"] for r in steady), 4),
        "step_s_median": round(statistics.median(step_s), 4),
        "first_step_s": round(records[0]["step_s"], 2),
        "tokens_per_step": round(statistics.mean(r["tokens"] for r in steady)),
        "loss_first": round(records[0]["loss"], 4),
        "loss_last": round(records[-1]["loss"], 4),
    }
    peaks = [r["peak_gib"] for r in records if "peak_gib" in r]
    result["peak_gib"] = max(peaks) if peaks else None
    return result


def one(name: str, sizes: dict, layers: list[int], extra: list[str], args, endpoint: str, work: Path,
        seed: int, timeout: float, publish) -> dict:
    """One run; publish(result) after each thing learnt (run written, steps summarised, trainer
    ended), so the caller's JSON always holds what is known."""
    bucket = f"bench-train-{os.getpid()}-{name}"
    path = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
    # TORCH_LOGS: each torch.compile recompile and graph break is logged with its reason (the 27B run of
    # 2026-12-04 logged no step in 132 s, where 2026-11-30's did 55 in 66 s; compiling the block mask
    # came in between), unless the caller chose what torch logs
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1", PYTHONPATH=path,
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               TORCH_LOGS=os.environ.get("TORCH_LOGS", "recompiles,graph_breaks"))
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION="us-east-1")
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    target = work / f"target-{name}"
    make_target(target, sizes)
    say(f"{name}: target folder written (vocab {sizes['vocab_size']:,}, hidden {sizes['hidden_size']:,})")
    lengths = sample_lengths(args.samples, args.min_tokens, args.max_tokens, seed)
    uri = f"s3://{bucket}/run"
    t = time.perf_counter()
    run = make_run(uri, str(target), sizes, layers, lengths, seed, args.shard_mb << 20)
    run["write_s"] = round(time.perf_counter() - t, 1)
    say(f"{name}: run written: {run}")
    out = work / f"out-{name}"
    result = {"rc": None, "run": run, "batch_size": args.batch_size, "capture_layers": layers,
              "hidden": sizes["hidden_size"], "vocab": sizes["vocab_size"], "time_limit_s": timeout}
    publish(result)

    def on_metrics(summary: dict) -> None:
        result.update(summary)
        publish(result)

    t = time.perf_counter()
    try:
        result.update(train(uri, str(target), out, args, extra, env, name, timeout, on_metrics))
    finally:  # also when the caller's time limit ends the bench (SystemExit): the steps done are the numbers
        if "trainer_exit" not in result:  # cut while it ran: said, not left looking like a run never started
            result.update(trainer_exit="cut: the bench itself was stopped (its caller's time limit) while the "
                                       "trainer ran", wall_s=round(time.perf_counter() - t, 1))
        if "steps" not in result and (out / "metrics.jsonl").exists():  # fewer steps than asked, then an exit
            try:
                result.update(summarize(out, args.warmup))
            except (ValueError, KeyError, ZeroDivisionError, statistics.StatisticsError) as e:
                result["summary_error"] = f"{type(e).__name__}: {e}"
        if (out / "drafter" / "config.json").exists():
            result["drafter_layers"] = json.loads((out / "drafter" / "config.json").read_text()).get("num_layers")
        say(f"{name}: {json.dumps({k: v for k, v in result.items() if k != 'from_log'})}")
        publish(result)
    return result


def markdown(r: dict, step: dict | None = None) -> str:
    """The docs/benchmarks.md section of a result (and of bench/gpu_train.py's, when given)."""
    runs = [(k, r[k]) for k in ("qwen27b", "small") if "run" in r.get(k, {})]  # a run that failed before its data: none

    def row(label: str, fmt) -> str:
        return f"| {label} | " + " | ".join(fmt(x) for _, x in runs) + " |"

    def num(key: str, spec: str, unit: str = ""):
        return lambda x: "-" if x.get(key) is None else f"{x[key]:{spec}}{unit}"

    names = {"qwen27b": "Qwen3.6-27B shapes, default drafter", "small": "hidden-512 target, 1-layer drafter"}
    first = runs[0][1]
    lines = [
        "## `layertap train` streaming from S3 on one GPU (issue 18)", "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}; device: {r['device']}; torch {r['torch']}  ",
        f"Server: {r.get('server', '?')}  ",
        f"Each run: the real command line on its own synthetic run of {r['samples']} samples of "
        f"{first['run']['tokens'] // max(1, first['run']['samples']):,} tokens on average "
        f"({r['min_tokens']:,}-{r['max_tokens']:,}; bf16-zstd; "
        "activation-like bf16 states), several epochs; medians over the steps after the first "
        f"{r.get('warmup', 5)} (the first compiles flex-attention), from the trainer's metrics.jsonl.", "",
        "| | " + " | ".join(names[k] for k, _ in runs) + " |",
        "|---|" + "---:|" * len(runs),
        row("capture layers x hidden, vocab", lambda x: f"{len(x['capture_layers'])} x {x['hidden']:,}, {x['vocab']:,}"),
        row("drafter layers / batch size / steps", lambda x: f"{x.get('drafter_layers')} / {x['batch_size']} / "
                                                           f"{x.get('steps')}"),
        row("run stored, GB", lambda x: f"{x['run']['stored_bytes'] / 1e9:.2f}"),
        row("input tokens/s", num("tokens_per_s", ",.0f")),
        row("step s, median", num("step_s_median", ".3f")),
        row("**data wait, median** (max)", lambda x: "-" if x.get("data_wait_median") is None else
            f"**{100 * x['data_wait_median']:.1f}%** ({100 * x['data_wait_max']:.1f}%)"),
        row("peak GPU memory", num("peak_gib", ".1f", " GiB")),
        row("first step s", num("first_step_s", ".1f")),
        # metrics_s: when the bench had the run's numbers (it does not wait for the final checkpoint)
        row("command wall s (start to the last step's metrics)",
            lambda x: num("metrics_s" if "metrics_s" in x else "wall_s", ".0f")(x)),
        "| target: median data wait | " + " | ".join("<= 5%" if k == "qwen27b" else "<= 10%" for k, _ in runs) + " |",
    ]
    if step:
        def gib(key: str) -> str:
            return "-" if step.get(key) is None else f"{step[key]} GiB"

        lines += ["", f"The step alone (`python bench/gpu_train.py`: {step['batch']} x {step['seq']:,} tokens, "
                      f"{step['anchors']} anchors, 27B shapes, set up as the trainer sets it up):", "",
                  "| head loss | peak GPU memory | step s | input tokens/s |", "|---|---:|---:|---:|"]
        if "step_s" in step:
            lines.append(f"| in chunks of rows (the trainer's) | {gib('peak_memory_gib')} | {step['step_s']} | "
                         f"{step['tokens_per_s']:,} |")
        if "unchunked_step_s" in step:
            lines.append(f"| unchunked (full-vocabulary logits of every row) | {gib('unchunked_peak_memory_gib')} | "
                         f"{step['unchunked_step_s']} | {step['unchunked_tokens_per_s']:,} |")
        elif "unchunked_error" in step:
            lines.append(f"| unchunked (full-vocabulary logits of every row) | failed: {step['unchunked_error'][:120]} "
                         f"(peak {gib('unchunked_peak_memory_gib')}) | - | - |")
        if step.get("at_rest_gib") is not None:
            lines.append(f"\nOf the chunked step's peak, {gib('at_rest_gib')} are held between steps (weights, AdamW "
                         f"moments, the borrowed embed and head, the batch) and {gib('step_gib')} are the step's own "
                         "(activations, autocast's bf16 weights, the loss's chunk, gradients).")
        lines.append("\nTarget: <= 40 GiB at that shape, tokens/s no lower than the unchunked path's.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=40, help="samples per synthetic run (default 40)")
    ap.add_argument("--min-tokens", type=int, default=800)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=55, help="steps per training run (default 55)")
    ap.add_argument("--batch-size", type=int, default=2, help="samples per step (default 2)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the medians (default 5)")
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--timeout", type=float, help="seconds per training run, both runs (overrides the two below)")
    ap.add_argument("--timeout-27b", type=float, help="seconds for the 27B-shaped training run, from the trainer's "
                                                      "start (default 170; --tiny 300)")
    ap.add_argument("--timeout-small", type=float, help="seconds for the small training run (default 90; --tiny 300)")
    ap.add_argument("--exit-grace", type=float, help="seconds a trainer may take to exit by itself once its steps "
                                                     "are in metrics.jsonl, before the bench stops it (default 5; "
                                                     "--tiny 60)")
    ap.add_argument("--only", choices=["27b", "small"], help="one of the two runs")
    ap.add_argument("--endpoint", help="an S3 server to use instead of a moto server started here")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, in seconds")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--report", metavar="JSON", help="no run: print (with --write-docs, write) the docs section of "
                                                     "results written before, e.g. on the GPU host")
    ap.add_argument("--step-report", metavar="JSON", help="with --report: bench/gpu_train.py's JSON, for the "
                                                          "chunked vs unchunked loss rows")
    ap.add_argument("--write-docs", action="store_true", help="put the section into docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.report:
        from bench._report import publish

        step = json.loads(Path(args.step_report).read_text()) if args.step_report else None
        publish("gpu-train-cli", markdown(json.loads(Path(args.report).read_text()), step), args.write_docs,
                ROOT / "docs" / "benchmarks.md")
        return 0
    if args.tiny:
        args.samples, args.min_tokens, args.max_tokens = min(args.samples, 8), 16, 48
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 1)
        big, small = (TINY, [1, 3, 5]), (TINY_SMALL, [1, 2, 3, 5])
        extra = ["--block-size", "4", "--max-anchors", "8"]
    else:
        big, small, extra = (QWEN27B, [1, 16, 31, 46, 61]), (SMALL, [1, 4, 7, 10]), []
    # time limits from the trainer's start; a CPU rehearsal (--tiny, maybe on a busy machine) gets room
    args.timeout_27b = args.timeout or args.timeout_27b or (300 if args.tiny else 170)
    args.timeout_small = args.timeout or args.timeout_small or (300 if args.tiny else 90)
    args.exit_grace = args.exit_grace if args.exit_grace is not None else 60 if args.tiny else 5
    cuda = torch.cuda.is_available()
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "command": "python bench/gpu_train_cli.py " + " ".join(argv if argv is not None else sys.argv[1:]),
                    "torch": torch.__version__, "samples": args.samples, "min_tokens": args.min_tokens, "max_tokens": args.max_tokens,
                    "steps": args.steps, "warmup": args.warmup}
    say(f"device {result['device']}; {args.samples} samples of {args.min_tokens}-{args.max_tokens} tokens, "
        f"{args.steps} steps of {args.batch_size}")

    def save() -> None:
        if args.json:
            save_json(args.json, result)

    def publish_27b(r: dict) -> None:
        result.update({k: r.get(k) for k in ("tokens_per_s", "data_wait_median", "peak_gib", "step_s_median")})
        result["qwen27b"] = r
        save()

    def publish_small(r: dict) -> None:
        result["small"] = r
        save()

    # a caller's time limit (timeout's SIGTERM): unwind, so that the finally blocks stop the trainer
    # (else it keeps the GPU for the next step of the device script) and moto, and the JSON is saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    save()
    try:
        with bench_server(args.endpoint) as server, tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
            result["server"] = server.description
            work = Path(tmp)
            if args.only in (None, "27b"):
                try:
                    one("27b", big[0], big[1], extra, args, server.endpoint, work, seed=1, timeout=args.timeout_27b,
                        publish=publish_27b)
                except Exception as e:  # the small run still runs
                    result.setdefault("qwen27b", {})["error"] = f"{type(e).__name__}: {e}"[:2000]
                    say(f"27b: FAILED {result['qwen27b']['error']}")
                save()
            if args.only in (None, "small"):
                try:
                    one("small", small[0], small[1], [*extra, "--drafter-layers", "1"], args, server.endpoint, work,
                        seed=2, timeout=args.timeout_small, publish=publish_small)
                except Exception as e:
                    result.setdefault("small", {})["error"] = f"{type(e).__name__}: {e}"[:2000]
                    say(f"small: FAILED {result['small']['error']}")
                save()
    finally:
        save()
    ok = all(r.get("rc") == 0 for r in (result.get("qwen27b", {"rc": 0}), result.get("small", {"rc": 0})))
    say("done" if ok else "a training run failed: see its lines above")
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
