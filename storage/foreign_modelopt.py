"""ModelOpt's offline data: `{conversation_id}.pt` per sample, a `torch.save` dict with
`input_ids` [T], `hidden_states` [T, H] (the last layer's state after the final norm: HF's last
`hidden_states` entry), `aux_hidden_states` [T, k*H] (the capture layers concatenated, ModelOpt's
0-based decoder layer ids, which are layertap's), optional `loss_mask` [T] and `conversation_id`.
"""

from __future__ import annotations

import logging
import posixpath
import re

import torch

from layertap.storage.errors import InputError
from layertap.storage.foreign import (ForeignFile, as_bf16, as_mask, check_lengths, load_torch, natural_key, save_torch,
                                      split_layers)
from layertap.storage.records import Sample
from layertap.storage.store import ObjectStore

log = logging.getLogger(__name__)


def file_key(sample_id: str) -> str:
    """A file name from a sample id: characters outside [A-Za-z0-9._-] become '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", sample_id).lstrip(".") + ".pt"


class ModelOptWriter:
    def __init__(self, store: ObjectStore):
        self.store = store
        self._keys: set[str] = set()

    def write(self, index: int, sample: Sample) -> None:
        if sample.final_state is None:
            raise InputError(f"sample {sample.sample_id} has no final state; ModelOpt's files need the last layer's "
                             "post-norm state")
        key = file_key(sample.sample_id)
        if key in self._keys:
            key = file_key(f"{sample.sample_id}-{index}")
        self._keys.add(key)
        t = sample.num_tokens
        self.store.put(key, save_torch({
            "input_ids": sample.input_ids.to(torch.int64).contiguous(),
            "hidden_states": as_bf16(sample.final_state).contiguous(),
            "aux_hidden_states": as_bf16(sample.hidden_states).reshape(t, -1).contiguous(),
            "loss_mask": sample.loss_mask.to(torch.int64).contiguous(),
            "conversation_id": sample.sample_id,
        }))

    def close(self) -> list[str]:
        return []


class ModelOptReader:
    final_state = "postnorm"

    def __init__(self, store: ObjectStore, num_layers: int):
        self.store, self.num_layers = store, num_layers
        self._files = sorted((o for o in store.list("") if o.key.endswith(".pt")), key=lambda o: natural_key(o.key))
        if not self._files:
            raise InputError(f"no ModelOpt files at {store.uri}: expected {{conversation_id}}.pt files")
        self._warned = False

    def files(self) -> list[ForeignFile]:
        return [ForeignFile(posixpath.splitext(o.key)[0], o.key, o.size) for o in self._files]

    def capture_values(self, f: ForeignFile) -> tuple[int, int | None]:
        where = f"{self.store.uri.rstrip('/')}/{f.key}"
        d = load_torch(self.store.get(f.key), where)
        if "aux_hidden_states" not in d:
            raise InputError(f"{where} lacks aux_hidden_states")
        return int(d["aux_hidden_states"].shape[-1]), None

    def read(self, f: ForeignFile) -> Sample:
        where = f"{self.store.uri.rstrip('/')}/{f.key}"
        d = load_torch(self.store.get(f.key), where)
        missing = [k for k in ("input_ids", "hidden_states", "aux_hidden_states") if k not in d]
        if missing:
            raise InputError(f"{where} lacks {missing}")
        ids = d["input_ids"].reshape(-1).to(torch.int64)
        states = split_layers(d["aux_hidden_states"], self.num_layers, where, "aux_hidden_states")
        final = d["hidden_states"]
        final = final[0] if final.dim() == 3 else final
        if final.shape[-1] != states.shape[-1]:
            raise InputError(f"{where}: hidden_states is {final.shape[-1]} wide, the {self.num_layers} aux layer(s) "
                             f"{states.shape[-1]}: is --layers right?")
        mask = d.get("loss_mask")
        if mask is None:
            if not self._warned:
                log.warning("%s has no loss_mask: every token counts as trained on (ModelOpt's default)", where)
                self._warned = True
            mask = torch.ones_like(ids)
        cid = d.get("conversation_id")
        sample_id = cid if isinstance(cid, str) and cid else f.sample_id
        return check_lengths(Sample(sample_id, ids, as_mask(mask), as_bf16(states).contiguous(),
                                    as_bf16(final).contiguous()), where)
