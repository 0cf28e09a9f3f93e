"""`layertap train` and `layertap eval`: command lines over `train.trainer` and `train.speculative`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def add_train(p: argparse.ArgumentParser) -> None:
    """One option per `TrainConfig` field (its help and default are written there), and --config."""
    from layertap.extract.config import CONFIG_HELP
    from layertap.storage.flags import add_flags
    from layertap.train.config import TrainConfig

    add_flags(p, TrainConfig, CONFIG_HELP)


def run_train(args: argparse.Namespace) -> int:
    from layertap.train.config import load_train_config
    from layertap.train.trainer import train

    code = train(load_train_config(args))
    if code == 0 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        # One process of several, its training ended on every rank (the last barrier passed, the process
        # groups destroyed, the drafter exported): gone now, past the interpreter's teardown, where a C++
        # thread of the distributed backend still joinable aborted a finished rank now and then ("terminate
        # called without an active exception", SIGABRT: 1 full test run in 5). At 1,000 ranks such odds
        # fail nearly every finished job, and Slurm would take it for a failure.
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return code


def add_eval(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="a `layertap train` output (or its drafter/ folder)")
    p.add_argument("--model", help="the target model folder (default: the one the drafter records, as "
                                    "`layertap train` takes the run's)")
    p.add_argument("--gguf-file", help="GGUF file inside --model")
    p.add_argument("--prompts", required=True,
                   help="JSON lines: ShareGPT or OpenAI chats (the assistant turns at the end are dropped: the "
                        "target answers the turns before; rendered with its chat template) or {\"prompt\": text} "
                        "(plain text, tokenized as it is: no chat template, as a base model's completion); or "
                        "'embedded': the packaged ShareGPT's chats from row 10,000 on, held out from the "
                        "Quickstart's extraction")
    p.add_argument("--chat-template-kwargs", metavar="JSON",
                   help="passed to the chat template rendering the prompts, e.g. '{\"enable_thinking\": false}' "
                        "(default: the settings the drafter's training chats were rendered with, which it records "
                        "from the run: its extraction's --chat-template-kwargs; a prompt rendered otherwise is a text "
                        "the drafter never saw; '{}': none)")
    p.add_argument("--limit", type=int, help="evaluate the first N prompts that fit --max-prompt-tokens (default all)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024,
                   help="prompts longer than this are skipped (and counted) (default 1024)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                   help="the target's dtype, and the drafter's (default float32, unlike extract's: the check against plain greedy "
                        "decoding compares exact choices, and in bfloat16 a near-tie between two tokens can come "
                        "out differently in a multi-token verify forward than in one-token decoding)")
    p.add_argument("--device", help="where the target and drafter run (default: cuda when there is one, else cpu)")
    p.add_argument("--step", type=int, help="evaluate the drafter of the checkpoint at this step instead of the "
                                            "exported one (a learning curve: train with --keep-checkpoints 0)")
    p.add_argument("--no-baseline", action="store_true", help="skip the untrained drafter's tau")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _check_device(device: str) -> None:
    """--device, before any model loads: a typo or a GPU this machine lacks failed inside the
    target's load, a traceback after the drafter and prompts were read."""
    import torch

    from layertap.storage.errors import ConfigError

    try:
        where = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"--device {device!r} is not a device torch knows: give cpu, cuda or cuda:N") from None
    if where.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"--device {device!r}: this machine has no CUDA GPU torch can use (torch "
                              f"{torch.__version__}); leave --device out to run on the CPU")
        if where.index is not None and where.index >= count:
            raise ConfigError(f"--device {device!r}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")


def run_eval(args: argparse.Namespace) -> int:
    from layertap.storage.errors import ConfigError
    from layertap.train.speculative import evaluate, format_report

    if args.max_new_tokens < 1:  # decoding emits the prefill's token before checking the limit
        raise ConfigError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.max_prompt_tokens < 1:
        raise ConfigError(f"--max-prompt-tokens must be at least 1, got {args.max_prompt_tokens}")
    if args.limit is not None and args.limit < 1:  # else "the prompts file has no usable prompts"
        raise ConfigError(f"--limit must be at least 1 prompt, got {args.limit} (leave it out to evaluate all)")
    if args.device is not None:
        _check_device(args.device)
    kwargs = None
    if args.chat_template_kwargs is not None:
        from layertap.storage.flags import parse_json_object

        try:
            kwargs = parse_json_object(args.chat_template_kwargs)
        except ValueError as e:
            raise ConfigError(f"--chat-template-kwargs {args.chat_template_kwargs!r}: {e}") from None

    report = evaluate(args.drafter, args.model, args.prompts, gguf_file=args.gguf_file, limit=args.limit,
                      max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens, dtype=args.dtype, baseline=not args.no_baseline,
                      device=args.device, step=args.step, chat_template_kwargs=kwargs)
    print(json.dumps(report) if args.json else format_report(report))
    if report["tau"] is None and args.max_new_tokens > 1:
        # nothing measured: not a result to go on with (a pipeline comparing drafters would read it as one)
        print("error: no prompt reached a verification step, so tau was not measured: every answer ended at its "
              "first token. {\"prompt\": ...} rows are plain text, without the chat template: an instruct "
              "target may end at once there; give chats ({\"messages\": [...]}) instead", file=sys.stderr)
        return 1
    return 0 if report["matches_greedy"] else 1
