"""`layertap extract`: the command line over `extract.run.extract`."""

from __future__ import annotations

import argparse


def add_extract(p: argparse.ArgumentParser) -> None:
    """One option per `ExtractConfig` field (its help and default are written there), and --config."""
    from layertap.extract.config import CONFIG_HELP, ExtractConfig
    from layertap.storage.flags import add_flags

    add_flags(p, ExtractConfig, CONFIG_HELP)
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
    from layertap.extract.config import load_config
    from layertap.extract.run import extract

    return extract(load_config(args))
