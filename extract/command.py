"""`layertap extract`: the command line over `extract.run.extract`."""

from __future__ import annotations

import argparse


def add_extract(p: argparse.ArgumentParser) -> None:
    """One option per `ExtractConfig` field (its help and default are written there), and --config."""
    from layertap.extract.config import CONFIG_HELP, ExtractConfig
    from layertap.storage.flags import add_flags

    add_flags(p, ExtractConfig, CONFIG_HELP)


def run_extract(args: argparse.Namespace) -> int:
    from layertap.extract.config import load_config
    from layertap.extract.run import extract

    return extract(load_config(args))
