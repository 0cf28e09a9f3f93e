"""Samples -> training batches: `collate` pads, `pack` concatenates samples into fixed-length rows.

Both keep one batch per fixed number of samples (the DataLoader's batch_size), so every rank
runs the same number of steps however long its samples are; packing into rows of a token
budget changes the rows per batch, never the batches per epoch.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Sequence

import torch


def _final_states(samples: Sequence[dict[str, Any]]) -> bool:
    have = ["final_state" in s for s in samples]
    if any(have) and not all(have):
        raise ValueError("some samples carry final_state and others do not: they come from different runs")
    return bool(have) and all(have)


def collate(samples: Sequence[dict[str, Any]], *, pad_token_id: int = 0,
            pad_to_multiple_of: int | None = None, pin_memory: bool = False) -> dict[str, Any]:
    """Right-pad to the longest sample: input_ids [B, T], loss_mask [B, T], attention_mask [B, T]
    (bool), hidden_states [B, T, L, H], final_state [B, T, H] if present, lengths [B], padding [B]
    (zero-weighted repeats) and sample_id (list of str). Padded positions have loss_mask 0.

    `pin_memory`: the states are written straight into page-locked memory, from which a copy to
    the GPU runs asynchronously, instead of being copied once more to pin them (in the process
    that owns the GPU only: not in a DataLoader worker)."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s["input_ids"].shape[0]) for s in samples]
    t = max(lengths)
    if pad_to_multiple_of:
        t = -(-t // pad_to_multiple_of) * pad_to_multiple_of
    b = len(samples)
    hs = samples[0]["hidden_states"]
    out: dict[str, Any] = {
        "input_ids": torch.full((b, t), pad_token_id, dtype=torch.int64),
        "loss_mask": torch.zeros((b, t), dtype=torch.uint8),
        "attention_mask": torch.zeros((b, t), dtype=torch.bool),
        "hidden_states": torch.empty((b, t, *hs.shape[1:]), dtype=hs.dtype, pin_memory=pin_memory),
    }
    final = _final_states(samples)
    if final:
        out["final_state"] = torch.empty((b, t, samples[0]["final_state"].shape[-1]), dtype=hs.dtype,
                                         pin_memory=pin_memory)
    states = ("hidden_states", "final_state") if final else ("hidden_states",)
    for i, (s, n) in enumerate(zip(samples, lengths)):
        out["input_ids"][i, :n] = s["input_ids"]
        out["loss_mask"][i, :n] = s["loss_mask"]
        out["attention_mask"][i, :n] = True
        for key in states:  # written once: the sample, then zeros on the padding only
            out[key][i, :n] = s[key]
            out[key][i, n:] = 0
    out["lengths"] = torch.tensor(lengths, dtype=torch.int64)
    out["padding"] = torch.tensor([bool(s.get("padding", False)) for s in samples])
    out["sample_id"] = [s["sample_id"] for s in samples]
    return out


def pack(samples: Sequence[dict[str, Any]], *, max_tokens: int, pad_token_id: int = 0) -> dict[str, Any]:
    """Concatenate samples into rows of exactly `max_tokens` tokens (first fit, in order).

    Besides the `collate` keys (attention_mask marks real tokens) it returns position_ids [R, T]
    (restarting at 0 in every sample) and sequence_ids [R, T] (index into `sample_id`, -1 on
    padding), from which attention is kept inside each sample (block-diagonal / varlen
    attention). A sample longer than `max_tokens` gets a row of its own and is cut to it;
    `truncated_tokens` counts what was cut.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not samples:
        raise ValueError("pack needs at least one sample")
    rows: list[list[int]] = []
    room: list[int] = []
    truncated = 0
    for i, s in enumerate(samples):
        n = int(s["input_ids"].shape[0])
        if n > max_tokens:
            truncated += n - max_tokens
            n = max_tokens
        for r, left in enumerate(room):
            if n <= left:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_tokens - n)
    nr, t = len(rows), max_tokens
    hs = samples[0]["hidden_states"]
    final = _final_states(samples)
    out: dict[str, Any] = {
        "input_ids": torch.full((nr, t), pad_token_id, dtype=torch.int64),
        "loss_mask": torch.zeros((nr, t), dtype=torch.uint8),
        "attention_mask": torch.zeros((nr, t), dtype=torch.bool),
        "position_ids": torch.zeros((nr, t), dtype=torch.int64),
        "sequence_ids": torch.full((nr, t), -1, dtype=torch.int64),
        "hidden_states": torch.zeros((nr, t, *hs.shape[1:]), dtype=hs.dtype),
    }
    if final:
        out["final_state"] = torch.zeros((nr, t, samples[0]["final_state"].shape[-1]), dtype=hs.dtype)
    for r, members in enumerate(rows):
        at = 0
        for i in members:
            s = samples[i]
            n = min(int(s["input_ids"].shape[0]), max_tokens)
            span = slice(at, at + n)
            out["input_ids"][r, span] = s["input_ids"][:n]
            out["loss_mask"][r, span] = s["loss_mask"][:n]
            out["attention_mask"][r, span] = True
            out["position_ids"][r, span] = torch.arange(n)
            out["sequence_ids"][r, span] = i
            out["hidden_states"][r, span] = s["hidden_states"][:n]
            if final:
                out["final_state"][r, span] = s["final_state"][:n]
            at += n
    out["padding"] = torch.tensor([bool(s.get("padding", False)) for s in samples])
    out["sample_id"] = [s["sample_id"] for s in samples]
    out["truncated_tokens"] = truncated
    return out


def packer(max_tokens: int, pad_token_id: int = 0):
    """`pack` with its budget bound, as a DataLoader collate_fn (picklable for worker processes)."""
    return partial(pack, max_tokens=max_tokens, pad_token_id=pad_token_id)
