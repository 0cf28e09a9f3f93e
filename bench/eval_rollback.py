"""What rolling back a gated-deltanet hybrid costs `layertap eval`: the same-size attention-only
(qwen3) and hybrid (qwen3_5_text: 3 gated-deltanet layers, then 1 full attention) targets, random
weights, decoded greedily and speculatively with the same acceptance pattern.

    python bench/eval_rollback.py [--hidden 512] [--layers 8] [--new-tokens 64] [--rounds 3] [--write-docs] [--json OUT]
    python bench/eval_rollback.py --device cuda --dtype bfloat16    # on a GPU
    python bench/eval_rollback.py --tiny                             # a tiny config: keeps the script tested

The drafter is a scripted stand-in that proposes the target's own greedy tokens for `hits` slots
of each block and a wrong token after them (so every block is rejected at the same place, and the
drafter itself costs nothing): with hits = 0 every block is rolled back and one token re-run, with
hits = block - 1 every draft is accepted and nothing is re-run. An attention-only target rolls
back by cropping its KV cache; a hybrid snapshots its linear-attention states before each verify
forward and, on a rejection, restores them and re-runs the accepted tokens (train/speculative.py).
Reported per row: seconds per generated token, plain greedy decoding's for reference, and the
share of the speculative time spent in snapshot, restore and re-forward.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench._report import machine, publish  # noqa: E402
from layertap.train.speculative import TargetRunner, greedy_decode, speculative_decode  # noqa: E402

TARGETS = ("qwen3", "qwen3_5_text")


class ScriptedDrafter(torch.nn.Module):
    """Drafts `greedy` (the target's plain greedy output) for `hits` slots of a block, then wrong tokens."""

    def __init__(self, greedy: list[int], prompt_len: int, hits: int, block_size: int, vocab: int):
        super().__init__()
        self.config = type("C", (), {"block_size": block_size})()
        self.greedy, self.prompt_len, self.hits, self.vocab = greedy + [0] * block_size, prompt_len, hits, vocab

    def forward(self, context, anchors, anchor_tokens):
        start = int(anchors[0, 0]) - self.prompt_len  # greedy[start] follows the anchor
        toks = [0] + [self.greedy[start + k] if k <= self.hits else (self.greedy[start + k] + 1) % self.vocab
                      for k in range(1, self.config.block_size)]
        return torch.tensor(toks)[None, None]

    def logits(self, hidden):
        return torch.nn.functional.one_hot(hidden, self.vocab).float()


def target(model_type: str, a: argparse.Namespace) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
              num_attention_heads=a.hidden // 64, num_key_value_heads=max(1, a.hidden // 256), head_dim=64,
              max_position_embeddings=4096, tie_word_embeddings=False)
    if model_type == "qwen3_5_text":  # Qwen3.6-27B's proportions: 2x as many value heads as key heads
        kw.update(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=max(1, a.hidden // 128),
                  linear_num_value_heads=max(1, a.hidden // 64))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw))
    return model.to(device=a.device, dtype=getattr(torch, a.dtype)).eval()


def measure(model_type: str, a: argparse.Namespace) -> list[dict]:
    """One row per acceptance pattern; times exclude the prompt's prefill (done before the clock
    starts, then reused), and each is the median of `a.rounds` passes over the prompts."""
    runner = TargetRunner(target(model_type, a), [1, a.layers - 1])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, a.vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(a.prompts)]
    greedy = [greedy_decode(runner, p, a.new_tokens, eos=set()) for p in prompts]
    tokens = sum(len(x) for x in greedy)

    def timed(decode) -> tuple[float, dict, list]:
        before, seconds, outs = dict(runner.seconds), 0.0, []
        for p, want in zip(prompts, greedy):
            runner.prefill(p)
            t0 = time.perf_counter()
            outs.append(decode(p, want))
            seconds += time.perf_counter() - t0
        return seconds, {k: runner.seconds[k] - before[k] for k in runner.seconds}, outs

    def median(decode) -> tuple[float, dict, list]:
        return sorted((timed(decode) for _ in range(a.rounds)), key=lambda x: x[0])[a.rounds // 2]

    greedy_s = median(lambda p, want: greedy_decode(runner, p, a.new_tokens, eos=set()))[0]
    rows = []
    for hits in sorted({0, (a.block_size - 1) // 2, a.block_size - 1}):
        spec_s, parts, outs = median(lambda p, want: speculative_decode(
            runner, ScriptedDrafter(want, len(p), hits, a.block_size, a.vocab), p, a.new_tokens, eos=set()))
        accepted = [m for o in outs for m in o.accepted]
        rows.append({"target": model_type, "hits": hits, "block_size": a.block_size,
                     "tau": sum(accepted) / len(accepted), "tokens": tokens, "speculative_s": spec_s,
                     "s_per_token": spec_s / tokens, "greedy_s_per_token": greedy_s / tokens,
                     **{f"{k}_s": v for k, v in parts.items()}, "rollback_fraction": sum(parts.values()) / spec_s,
                     "matches_greedy": [o.tokens for o in outs] == greedy})
        print(f"{model_type:>13} hits {hits:2d}: {1e3 * spec_s / tokens:7.2f} ms/token, rollback "
              f"{100 * rows[-1]['rollback_fraction']:.1f}%", flush=True)
    return rows


def markdown(r: dict) -> str:
    a = r["args"]
    lines = [
        "## `layertap eval` on a gated-deltanet hybrid: the rollback's cost", "",
        f"Command: `{r['command']}`  ",
        f"Date: {r['date']}  ",
        f"Machine: {r['machine']}; torch {torch.__version__}, device {a['device']}, {a['dtype']}, "
        f"{torch.get_num_threads()} torch thread(s); load average {r['load_average'][0]} before, "
        f"{r['load_average'][1]} after  ",
        f"Targets: random-init qwen3 and qwen3_5_text of the same size (hidden {a['hidden']}, {a['layers']} layers, "
        f"vocab {a['vocab']}; the hybrid's layers 3 gated deltanet : 1 full attention); {a['prompts']} random prompts "
        f"of {a['prompt_tokens']} tokens, {a['new_tokens']} new tokens each, block {a['block_size']}; times exclude "
        f"the prefill, medians of {a['rounds']} passes. The drafter is "
        "a scripted stand-in (bench/eval_rollback.py) accepting `hits` drafts of each block, so both targets "
        "decode the same blocks and the drafter costs nothing.", "",
        "| target | accepted drafts per block | tau | ms per token, speculative | ms per token, greedy "
        "| snapshot | restore | re-forward | rollback share of speculative time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["rows"]:
        share = [f"{100 * x[k] / x['speculative_s']:.1f}%" for k in ("snapshot_s", "restore_s", "reforward_s")]
        lines.append(f"| {x['target']} | {x['hits']} of {x['block_size'] - 1} | {x['tau']:.2f} | "
                     f"{1e3 * x['s_per_token']:.2f} | {1e3 * x['greedy_s_per_token']:.2f} | {' | '.join(share)} | "
                     f"{100 * x['rollback_fraction']:.1f}% |")
    lines += ["", "Snapshot, restore and re-forward are shares of the speculative decoding time; the rollback "
              "share is their sum. Every row's output equals plain greedy decoding: "
              + ("yes." if all(x["matches_greedy"] for x in r["rows"]) else "NO."), "",
              "Reading: copying and restoring the linear-attention states is cheap; the cost is the re-forward of "
              "the accepted tokens after each rejection, a second forward of the target per verification step "
              "(with no LM head). With every draft accepted nothing is re-run. The hybrid's multi-token forwards "
              "here run transformers' PyTorch fallback kernels (no flash-linear-attention or causal_conv1d on "
              "this machine), which makes its verify forward dearer than the attention-only target's."]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts per row; the median is kept")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--tiny", action="store_true", help="hidden 64, 4 layers, 2 short prompts: seconds on a CPU")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--write-docs", action="store_true", help="put the section into docs/benchmarks.md")
    a = ap.parse_args()
    if a.tiny:
        a.hidden, a.layers, a.vocab, a.prompts, a.prompt_tokens, a.new_tokens, a.block_size, a.rounds = (
            64, 4, 512, 2, 16, 12, 4, 1)
    load = os.getloadavg()[0]
    rows = [row for t in TARGETS for row in measure(t, a)]
    r = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(),
         "load_average": [round(load, 1), round(os.getloadavg()[0], 1)],
         "command": "".join(f"{k}={os.environ[k]} " for k in ("OMP_NUM_THREADS",) if k in os.environ)
         + "python bench/eval_rollback.py " + " ".join(sys.argv[1:]), "args": vars(a), "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    publish("eval-rollback", markdown(r), a.write_docs, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
