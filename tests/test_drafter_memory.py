"""What the drafter keeps for its backward: the SwiGLU's silu(gate) is recomputed, not held."""

from __future__ import annotations

import torch

from layertap.train import drafter as drafter_module
from test_objective import toy_batch, toy_drafter


def _saved_elements_and_grads(d, batch) -> tuple[int, dict[str, torch.Tensor]]:
    from layertap.train.objective import dflash_loss

    saved: list[int] = []
    d.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        loss = dflash_loss(d, batch, torch.Generator().manual_seed(0)).loss
    loss.backward()
    return sum(saved), {k: p.grad.clone() for k, p in d.trainable_state().items()}


def test_the_swiglu_keeps_one_tensor_less_per_layer_with_the_same_gradients(monkeypatch):
    d = toy_drafter(vocab=8)
    batch = toy_batch(8)
    ours, grads = _saved_elements_and_grads(d, batch)
    monkeypatch.setattr(drafter_module, "swiglu", drafter_module._silu_mul)  # the plain formula
    plain, plain_grads = _saved_elements_and_grads(d, batch)
    rows = d.config.max_anchors * d.config.block_size  # the query rows of a full batch, at most
    per_layer = (plain - ours) / len(d.layers)
    assert per_layer > 0 and per_layer % d.config.intermediate_size == 0, (plain, ours)
    assert per_layer / d.config.intermediate_size <= batch["input_ids"].shape[0] * rows
    assert grads.keys() == plain_grads.keys()
    for k, g in grads.items():
        assert torch.equal(g, plain_grads[k]), k
