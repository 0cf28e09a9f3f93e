"""Extraction throughput of a Qwen3.6-27B-sized target on one GPU, with random-init weights
(speed does not depend on the weights' values).

    python bench/gpu_extract.py [--seq 2048] [--batches 8] [--batch-tokens 16384] [--json OUT]
    python bench/gpu_extract.py --tiny        # a tiny config on CPU: keeps the script tested

Reports tokens/s and MFU of the bare truncated forward, then the whole pipeline (forward ->
pinned host copy -> encode pool -> streaming shard writer) into a local folder and into an S3
server (moto in its own process, or --endpoint), with the time split between forward, copy,
encode and upload.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from extract.inputs import TokenizedSample  # noqa: E402
from extract.model import Capture  # noqa: E402
from extract.pipeline import PipelineStats, extract_shard, make_batches, pad_batch  # noqa: E402
from storage.shard import ShardMeta  # noqa: E402
from storage.store import open_store  # noqa: E402
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


def build(sizes: dict, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", **sizes)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return model.eval().requires_grad_(False)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny config on CPU (a smoke test of this script)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batches", type=int, default=8)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--layers", default="1,16,31,46,61")
    ap.add_argument("--codec", default="bf16-zstd")
    ap.add_argument("--encode-threads", type=int, default=max(2, (os.cpu_count() or 4) - 2))
    ap.add_argument("--endpoint", help="an S3 server to write to instead of starting moto (credentials from env)")
    ap.add_argument("--json", help="write the results here as JSON")
    args = ap.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    sizes = TINY if args.tiny else QWEN27B
    layers = [int(x) for x in args.layers.split(",")] if not args.tiny else [1, 3, 5]
    seq = min(args.seq, 64) if args.tiny else args.seq
    batch_tokens = max(seq, min(args.batch_tokens, 256) if args.tiny else args.batch_tokens)
    model = build(sizes, device)
    capture = Capture(model, layers)
    params = sum(p.numel() for p in capture.decoder.parameters()) - capture.decoder.embed_tokens.weight.numel()
    g = torch.Generator().manual_seed(0)
    per_batch = batch_tokens // seq
    samples = [TokenizedSample(f"s{i}", torch.randint(0, sizes["vocab_size"], (seq,), generator=g),
                               torch.ones(seq, dtype=torch.bool)) for i in range(per_batch * args.batches)]
    batches = make_batches(samples, batch_tokens)
    tokens = sum(len(s) for s in samples)

    def bare() -> float:
        sync(device)
        t0 = time.perf_counter()
        for b in batches:
            ids, mask = pad_batch(b, 0)
            capture(ids, mask)
        sync(device)
        return time.perf_counter() - t0

    bare()  # warm-up: kernels, allocator, lazy inits
    bare_s = bare()
    flops = 2 * params * tokens  # matmul FLOPs of the kept layers (attention scores excluded)
    results = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "kept_layers": capture.kept_layers, "params_kept": params, "tokens": tokens, "seq": seq,
        "batch_tokens": batch_tokens, "codec": args.codec, "encode_threads": args.encode_threads,
        "bare": {"s": bare_s, "tokens_per_s": tokens / bare_s,
                 "mfu": flops / bare_s / H200_BF16_PEAK if device == "cuda" else None,
                 "raw_mb_per_s": tokens * len(layers) * sizes["hidden_size"] * 2 / bare_s / 1e6},
    }
    meta = ShardMeta(run_id="bench", shard_id=0, model="qwen3_5_text-random", layers=layers,
                     hidden_size=sizes["hidden_size"], codec=args.codec)

    def pipeline(store, key):
        stats = PipelineStats()
        sync(device)
        t = time.perf_counter()
        info = extract_shard(capture, samples, meta, store.open_writer(key), batch_tokens=batch_tokens, pad_id=0,
                             encode_threads=args.encode_threads, stats=stats)
        wall = time.perf_counter() - t
        return {"s": wall, "tokens_per_s": tokens / wall, "vs_bare": wall / bare_s, "bytes": info.bytes,
                "ratio": info.raw_bytes / info.bytes, "forward_s": stats.forward_s, "copy_s": stats.copy_s,
                "encode_s_summed": stats.encode_s, "write_s": stats.write_s, "close_s": stats.close_s}

    tmp = tempfile.mkdtemp(prefix="gpu-extract-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        results["local"] = pipeline(open_store(tmp), "shard.lts")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    with bench_server(args.endpoint) as srv:
        os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
        import boto3

        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="bench")
        results["s3"] = dict(pipeline(open_store("s3://bench/run"), "shard.lts"), server=srv.description)

    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
