"""The drafter's flex-attention mask, built tile by tile from the anchors, is create_block_mask's."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from layertap.train.drafter import _tiled_block_mask


def _visible(anchors: torch.Tensor, t: int, bs: int):
    def visible(bi, h, q_idx, kv_idx):
        block = q_idx // bs
        return torch.where(kv_idx < t, kv_idx < anchors[bi, block], (kv_idx - t) // bs == block)
    return visible


@pytest.mark.parametrize("seed", range(4))
def test_the_tiled_mask_is_create_block_masks_tile_for_tile(seed):
    """Random batches, context lengths, anchor counts and block sizes (tiles of 128 holding whole
    blocks, parts of blocks, and a block longer than a tile), anchors sorted or not, 0 and T among
    them: the same partial and full tiles, in the same order, as create_block_mask (eager)."""
    rng = random.Random(seed)
    for _ in range(40):
        bs = rng.choice([16, 8, 4, 10, 3, 32, 128, 200])
        b, t, a = rng.choice([1, 2, 3]), rng.randint(1, 700), rng.randint(1, 40)
        anchors = torch.randint(0, t + 1, (b, a), generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
        if rng.random() < 0.5:
            anchors = anchors.sort(1).values
        ref = create_block_mask(_visible(anchors, t, bs), b, None, a * bs, t + a * bs, device="cpu")
        ours = _tiled_block_mask(anchors, t, bs, _visible(anchors, t, bs))
        case = (bs, b, t, a)
        assert ours.seq_lengths == ref.seq_lengths, case
        for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (name, case)
        for idx, num in (("kv_indices", "kv_num_blocks"), ("full_kv_indices", "full_kv_num_blocks")):
            counts = getattr(ref, num)
            for bi in range(b):
                for q in range(counts.shape[-1]):
                    n = int(counts[bi, 0, q])
                    assert sorted(getattr(ref, idx)[bi, 0, q, :n].tolist()) == getattr(ours, idx)[bi, 0, q, :n].tolist(), (idx, case)
        assert torch.equal(ours.to_dense(), ref.to_dense()), case


def test_flex_attention_under_the_tiled_mask_equals_the_dense_mask():
    """The mask as flex-attention applies it: the same output as attention under the dense mask."""
    g = torch.Generator().manual_seed(0)
    b, t, a, bs, heads, dim = 2, 300, 12, 16, 2, 16
    anchors = torch.randint(1, t, (b, a), generator=g).sort(1).values
    q = torch.randn(b, heads, a * bs, dim, generator=g)
    k, v = (torch.randn(b, heads, t + a * bs, dim, generator=g) for _ in range(2))
    out = flex_attention(q, k, v, block_mask=_tiled_block_mask(anchors, t, bs, _visible(anchors, t, bs)))
    qi, ki = torch.arange(a * bs)[:, None], torch.arange(t + a * bs)[None, :]
    dense = torch.stack([_visible(anchors, t, bs)(bi, 0, qi, ki) for bi in range(b)])[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
