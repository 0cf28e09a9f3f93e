"""A fresh drafter's first loss is that of a guess, not of a confident mistake (issue 24).

SmolLM2 with the default drafter logged loss ~59 and grad norm ~590 at step 1, against
ln(vocab) = 10.8 for a uniform guess: the final norm's unit output scale met the frozen head's
rows, and the mask slots started from the mean embedding, the direction every token shares.
Here a tiny target built like SmolLM2's embeddings (tied, rows of norm ~3.2 of which a shared
component of norm ~2.2) and states at SmolLM2's per-layer scales (RMS 3 to 70)."""

from __future__ import annotations

import math

import torch

from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.objective import dflash_loss
from layertap.train.target_head import TargetHead

VOCAB, HIDDEN = 2000, 64


def smollm2_like_head() -> TargetHead:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(HIDDEN, generator=g)
    shared *= 2.2 / shared.norm()
    rows = torch.randn(VOCAB, HIDDEN, generator=g)
    rows *= 2.4 / rows.norm(dim=1, keepdim=True)
    embed = shared + rows  # row norm ~3.2, like SmolLM2's
    return TargetHead(embed, embed, True, {"num_layers": 24, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16,
                                           "intermediate_size": 128, "rms_norm_eps": 1e-5})


def realistic_batch(seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    scales = torch.tensor([3.0, 6.0, 66.0])  # SmolLM2's stored layers: RMS 3, 6, then ~66
    states = torch.randn(2, 48, 3, HIDDEN, generator=g) * scales[:, None]
    return {"input_ids": torch.randint(0, VOCAB, (2, 48), generator=g), "loss_mask": torch.ones(2, 48, dtype=torch.uint8),
            "lengths": torch.tensor([48, 40]), "hidden_states": states}


def fresh_drafter(head: TargetHead, mask_token_id: int) -> DFlashDrafter:
    torch.manual_seed(0)  # as train.trainer.build_drafter
    return DFlashDrafter(default_config(head, [1, 2, 3], mask_token_id, block_size=8, max_anchors=16), head)


def initial_loss_and_grad_norm(d: DFlashDrafter) -> tuple[float, float]:
    result = dflash_loss(d, realistic_batch(), torch.Generator().manual_seed(0))
    result.loss.backward()
    params = [p for p in d.parameters() if p.requires_grad]
    return float(result.loss.detach()), float(torch.nn.utils.clip_grad_norm_(params, float("inf")))


def test_a_fresh_drafter_starts_near_a_uniform_guess():
    head = smollm2_like_head()
    uniform = math.log(VOCAB)  # 7.6
    # the learned mask embedding (no free vocabulary slot, as SmolLM2) and a vocabulary row as the mask
    for mask_id in (VOCAB, 7):
        d = fresh_drafter(head, mask_id)
        assert d.config.learned_mask == (mask_id == VOCAB)
        loss, grad_norm = initial_loss_and_grad_norm(d)
        # before the fix: 10.5 (learned mask) / 13.5 (a row as mask), grad norms 2.6 / 7.0;
        # after: 7.85 both, grad norms ~0.6 (SmolLM2's width, 576, makes the old excess far larger)
        assert loss < uniform + 1.0, (mask_id, loss)
        assert grad_norm < 1.5, (mask_id, grad_norm)


def test_the_initial_output_scale_is_set_from_the_head_and_saved_weights_still_load():
    head = smollm2_like_head()
    d = fresh_drafter(head, VOCAB)
    rms_row = float(head.lm_head.pow(2).sum(1).mean().sqrt())
    assert torch.allclose(d.norm.weight, torch.full((HIDDEN,), 1 / rms_row))
    mask = d.mask_embedding.detach()
    assert abs(float(mask.pow(2).mean().sqrt()) / float(head.embed.pow(2).mean().sqrt()) - 1) < 0.3
    # not the shared direction: the mean embedding's cosine with the mask is that of a random vector
    assert abs(float(torch.cosine_similarity(mask, head.embed.mean(0), dim=0))) < 0.5
    # initial values only: a checkpoint's weights load as saved, the format is unchanged
    saved = {k: torch.randn_like(v) for k, v in d.trainable_state().items()}
    again = fresh_drafter(head, VOCAB)
    again.load_trainable(saved, "a checkpoint")
    assert all(torch.equal(again.trainable_state()[k], v) for k, v in saved.items())
    assert set(saved) == set(again.trainable_state())


def test_a_step_with_nothing_to_learn_leaves_the_weights_alone():
    """A batch of zero-weighted pads only (the end of a follow epoch sized from the plan when
    extraction skipped rows) gives zero gradients; AdamW with weight decay would still move the
    weights, so `train_step` skips the optimizer for it, and takes the next real step as usual."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from layertap.train.config import TrainConfig
    from layertap.train.trainer import train_step

    d = fresh_drafter(smollm2_like_head(), mask_token_id=7)
    params = [p for p in d.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
    batch = dict(realistic_batch(), sample_id=["a", "b"])
    pads = dict(batch, loss_mask=torch.zeros_like(batch["loss_mask"]))
    queue = [pads, batch]
    run = SimpleNamespace(cfg=TrainConfig(data="unused", out="unused", grad_accum=1, weight_decay=0.1),
                          acc=Accelerator(cpu=True), ddp_model=d, model=d, params=params, optimizer=optimizer,
                          batches=SimpleNamespace(wait_for_batch=lambda: queue.pop(0)),
                          stop=SimpleNamespace(requested=None), total=10)
    before = [p.detach().clone() for p in params]
    stats = train_step(run, 0)
    assert stats.grad_norm == 0 and float(stats.totals[1]) == 0  # no weight, no gradient
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    stats = train_step(run, 1)
    assert stats.grad_norm > 0 and not all(torch.equal(a, p) for a, p in zip(before, params))


def test_the_weights_are_drawn_once_on_the_device_asked_for():
    """Construction draws the trainable weights once, in `reset_parameters`: nn.Linear's own
    initialisation, which it replaced, took 26 of 37 s at Qwen3.6-27B's shapes on one CPU thread.
    So the same seed and a second `reset_parameters` give the same weights (not so when the
    constructor drew numbers of its own first), and every norm starts at one (none left empty)."""
    head = smollm2_like_head()
    d = fresh_drafter(head, VOCAB)
    built = {k: v.detach().clone() for k, v in d.trainable_state().items()}
    torch.manual_seed(0)
    d.reset_parameters()
    assert all(torch.equal(d.trainable_state()[k], v) for k, v in built.items())
    assert all(p.device.type == "cpu" for p in d.parameters())  # none left on the meta device
    norms = [m for m in d.modules() if isinstance(m, torch.nn.RMSNorm) and m is not d.norm]
    assert len(norms) == 1 + 4 * d.config.num_layers and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert torch.equal(d.embed, head.embed) and not d.embed.requires_grad  # borrowed as it is, frozen
