"""`layertap regenerate`: the command line over `extract.regenerate.regenerate`."""

from __future__ import annotations

import argparse


def add_regenerate(p: argparse.ArgumentParser) -> None:
    """One option per `RegenerateConfig` field, and --config."""
    from layertap.extract.regenerate import RegenerateConfig
    from layertap.storage.flags import add_flags

    add_flags(p, RegenerateConfig)


def run_regenerate(args: argparse.Namespace) -> int:
    from layertap.extract.regenerate import load_regenerate_config, regenerate

    regenerate(load_regenerate_config(args))
    return 0
