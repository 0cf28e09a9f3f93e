"""Streaming training data: `ShardStream` reads a run's committed shards from the store into RAM;
`StreamLoader` batches it with exact mid-epoch resume; `collate` pads, `pack` packs.

Imported on first use (PEP 562): `layertap submit train` reads `train.config` on a login node,
and these bring torch (a second or more on a shared filesystem) for nothing there."""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {"collate": "batch", "pack": "batch", "packer": "batch", "StreamLoader": "loader",
         "ShardStream": "stream", "StreamConfig": "stream"}
__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
