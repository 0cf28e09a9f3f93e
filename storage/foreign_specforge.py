"""SpecForge's offline data: one `torch.save` dict per sample, `rows_{g}-{g+2000}/data_{i}.ckpt`
(`.ckpt.gz` when compressed; a `.ckpt.gz` beside the `.ckpt` of its name is taken for its
compressed copy, not imported a second time). DFlash files hold `input_ids` [T], `loss_mask` [T] and
`hidden_states` [1, T, k*H], the capture layers concatenated (z-lab's layer ids, which are
layertap's). EAGLE-3 files hold `aux_hidden_state` [1, T, 3H] and `hidden_state` [1, T, H] (the
post-norm last state, which SpecForge projects with the bare LM head) instead. Files may carry
zero-padded tails past the tokens: they are cut to `input_ids`' length.
"""

from __future__ import annotations

import logging
import posixpath

import torch

from layertap.storage.errors import InputError
from layertap.storage.foreign import (PROBE_FILES, ForeignFile, as_bf16, as_mask, check_lengths, load_torch,
                                      natural_key, one_state, printable, save_torch, split_layers, tensor_of,
                                      tokens_of)
from layertap.storage.records import Sample
from layertap.storage.store import ObjectStore

log = logging.getLogger(__name__)

ROWS_PER_FOLDER = 2000
SUFFIXES = (".ckpt", ".ckpt.gz")


def data_key(index: int) -> str:
    g = index // ROWS_PER_FOLDER * ROWS_PER_FOLDER
    return f"rows_{g}-{g + ROWS_PER_FOLDER}/data_{index}.ckpt"


class SpecForgeWriter:
    """DFlash files (the capture layers only: SpecForge's DFlash trains on labels)."""

    def __init__(self, store: ObjectStore):
        self.store = store
        self._keys: list[str] = []

    def write(self, index: int, sample: Sample) -> None:
        t = sample.num_tokens
        data = save_torch({
            "input_ids": sample.input_ids.to(torch.int64).contiguous(),
            "loss_mask": sample.loss_mask.to(torch.int64).contiguous(),
            "hidden_states": as_bf16(sample.hidden_states).reshape(1, t, -1).contiguous(),
        })
        self._keys.append(data_key(index))  # before the put: one that fails halfway is removed too
        self.store.put(data_key(index), data)

    def close(self) -> list[str]:
        return []

    def written(self) -> list[str]:
        return list(self._keys)


class SpecForgeReader:
    renamed = 0  # a file's id is its key's stem, always

    def __init__(self, store: ObjectStore, num_layers: int):
        self.store, self.num_layers = store, num_layers
        listed = [o for o in store.list("") if o.key.endswith(SUFFIXES)]
        plain = {o.key for o in listed if o.key.endswith(".ckpt")}
        copies = sorted(o.key for o in listed if o.key.endswith(".gz") and o.key[:-3] in plain)
        if copies:
            log.warning("%d .ckpt.gz file(s) at %s sit beside the .ckpt of the same name (e.g. %s beside %s): read as "
                        "the same sample compressed, so only the .ckpt is imported (SpecForge's own reader would "
                        "train on both); to import such a file as a sample of its own, give it another name",
                        len(copies), store.uri, copies[0], copies[0][:-3])
        skip = set(copies)
        self._files = sorted((o for o in listed if o.key not in skip), key=lambda o: natural_key(o.key))
        if not self._files:
            raise InputError(f"no SpecForge files at {store.uri}: expected data_*.ckpt or .ckpt.gz files")
        first = self._first_readable()
        self.eagle3 = "aux_hidden_state" in first and "hidden_states" not in first
        self.final_state = "postnorm" if self.eagle3 else "none"

    def _where(self, key: str) -> str:
        return f"{self.store.uri.rstrip('/')}/{printable(key)}"

    def _first_readable(self) -> dict:
        """The first file that loads, of the first PROBE_FILES, which says DFlash or EAGLE-3 for all: a
        first file cut short refused the whole import (the import skips it, as any file that does not read)."""
        error = None
        for o in self._files[:PROBE_FILES]:
            try:
                return load_torch(self.store.get(o.key), self._where(o.key))
            except InputError as e:
                error = error or e
        raise error

    def files(self) -> list[ForeignFile]:
        return [ForeignFile(printable(_stem(o.key)), o.key, o.size) for o in self._files]

    def capture_values(self, f: ForeignFile) -> tuple[int, int | None]:
        where = self._where(f.key)
        d = load_torch(self.store.get(f.key), where)
        states_key = "aux_hidden_state" if self.eagle3 else "hidden_states"
        if states_key not in d:
            raise InputError(f"{where} lacks {states_key}")
        return int(tensor_of(d, states_key, where, (2, 3), "states").shape[-1]), None

    def read(self, f: ForeignFile) -> Sample:
        where = self._where(f.key)
        d = load_torch(self.store.get(f.key), where)
        states_key = "aux_hidden_state" if self.eagle3 else "hidden_states"
        missing = [k for k in ("input_ids", "loss_mask", states_key) + (("hidden_state",) if self.eagle3 else ())
                   if k not in d]
        if missing:
            raise InputError(f"{where} lacks {missing} (a {'EAGLE-3' if self.eagle3 else 'DFlash'} file is expected, "
                             "like the first file of the folder)")
        ids = tokens_of(d, "input_ids", where, "ids").to(torch.int64)
        t = ids.shape[0]
        states = _padding_cut(split_layers(tensor_of(d, states_key, where, (2, 3), "states"), self.num_layers, where,
                                           states_key), t, where, states_key)
        final = None
        if self.eagle3:
            final = one_state(tensor_of(d, "hidden_state", where, (2, 3), "states"), where, "hidden_state")
            final = as_bf16(_padding_cut(final, t, where, "hidden_state")).contiguous()
        mask = as_mask(_padding_cut(tokens_of(d, "loss_mask", where), t, where, "loss_mask"))
        return check_lengths(Sample(f.sample_id, ids, mask, as_bf16(states).contiguous(), final), where)


def _padding_cut(x: torch.Tensor, t: int, where: str, name: str) -> torch.Tensor:
    """`x` cut to the file's `t` tokens: what lies past them must be padding (zeros), or the file
    holds states (or a loss mask) of tokens its input_ids lost, which were dropped without a word."""
    if x.shape[0] > t and bool(x[t:].any()):
        raise InputError(f"{where}: {name} covers {x.shape[0]} tokens, input_ids {t}, and its values past them are "
                         "not zero padding: values of tokens the file's input_ids lack")
    return x[:t]


def _stem(key: str) -> str:
    for suffix in SUFFIXES[::-1]:
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return posixpath.splitext(key)[0]
