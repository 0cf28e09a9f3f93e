"""speculators reads its training states straight from a layertap run: a hidden-states transfer
(hs_connectors' `HiddenStatesTransfer`, what speculators' `ArrowDataset` takes as `transfer=`)
that serves row i as the run's i-th committed sample, decoded from its shard on the store.

With `layertap export RUN --to speculators DEST --rows-only` (the Arrow dataset alone, rows in
the same order), `ArrowDataset(max_len, DEST, transfer=LayertapTransfer(RUN))` trains on the run
without a file per sample on any disk. Rows are mapped through the run's commit records, in
shard order, as the export wrote them; each shard's footer is read once and kept (a few per
process), and each row is one ranged GET with every hash checked.

Importing this module needs hs_connectors (installed with speculators).
"""

from __future__ import annotations

import bisect
import functools
from typing import Any

import torch
from hs_connectors import HiddenStatesTransfer

from layertap.extract.interop import check_exportable
from layertap.storage.foreign import layer_order
from layertap.manifests.commit_index import read_commits
from layertap.manifests.manifest import load_manifest
from layertap.storage.foreign_speculators import hs_tensors
from layertap.storage.reader import ShardReader
from layertap.storage.store import open_store


class LayertapTransfer(HiddenStatesTransfer):
    """Row `file_idx` of a `--rows-only` export of `run` (an S3 prefix or folder), from the run."""

    def __init__(self, run: str, **store_options: Any):
        self.run, self.store_options = run, store_options
        self._store = None

    def setup(self) -> None:
        """Opened lazily, in the process that reads (a DataLoader worker opens its own)."""
        if self._store is not None:
            return
        store = open_store(self.run, **self.store_options)
        ident = load_manifest(store).identity
        check_exportable("speculators", ident, self.run)
        self._order = layer_order("speculators", ident.layers)
        self._commits = read_commits(store).records
        self._starts = [0]
        for c in self._commits:
            self._starts.append(self._starts[-1] + c.num_records)
        self._store = store
        self._reader = functools.lru_cache(maxsize=4)(lambda key: ShardReader(store, key))

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self.setup()
        if not 0 <= file_idx < self._starts[-1]:
            return None
        shard = bisect.bisect_right(self._starts, file_idx) - 1
        sample = self._reader(self._commits[shard].data_key).read(file_idx - self._starts[shard])
        sample.hidden_states = sample.hidden_states[:, self._order]
        return hs_tensors(sample)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None  # a run holds what was extracted; nothing is generated on demand
