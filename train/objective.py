"""DFlash's training objective: sample anchors, build the blocks' targets, weighted cross-entropy.

Anchors are positions ``a`` where ``loss_mask[a]`` and ``loss_mask[a+1]`` are set (the anchor and
the first drafted token are both assistant output); up to `max_anchors` per sequence are drawn
without replacement from a generator the caller seeds per step, so a resumed run draws the same
anchors. Block slot ``k >= 1`` predicts ``input_ids[a+k]`` with weight
``loss_mask[a+k] * exp(-(k-1)/gamma)``: early slots matter most, since a draft is accepted only
up to its first miss. The head is applied only where the weight is non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from train.drafter import DFlashDrafter


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B, A] positions (0 where unused)
    valid: torch.Tensor  # [B, A] bool
    labels: torch.Tensor  # [B, A, block] token ids, slot 0 unused
    weights: torch.Tensor  # [B, A, block] float, 0 where there is nothing to learn


@dataclass
class StepLoss:
    loss: torch.Tensor  # scalar, weighted mean over this batch
    weight: float  # the sum of weights behind it
    correct: torch.Tensor  # [block] greedy hits per slot (loss-masked targets only)
    counted: torch.Tensor  # [block] loss-masked targets per slot


def sample_anchors(loss_mask: torch.Tensor, lengths: torch.Tensor, max_anchors: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] mask and [B] lengths -> anchors [B, A] (sorted) and valid [B, A]."""
    b, t = loss_mask.shape
    m = loss_mask.bool()
    ok = torch.zeros_like(m)
    ok[:, :-1] = m[:, :-1] & m[:, 1:]
    ok &= (torch.arange(t)[None, :] + 1) < lengths[:, None]
    picks = []
    for row in ok:
        idx = row.nonzero().flatten()
        if idx.numel() > max_anchors:
            idx = idx[torch.randperm(idx.numel(), generator=generator)[:max_anchors]].sort().values
        picks.append(idx)
    a = max(1, max(p.numel() for p in picks))
    anchors = torch.zeros((b, a), dtype=torch.int64)
    valid = torch.zeros((b, a), dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, : p.numel()] = p
        valid[i, : p.numel()] = True
    return anchors, valid


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, lengths: torch.Tensor, anchors: torch.Tensor,
                  valid: torch.Tensor, block_size: int, gamma: float) -> Blocks:
    """Labels and weights of every block slot; slots past a sequence's end weigh 0."""
    b, t = input_ids.shape
    pos = anchors[:, :, None] + torch.arange(block_size)  # [B, A, block]
    inside = pos < lengths[:, None, None]
    at = pos.clamp(max=t - 1)
    labels = torch.gather(input_ids, 1, at.reshape(b, -1)).view_as(pos)
    mask = torch.gather(loss_mask.float(), 1, at.reshape(b, -1)).view_as(pos) * inside * valid[:, :, None]
    decay = torch.exp(-(torch.arange(block_size, dtype=torch.float32) - 1) / gamma)
    decay[0] = 0.0  # slot 0 holds the anchor itself
    return Blocks(anchors, valid, labels, mask * decay)


def dflash_loss(model: DFlashDrafter, batch: dict, generator: torch.Generator) -> StepLoss:
    """The weighted CE of one padded batch (`train.batch.collate`'s keys)."""
    inner: DFlashDrafter = getattr(model, "module", model)  # under DDP, the wrapped drafter
    c = inner.config
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], c.max_anchors, generator)
    blocks = block_targets(batch["input_ids"], batch["loss_mask"], batch["lengths"], anchors, valid,
                           c.block_size, c.gamma)
    device = next(p for p in model.parameters() if p.requires_grad).device
    anchor_tokens = torch.gather(batch["input_ids"], 1, anchors)
    hidden = model(batch["hidden_states"].to(device), anchors.to(device), anchor_tokens.to(device))
    weights = blocks.weights.to(device)
    keep = weights > 0
    slots = torch.arange(c.block_size, device=device).expand_as(weights)[keep]
    counted = torch.bincount(slots, minlength=c.block_size).cpu()
    if not bool(keep.any()):  # nothing supervised here: a zero loss that still reaches every weight (DDP)
        zero = hidden.sum() * 0.0
        return StepLoss(zero, 0.0, torch.zeros(c.block_size, dtype=torch.int64), counted)
    logits = inner.logits(hidden[keep]).float()
    labels = blocks.labels.to(device)[keep]
    w = weights[keep]
    ce = F.cross_entropy(logits, labels, reduction="none")
    loss = (ce * w).sum() / w.sum()
    hits = (logits.argmax(-1) == labels).long()
    correct = torch.zeros(c.block_size, dtype=torch.int64, device=device).scatter_add_(0, slots, hits).cpu()
    return StepLoss(loss, float(w.sum()), correct, counted)
