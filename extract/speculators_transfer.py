"""speculators reads its training states straight from a layertap run: a hidden-states transfer
(hs_connectors' `HiddenStatesTransfer`, what speculators' `ArrowDataset` takes as `transfer=`)
that serves each row of a `--rows-only` export from the run's shard that holds it.

With `layertap export RUN --to speculators DEST --rows-only` (the Arrow dataset alone),
`ArrowDataset(max_len, DEST, transfer=LayertapTransfer(DEST))` trains on the run without a file
per sample on any disk. Rows map to samples through the export's own record of the shards it
read (`layertap-export.json`'s `sources`), not through the run's commits at training time: a
shard committed since, or one whose data a `--delete-consumed` trainer removed, must not shift
every later row onto another sample. A row whose shard is gone is missing (`on_missing` applies).
Each shard's index is read once per process and kept (~100 bytes a row: ~90 MB for 900,000 rows),
so each row is one ranged GET with every hash checked, in whatever order the sampler shuffles
them (a few readers kept cost 2 more GETs, a HEAD's and a footer's, for nearly every row).

Importing this module needs hs_connectors (installed with speculators).
"""

from __future__ import annotations

import bisect
import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hs_connectors import HiddenStatesTransfer

from layertap.extract.interop import EXPORT_NOTE, check_exportable
from layertap.manifests.manifest import header_mismatch, load_manifest
from layertap.storage.errors import InputError
from layertap.storage.foreign import layer_order
from layertap.storage.foreign_speculators import hs_tensors
from layertap.storage.format import RecordEntry, ShardMeta
from layertap.storage.reader import ShardReader, read_record
from layertap.storage.store import ObjectNotFound, ObjectStore, open_store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ShardIndex:
    """A shard's footer index in arrays (what `ShardReader` holds as an object per record, and the
    parsed footer beside it: several times the bytes), for reading any of its records again."""

    key: str
    where: str
    meta: ShardMeta
    ids: list[str]
    spans: np.ndarray  # [n, 3] int64: offset, length, num_tokens
    hashes: np.ndarray  # [n] uint64: each record's xxh3-64

    @classmethod
    def of(cls, reader: ShardReader) -> _ShardIndex:
        return cls(reader.key, reader.where, reader.meta, [e.sample_id for e in reader.entries],
                   np.array([(e.offset, e.length, e.num_tokens) for e in reader.entries], dtype=np.int64),
                   np.array([int(e.xxh3_64, 16) for e in reader.entries], dtype=np.uint64))

    def read(self, store: ObjectStore, index: int):
        """`ShardReader.read(index)`: one ranged GET, the frame's hash checked against the index."""
        offset, length, tokens = (int(v) for v in self.spans[index])
        entry = RecordEntry(sample_id=self.ids[index], offset=offset, length=length, num_tokens=tokens,
                            xxh3_64=f"{int(self.hashes[index]):016x}")
        return read_record(store, self.key, self.where, self.meta, index, entry)


class LayertapTransfer(HiddenStatesTransfer):
    """Row `file_idx` of the `--rows-only` export at `rows` (a folder or S3 prefix), read from the
    run it names; `run`: where that run is now, if it moved since the export."""

    def __init__(self, rows: str, run: str | None = None, **store_options: Any):
        self.rows, self.run, self.store_options = rows, run, store_options
        self._store = None

    def setup(self) -> None:
        """Opened lazily, in the process that reads (a DataLoader worker opens its own)."""
        if self._store is not None:
            return
        try:
            note = json.loads(open_store(self.rows, **self.store_options).get(EXPORT_NOTE))
        except ObjectNotFound:
            raise InputError(f"{self.rows} has no {EXPORT_NOTE}: pass the folder `layertap export --rows-only` "
                             "wrote (it names the run and the shard of each row)") from None
        if "sources" not in note:
            raise InputError(f"{self.rows}/{EXPORT_NOTE} lists no sources (an export by an older layertap): "
                             "export it again")
        store = open_store(self.run or note["source"], **self.store_options)
        manifest = load_manifest(store)
        if manifest.run_id != note["run_id"]:
            raise InputError(f"the run at {store.uri} is run {manifest.run_id}, but {self.rows} was exported from "
                             f"run {note['run_id']}: pass that run's location as run=")
        check_exportable("speculators", manifest.identity, store.uri)
        self._order = layer_order("speculators", manifest.identity.layers)
        self._config = manifest.config
        self._sources = note["sources"]
        self._starts = [0]
        for source in self._sources:
            self._starts.append(self._starts[-1] + source["samples"])
        self._store = store
        self._indexes: dict[str, _ShardIndex] = {}

    def __getstate__(self) -> dict[str, Any]:
        """What a spawned DataLoader worker (speculators' own) receives: the locations, not the open
        store and its shard indexes, read again there (`setup`)."""
        return {"rows": self.rows, "run": self.run, "store_options": self.store_options, "_store": None}

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor] | None:
        self.setup()
        if not 0 <= file_idx < self._starts[-1]:
            return None
        i = bisect.bisect_right(self._starts, file_idx) - 1
        key = self._sources[i]["data_key"]
        try:
            if (index := self._indexes.get(key)) is None:
                reader = ShardReader(self._store, key)
                # labelled by the manifest, which an edit may have made say other states than the shard holds
                if (refused := header_mismatch(self._store.uri, self._sources[i]["shard"], key, reader.meta,
                                               self._config)) is not None:
                    raise refused
                index = self._indexes[key] = _ShardIndex.of(reader)
            sample = index.read(self._store, file_idx - self._starts[i])
        except ObjectNotFound:  # consumed by a --delete-consumed trainer, or withdrawn by verify
            log.warning("row %d: shard %d's data %s is gone from the run", file_idx, self._sources[i]["shard"], key)
            return None
        sample.hidden_states = sample.hidden_states[:, self._order]
        return hs_tensors(sample)

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        return None  # a run holds what was extracted; nothing is generated on demand
