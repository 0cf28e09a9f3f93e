"""Extraction throughput and numerics of a Qwen3.6-27B-sized target on one GPU, with random-init
weights (speed does not depend on the weights' values).

    python bench/gpu_extract.py [--variants eager,conv,norms,fused,split,compile,tokens32k] [--pipeline] [--profile]
                                [--reference-out F | --reference-in F] [--json OUT]
    python bench/gpu_extract.py --tiny        # a tiny config on CPU: keeps the script tested

Each variant of the bare truncated forward is timed on the same batches, one after the other in
this process, each on top of the previous one's kernels: `eager` (the kernels transformers picked
at import: fla's if installed, else its torch fallback), `conv` (+ the short convolution routed to
fla's Triton kernel, extract.kernels.use_fla_short_conv), `norms` (+ each RMSNorm one fused
kernel, extract.fused_norms: layertap's default on CUDA), `fused` (+ each group of projections
of the same states as one matmul, extract.fused_projections), `split` (+ the gated deltanet's
short convolution per q/k/v span, so the delta rule copies nothing, extract.split_conv),
`compile` (+ torch.compile of each decoder layer), `tokens32k` (the best so far with twice the tokens per batch). Per variant:
tokens/s, MFU (matmul FLOPs of the kept layers / 989 TFLOP/s), warm-up (compile) seconds, peak
memory, and the relative error of the captured states on one 2,048-token sequence against an
fp32 forward of the same weights (`--reference-out` computes and saves that fp32 reference with
this process's kernels, best run where the torch fallback is the kernel; `--reference-in` reads
it; a missing or unreadable file is recorded as "no reference" and the variants run without
errors; a reference of other weights or inputs is refused: recorded, not compared, and the
script exits 2 after its measurements). `--pipeline` then runs the whole pipeline (forward ->
pinned side-stream copy -> encode pool -> streaming shard writer) into a tmpfs folder and into an
S3 server with the fastest eager-mode kernels, as one shard and as shards of `--shard-batches`
batches through the worker's loop over a real manifest, overlapped (a GPU worker's default) and
in turn (the one-shard rows also split at the last forward's end: `steady_vs_bare`, what the
pipeline costs while forwards run, and `drain_s`, what follows them, which a long run's next shard
hides); each run's output is deleted once measured, and the local runs need `--min-free-gib`
(16) free in /dev/shm, else in the temp dir, else they are skipped with the reason. `--profile`
adds the top CUDA kernels of one batch, and the time the same batch's matmuls alone take (the MFU
ceiling of this model on this GPU), with the projections as they are and fused.

Every part is recorded on its own (an error is written into the JSON and the next part runs) and
the JSON is rewritten after each: on the GPU machine a call has a hard time limit, and what is
not in the file when it ends is lost.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from layertap.extract.inputs import TokenizedSample  # noqa: E402
from layertap.extract.fused_norms import fuse_norms  # noqa: E402
from layertap.extract.fused_projections import (FusedGroup, fusable_groups, fuse_projections, fused_count,  # noqa: E402
                                                unfuse_projections)
from layertap.extract.split_conv import is_split, split_conv, unsplit_conv  # noqa: E402
from layertap.extract.kernels import describe, use_fla_short_conv  # noqa: E402
from layertap.extract.model import Capture  # noqa: E402
from layertap.extract.pipeline import (  # noqa: E402
    ForwardClock, HostStaging, PipelineStats, make_batches, pad_batch, start_shard,
)
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402
from bench._report import save_json  # noqa: E402
from tests.s3server import bench_server  # noqa: E402

# Qwen3.6-27B's text stack (gated-deltanet hybrid: 3 linear-attention layers, then 1 full).
QWEN27B = dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
               num_key_value_heads=4, head_dim=256, vocab_size=248320, linear_num_key_heads=16,
               linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
               tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, tie_word_embeddings=False)
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s
VARIANTS = ("eager", "conv", "norms", "fused", "split", "compile", "tokens32k")
FP32_HEADROOM = 1.1  # the fp32 reference forward: 4 bytes per weight, plus ~10% for activations and the allocator


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def build(sizes: dict, device: str, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", **sizes)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_reference(path: str, weights_fingerprint: float, seq: int) -> tuple[torch.Tensor | None, dict]:
    """The fp32 reference states in `path`, and what became of them for the JSON's `reference_in`.

    A missing or unreadable file (the `ref` step ran out of memory, was skipped on a GPU too small
    for fp32, or was cut by its time limit) is "no reference": the variants still run, without
    errors. A file of other weights or inputs is refused (`refused` in the record): comparing
    against it would report a wrong error, not a missing one."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    info: dict = {"path": path}
    if not os.path.isfile(path):
        info["status"] = "no reference: the file is missing"
        return None, info
    try:
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        ref_fp, ref_seq = float(meta["weights_fingerprint"]), int(meta["seq"])
    except Exception as e:  # a file cut short by a killed `ref` step, or one of another format
        info["status"] = f"no reference: unreadable ({error_text(e)})"
        return None, info
    if abs(ref_fp - weights_fingerprint) > 1e-6 * max(1.0, abs(ref_fp)) or ref_seq != seq:
        info["status"] = "refused"
        info["refused"] = (f"the reference in {path} is of other weights or inputs (fingerprint {ref_fp}, seq "
                           f"{ref_seq}; here {weights_fingerprint}, seq {seq}): not compared")
        return None, info
    try:
        states = load_file(path)["states"]
    except Exception as e:
        info["status"] = f"no reference: unreadable ({error_text(e)})"
        return None, info
    info["status"] = "compared"
    return states, info


def fingerprint(model) -> float:
    """A checksum of the weights, so a reference from another process is known to be of these."""
    return float(sum(p.detach()[:4].double().sum() for p in list(model.parameters())[:: max(1, len(list(model.parameters())) // 16)]))


def timed_forward(capture: Capture, batches, device: str, clock: ForwardClock | None = None) -> float:
    """Wall seconds of the forwards over `batches`; `clock` (the pipeline's) also sums the forwards'
    own time, device time on CUDA, so that the pipeline's forwards compare with these on one clock."""
    sync(device)
    t0 = time.perf_counter()
    for b in batches:
        ids, mask = pad_batch(b, 0)
        if clock is None:
            capture(ids, mask)
        else:
            with clock:
                capture(ids, mask)
    sync(device)
    return time.perf_counter() - t0


def keep_winner(capture: Capture, row: dict) -> None:
    """Back to the forward of the variant measured in `row`: variants build on each other, so the
    projections are unfused and the convolution unsplit where it ran without them. (fla's short
    convolution and fused norms stay: nothing undoes them.)"""
    if not row["fused_projection_groups"] and unfuse_projections(capture.decoder):
        log("fused projections lost: what follows runs the projections unfused")
    if not row["split_conv_layers"] and unsplit_conv(capture.decoder):
        log("the split convolution lost: what follows runs the layers' own forward")


def rel_errors(states: torch.Tensor, reference: torch.Tensor) -> list[float]:
    """||x - ref|| / ||ref|| per capture layer; states [T, L, H]."""
    d = (states.double() - reference.double())
    return [float(d[:, j].norm() / reference[:, j].double().norm()) for j in range(reference.shape[1])]


def numerics_sample(sizes: dict, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(123)
    return torch.randint(0, sizes["vocab_size"], (1, seq), generator=g)


def capture_one(capture: Capture, ids: torch.Tensor) -> torch.Tensor:
    hidden, _ = capture(ids, torch.ones_like(ids))
    return hidden[0].float().cpu()


def compile_layers(capture: Capture) -> dict:
    """torch.compile each decoder layer (regional compilation); layers of one type share graphs.

    The recompile limit is raised: dynamo would otherwise stop compiling after 8 variants of the
    same code and run the rest of the 62 layers eagerly."""
    import torch._dynamo as dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, 256)
    if hasattr(dynamo.config, "accumulated_recompile_limit"):
        dynamo.config.accumulated_recompile_limit = 4096
    dynamo.reset()
    for layer in capture.decoder.layers:
        layer.compile(dynamic=False)
    return {"layers_compiled": len(capture.decoder.layers)}


def dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    breaks = dict(counters.get("graph_break", {}))
    return {"unique_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
            "graph_breaks": sum(breaks.values()), "graph_break_reasons": sorted(breaks, key=breaks.get)[-5:],
            "recompiles": int(counters.get("recompiles", {}).get("total", 0)) if "recompiles" in counters else None}


def profile_batch(capture: Capture, batch, device: str, top: int = 20) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    ids, mask = pad_batch(batch, 0)
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        capture(ids, mask)
        sync(device)
    events = prof.key_averages()
    attr = "device_time_total" if device == "cuda" else "cpu_time_total"
    total = sum(getattr(e, attr, 0) for e in events) or 1
    rows = sorted(events, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
    return [{"name": e.key[:120], "ms": getattr(e, attr, 0) / 1e3, "share": getattr(e, attr, 0) / total,
             "calls": e.count} for e in rows]


def matmul_ceiling(capture: Capture, tokens: int, device: str, reps: int = 3) -> dict:
    """Seconds the Linear layers of one layer of each type take at `tokens` rows, scaled to the
    kept layers: the forward's time if nothing but its matmuls ran. Both as the layers' own
    projections (`kept_layers_s`) and with each group extract.fused_projections fuses as one
    matmul (`fused_kept_layers_s`), whichever of the two the model runs now."""
    types = list(getattr(capture.decoder.config, "layer_types", None) or ["attention"] * capture.kept_layers)
    seen: dict[str, tuple[float, float]] = {}
    for i, layer in enumerate(capture.decoder.layers):
        kind = types[i]
        if kind not in seen:
            separate, fused = projection_weights(layer)
            seen[kind] = (time_matmuls(separate, tokens, device, reps), time_matmuls(fused, tokens, device, reps))
    return {"per_layer_s": {k: v[0] for k, v in seen.items()},
            "fused_per_layer_s": {k: v[1] for k, v in seen.items()},
            "kept_layers_s": sum(seen[types[i]][0] for i in range(capture.kept_layers)),
            "fused_kept_layers_s": sum(seen[types[i]][1] for i in range(capture.kept_layers))}


def projection_weights(layer) -> tuple[list, list]:
    """The weight matrices of `layer`'s matmuls: each projection on its own, and with each
    fusable group as one matrix (a group already fused gives its slices for the first list)."""
    from torch import nn

    separate, fused = [], []
    for owner in layer.modules():
        if isinstance(owner, FusedGroup):
            separate += [owner.weight[lo:hi] for lo, hi in owner.spans]
            fused.append(owner.weight)
            continue
        grouped = set()
        for _, members in fusable_groups(owner):
            separate += [m.weight for m in members]
            fused.append(torch.cat([m.weight for m in members]))
            grouped.update(id(m) for m in members)
        for child in owner.children():
            if isinstance(child, nn.Linear) and id(child) not in grouped:
                separate.append(child.weight)
                fused.append(child.weight)
    return separate, fused


def time_matmuls(weights: list, tokens: int, device: str, reps: int) -> float:
    """Seconds one pass of `tokens` rows through each matrix takes (after a warm-up pass)."""
    xs = {w.shape[1]: torch.randn(tokens, w.shape[1], device=device, dtype=w.dtype) for w in weights}
    for w in weights:
        torch.nn.functional.linear(xs[w.shape[1]], w)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)
    sync(device)
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU (a smoke test of this script)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=4, help="batches of --batch-tokens timed per variant")
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--layers", default="1,16,31,46,61")
    ap.add_argument("--variants", default="eager", help=f"comma-separated, in order, from {', '.join(VARIANTS)}")
    ap.add_argument("--codec", default="bf16-zstd")
    ap.add_argument("--encode-threads", type=int, default=None, help="default: the extractor's default")
    ap.add_argument("--pipeline", action="store_true", help="also the whole pipeline into tmpfs and into S3")
    ap.add_argument("--pipeline-rows", choices=("all", "lean"), default="all",
                    help="lean: one shard into tmpfs, shards overlapped through the worker's loop into tmpfs and "
                         "one shard into S3, without the serial and S3-shards comparison rows (~50 s less on an "
                         "H200 at the default sizes, for a device session's budget)")
    ap.add_argument("--shard-batches", type=int, default=1,
                    help="batches per shard in the pipeline's multi-shard runs (the worker's loop, overlapped or not)")
    ap.add_argument("--profile", action="store_true", help="top CUDA kernels of one batch, and the matmul ceiling")
    ap.add_argument("--reference-out", help="compute the fp32 reference states here (safetensors)")
    ap.add_argument("--reference-in", help="compare against the fp32 reference states in this file")
    ap.add_argument("--endpoint", help="an S3 server to write to instead of starting moto (credentials from env)")
    ap.add_argument("--min-free-gib", type=float, default=None,
                    help="--pipeline: free space a local folder needs for the local runs (default 16; --tiny 0.5)")
    ap.add_argument("--json", help="write the results here as JSON (rewritten after every step)")
    args = ap.parse_args()
    # a caller's time limit (timeout's SIGTERM) unwinds through the finally blocks: the pipeline's
    # folder in /dev/shm is deleted (else a warm machine's next call finds its tmpfs full) and moto stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    from layertap.extract.config import default_encode_threads

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    sizes = TINY if args.tiny else QWEN27B
    layers = [int(x) for x in args.layers.split(",")] if not args.tiny else [1, 3, 5]
    seq = min(args.seq, 64) if args.tiny else args.seq
    batch_tokens = max(seq, min(args.batch_tokens, 256) if args.tiny else args.batch_tokens)
    encode_threads = args.encode_threads or default_encode_threads()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")

    t_build = time.perf_counter()
    model = build(sizes, device)
    capture = Capture(model, layers)
    params = sum(p.numel() for p in capture.decoder.parameters()) - capture.decoder.embed_tokens.weight.numel()
    log(f"built {capture.kept_layers} layers ({params / 1e9:.2f} B params) on {device} in "
        f"{time.perf_counter() - t_build:.1f} s")
    g = torch.Generator().manual_seed(0)
    per_batch = batch_tokens // seq
    samples = [TokenizedSample(f"s{i}", torch.randint(0, sizes["vocab_size"], (seq,), generator=g),
                               torch.ones(seq, dtype=torch.bool)) for i in range(per_batch * args.batches)]
    tokens = sum(len(s) for s in samples)
    flops = 2 * params * tokens  # matmul FLOPs of the kept layers (attention scores excluded)
    peak_flops = H200_BF16_PEAK if device == "cuda" else None
    import transformers

    results: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "kept_layers": capture.kept_layers, "params_kept": params, "tokens": tokens, "seq": seq,
        "batch_tokens": batch_tokens, "codec": args.codec, "encode_threads": encode_threads,
        "weights_fingerprint": fingerprint(model), "variants": {},
    }

    def save() -> None:
        if args.json:
            save_json(args.json, results, indent=2)

    ids_num = numerics_sample(sizes, seq)
    reference = None
    if args.reference_in:
        reference, results["reference_in"] = load_reference(args.reference_in, results["weights_fingerprint"], seq)
        said = results["reference_in"]
        log(f"reference {args.reference_in}: {said.get('refused') or said['status']}")
    else:
        results["reference_in"] = {"status": "no reference: none given"}
    save()

    def kernels_now() -> dict:
        return {kind: [str(c) for c in choices] for kind, choices in describe(model).items()}

    results["kernels"] = kernels_now()
    layers_kept = list(capture.decoder.layers)
    # the variants that route kernels: what each does to the model (its result: what it routed), and
    # why it is skipped where it routes nothing. norms: inductor on the GPU; on CPU (--tiny) dynamo's
    # capture alone, which checks the routing
    routes = {
        "conv": (lambda: use_fla_short_conv(model), "fla's short convolution is not available here"),
        "norms": (lambda: fuse_norms(capture.decoder, layers_kept, backend="inductor" if device == "cuda" else "eager"),
                  "no RMSNorm class of this model could be fused"),
        "fused": (lambda: fuse_projections(layers_kept), "no group of projections could be fused"),
        "split": (lambda: split_conv(layers_kept), "no gated-deltanet layer could be routed"),
    }
    best: tuple[float, str] | None = None
    for name in variants:
        bt = batch_tokens * 2 if name == "tokens32k" else batch_tokens
        if name == "tokens32k" and best is not None:  # the winner's forward at twice the tokens, not the last one's
            keep_winner(capture, results["variants"][best[1]])
        try:
            if name in routes:
                route, why_not = routes[name]
                if not route():
                    results["variants"][name] = {"skipped": why_not}
                    save()
                    continue
            if name == "compile":
                compile_layers(capture)
            batches = make_batches(samples, bt)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
            warm = timed_forward(capture, batches[:1], device)  # kernels, Triton and dynamo compiles, allocator
            s = timed_forward(capture, batches, device)
            row = {"batch_tokens": bt, "s": s, "tokens_per_s": tokens / s, "warmup_s": warm,
                   "mfu": flops / s / peak_flops if peak_flops else None, "kernels": kernels_now(),
                   "raw_mb_per_s": tokens * len(layers) * sizes["hidden_size"] * 2 / s / 1e6,
                   "fused_projection_groups": fused_count(capture.decoder),
                   "split_conv_layers": sum(map(is_split, capture.decoder.modules()))}
            if device == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            if name == "compile":
                row["dynamo"] = dynamo_counts()
            if reference is not None:
                row["rel_error"] = rel_errors(capture_one(capture, ids_num), reference)
            results["variants"][name] = row
            log(f"{name}: {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu'] or 0:.3f}, warm-up {warm:.1f} s"
                + (f", rel error {[round(e, 4) for e in row['rel_error']]}" if "rel_error" in row else ""))
            if name != "tokens32k" and (best is None or s < best[0]):
                best = (s, name)
        except Exception as e:  # one variant failing still leaves the others' numbers
            results["variants"][name] = {"error": error_text(e)}
            log(f"{name}: FAILED {type(e).__name__}: {e}")
        save()

    if best is not None:
        results["best"] = best[1]
        results["bare"] = dict(results["variants"][best[1]], variant=best[1])
        keep_winner(capture, results["bare"])  # the rest runs the winner's forward

    if args.profile:
        try:
            batches = make_batches(samples, batch_tokens)
            results["profile_top"] = profile_batch(capture, batches[0], device)
            results["matmul_ceiling"] = mc = matmul_ceiling(capture, batch_tokens, device)
            batch_flops = 2 * params * batch_tokens
            results["matmul_ceiling"]["mfu"] = batch_flops / mc["kept_layers_s"] / peak_flops if peak_flops else None
            results["matmul_ceiling"]["fused_mfu"] = (batch_flops / mc["fused_kept_layers_s"] / peak_flops
                                                      if peak_flops else None)
            log(f"matmuls alone: {mc['kept_layers_s']:.3f} s per batch of {batch_tokens} tokens "
                f"(MFU ceiling {mc['mfu'] or 0:.3f}; with fused projections {mc['fused_kept_layers_s']:.3f} s, "
                f"{mc['fused_mfu'] or 0:.3f})")
        except Exception as e:  # the pipeline's numbers still follow
            results["profile_error"] = error_text(e)
            log(f"profile: FAILED {error_text(e)}")
        save()

    if args.reference_out:
        reference_out(args.reference_out, model, capture, ids_num, results, kernels_now, device, save)
        return  # the weights are fp32 now (or the reference failed halfway): nothing after this would measure bf16

    if args.pipeline and "bare" in results:
        pipeline_part(args, capture, samples, layers, sizes, seq, per_batch, tokens, batch_tokens, encode_threads,
                      device, results, save)

    print(json.dumps(results, indent=2))
    save()
    if results["reference_in"].get("refused"):
        log(results["reference_in"]["refused"])
        sys.exit(2)  # measured and saved, but the numerics were not checked: say so to the caller
    if failed := failures(results):  # every number saved, and the caller told (device_checks.sh logged rc=0)
        log(f"failed: {', '.join(failed)}")
        sys.exit(1)


def failures(results: dict) -> list[str]:
    """The parts of `results` that recorded an error (a variant, a pipeline row, the profile, S3)."""
    found = [f"variant {name}" for name, row in results.get("variants", {}).items() if "error" in row]
    found += [key for key, value in results.items() if key != "variants"
              and (key.endswith("_error") or isinstance(value, dict) and "error" in value)]
    return found


def reference_out(path: str, model, capture: Capture, ids_num: torch.Tensor, results: dict, kernels_now, device: str,
                  save) -> None:
    """The fp32 reference states into `path`, this process's bf16 error against them into
    results["reference"]; or why not (too little GPU memory, an error), recorded the same way."""
    from safetensors.torch import save_file

    if device == "cuda":
        # fp32 weights of a 27B-shaped stack are ~93 GiB: an 80 GB H100 runs out of memory halfway
        # through model.float(), after a minute of work; say so at once instead
        need = FP32_HEADROOM * 4 * sum(p.numel() for p in model.parameters())
        total = torch.cuda.get_device_properties(0).total_memory
        if total < need:
            results["reference"] = {"skipped": f"the fp32 forward needs ~{need / 2**30:.0f} GiB of GPU memory, "
                                               f"this GPU has {total / 2**30:.0f} GiB"}
            log(f"reference: skipped: {results['reference']['skipped']}")
            save()
            return
    try:
        own = capture_one(capture, ids_num)  # this process's bf16 states, before the weights go fp32
        torch.backends.cuda.matmul.allow_tf32 = False  # a true fp32 reference, not TF32
        torch.backends.cudnn.allow_tf32 = False
        torch.compiler.reset()
        model.float()
        ref = capture_one(capture, ids_num)
        tmp = f"{path}.part"  # renamed when whole: a step cut while writing leaves no half-written reference
        save_file({"states": ref.contiguous()}, tmp,
                  metadata={"weights_fingerprint": repr(results["weights_fingerprint"]), "seq": str(ids_num.shape[1])})
        os.replace(tmp, path)
        results["reference"] = {"kernels": kernels_now(), "bf16_rel_error": rel_errors(own, ref)}
        log(f"fp32 reference saved; this process's bf16 rel error {[round(e, 4) for e in rel_errors(own, ref)]}")
    except Exception as e:  # out of memory on a smaller GPU than the check above expects, most likely
        results["reference"] = {"error": error_text(e)}
        log(f"reference: FAILED {error_text(e)}")
    save()


def pipeline_part(args, capture: Capture, samples, layers: list[int], sizes: dict, seq: int, per_batch: int,
                  tokens: int, batch_tokens: int, encode_threads: int, device: str, results: dict, save) -> None:
    """--pipeline: the whole pipeline into a local folder and into S3, each measurement on its own
    (recorded and saved at once, or its error recorded and the next one run) and each run's output
    deleted once measured: a 27B-shaped run is ~3.4 GB, and seven of them would fill a tmpfs."""
    if results["best"] == "compile":
        torch.compiler.reset()  # the pipeline runs on the best eager kernels (compile is measured apart)
        for layer in capture.decoder.layers:
            layer._compiled_call_impl = None
    try:
        clock = ForwardClock(device == "cuda")
        bare_s = timed_forward(capture, make_batches(samples, batch_tokens), device, clock)
        bare_forward_s = clock.seconds()
    except Exception as e:
        results["pipeline_bare"] = {"error": error_text(e)}
        log(f"pipeline: the bare forward FAILED {error_text(e)}")
        save()
        return
    results["pipeline_bare"] = {"s": bare_s, "tokens_per_s": tokens / bare_s, "forward_s": bare_forward_s}
    save()
    lean = args.pipeline_rows == "lean"
    results["pipeline_rows"] = args.pipeline_rows
    meta = ShardMeta(run_id="bench", shard_id=0, model="qwen3_5_text-random", layers=layers,
                     hidden_size=sizes["hidden_size"], codec=args.codec)
    staging = HostStaging() if device == "cuda" else None

    def pipeline(store, key):
        """One shard of every batch (extract_shard's two halves, timed apart): `to_last_forward_s`
        until the last forward (and its copy to the host) is done on the device, `drain_s` after it (the last batch's copies, encodes and
        appends, the object's completion). A worker runs the next shard's forwards during a drain
        (`--overlap-shards`), so over a long run the cost is `steady_vs_bare`, not `vs_bare`."""
        stats = PipelineStats()
        sync(device)
        t = time.perf_counter()
        tail = start_shard(capture, samples, meta, store.open_writer(key), batch_tokens=batch_tokens, pad_id=0,
                           encode_threads=encode_threads, stats=stats, staging=staging)
        try:
            sync(device)  # where an earlier CUDA error surfaces: the shard is aborted, as extract_shard's would be
        except BaseException:
            tail.abort()
            raise
        to_last_forward = time.perf_counter() - t
        info = tail.finish()
        wall = time.perf_counter() - t
        return {"s": wall, "tokens_per_s": tokens / wall, "vs_bare": wall / bare_s, "bytes": info.bytes,
                "ratio": info.raw_bytes / info.bytes, "to_last_forward_s": to_last_forward,
                "drain_s": wall - to_last_forward, "steady_vs_bare": to_last_forward / bare_s, "forward_s": stats.forward_s,
                # the forwards' own time beside the bare loop's, both by the pipeline's clock (device time on
                # CUDA): > 1 where the pipeline's host work slows them (it was over the bare loop's wall time)
                "forward_vs_bare": stats.forward_s / bare_forward_s, "copy_s": stats.copy_s,
                "encode_s_summed": stats.encode_s, "write_s": stats.write_s, "close_s": stats.close_s}

    def pipeline_run(store, overlap: bool) -> dict:
        """The worker's own loop (extract.worker.ShardLoop) over a real manifest of these
        samples in shards of --shard-batches batches (a 1 GB shard is ~2 batches at
        Qwen3.6-27B's shapes): claimed, extracted and committed as `layertap extract` does,
        each shard finishing behind the next one's forwards (`overlap`) or before them."""
        from layertap.extract.worker import ShardLoop, Started
        from layertap.manifests.manifest import create_or_resume
        from layertap.manifests.records import Producer
        from layertap.manifests.work import WorkQueue

        manifest = create_or_resume(store, config={"model": "bench", "layers": layers, "codec": args.codec},
                                    dataset={"fingerprint": "bench"}, token_counts=[len(x) for x in samples],
                                    bytes_per_token=1.0, shard_bytes=per_batch * seq * args.shard_batches)[0]
        stats = PipelineStats()

        def start(claim, counted):
            part = samples[claim.plan.start:claim.plan.end]
            tail = start_shard(capture, part, dataclasses.replace(meta, shard_id=claim.shard),
                               store.open_writer(claim.data_key), batch_tokens=batch_tokens, pad_id=0,
                               encode_threads=encode_threads, stats=stats, on_record=counted, staging=staging)
            return Started(tail, [], 0)

        loop = ShardLoop(start, overlap=overlap, committed=lambda *a: None, abandoned=lambda *a: None)
        sync(device)
        t = time.perf_counter()
        committed = loop.run(WorkQueue(store, manifest, Producer.current(0), on_idle=loop.settle))
        wall = time.perf_counter() - t
        return {"s": wall, "tokens_per_s": tokens / wall, "vs_bare": wall / bare_s, "shards": committed,
                "forward_s": stats.forward_s, "encode_s_summed": stats.encode_s, "write_s": stats.write_s,
                "close_s": stats.close_s}

    def measure(label: str, run) -> dict:
        """run() timed, or its error: either way a row, and the JSON saved by the caller."""
        try:
            return run()
        except Exception as e:
            log(f"pipeline {label}: FAILED {error_text(e)}")
            return {"error": error_text(e)}

    def clear(store) -> None:
        """Delete what a measured run wrote (moto keeps its objects in this host's memory)."""
        try:
            for obj in list(store.list()):
                store.delete(obj.key)
        except Exception as e:
            log(f"pipeline: could not delete a run's objects ({error_text(e)})")

    def brief(row: dict) -> str:
        if "error" in row:
            return "FAILED"
        steady = f" ({row['steady_vs_bare']:.3f}x until the last forward, then {row['drain_s']:.2f} s of drain;" \
                 f" the forwards' own device time {row['forward_vs_bare']:.3f}x)" if "steady_vs_bare" in row else ""
        return f"{row['vs_bare']:.3f}x of the bare forward{steady}"

    # Local runs: a folder with room for one run's output at a time (each is deleted after it is
    # measured): /dev/shm (tmpfs: no disk in the way), else the temp dir, else none and a reason.
    min_free = (args.min_free_gib if args.min_free_gib is not None else 0.5 if args.tiny else 16) * 2**30
    root = folder = None
    for candidate, label in (("/dev/shm", "tmpfs"), (tempfile.gettempdir(), "tempdir")):
        try:
            if os.path.isdir(candidate) and shutil.disk_usage(candidate).free > min_free:
                root, folder = candidate, label
                break
        except OSError:
            continue
    if root is None:
        results["local_skipped"] = (f"neither /dev/shm nor {tempfile.gettempdir()} has {min_free / 2**30:.1f} GiB "
                                    "free for one run's output")
        log(f"pipeline into a local folder: skipped: {results['local_skipped']}")
    else:
        tmp = tempfile.mkdtemp(prefix="gpu-extract-", dir=root)

        def local(name: str, run) -> dict:
            path = os.path.join(tmp, name)
            try:
                return measure(name, lambda: run(open_store(path)))
            finally:
                shutil.rmtree(path, ignore_errors=True)

        try:
            # the staging buffers' first pinning, the encode pool warm
            warm = local("warm", lambda s: pipeline(s, "warm.lts"))
            if "error" in warm:
                results["local_warm"] = warm
            results["local"] = dict(local("shard", lambda s: pipeline(s, "shard.lts")), folder=folder)
            save()
            log(f"pipeline into a local folder: {brief(results['local'])}")
            modes = (True, True) if lean else (True, False, True, False)  # alternated: a drift hits both
            counted: dict[str, int] = {}  # the rounds of each that did not fail: the row is the best of them
            for i, overlap in enumerate(modes):
                key = "local_shards" if overlap else "local_shards_serial"
                row = dict(local(f"run{i}", lambda s: pipeline_run(s, overlap)), folder=folder)
                counted[key] = counted.get(key, 0) + ("error" not in row)
                old = results.get(key)
                if old is None or "error" in old or ("error" not in row and row["s"] < old["s"]):
                    results[key] = row
                results[key]["rounds"] = counted[key]
                save()
            serial = "" if lean else f", {brief(results['local_shards_serial'])} serial"
            log(f"shards of {args.shard_batches} batch(es) through the worker's loop into a local folder: "
                f"{brief(results['local_shards'])} overlapped{serial} (best of 2 each)")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        save()

    try:
        with bench_server(args.endpoint) as srv:
            os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
            import boto3

            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bench")

            def remote(prefix: str, run) -> dict:
                store = open_store(f"s3://bench/{prefix}")
                try:
                    return dict(measure(prefix, lambda: run(store)), server=srv.description)
                finally:
                    clear(store)

            results["s3"] = remote("run", lambda s: pipeline(s, "shard.lts"))
            save()
            log(f"pipeline into S3: {brief(results['s3'])}")
            if not lean:  # moto's ingest bounds these (2.1x-3.1x on 2026-12-04): comparison rows
                for overlap in (True, False):
                    key = "s3_shards" if overlap else "s3_shards_serial"
                    results[key] = remote(key, lambda s: pipeline_run(s, overlap))
                    save()
                log(f"shards through the worker's loop into S3: {brief(results['s3_shards'])} overlapped, "
                    f"{brief(results['s3_shards_serial'])} serial")
    except Exception as e:  # the server did not start, or the bucket could not be made
        results["s3_error"] = error_text(e)
        log(f"pipeline into S3: FAILED {error_text(e)}")
    save()



if __name__ == "__main__":
    main()
