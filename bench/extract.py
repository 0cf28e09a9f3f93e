"""Extraction cost on CPU with the real SmolLM2-135M-Instruct over real ShareGPT conversations.

    python bench/extract.py [--samples 48] [--max-length 256] [--rounds 2] [--write-docs]

Three ways over the same length-sorted batches, interleaved in each round (the machine is
shared, so only ratios measured side by side mean anything):
  bare      the truncated forward alone (the floor: no copy, no encode, no I/O)
  layertap  extract_shard: forward -> encode pool -> streaming shard writer into a local folder
  baseline  the public trainers' way: forward, then one uncompressed safetensors file per sample
Targets (issue 4): layertap <= 1.10x bare; bytes stored >= 1.45x fewer than the baseline.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench._report import machine, write_section  # noqa: E402
from layertap.extract.embedded import sharegpt_conversations, smollm2_gguf  # noqa: E402
from layertap.extract.inputs import TokenizedSample, tokenize_rows  # noqa: E402
from layertap.extract.model import Capture, default_layers, load_target  # noqa: E402
from layertap.extract.pipeline import PipelineStats, extract_shard, make_batches, pad_batch  # noqa: E402
from layertap.storage.format import ShardMeta  # noqa: E402
from layertap.storage.store import open_store  # noqa: E402


def bare(capture, batches, pad_id) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        ids, mask = pad_batch(batch, pad_id)
        capture(ids, mask)
    return time.perf_counter() - t0


def layertap(capture, samples, meta, folder, batch_tokens, pad_id, threads) -> tuple[float, int, PipelineStats]:
    store = open_store(folder)
    stats = PipelineStats()
    t0 = time.perf_counter()
    info = extract_shard(capture, samples, meta, store.open_writer("shard.lts"), batch_tokens=batch_tokens,
                         pad_id=pad_id, encode_threads=threads, stats=stats)
    return time.perf_counter() - t0, info.bytes, stats


def baseline(capture, batches, folder, pad_id) -> tuple[float, int]:
    """speculators-style: hs_{i}.safetensors with token_ids and hidden_states [S, L, H], serially."""
    t0 = time.perf_counter()
    for batch in batches:
        ids, mask = pad_batch(batch, pad_id)
        hidden, _ = capture(ids, mask)
        hidden = hidden.to(torch.bfloat16)
        for i, s in enumerate(batch):
            n = len(s)
            save_file({"token_ids": s.input_ids, "hidden_states": hidden[i, :n].contiguous(),
                       "loss_mask": s.loss_mask.to(torch.uint8)}, os.path.join(folder, f"hs_{s.sample_id}.safetensors"))
    elapsed = time.perf_counter() - t0
    return elapsed, sum(f.stat().st_size for f in Path(folder).iterdir())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--encode-threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()

    folder, name = smollm2_gguf()
    target = load_target(folder, name, dtype=getattr(torch, args.dtype))
    layers = default_layers(target.info["num_layers"])
    capture = Capture(target.model, layers)
    pad_id = target.tokenizer.pad_token_id or 0
    rows = list(sharegpt_conversations(args.samples * 2))
    samples = [s for s in tokenize_rows(rows, target.tokenizer, args.max_length) if isinstance(s, TokenizedSample)]
    samples = samples[: args.samples]
    batches = make_batches(samples, args.batch_tokens)
    tokens = sum(len(s) for s in samples)
    meta = ShardMeta(run_id="bench", shard_id=0, model="SmolLM2-135M-Instruct", layers=layers,
                     hidden_size=target.info["hidden_size"], codec="bf16-zstd")
    bare(capture, batches[:1], pad_id)  # warm-up

    times = {"bare": [], "layertap": [], "baseline": []}
    sizes = {}
    stats = None
    for r in range(args.rounds):
        order = ["bare", "layertap", "baseline"] if r % 2 == 0 else ["baseline", "layertap", "bare"]
        for what in order:
            tmp = tempfile.mkdtemp(prefix=f"bench-{what}-")
            try:
                if what == "bare":
                    times[what].append(bare(capture, batches, pad_id))
                elif what == "layertap":
                    dt, sizes[what], stats = layertap(capture, samples, meta, tmp, args.batch_tokens, pad_id,
                                                      args.encode_threads)
                    times[what].append(dt)
                else:
                    dt, sizes[what] = baseline(capture, batches, tmp, pad_id)
                    times[what].append(dt)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio_time = med["layertap"] / med["bare"]
    ratio_bytes = sizes["baseline"] / sizes["layertap"]
    lines = [
        "## Extraction on CPU: layertap vs the bare forward vs one safetensors file per sample",
        "",
        f"Command: `python bench/extract.py --samples {args.samples} --max-length {args.max_length} "
        f"--rounds {args.rounds}{' --write-docs' if args.write_docs else ''}`  ",
        f"Date: {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  ",
        f"Machine: {machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads  ",
        f"Workload: SmolLM2-135M-Instruct ({args.dtype} forward, states stored as bf16), layers {layers}, "
        f"{len(samples)} ShareGPT conversations, {tokens:,} tokens, {len(batches)} batches of <= "
        f"{args.batch_tokens} padded tokens, codec bf16-zstd, {args.encode_threads} encode thread(s), "
        f"local folder store; median of {args.rounds} interleaved rounds.",
        "",
        "| way | median s | tokens/s | vs bare | bytes stored |",
        "|---|---:|---:|---:|---:|",
        f"| bare truncated forward | {med['bare']:.2f} | {tokens / med['bare']:,.0f} | 1.00x | - |",
        f"| layertap extract_shard | {med['layertap']:.2f} | {tokens / med['layertap']:,.0f} | {ratio_time:.3f}x "
        f"| {sizes['layertap']:,} |",
        f"| baseline: safetensors per sample | {med['baseline']:.2f} | {tokens / med['baseline']:,.0f} "
        f"| {med['baseline'] / med['bare']:.3f}x | {sizes['baseline']:,} |",
        "",
        f"- extractor / bare forward: **{ratio_time:.3f}x** (target <= 1.10x: "
        f"{'met' if ratio_time <= 1.10 else 'missed'})",
        f"- bytes, baseline / layertap: **{ratio_bytes:.3f}x** fewer (target >= 1.45x: "
        f"{'met' if ratio_bytes >= 1.45 else 'missed'})",
        f"- layertap's last run, seconds per stage (encode and write run beside the forward, on other "
        f"threads): forward {stats.forward_s:.2f}, encode {stats.encode_s:.2f}, write {stats.write_s:.2f}, "
        f"wall {stats.wall_s:.2f}",
    ]
    text = "\n".join(lines)
    print(text)
    if args.write_docs:
        write_section("extract", text, ROOT / "docs" / "benchmarks.md")


if __name__ == "__main__":
    main()
