"""`layertap train` and `layertap eval`: command lines over `train.trainer` and `train.speculative`."""

from __future__ import annotations

import argparse
import json
import sys


def add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", help="the extraction's run prefix: s3://bucket/prefix or a local folder (required)")
    p.add_argument("--model", help="the target model folder the extraction used; only its embed_tokens and "
                                   "lm_head are read (default: the folder the run's manifest records)")
    p.add_argument("--gguf-file", help="GGUF file inside --model")
    p.add_argument("--out", help="checkpoints, metrics.jsonl and the exported drafter: s3://... or a folder (required)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs passes over the data)")
    p.add_argument("--epochs", type=int, help="passes over the data when --steps is not given (default 1)")
    p.add_argument("--batch-size", type=int, help="samples per micro-batch per rank (default 4)")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step (default 1)")
    p.add_argument("--lr", type=float, help="peak learning rate (default 6e-4)")
    p.add_argument("--seed", type=int, help="data order, anchors and initial weights (default 0)")
    p.add_argument("--save-every", type=int, help="steps between checkpoints (default 500)")
    p.add_argument("--drafter-layers", type=int, help="drafter depth (default: one per ~12 target layers)")
    p.add_argument("--block-size", type=int, help="tokens per drafted block, the anchor included (default 16)")
    p.add_argument("--max-anchors", type=int, help="blocks sampled per sequence (default 512)")
    p.add_argument("--num-workers", type=int, help="DataLoader worker processes per rank (default 0)")
    p.add_argument("--fetch-threads", type=int,
                   help="concurrent ranged GETs per rank, or per worker with --num-workers (default 8; S3 "
                        "serves one connection at ~90 MB/s)")
    p.add_argument("--resume", action="store_true", default=None,
                   help="continue from the latest checkpoint in --out (same batches, same loss curve)")
    p.add_argument("--log-dir", help="TensorBoard logs, when tensorboard is installed (default ./layertap-logs)")
    p.add_argument("--config", help="JSON file with any of train.config.TrainConfig's settings (flags override)")


def run_train(args: argparse.Namespace) -> int:
    from layertap.extract.config import USER_ERRORS
    from layertap.train.config import load_train_config

    overrides = {k: getattr(args, k) for k in (
        "data", "model", "gguf_file", "out", "steps", "epochs", "batch_size", "grad_accum", "lr", "seed",
        "save_every", "drafter_layers", "block_size", "max_anchors", "num_workers", "fetch_threads", "resume",
        "log_dir")}
    try:
        cfg = load_train_config(args.config, overrides)
        from layertap.train.trainer import train

        return train(cfg)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="a `layertap train` output (or its drafter/ folder)")
    p.add_argument("--model", help="the target model folder (default: the one the drafter records, as "
                                    "`layertap train` takes the run's)")
    p.add_argument("--gguf-file", help="GGUF file inside --model")
    p.add_argument("--prompts", required=True,
                   help="JSON lines: ShareGPT or OpenAI chats (the last assistant turn is dropped) or {\"prompt\": ...}")
    p.add_argument("--limit", type=int, help="evaluate the first N prompts (default all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                   help="the target's dtype (default float32, unlike extract's: the check against plain greedy "
                        "decoding compares exact choices, and in bfloat16 a near-tie between two tokens can come "
                        "out differently in a multi-token verify forward than in one-token decoding)")
    p.add_argument("--device", help="where the target and drafter run (default: cuda when there is one, else cpu)")
    p.add_argument("--no-baseline", action="store_true", help="skip the untrained drafter's tau")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_eval(args: argparse.Namespace) -> int:
    from layertap.extract.config import USER_ERRORS
    from layertap.train.speculative import evaluate, format_report

    try:
        report = evaluate(args.drafter, args.model, args.prompts, gguf_file=args.gguf_file, limit=args.limit,
                          max_new_tokens=args.max_new_tokens, dtype=args.dtype, baseline=not args.no_baseline,
                          device=args.device)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report) if args.json else format_report(report))
    return 0 if report["matches_greedy"] else 1
