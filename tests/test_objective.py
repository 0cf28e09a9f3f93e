"""The loss over the frozen head, computed a chunk of rows at a time, equals the unchunked one:
loss, greedy hits per slot and the gradient of every trainable weight."""

from __future__ import annotations

import pytest
import torch

from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.objective import default_chunk_rows, dflash_loss, head_cross_entropy
from layertap.train.target_head import TargetHead


def toy_drafter(vocab: int, hidden: int = 32) -> DFlashDrafter:
    g = torch.Generator().manual_seed(1)
    head = TargetHead(torch.randn(vocab, hidden, generator=g), torch.randn(vocab, hidden, generator=g), False,
                      {"num_layers": 24, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64})
    torch.manual_seed(0)
    return DFlashDrafter(default_config(head, [1, 2], mask_token_id=vocab - 1, block_size=4, max_anchors=6), head)


def toy_batch(vocab: int, loss_mask: torch.Tensor | None = None) -> dict:
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(3, 20, dtype=torch.uint8) if loss_mask is None else loss_mask
    return {"input_ids": torch.randint(0, vocab, (3, 20), generator=g), "loss_mask": mask,
            "lengths": torch.tensor([20, 13, 9]), "hidden_states": torch.randn(3, 20, 2, 32, generator=g)}


def run_loss(d: DFlashDrafter, batch: dict, chunk_rows: int | None):
    d.zero_grad(set_to_none=True)
    r = dflash_loss(d, batch, torch.Generator().manual_seed(0), chunk_rows=chunk_rows)
    r.loss.backward()
    return r, {k: p.grad.clone() for k, p in d.trainable_state().items()}


def test_chunked_head_loss_equals_the_unchunked_path():
    d = toy_drafter(vocab=8)  # a small vocabulary: an untrained drafter still guesses some slots right
    batch = toy_batch(8)
    ref, ref_grads = run_loss(d, batch, chunk_rows=0)
    rows = int(ref.counted.sum())
    assert rows > 0 and int(ref.correct.sum()) > 0 and rows % 7  # 7 does not divide the rows
    for chunk in (1, 7, rows, None):
        got, grads = run_loss(d, batch, chunk_rows=chunk)
        assert torch.allclose(got.loss, ref.loss, rtol=1e-6, atol=0), chunk
        assert got.weight == ref.weight
        assert torch.equal(got.correct, ref.correct) and torch.equal(got.counted, ref.counted)
        assert grads.keys() == ref_grads.keys()
        for k, g in ref_grads.items():
            assert torch.allclose(grads[k], g, rtol=1e-5, atol=1e-7), (chunk, k, float((grads[k] - g).abs().max()))
    # the head is borrowed and frozen: no gradient reaches it
    assert d.lm_head.grad is None and d.embed.grad is None


def test_chunked_rows_hits_and_hidden_gradient_directly():
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    hidden = torch.randn(37, 16, generator=g)
    hidden[::2] += 3 * head[labels[::2]]  # every other row points at its label: a hit
    weights = torch.rand(37, generator=g) * (torch.rand(37, generator=g) > 0.2)
    out = {}
    for chunk in (0, 5, 64):
        h = hidden.clone().requires_grad_()
        loss, hits = head_cross_entropy(h, head, labels, weights, chunk)
        (loss * 2.5).backward()  # the upstream gradient is applied, not assumed to be 1
        out[chunk] = (loss.detach(), hits, h.grad)
    assert int(out[0][1].sum()) >= 18
    for chunk in (5, 64):
        assert torch.allclose(out[chunk][0], out[0][0], rtol=1e-6)
        assert torch.equal(out[chunk][1], out[0][1])
        scale = float(out[0][2].abs().max())  # confident rows' gradients cancel to ~0: compare at the scale
        assert torch.allclose(out[chunk][2], out[0][2], rtol=1e-5, atol=1e-6 * scale)
    assert default_chunk_rows(248_320) == 540 and default_chunk_rows(10**12) == 1


def test_chunked_loss_under_bf16_autocast():
    """The GPU runs the step under bf16 autocast: the chunked path must follow it (bf16 matmuls,
    fp32 softmax) and land where the unchunked one does, within bf16's precision."""
    d = toy_drafter(vocab=8)
    batch = toy_batch(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, ref_grads = run_loss(d, batch, chunk_rows=0)
        got, grads = run_loss(d, batch, chunk_rows=7)
    assert got.loss.dtype == torch.float32
    assert torch.allclose(got.loss, ref.loss, rtol=2e-2)
    for k, g in ref_grads.items():
        assert float((grads[k] - g).norm() / g.norm().clamp_min(1e-12)) < 5e-2, k


def test_a_batch_with_nothing_to_learn_gives_a_zero_loss_that_reaches_every_weight():
    d = toy_drafter(vocab=8)
    r, grads = run_loss(d, toy_batch(8, loss_mask=torch.zeros(3, 20, dtype=torch.uint8)), chunk_rows=None)
    assert float(r.loss) == 0.0 and r.weight == 0.0 and int(r.counted.sum()) == 0
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())


@pytest.mark.parametrize("tied", [False, True])
def test_borrowed_weights_in_bf16_keep_the_tie_and_the_trainable_state(tied):
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(8, 32, generator=g, dtype=torch.bfloat16)  # as a bf16 checkpoint holds it
    head = TargetHead(embed, embed if tied else torch.randn(8, 32, generator=g, dtype=torch.bfloat16), tied,
                      {"num_layers": 12, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "intermediate_size": 64})
    config = default_config(head, [1], mask_token_id=7, block_size=4)
    torch.manual_seed(0)
    fp32 = DFlashDrafter(config, head)
    torch.manual_seed(0)
    d = DFlashDrafter(config, head, borrowed_dtype=torch.bfloat16)
    assert fp32.embed.dtype == torch.float32 and d.embed.dtype == d.lm_head.dtype == torch.bfloat16
    assert (d.lm_head is d.embed) == tied and d.embed.data_ptr() == head.embed.data_ptr()  # borrowed, not copied
    # the trainable weights as with float32 borrowed weights (the init reads the head's values, the same in both)
    assert all(torch.equal(v, fp32.trainable_state()[k]) and v.dtype == torch.float32 for k, v in d.trainable_state().items())
    batch = toy_batch(8)
    batch["hidden_states"] = batch["hidden_states"][:, :, :1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        r = dflash_loss(d, batch, torch.Generator().manual_seed(0))
    r.loss.backward()
    assert torch.isfinite(r.loss) and d.fc.weight.grad is not None
