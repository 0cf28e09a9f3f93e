"""Streaming training data: `ShardStream` reads a run's committed shards from the store into RAM;
`StreamLoader` batches it with exact mid-epoch resume; `collate` pads, `pack` packs."""

from layertap.train.batch import collate, pack, packer
from layertap.train.loader import StreamLoader
from layertap.train.stream import ShardStream, StreamConfig

__all__ = ["ShardStream", "StreamConfig", "StreamLoader", "collate", "pack", "packer"]
