"""The drafter's flex-attention BlockMask three ways, on the shapes of one epoch of
bench/gpu_train_cli.py's data (batches of 2 samples of 800-4,096 tokens, 512 anchors, block 16):

    python bench/block_mask.py [--batches 12] [--device cpu|cuda] [--json OUT]

  tiled     layertap's `_tiled_block_mask` (train/drafter.py): built from the anchors tile by tile
  compiled  `torch.compile(create_block_mask)`, as the trainer built it from 2026-12-03 to 12-04
  eager     `create_block_mask` eager, which materialises the dense [B, 1, Q, KV] mask first

Per way: each batch's seconds (the first ones include compiling), the total, and for `compiled`
the number of graphs dynamo made. The three masks are checked equal (their dense tile views).
Speed is a ratio measured side by side in one process; compile times are this machine's.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch._dynamo  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from bench._report import save_json  # noqa: E402
from bench.gpu_train_cli import sample_lengths  # noqa: E402
from layertap.train.drafter import _tiled_block_mask  # noqa: E402


def shapes(batches: int, batch_size: int, anchors: int, seed: int) -> list[tuple[int, int, int]]:
    """(batch, context tokens, anchors) per batch: an epoch's lengths in pairs, the last batch short."""
    lengths = sample_lengths(batches * batch_size - 1, 800, 4096, seed)
    out = []
    for i in range(0, len(lengths), batch_size):
        group = lengths[i:i + batch_size]
        out.append((len(group), max(group), min(anchors, max(group) // 2)))
    return out


def visible_fn(anchors: torch.Tensor, t: int, bs: int):
    def visible(bi, h, q_idx, kv_idx):
        block = q_idx // bs
        return torch.where(kv_idx < t, kv_idx < anchors[bi, block], (kv_idx - t) // bs == block)
    return visible


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--anchors", type=int, default=512)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ways", default="tiled,compiled,eager")
    ap.add_argument("--tiny", action="store_true", help="3 batches of short samples: keeps the script tested")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    plan = shapes(3 if args.tiny else args.batches, 2, 16 if args.tiny else args.anchors, seed=1)
    if args.tiny:
        plan = [(b, t // 16, a) for b, t, a in plan]
    g = torch.Generator().manual_seed(0)
    inputs = [(torch.sort(torch.randint(1, t, (b, a), generator=g), 1).values.to(args.device), t) for b, t, a in plan]
    compiled = torch.compile(create_block_mask)
    ways = {"tiled": lambda anc, t: _tiled_block_mask(anc, t, args.block, visible_fn(anc, t, args.block)),
            "compiled": lambda anc, t: compiled(visible_fn(anc, t, args.block), anc.shape[0], None,
                                                anc.shape[1] * args.block, t + anc.shape[1] * args.block, device=anc.device),
            "eager": lambda anc, t: create_block_mask(visible_fn(anc, t, args.block), anc.shape[0], None,
                                                      anc.shape[1] * args.block, t + anc.shape[1] * args.block,
                                                      device=anc.device)}
    chosen = args.ways.split(",")
    if unknown := [w for w in chosen if w not in ways]:
        ap.error(f"--ways: unknown {unknown}; choose from {sorted(ways)}")
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    result: dict = {"device": gpu or args.device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "torch": torch.__version__, "block": args.block,
                    "batches": [{"batch": b, "tokens": t, "anchors": a} for b, t, a in plan], "ways": {}}

    def save() -> None:  # after each way: a run cut by a time limit still says what it measured
        if args.json:
            save_json(args.json, result)

    masks: dict[str, list] = {}
    for name in chosen:
        torch._dynamo.utils.counters.clear()
        times, made = [], []
        for anc, t in inputs:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = ways[name](anc, t)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(round(time.perf_counter() - t0, 4))
            made.append(m.to_dense())
        masks[name] = made
        entry = {"seconds": times, "total_s": round(sum(times), 3),
                 "steady_s": round(sorted(times)[len(times) // 2], 4)}
        if name == "compiled":
            entry["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        result["ways"][name] = entry
        save()
        print(f"{name}: total {entry['total_s']:.2f} s, median batch {entry['steady_s'] * 1e3:.1f} ms"
              + (f", {entry['graphs']} graphs compiled" if "graphs" in entry else ""), flush=True)
    first = next(iter(masks.values()))
    result["equal"] = all(torch.equal(a, b) for made in masks.values() for a, b in zip(first, made))
    print("the masks are equal" if result["equal"] else "THE MASKS DIFFER", flush=True)
    save()
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
