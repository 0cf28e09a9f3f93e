"""DFlash drafter training step on one GPU at the full recipe's shapes, random weights and states
(speed does not depend on the values); and the flex-attention path's gradients against the
dense-mask path's (flex-attention has no CPU backward, so only a GPU can check them).

    python bench/gpu_train.py [--seq 4096] [--anchors 512] [--steps 6] [--json OUT]
    python bench/gpu_train.py --tiny        # a tiny config on CPU (dense path): keeps the script tested

Target shapes are Qwen3.6-27B's (hidden 5120, vocab 248,320, 5 capture layers); the drafter is
DFlash's recipe (5 layers, block 16), set up as `layertap train` sets it up on a GPU (bf16
autocast, the borrowed embed/lm_head in bf16, fused AdamW). Reports step time, input tokens/s and
peak memory of the loss over the head in chunks of rows (the trainer's), then, after a reset of
the peak, the same for the unchunked loss (full-vocabulary logits for every row at once) over
`--unchunked-steps` steps (0: skip).

The JSON is written after each part (the flex/dense check, the chunked steps, the unchunked
ones), and a part that fails records its error and leaves the others': the unchunked loss holds
several full-vocabulary fp32 copies of the logits and may run out of memory on an 80 GB H100,
which is itself the answer that part looks for.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._report import save_json  # noqa: E402
from layertap.train.drafter import DFlashDrafter, default_config  # noqa: E402
from layertap.train.objective import dflash_loss  # noqa: E402
from layertap.train.target_head import TargetHead  # noqa: E402

QWEN27B = dict(hidden=5120, vocab=248320, heads=24, kv=4, head_dim=256, inter=17408, layers=64)
TINY = dict(hidden=64, vocab=512, heads=4, kv=2, head_dim=16, inter=128, layers=12)


def drafter(sizes: dict, device: str, block: int, anchors: int) -> DFlashDrafter:
    # drawn where they are used: 2 x 1.27 G values at 27B shapes took ~16 s on the host
    g = torch.Generator(device).manual_seed(0)
    embed = torch.randn(sizes["vocab"], sizes["hidden"], generator=g, device=device) * 0.02
    head = TargetHead(embed, torch.randn(sizes["vocab"], sizes["hidden"], generator=g, device=device) * 0.02, False,
                      {"num_layers": sizes["layers"], "num_heads": sizes["heads"], "num_kv_heads": sizes["kv"],
                       "head_dim": sizes["head_dim"], "intermediate_size": sizes["inter"]})
    torch.manual_seed(0)
    config = default_config(head, [1, 16, 31, 46, 61][: max(1, min(5, sizes["layers"] // 12))],
                            mask_token_id=sizes["vocab"] - 1, block_size=block, max_anchors=anchors)
    # bf16 borrowed weights on CUDA, as `layertap train` keeps them under bf16 autocast
    d = DFlashDrafter(config, head, device, torch.bfloat16 if device == "cuda" else torch.float32)
    return d.to(device)


def batch(sizes: dict, layers: int, seq: int, n: int, device: str) -> dict:
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, sizes["vocab"], (n, seq), generator=g),
            "loss_mask": torch.ones(n, seq, dtype=torch.uint8), "lengths": torch.full((n,), seq),
            "hidden_states": torch.randn(n, seq, layers, sizes["hidden"], generator=g).to(torch.bfloat16).to(device)}


def grads_match(device: str) -> float:
    """Max relative difference between flex and dense gradients at a small shape."""
    sizes = dict(TINY, hidden=256, head_dim=64)
    d = drafter(sizes, device, block=16, anchors=24)
    b = batch(sizes, len(d.config.capture_layers), 256, 2, device)
    out = {}
    for mode in ("sdpa", "flex"):
        d.attention = mode
        d.zero_grad()
        dflash_loss(d, b, torch.Generator().manual_seed(0)).loss.backward()
        out[mode] = {k: p.grad.float().clone() for k, p in d.trainable_state().items()}
    return max(float((out["flex"][k] - g).norm() / g.norm().clamp_min(1e-12)) for k, g in out["sdpa"].items())


def timed_steps(d: DFlashDrafter, opt, b: dict, steps: int, device: str, chunk_rows: int | None):
    """Step times and the last loss of `steps` optimizer steps."""
    times, loss = [], None
    for step in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = dflash_loss(d, b, torch.Generator().manual_seed(step), chunk_rows=chunk_rows).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, float(loss.detach())


def steady_s(times: list[float]) -> float:
    """The median step after the first (its compiles and allocations): the same statistic for the
    chunked and the unchunked loss (the unchunked took the min of 2, the first unwarmed)."""
    later = sorted(times[1:])
    return later[len(later) // 2] if later else times[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--unchunked-steps", type=int, default=2)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    sizes = TINY if args.tiny else QWEN27B
    seq, anchors = (64, 8) if args.tiny else (args.seq, args.anchors)
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "seq": seq,
                    "anchors": anchors, "batch": args.batch}

    def save() -> None:
        if args.json:
            save_json(args.json, result)

    def error(e: BaseException) -> str:
        return f"{type(e).__name__}: {e}"[:2000]

    if device == "cuda":
        try:
            result["flex_vs_dense_grad_rel_diff"] = grads_match(device)
        except Exception as e:  # the step's numbers below still count
            result["flex_vs_dense_error"] = error(e)
        torch.cuda.empty_cache()
        save()
    d = drafter(sizes, device, block=16, anchors=anchors)
    d.attention = "sdpa" if args.tiny else "flex"
    params = [p for p in d.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=device == "cuda")
    b = batch(sizes, len(d.config.capture_layers), seq, args.batch, device)
    if device == "cuda":  # the steps' peak, not the drafter's construction (fp32 embed and head drawn here)
        torch.cuda.reset_peak_memory_stats()
    times, loss = timed_steps(d, opt, b, args.steps, device, chunk_rows=None)
    steady = steady_s(times)
    result.update(first_step_s=round(times[0], 3), step_s=round(steady, 4),
                  tokens_per_s=round(args.batch * seq / steady), drafter_params=sum(p.numel() for p in params),
                  loss=loss)
    if device == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        # at rest between steps: weights, AdamW moments, the borrowed embed and head, the batch; the rest
        # of the peak is the step's own (activations, autocast's bf16 weights, the loss's chunk, gradients)
        result["at_rest_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
        result["step_gib"] = round(result["peak_memory_gib"] - result["at_rest_gib"], 2)
    save()  # the chunked loss's numbers are in before the unchunked part may run out of memory
    if args.unchunked_steps > 0:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            times, loss_unchunked = timed_steps(d, opt, b, args.unchunked_steps, device, chunk_rows=0)
            result.update(unchunked_step_s=round(steady_s(times), 4),
                          unchunked_tokens_per_s=round(args.batch * seq / steady_s(times)), unchunked_loss=loss_unchunked)
        except Exception as e:  # torch.OutOfMemoryError on an H100, most likely
            result["unchunked_error"] = error(e)
        if device == "cuda":
            result["unchunked_peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    print(json.dumps(result))
    save()


if __name__ == "__main__":
    main()
