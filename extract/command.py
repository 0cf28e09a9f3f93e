"""`layertap extract`: the command line over `extract.run.extract`."""

from __future__ import annotations

import argparse
import sys


def add_extract(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="run prefix: s3://bucket/prefix or a local folder (required)")
    p.add_argument("--model", help="target model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--gguf-file", help="GGUF file inside --model to load")
    p.add_argument("--dataset", help="saved dataset folder or .jsonl/.json/.parquet file "
                                     "(default: the embedded ShareGPT conversations)")
    p.add_argument("--layers", help="capture layers, e.g. 1,16,31,46,61 (default: DFlash's spacing); "
                                    "layer k = output of decoder layer k")
    p.add_argument("--codec", choices=["bf16", "bf16-zstd", "fp8"], help="hidden-state codec (default bf16-zstd)")
    p.add_argument("--max-length", type=int, help="truncate samples to N tokens (default 4096)")
    p.add_argument("--limit", type=int, help="take the first N samples (default: all; 300 for the embedded data)")
    p.add_argument("--final-state", choices=["none", "prenorm", "postnorm"], help="also store the last layer's state")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"],
                   help="forward dtype (default auto: bfloat16 on CUDA and on CPUs with native bf16, float32 on "
                        "other CPUs, where it is faster); states are stored as bf16 either way")
    p.add_argument("--attn-implementation", help="sdpa (default), eager, flash_attention_2 ...")
    p.add_argument("--batch-tokens", type=int, help="padded tokens per forward batch (default 16384)")
    p.add_argument("--shard-bytes", help="target stored bytes per shard, e.g. 64MB, 1GB (default 1GB)")
    p.add_argument("--encode-threads", type=int, help="threads compressing records (default: this process's share of its CPUs, 2 to 8)")
    p.add_argument("--shards", help="static assignment: only these shard ids, e.g. 0-99 (default: any free shard)")
    p.add_argument("--lease-ttl", type=float, dest="lease_ttl_s", help="seconds before a dead worker's lease expires (default 60)")
    p.add_argument("--log-dir", help="per-rank log files (default ./layertap-logs)")
    p.add_argument("--config", help="JSON file with any of these settings (flags override it)")
    if isinstance(p, argparse.ArgumentParser):  # not when another command forwards these options
        _hint_attached_values(p)


def _hint_attached_values(p: argparse.ArgumentParser) -> None:
    """argparse reads `--layers -1,3` as two options and says only "expected one argument":
    say how to give a value that starts with '-'."""
    error = p.error

    def error_with_hint(message: str) -> None:
        if message.endswith("expected one argument") and message.startswith("argument --"):
            option = message.split()[1].rstrip(":").split("/")[-1]
            message += f" (a value that starts with '-' must be attached with '=': {option}=VALUE)"
        error(message)

    p.error = error_with_hint


def run_extract(args: argparse.Namespace) -> int:
    from layertap.extract.config import USER_ERRORS, load_config, parse_ids

    overrides = {k: getattr(args, k) for k in (
        "out", "model", "gguf_file", "dataset", "codec", "dtype", "max_length", "limit", "final_state", "attn_implementation",
        "batch_tokens", "shard_bytes", "encode_threads", "lease_ttl_s", "log_dir")}
    try:
        overrides["layers"] = parse_ids(args.layers) if args.layers is not None else None
        overrides["shards"] = parse_ids(args.shards) if args.shards is not None else None
        cfg = load_config(args.config, overrides)
        from layertap.extract.run import extract

        return extract(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
