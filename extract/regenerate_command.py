"""`layertap regenerate`: the command line over `extract.regenerate.regenerate`."""

from __future__ import annotations

import argparse


def add_regenerate(p: argparse.ArgumentParser) -> None:
    """One option per `RegenerateConfig` field, and --config."""
    from layertap.extract.regenerate import RegenerateConfig
    from layertap.storage.flags import add_flags

    add_flags(p, RegenerateConfig)


def run_regenerate(args: argparse.Namespace) -> int:
    import logging

    from layertap.extract.regenerate import load_regenerate_config, regenerate
    from layertap.manifests.cli import format_regeneration
    from layertap.manifests.preemption import Preempted
    from layertap.manifests.regeneration import regeneration_status
    from layertap.storage.store import open_store

    cfg = load_regenerate_config(args)
    try:
        totals = regenerate(cfg)
    except Preempted as e:  # the parts written are kept; the open ones are redone by a rerun
        logging.getLogger("layertap.extract.regenerate").warning(
            "stopped (%s): the parts written are kept; rerun the same command to continue", e)
        return e.exit_code
    # on stdout, as extract, train and import end: the output's status and what reads it
    status = totals.status if totals.status is not None else regeneration_status(open_store(cfg.out))
    if status is not None:
        print(format_regeneration(status))
    return 0
