"""speculators' offline data: an Arrow dataset (`save_to_disk`; columns `input_ids`, `loss_mask`,
`seq_len`, torch format) beside `hidden_states/hs_{i}.safetensors` for row i, holding
`hidden_states` [T, k+1, H] (the k capture layers ascending, then the pre-norm output of the last
decoder layer, which speculators' trainer splits off as the verifier's last state) and
`token_ids` [T]. Files written by its FP8 connector add `hidden_states_scales` [T, 1, 1].

The Arrow dataset is small (token ids and masks); it passes through a local temporary folder,
since `datasets` reads and writes only local paths. The states go straight to and from the store.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from layertap.storage.errors import InputError, MissingInput
from layertap.storage.foreign import ForeignFile, as_bf16, as_mask, check_lengths
from layertap.storage.records import Sample
from layertap.storage.store import ObjectNotFound, ObjectStore

log = logging.getLogger(__name__)

HIDDEN = "hidden_states/"


def hs_key(index: int) -> str:
    return f"{HIDDEN}hs_{index}.safetensors"


def hs_tensors(sample: Sample) -> dict[str, torch.Tensor]:
    """A sample as speculators' `hs_{i}.safetensors` holds it (layers already in the file's order)."""
    if sample.final_state is None:
        raise InputError(f"sample {sample.sample_id} has no final state; speculators' files need the pre-norm "
                         "output of the last decoder layer")
    states = torch.cat((as_bf16(sample.hidden_states), as_bf16(sample.final_state)[:, None]), dim=1)
    return {"hidden_states": states.contiguous(), "token_ids": sample.input_ids.to(torch.int64).contiguous()}


class SpeculatorsWriter:
    """Rows in the order written (index 0, 1, ...); `close` writes the Arrow dataset. With
    `states=False` only the Arrow dataset is written, for speculators to read the states from the
    run itself (`extract.speculators_transfer`)."""

    def __init__(self, store: ObjectStore, states: bool = True):
        import pyarrow as pa

        self.store, self.states = store, states
        self._tmp = tempfile.TemporaryDirectory(prefix="layertap-speculators-")
        self._schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                                  ("seq_len", pa.int64())])
        self._rows = os.path.join(self._tmp.name, "rows.arrow")
        self._out = pa.ipc.new_stream(pa.OSFile(self._rows, "wb"), self._schema)  # streamed: no row list in RAM
        self._next = 0
        self._keys: list[str] = []

    def write(self, index: int, sample: Sample) -> None:
        import pyarrow as pa

        if index != self._next:
            raise ValueError(f"speculators rows are written in order: expected row {self._next}, got {index}")
        ids = sample.input_ids.to(torch.int64)
        if self.states:  # not for --rows-only: the states' concatenation is the costly part
            self._keys.append(hs_key(index))  # before the put: one that fails halfway is removed too
            self.store.put(hs_key(index), st_save(hs_tensors(sample)))
        batch = pa.record_batch([pa.array([ids.tolist()], pa.list_(pa.int64())),
                                 pa.array([sample.loss_mask.to(torch.int64).tolist()], pa.list_(pa.int64())),
                                 pa.array([len(ids)], pa.int64())], schema=self._schema)
        self._out.write_batch(batch)
        self._next += 1

    def close(self) -> list[str]:
        """The Arrow dataset (`save_to_disk`, torch format) next to `hidden_states/`; the keys written."""
        import datasets

        self._out.close()
        try:
            ds = datasets.Dataset.from_file(self._rows)
            ds.set_format("torch")
            folder = os.path.join(self._tmp.name, "dataset")
            ds.save_to_disk(folder)
            keys = []
            for name in sorted(os.listdir(folder)):
                self._keys.append(name)
                with open(os.path.join(folder, name), "rb") as f:
                    self.store.put(name, f.read())
                keys.append(name)
            return keys
        finally:
            self._tmp.cleanup()

    def written(self) -> list[str]:
        return list(self._keys)


class SpeculatorsReader:
    final_state = "prenorm"
    renamed = 0  # a row's id is its index, always

    def __init__(self, store: ObjectStore, num_layers: int):
        self.store, self.num_layers = store, num_layers
        self._tmp = tempfile.TemporaryDirectory(prefix="layertap-speculators-")
        self.rows = self._load_rows()

    def _load_rows(self):
        """The Arrow dataset at the store's root, copied into a temporary folder (it is small)."""
        import datasets

        try:  # state.json names the data files: no listing of hidden_states/, which holds a file per row
            state = json.loads(self.store.get("state.json"))
            names = ["state.json", "dataset_info.json", *(d["filename"] for d in state["_data_files"])]
            for name in names[1:]:
                self.store.size(name)
        except (ObjectNotFound, ValueError, KeyError, TypeError, RecursionError):
            raise MissingInput(f"no speculators dataset at {self.store.uri}: expected an Arrow dataset saved with "
                               "`save_to_disk` (state.json, dataset_info.json, data-*.arrow) beside hidden_states/"
                               ) from None
        for name in names:
            path = os.path.join(self._tmp.name, name)  # a data file in a subfolder: the store refused any ".."
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(self.store.get(name))
        try:
            rows = datasets.load_from_disk(self._tmp.name)
        except Exception as e:  # a data-*.arrow cut short (OSError), another datasets' feature types (ValueError)
            raise InputError(f"the speculators dataset at {self.store.uri} (state.json, dataset_info.json, "
                             f"{', '.join(names[2:])}) does not load: {type(e).__name__}: {e}") from None
        missing = {"input_ids", "loss_mask"} - set(rows.column_names)
        if missing:
            raise InputError(f"the speculators dataset at {self.store.uri} lacks the columns {sorted(missing)}")
        for name, listed in (("input_ids", True), ("loss_mask", True), ("seq_len", False)):
            kind = rows.features.get(name)  # another type: each row failed its shard, on every retry
            inner = getattr(kind, "feature", None) if listed else kind
            dtype = str(getattr(inner, "dtype", ""))
            if kind is not None and not (dtype.startswith(("int", "uint")) or name == "loss_mask" and dtype == "bool"):
                raise InputError(f"the speculators dataset at {self.store.uri}: its column {name} is {kind}, not "
                                 + ("a list of integers" if listed else "an integer"))
        return rows.with_format("torch")

    def files(self) -> list[ForeignFile]:
        sizes = {o.key: o.size for o in self.store.list(HIDDEN)}
        # The plan counts tokens by the ids the import reads, from Arrow's list lengths (no row is decoded): a
        # seq_len column that disagreed (stale, or edited) planned its tokens into one shard of all
        import pyarrow.compute as pc

        ids = self.rows.data.column("input_ids")
        lengths = pc.fill_null(pc.list_value_length(ids), 0).to_pylist()
        if "seq_len" in self.rows.column_names:
            stated = self.rows.data.column("seq_len").to_pylist()
            if off := [i for i, (n, m) in enumerate(zip(lengths, stated)) if n != m]:
                log.warning("the speculators dataset at %s: %d row(s) hold another number of input_ids than their "
                            "seq_len (row %d: %d ids, seq_len %r): planned by their input_ids, which are imported",
                            self.store.uri, len(off), off[0], lengths[off[0]], stated[off[0]])
        if extra := len(set(sizes) - {hs_key(i) for i in range(len(lengths))}):
            log.warning("%s holds %d file(s) beside the hidden states of the dataset's %d rows: no row names them, so "
                        "they are not imported", f"{self.store.uri.rstrip('/')}/{HIDDEN}", extra, len(lengths))
        return [ForeignFile(str(i), hs_key(i), sizes.get(hs_key(i), 0), int(n)) for i, n in enumerate(lengths)]

    def _load(self, f: ForeignFile) -> tuple[dict[str, torch.Tensor], str]:
        where = f"{self.store.uri.rstrip('/')}/{f.key}"
        try:
            data = st_load(bytes(self.store.get(f.key)))
        except ObjectNotFound:
            raise InputError(f"{where} is missing (row {f.sample_id} of the dataset has no hidden states)") from None
        except SafetensorError as e:
            raise InputError(f"{where} is not a readable safetensors file, or was cut short: {e}") from None
        if "hidden_states" not in data or "token_ids" not in data:
            raise InputError(f"{where} lacks hidden_states or token_ids")
        return data, where

    def capture_values(self, f: ForeignFile) -> tuple[int, int | None]:
        data, where = self._load(f)
        shape = data["hidden_states"].shape
        if len(shape) != 3 or shape[1] < 2:
            raise InputError(f"{where}: hidden_states has shape {tuple(shape)}, not [tokens, capture layers + the "
                             "final state, hidden]")
        return (shape[1] - 1) * shape[2], shape[1] - 1

    def read(self, f: ForeignFile) -> Sample:
        data, where = self._load(f)
        states = data["hidden_states"]
        if "hidden_states_scales" in data:  # speculators' FP8 connector: per-token scales
            scales = data["hidden_states_scales"]
            if states.dim() != 3 or tuple(scales.shape) != (states.shape[0], 1, 1):
                raise InputError(f"{where}: hidden_states_scales has shape {tuple(scales.shape)}, not "
                                 f"[{states.shape[0]}, 1, 1] (one scale a token of hidden_states "
                                 f"{tuple(states.shape)})")
            states = states.float() * scales.float()
        if states.dim() != 3 or states.shape[1] != self.num_layers + 1:
            raise InputError(f"{where}: hidden_states has shape {tuple(states.shape)}, not [tokens, "
                             f"{self.num_layers + 1}, hidden] for the {self.num_layers} layer(s) of --layers plus "
                             "the final state")
        row = self.rows[int(f.sample_id)]
        if not all(isinstance(row[k], torch.Tensor) for k in ("input_ids", "loss_mask")):
            raise InputError(f"row {f.sample_id} of the speculators dataset at {self.store.uri} has no input_ids or "
                             "loss_mask (null)")
        if not states.is_floating_point() or data["token_ids"].is_floating_point():
            raise InputError(f"{where}: hidden_states is {states.dtype} and token_ids {data['token_ids'].dtype}: "
                             "states are floating point, token ids integers")
        ids = data["token_ids"].to(torch.int64)
        if not torch.equal(ids, row["input_ids"].to(torch.int64)):
            raise InputError(f"{where}: its token_ids differ from the dataset's input_ids of row {f.sample_id}")
        states = as_bf16(states)
        return check_lengths(Sample(f.sample_id, ids, as_mask(row["loss_mask"]), states[:, :-1].contiguous(),
                                    states[:, -1].contiguous()), where)
