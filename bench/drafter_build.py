"""How long `layertap train` takes to build the default drafter of a Qwen3.6-27B-shaped target
(hidden 5,120, 5 layers, 1.84 B trainable weights), two ways side by side in one process:

    python bench/drafter_build.py [--device cpu|cuda] [--vocab 32768] [--json OUT]

  default-init  the same trainable modules built as torch builds them (each nn.Linear drawn by
                kaiming_uniform_ on one CPU thread), then drawn again by the drafter's own init
                (and the head's row norms read, as it does): how `DFlashDrafter` built itself
                until 2026-12-04
  drafter       `DFlashDrafter(config, head, device)`: built on the meta device, allocated on
                `--device` and drawn once there (train/drafter.py)

The vocabulary only sizes the borrowed embed and lm_head (bf16, borrowed as read); 32,768 keeps
this within a small machine's memory (Qwen3.6's is 248,320).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from bench._report import machine, save_json  # noqa: E402
from bench.gpu_train import QWEN27B, TINY  # noqa: E402
from layertap.train.drafter import DFlashDrafter, DrafterLayer, default_config  # noqa: E402
from layertap.train.target_head import TargetHead  # noqa: E402


def timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--tiny", action="store_true", help="hidden 64 (a smoke test of this script)")
    ap.add_argument("--json")
    args = ap.parse_args()
    sizes = TINY if args.tiny else QWEN27B  # bench/gpu_train.py's shapes (its vocabulary aside)
    h = sizes["hidden"]
    g = torch.Generator().manual_seed(0)
    head = TargetHead(torch.randn(args.vocab, h, generator=g).to(torch.bfloat16),
                      torch.randn(args.vocab, h, generator=g).to(torch.bfloat16), False,
                      {"num_layers": sizes["layers"], "num_heads": sizes["heads"], "num_kv_heads": sizes["kv"],
                       "head_dim": sizes["head_dim"], "intermediate_size": sizes["inter"]})
    config = default_config(head, [1, 16, 31, 46, 61], mask_token_id=0)
    made: dict = {}

    def default_init() -> None:  # the trainable modules as torch builds them, then the drafter's own draws
        with torch.device(args.device):
            mods = nn.ModuleList([nn.Linear(len(config.capture_layers) * h, h, bias=False),
                                  *(DrafterLayer(config) for _ in range(config.num_layers))])
        for m in mods.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=config.initializer_range)
        made["head_rms"] = float(head.lm_head.float().pow(2).sum(1).mean().sqrt())  # as the drafter's init reads it
        made["default-init"] = mods

    def drafter() -> None:
        made["drafter"] = DFlashDrafter(config, head, args.device, torch.bfloat16)

    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else machine(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "hidden": h, "vocab": args.vocab,
              "drafter_layers": config.num_layers, "command": "python " + " ".join(sys.argv)}
    for name, fn in (("default-init", default_init), ("drafter", drafter)):
        torch.manual_seed(0)
        result[f"{name}_s"] = float(f"{timed(fn, args.device):.4g}")  # 4 significant digits: tiny runs take ms
        made.clear()
        gc.collect()
    d = DFlashDrafter(config, head, args.device, torch.bfloat16)
    result["trainable_params"] = sum(p.numel() for p in d.parameters() if p.requires_grad)
    result["ratio"] = float(f"{result['default-init_s'] / max(result['drafter_s'], 1e-9):.3g}")  # 3 significant digits
    print(f"{result['trainable_params'] / 1e9:.2f} B trainable weights on {args.device}: built as torch builds them "
          f"{result['default-init_s']:.1f} s, as DFlashDrafter builds them {result['drafter_s']:.1f} s "
          f"({result['ratio']}x)")
    if args.json:
        save_json(args.json, result)


if __name__ == "__main__":
    main()
