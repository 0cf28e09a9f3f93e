"""ModelOpt's offline data: `{conversation_id}.pt` per sample, a `torch.save` dict with
`input_ids` [T], `hidden_states` [T, H] (the last layer's state: after the final norm from its HF
dumper, HF's last `hidden_states` entry; before it from its vLLM dumper, which newer ModelOpt
flags with `hidden_states_prenorm: True` and its reader norms), `aux_hidden_states` [T, k*H] (the
capture layers concatenated, ascending, ModelOpt's 0-based decoder layer ids, which are layertap's),
optional `loss_mask` [T] and `conversation_id`.
A sample's id is its `conversation_id` where the file is named after it, else the file's name
(`ModelOptReader.sample_id`).
"""

from __future__ import annotations

import logging
import posixpath
import re
from typing import Any

import torch

from layertap.storage.errors import InputError
from layertap.storage.foreign import (ForeignFile, as_bf16, as_mask, check_lengths, load_torch, natural_key, printable,
                                      save_torch, one_state, split_layers, tensor_of, tokens_of)
from layertap.storage.records import Sample
from layertap.storage.store import ObjectStore

log = logging.getLogger(__name__)


def file_key(sample_id: str) -> str:
    """A file name from a sample id: characters outside [A-Za-z0-9._-] become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", sample_id).lstrip(".") + ".pt"


class ModelOptWriter:
    def __init__(self, store: ObjectStore):
        self.store = store
        self._keys: dict[str, None] = {}  # in the order written

    def write(self, index: int, sample: Sample) -> None:
        if sample.final_state is None:
            raise InputError(f"sample {sample.sample_id} has no final state; ModelOpt's files need the last layer's "
                             "post-norm state")
        key = file_key(sample.sample_id)
        n = 1
        while key in self._keys:  # ids that differ only in characters a file name cannot hold; "-{index}" may clash too
            key = file_key(f"{sample.sample_id}-{index}" + (f"-{n}" if n > 1 else ""))
            n += 1
        self._keys[key] = None  # before the put: one that fails halfway is removed too
        t = sample.num_tokens
        self.store.put(key, save_torch({
            "input_ids": sample.input_ids.to(torch.int64).contiguous(),
            "hidden_states": as_bf16(sample.final_state).contiguous(),
            "aux_hidden_states": as_bf16(sample.hidden_states).reshape(t, -1).contiguous(),
            "loss_mask": sample.loss_mask.to(torch.int64).contiguous(),
            "conversation_id": sample.sample_id,
            "hidden_states_prenorm": False,  # said, for ModelOpt's reader (which norms a flagged pre-norm state)
        }))

    def close(self) -> list[str]:
        return []

    def written(self) -> list[str]:
        return list(self._keys)


class ModelOptReader:
    def __init__(self, store: ObjectStore, num_layers: int, unflagged: str = "postnorm", asked: bool = False):
        """`unflagged`: the final state of files without `hidden_states_prenorm` (older ModelOpt's);
        `asked`: given as --final-state (a file that says otherwise is warned of, once)."""
        self.store, self.num_layers, self.unflagged, self.asked = store, num_layers, unflagged, asked
        self.final_state: str | None = None  # the first file's, which every later one must match
        self._files = sorted((o for o in store.list("") if o.key.endswith(".pt")), key=lambda o: natural_key(o.key))
        if not self._files:
            raise InputError(f"no ModelOpt files at {store.uri}: expected {{conversation_id}}.pt files")
        self._warned = False
        self._stems = {printable(posixpath.splitext(o.key)[0]) for o in self._files}
        self.renamed = 0

    def files(self) -> list[ForeignFile]:
        return [ForeignFile(printable(posixpath.splitext(o.key)[0]), o.key, o.size) for o in self._files]

    def sample_id(self, cid: Any, f: ForeignFile) -> str:
        """The file's `conversation_id` when the file is named after it (as ModelOpt's dumper and
        `layertap export` name them) and it is no other file's name; else the file's name (its key
        without .pt). Unique, as a run's ids must be, and fixed by the file and the listing alone,
        so that shards of any size get the same ids: a conversation_id repeated in several files,
        or files in subfolders, no longer make two samples of one id."""
        if isinstance(cid, str) and cid and (cid == f.sample_id or (file_key(cid) == f.key
                                                                     and cid not in self._stems)):
            return cid
        if isinstance(cid, str) and cid:
            self.renamed += 1
            if self.renamed == 1:
                log.warning("%s: its conversation_id %r is not its file's name, or is another file's: its sample id "
                            "is the file's, %r (and so for any other such file; the import counts them)", printable(f.key), cid,
                            f.sample_id)
        return f.sample_id

    def _check_final_state(self, prenorm: Any, where: str) -> None:
        """Which final state the file holds (`hidden_states_prenorm`, else `unflagged`): the run's is
        the first file's, and a later file of the other kind is refused (ModelOpt's reader refuses
        the mix too). Taken for post-norm always, a vLLM dump's pre-norm state trained unnormed."""
        if isinstance(prenorm, torch.Tensor) and prenorm.numel() == 1:
            prenorm = bool(prenorm.item())
        if prenorm is not None and not isinstance(prenorm, bool):
            raise InputError(f"{where}: hidden_states_prenorm is {prenorm!r}, not true or false")
        kind = self.unflagged if prenorm is None else "prenorm" if prenorm else "postnorm"
        if self.final_state is None:
            self.final_state = kind
            if self.asked and kind != self.unflagged:
                log.warning("%s says it holds a %s final state (hidden_states_prenorm %s): imported as one; "
                            "--final-state %s applies only to files that do not say", where, kind, prenorm,
                            self.unflagged)
        elif kind != self.final_state:
            raise InputError(f"{where} holds a {kind} final state (hidden_states_prenorm {prenorm}), the first file a "
                             f"{self.final_state} one: import the two kinds as two runs")

    def capture_values(self, f: ForeignFile) -> tuple[int, int | None]:
        where = f"{self.store.uri.rstrip('/')}/{printable(f.key)}"
        d = load_torch(self.store.get(f.key), where)
        if "aux_hidden_states" not in d:
            raise InputError(f"{where} lacks aux_hidden_states")
        return int(tensor_of(d, "aux_hidden_states", where, (2, 3), "states").shape[-1]), None

    def read(self, f: ForeignFile) -> Sample:
        where = f"{self.store.uri.rstrip('/')}/{printable(f.key)}"
        d = load_torch(self.store.get(f.key), where)
        missing = [k for k in ("input_ids", "hidden_states", "aux_hidden_states") if k not in d]
        if missing:
            raise InputError(f"{where} lacks {missing}")
        ids = tokens_of(d, "input_ids", where, "ids").to(torch.int64)
        states = split_layers(tensor_of(d, "aux_hidden_states", where, (2, 3), "states"), self.num_layers, where,
                              "aux_hidden_states")
        self._check_final_state(d.get("hidden_states_prenorm"), where)
        final = one_state(tensor_of(d, "hidden_states", where, (2, 3), "states"), where, "hidden_states")
        if final.shape[-1] != states.shape[-1]:
            raise InputError(f"{where}: hidden_states is {final.shape[-1]} wide, the {self.num_layers} aux layer(s) "
                             f"{states.shape[-1]}: is --layers right?")
        mask = tokens_of(d, "loss_mask", where) if d.get("loss_mask") is not None else None
        if mask is None:
            if not self._warned:
                log.warning("%s has no loss_mask: every token counts as trained on (ModelOpt's default)", where)
                self._warned = True
            mask = torch.ones_like(ids)
        return check_lengths(Sample(self.sample_id(d.get("conversation_id"), f), ids, as_mask(mask),
                                    as_bf16(states).contiguous(), as_bf16(final).contiguous()), where)
