"""DFlash's training objective: sample anchors, build the blocks' targets, weighted cross-entropy
or distillation from the target's own next-token distribution.

Anchors are positions ``a`` where ``loss_mask[a]`` and ``loss_mask[a+1]`` are set (the anchor and
the first drafted token are both assistant output); up to `max_anchors` per sequence are drawn
without replacement from a generator the caller seeds per step, so a resumed run draws the same
anchors. Block slot ``k >= 1`` predicts ``input_ids[a+k]`` with weight
``loss_mask[a+k] * exp(-(k-1)/gamma)``: early slots matter most, since a draft is accepted only
up to its first miss. The head is applied only where the weight is non-zero, and a chunk of rows
at a time: at a 27B target's vocabulary (248,320) the logits of 512 anchors x 15 slots would
take 7.1 GiB in fp32, several times over with their softmax and gradients.

Distillation (`--objective kl|ce+kl`, `Distill`): a run that stored the target's final-layer state
holds, at position p-1, what the target's own head turns into its distribution for token p, so
slot k's teacher is softmax(head(norm(final[a+k-1]))) (no norm for a postnorm state). The
drafter then learns the target's whole distribution, not only the one token the data holds,
which is what acceptance measures: the target's greedy choice. The teacher's logits are made
in the same chunks as the drafter's, under no_grad, their softmax in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from layertap.train.drafter import DFlashDrafter


@dataclass
class Blocks:
    anchors: torch.Tensor  # [B, A] positions (0 where unused)
    valid: torch.Tensor  # [B, A] bool
    labels: torch.Tensor  # [B, A, block] token ids, slot 0 unused
    weights: torch.Tensor  # [B, A, block] float, 0 where there is nothing to learn


Objective = Literal["ce", "kl", "ce+kl"]
OBJECTIVES: tuple[str, ...] = ("ce", "kl", "ce+kl")


@dataclass
class StepLoss:
    loss: torch.Tensor  # scalar, weighted mean over this batch (`mean=False`: the weighted sum)
    weight: float  # the sum of weights behind it
    correct: torch.Tensor  # [block] greedy hits per slot (loss-masked targets only), on the model's device
    counted: torch.Tensor  # [block] loss-masked targets per slot, on the CPU
    kl: torch.Tensor | None = None  # scalar, detached: the KL part of `loss`, reduced alike (distillation only)


@dataclass
class Distill:
    """The teacher side of `--objective kl|ce+kl`.

    `norm` is the target's frozen final norm for a prenorm final state (None: the state is
    already normed, postnorm). The loss per supervised slot is `weight * (CE [if ce] + T^2 *
    KL(teacher_T || drafter_T))` at temperature T: the T^2 keeps the gradient's scale the same
    at any T (Hinton et al.), so a CE term next to it keeps its share."""

    ce: bool
    temperature: float = 1.0
    norm: nn.Module | None = None
    scale: float = 1.0  # what the target's forward multiplies its head's logits by (Granite, Cohere)
    softcap: float | None = None  # its soft cap on them, cap * tanh(logits / cap) (Gemma)

    @classmethod
    def of(cls, objective: str, temperature: float, norm: nn.Module | None, *, scale: float = 1.0,
           softcap: float | None = None) -> "Distill | None":
        """None for plain CE (the objective as it always was)."""
        return None if objective == "ce" else cls(ce=objective == "ce+kl", temperature=temperature, norm=norm,
                                                  scale=scale, softcap=softcap)

    def to(self, device: torch.device) -> "Distill":
        if self.norm is not None:
            self.norm.to(device)
        return self

    @torch.no_grad()
    def teacher_states(self, final: torch.Tensor) -> torch.Tensor:
        """Stored final states [N, H] -> the vectors the target's head reads, in fp32, times the
        scale its forward gives the logits (linear in them: folded in here)."""
        x = final.float()
        with torch.autocast(x.device.type, enabled=False):
            x = x if self.norm is None else self.norm(x).float()
        return x if self.scale == 1.0 else x * self.scale


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


def teacher_positions(anchors: torch.Tensor, rows: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Rows of a flattened [B, A, block] -> rows of the flattened [B, T] final state that hold
    their teacher: slot k of the block at anchor a predicts token a+k, which the target predicts
    from its state at a+k-1."""
    per_sample = anchors.shape[1] * block_size
    b, a, k = rows // per_sample, (rows // block_size) % anchors.shape[1], rows % block_size
    return b * length + anchors[b, a] + k - 1


def dflash_loss(model: DFlashDrafter, batch: dict, generator: torch.Generator,
                chunk_rows: int | None = None, distill: Distill | None = None, mean: bool = True) -> StepLoss:
    """The weighted CE of one padded batch (`train.batch.collate`'s keys), or with `distill` the
    weighted KL from the target's distribution (its final states: the batch's `final_state`).

    Anchors, labels and weights are made on the CPU from the batch's CPU tensors, so which rows
    the head sees is known without asking the GPU: nothing here waits for the device, and the
    host can queue the next step while this one runs. `chunk_rows`: rows of the frozen head's
    logits computed at once (`head_cross_entropy`); None sizes it from the vocabulary, 0 runs
    the unchunked reference. `mean=False`: the loss is the weighted sum, for a caller that
    normalizes over more than this batch (the trainer: over every micro-batch of every rank).
    """
    inner: DFlashDrafter = getattr(model, "module", model)  # under DDP, the wrapped drafter
    c = inner.config
    anchors, valid = sample_anchors(batch["loss_mask"], batch["lengths"], c.max_anchors, generator)
    blocks = block_targets(batch["input_ids"], batch["loss_mask"], batch["lengths"], anchors, valid,
                           c.block_size, c.gamma)
    device = next(p for p in model.parameters() if p.requires_grad).device
    anchor_tokens = torch.gather(batch["input_ids"], 1, anchors)
    hidden = model(to_device(batch["hidden_states"], device), to_device(anchors, device),
                   to_device(anchor_tokens, device))
    weights = blocks.weights.flatten()
    rows = (weights > 0).nonzero().flatten()  # the order of a boolean mask over [B, A, block]
    slots = rows % c.block_size
    counted = torch.bincount(slots, minlength=c.block_size)
    if rows.numel() == 0:  # nothing supervised here: a zero loss that still reaches every weight (DDP)
        return StepLoss(hidden.sum() * 0.0, 0.0, torch.zeros(c.block_size, dtype=torch.int64, device=device),
                        counted)
    w = weights[rows]
    total = float(w.sum())
    picked = hidden.reshape(-1, c.hidden_size).index_select(0, to_device(rows, device))
    labels, scaled = to_device(blocks.labels.flatten()[rows], device), to_device(w / total if mean else w, device)
    kl = None
    if distill is None:
        loss, hits = head_cross_entropy(picked, inner.lm_head, labels, scaled, chunk_rows)
    else:
        final = batch["final_state"]
        at = teacher_positions(anchors, rows, c.block_size, final.shape[1])
        teacher = distill.teacher_states(final.reshape(-1, final.shape[-1]).index_select(0, to_device(at, device)))
        loss, hits, kl = head_distill_loss(picked, inner.lm_head, labels, scaled, teacher, ce=distill.ce,
                                           temperature=distill.temperature, softcap=distill.softcap,
                                           chunk_rows=chunk_rows)
    correct = torch.zeros(c.block_size, dtype=torch.int64, device=device)
    correct.index_add_(0, to_device(slots, device), hits.long())
    return StepLoss(loss, total, correct, counted, kl)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a stream sync (a blocking copy to CUDA synchronizes the
    whole stream); a no-op for one already there."""
    return t.to(device, non_blocking=True)


def default_chunk_rows(vocab: int) -> int:
    """Rows whose fp32 logits take ~512 MiB: large enough for a full-speed matmul (540 rows x 5,120
    x 248,320 at Qwen3.6-27B's shapes), small enough that the head's logits never dominate the
    step's memory (7,680 rows x 248,320 would take 7.1 GiB). A chunk holds its logits in the matmul
    dtype and their fp32 log-softmax at once, at the end of the forward, where the step's memory
    peaks: 1 GiB chunks measured 41.6 GiB there on an H200 (2026-12-04), over the 40 GiB aimed at."""
    return max(1, (1 << 27) // vocab)


def head_cross_entropy(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                       chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of weights * CE of `hidden @ head.T` against labels, greedy hits [N] bool), for rows
    `hidden` [N, H] and a frozen `head` [V, H]. The logits are made `chunk_rows` rows at a time
    and the gradient w.r.t. `hidden` in the same pass, so full-vocabulary logits never exist for
    all rows at once; `chunk_rows=0` is the plain unchunked computation, kept as the reference."""
    if chunk_rows == 0:
        logits = _unchunked_logits(hidden, head)
        ce = F.cross_entropy(logits, labels, reduction="none")
        return (ce * weights).sum(), logits.argmax(-1) == labels
    loss, hits, _ = _ChunkedHeadLoss.apply(hidden, head, labels, weights, None, True, 1.0,
                                           chunk_rows or default_chunk_rows(head.shape[0]), None)
    return loss, hits


def head_distill_loss(hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                      teacher: torch.Tensor, *, ce: bool, temperature: float = 1.0, softcap: float | None = None,
                      chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum of weights * (CE [if `ce`] + T^2 KL(softmax(teacher @ head.T / T) || softmax(hidden @ head.T / T))),
    greedy hits [N] against `labels`, the KL part alone, detached), for the drafter's rows `hidden`
    [N, H] and the target's `teacher` [N, H] (what its head reads). Chunked as
    `head_cross_entropy`, the teacher's logits too; each chunk holds a few more fp32 arrays of
    its size (teacher, drafter at T, gradient), so the default chunk is half CE's. `softcap`: the
    target's soft cap on its logits, applied to the teacher's."""
    if chunk_rows == 0:
        logits = _unchunked_logits(hidden, head)
        with torch.no_grad():
            target = torch.log_softmax(_capped(_unchunked_logits(teacher, head), softcap) / temperature, -1)
        kl = F.kl_div(torch.log_softmax(logits / temperature, -1), target, log_target=True,
                      reduction="none").sum(-1) * temperature ** 2
        loss = (kl * weights).sum()
        if ce:
            loss = loss + (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
        return loss, logits.argmax(-1) == labels, (kl * weights).sum().detach()
    chunk = chunk_rows or max(1, default_chunk_rows(head.shape[0]) // 2)
    return _ChunkedHeadLoss.apply(hidden, head, labels, weights, teacher, ce, float(temperature), chunk, softcap)


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The target's soft cap on its logits (Gemma's final_logit_softcapping), in fp32; or them as they are."""
    return logits if softcap is None else softcap * torch.tanh(logits.float() / softcap)


def _unchunked_logits(hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(hidden)
    return (hidden.to(dtype) @ head.to(dtype).t()).float()


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul of `t` runs in: autocast's where it is on, else t's own."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else t.dtype


def _kl_chunk(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
              want_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row T^2 KL(teacher_T || drafter_T) [n] and its gradient w.r.t. the drafter's logits,
    T (q_T - p_T) [n, V] (None unless `want_grad`); softmaxes in fp32, buffers reused in place."""
    t = temperature
    log_p = torch.log_softmax(teacher_logits if t == 1 else teacher_logits.float() / t, -1, dtype=torch.float32)
    log_q = torch.log_softmax(logits if t == 1 else logits.float() / t, -1, dtype=torch.float32)
    p = log_p.exp()
    kl = log_p.sub_(log_q).mul_(p).sum(-1) * (t * t)  # sum_v p (log p - log q), in log_p's buffer
    del log_p
    return kl, (log_q.exp_().sub_(p).mul_(t) if want_grad else None)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward computes, per chunk of rows, logits -> weighted CE and/or KL from the teacher's
    logits, argmax hits and d(loss)/d(hidden) (CE: softmax minus one-hot; KL: T (q_T - p_T); each
    times the row's weight, back through the head); backward only scales the saved gradient. The
    head is frozen: it gets no gradient, nor does the teacher. Under autocast the matmuls run in
    the autocast dtype and the softmaxes in fp32, as the unchunked path's do."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                teacher: torch.Tensor | None, ce: bool, temperature: float,
                chunk_rows: int, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kind, dtype = hidden.device.type, _compute_dtype(hidden)
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        kl_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        hits = torch.empty(n, dtype=torch.bool, device=hidden.device)
        grad = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        with torch.autocast(kind, enabled=False):
            w = head.to(dtype)
            for s in range(0, n, chunk_rows):
                e = min(n, s + chunk_rows)
                logits = hidden[s:e].to(dtype) @ w.t()
                y, ws = labels[s:e], weights[s:e]
                hits[s:e] = logits.argmax(-1) == y
                g = None
                if ce:
                    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
                    loss -= (logp.gather(1, y[:, None]).squeeze(1) * ws).sum()
                    if grad is not None:
                        g = logp.exp_()  # softmax, in place
                        g.scatter_add_(1, y[:, None], torch.full((e - s, 1), -1.0, device=g.device))
                    del logp
                if teacher is not None:
                    kl, g_kl = _kl_chunk(logits, _capped(teacher[s:e].to(dtype) @ w.t(), softcap), temperature,
                                         grad is not None)
                    kl_sum += (kl * ws).sum()
                    g = g_kl if g is None else g.add_(g_kl)
                    del g_kl
                del logits
                if grad is not None:
                    grad[s:e] = g.mul_(ws[:, None].float()).to(dtype) @ w
                del g
        loss += kl_sum
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hits, kl_sum)
        return loss, hits, kl_sum

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_hits: torch.Tensor | None, grad_kl: torch.Tensor | None):
        (grad,) = ctx.saved_tensors
        # not cast first: on CPU a 0-dim float32 factor then multiplies in float32; on CUDA it is rounded
        # to grad's dtype (1/3 -> 0.33398 in bf16), which is why the trainer backpropagates unscaled losses
        return grad * grad_loss, None, None, None, None, None, None, None, None
