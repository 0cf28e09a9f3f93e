"""What the drafter keeps for its backward: the SwiGLU's silu(gate) is recomputed, not held."""

from __future__ import annotations

import math

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


def test_the_prepared_drafter_returns_its_autocast_dtype_not_float32():
    """accelerate casts a mixed-precision model's outputs to float32; the trainer's `prepare` takes
    that cast off (the step's memory peaks where the loss holds rows of the output and their
    gradient), and the loss and gradients are the same."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from layertap.train.objective import dflash_loss
    from layertap.train.trainer import prepare

    def step(prepared: bool):
        torch.manual_seed(0)
        d = toy_drafter(vocab=8)
        opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad])
        AcceleratorState._reset_state(reset_partial_state=True)
        acc = Accelerator(mixed_precision="bf16", cpu=True)
        model, _ = prepare(acc, d, opt) if prepared else acc.prepare(d, opt)
        batch = toy_batch(8)
        with acc.autocast():
            out = model(batch["hidden_states"], torch.tensor([[2, 5]] * 3), torch.tensor([[1, 2]] * 3))
            loss = dflash_loss(model, batch, torch.Generator().manual_seed(0)).loss
        loss.backward()
        return out.dtype, float(loss), {k: p.grad.clone() for k, p in d.trainable_state().items()}

    try:
        ours, loss, grads = step(prepared=True)
        accelerates, loss_fp32, grads_fp32 = step(prepared=False)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert ours == torch.bfloat16 and accelerates == torch.float32
    assert loss == loss_fp32 and all(torch.equal(g, grads_fp32[k]) for k, g in grads.items())


def test_keys_and_values_keep_no_concatenation_of_context_and_block():
    """K and V project the context and the block apart, then join the projections: no layer keeps
    the [B, T + A*block, H] concatenation of their inputs for its backward (120 MB a layer at a
    4K-token sample with 512 anchors at Qwen3.6-27B's width). The context is kept once for all
    layers, the block's normed input by q_proj anyway."""
    d = toy_drafter(vocab=8)
    b, t, h, a = 3, 20, d.config.hidden_size, 5
    states = torch.randn(b, t, 2, h)
    anchors = torch.tensor([[1, 4, 8, 12, 15]] * b)
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: shapes.append(tuple(x.shape)) or x, lambda x: x):
        out = d(states, anchors, torch.zeros(b, a, dtype=torch.long))
    out.float().pow(2).sum().backward()
    kv_rows = t + a * d.config.block_size  # [B, kv_rows, H] kept whole or flattened to [B * kv_rows, H]
    assert not [s for s in shapes if s and s[-1] == h and math.prod(s) == b * kv_rows * h], shapes
    assert [s for s in shapes if s and s[-1] == h and math.prod(s) == b * t * h]  # the context, kept


def test_a_scaled_loss_reaches_a_bf16_output_unrounded():
    """The chunked head loss keeps the gradient w.r.t. its rows in their dtype (bf16 under bf16,
    now that the drafter's output stays bf16): a loss scaled by 1/3 must scale that gradient by
    1/3 computed in float32, not by 1/3 rounded to bf16 (0.33398), which scaled every gradient of
    a --grad-accum 3 step by 1.002."""
    from layertap.train.objective import head_cross_entropy

    g = torch.Generator().manual_seed(0)
    rows, head = torch.randn(6, 16, generator=g).bfloat16(), torch.randn(32, 16, generator=g).bfloat16()
    labels, weights = torch.randint(0, 32, (6,), generator=g), torch.full((6,), 1 / 6)

    def grad(scale: float) -> torch.Tensor:
        x = rows.clone().requires_grad_(True)
        (head_cross_entropy(x, head, labels, weights, chunk_rows=4)[0] * scale).backward()
        return x.grad

    assert grad(1 / 3).dtype == torch.bfloat16
    assert torch.equal(grad(1 / 3), (grad(1.0).float() * (1 / 3)).bfloat16())


def test_the_init_reads_the_heads_own_values_whatever_dtype_it_is_borrowed_in():
    """A float32 head (every GGUF target's) borrowed in bf16 gives the same initial weights as
    borrowed in float32: the init's scales come from the head's values, not from their rounding."""
    from layertap.train.drafter import DFlashDrafter, default_config
    from layertap.train.target_head import TargetHead

    g = torch.Generator().manual_seed(2)
    embed = torch.randn(40, 32, generator=g) * 0.7
    head = TargetHead(embed, torch.randn(40, 32, generator=g) * 1.3, False,
                      {"num_layers": 12, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64})
    config = default_config(head, [1], mask_token_id=40, block_size=4)  # no spare id: a learned mask
    built = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        built.append(DFlashDrafter(config, head, borrowed_dtype=dtype).trainable_state())
    assert all(torch.equal(v, built[1][k]) for k, v in built[0].items())
