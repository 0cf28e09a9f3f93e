"""The DFlash drafter: a few transformer layers that draft a block of tokens in one pass.

The target's stored capture layers are concatenated, projected to the hidden size and normed:
that is the *context feature*, one vector per target position. Each drafter layer attends with
Q from the block only and K/V = [proj(context), proj(block)], so every layer reads the target's
states directly. A block is ``[anchor token, MASK x (block_size-1)]`` at positions
``a .. a+block_size-1``; it sees context positions ``< a`` only, sees its own slots in both
directions, and never another block. The target's `embed_tokens` and `lm_head` are borrowed
frozen (`train.target_head`); only the layers, the context projection and the norms train.

When the tokenizer fills the whole embedding (no unused slot for the mask token), the mask
token gets a learned embedding of its own, saved with the drafter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layertap.storage.errors import ConfigError, InputError
from layertap.train.target_head import TargetHead

CONFIG_FORMAT = "layertap-dflash-drafter"
CONFIG_VERSION = 1


@dataclass(kw_only=True)
class DrafterConfig:
    """Everything that shapes the drafter; saved as its config.json."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    capture_layers: list[int]  # the target layers the context is built from, in stored order
    mask_token_id: int  # the first id the tokenizer does not use
    block_size: int = 16
    max_anchors: int = 512
    gamma: float = 7.0  # loss weight of block slot k is exp(-(k-1)/gamma)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02
    target: dict[str, Any] = dataclasses.field(default_factory=dict)  # model, gguf_file, model_type

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"drafter num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2 (the anchor and at least one drafted token), "
                             f"got {self.block_size}")
        if self.max_anchors < 1 or self.gamma <= 0:
            raise ConfigError("max_anchors must be >= 1 and gamma > 0")
        if not self.capture_layers:
            raise ConfigError("the drafter needs at least one capture layer")

    @property
    def learned_mask(self) -> bool:
        return self.mask_token_id >= self.vocab_size

    def to_json(self) -> dict[str, Any]:
        return {"format": CONFIG_FORMAT, "version": CONFIG_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "DrafterConfig":
        if d.get("format") != CONFIG_FORMAT:
            if "speculators_model_type" in d:  # what `layertap export-drafter --to speculators` writes
                raise InputError(f"a speculators export (config.json with speculators_model_type "
                                 f"{d['speculators_model_type']!r}: vLLM's and speculators' form), not a layertap "
                                 "drafter: `layertap eval --drafter` takes the `layertap train` output it was "
                                 "exported from (train's --out prefix)")
            raise InputError(f"not a layertap drafter config (format {d.get('format')!r})")
        if d.get("version") != CONFIG_VERSION:
            raise InputError(f"drafter config version {d.get('version')} is not supported (this layertap reads "
                             f"{CONFIG_VERSION})")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def default_config(head: TargetHead, capture_layers: list[int], mask_token_id: int, **overrides: Any) -> DrafterConfig:
    """Sized from the target: its width, heads and MLP; one drafter layer per ~12 target layers
    (DFlash's recipe: 5 layers for a 64-layer target)."""
    f = head.facts
    values: dict[str, Any] = {
        "hidden_size": head.hidden_size,
        "num_layers": max(1, round(f.get("num_layers", 12) / 12)),
        "num_heads": f.get("num_heads", max(1, head.hidden_size // 64)),
        "num_kv_heads": f.get("num_kv_heads", f.get("num_heads", max(1, head.hidden_size // 64))),
        "head_dim": f.get("head_dim", 64),
        "intermediate_size": f.get("intermediate_size", 4 * head.hidden_size),
        "vocab_size": head.vocab_size,
        "capture_layers": list(capture_layers),
        "mask_token_id": mask_token_id,
        "rms_norm_eps": f.get("rms_norm_eps", 1e-6),
        "rope_theta": f.get("rope_theta", 10000.0),
    }
    values.update({k: v for k, v in overrides.items() if v is not None})
    return DrafterConfig(**values)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of x [B, heads, N, D] at positions [B, N] (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.to(torch.float32)[:, None, :, None] * inv  # [B, 1, N, D/2]
    cos, sin = angles.cos().repeat(1, 1, 1, 2).to(x.dtype), angles.sin().repeat(1, 1, 1, 2).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm that takes its input's dtype: under bf16 autocast a projection's bf16 output met
    the float32 weight, and torch ran its unfused fallback ("Mismatch dtype ... Cannot dispatch to
    fused implementation"), several passes over the states instead of one. Autocast's own rule
    for weights (a matmul's are cast to bf16 too); the float32 weight still trains."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.weight is None or self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, w, self.eps)


class DrafterLayer(nn.Module):
    """Pre-norm attention (Q from the block; K/V from context and block) and a SwiGLU MLP."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        self.c = c
        h, hd = c.hidden_size, c.head_dim
        self.input_norm = RMSNorm(h, eps=c.rms_norm_eps)
        self.q_proj = nn.Linear(h, c.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, eps=c.rms_norm_eps)  # per-head q/k norms, as in Qwen3
        self.k_norm = RMSNorm(hd, eps=c.rms_norm_eps)
        self.post_norm = RMSNorm(h, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.c.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, context: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                mask: Any) -> torch.Tensor:
        c = self.c
        h = self.input_norm(x)
        q = _rope(self.q_norm(self._heads(self.q_proj(h), c.num_heads)), q_pos, c.rope_theta)
        # K and V of [context; block], projected apart and joined: a projection keeps its input for
        # the backward, and the [B, T + A*block, H] concatenation would be one more copy per layer
        # (120 MB at a 4K-token sample, 512 anchors, Qwen3.6-27B's width), where the context is
        # kept once for every layer and the block's `h` by q_proj anyway
        k = torch.cat((self.k_proj(context), self.k_proj(h)), dim=1)
        v = torch.cat((self.v_proj(context), self.v_proj(h)), dim=1)
        k = _rope(self.k_norm(self._heads(k, c.num_kv_heads)), kv_pos, c.rope_theta)
        v = self._heads(v, c.num_kv_heads)
        gqa = c.num_heads != c.num_kv_heads
        if isinstance(mask, torch.Tensor):
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=gqa)
        else:
            att = _flex_attention(q.device)(q, k, v, block_mask=mask, enable_gqa=gqa)
        x = x + self.o_proj(att.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        h = self.post_norm(x)
        return x + self.down_proj(swiglu(self.gate_proj(h), self.up_proj(h)))


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping for the backward only gate and up: silu(gate) is recomputed there
    (one elementwise pass), not held from the forward. At Qwen3.6-27B's shapes that is one
    [8,192 x 17,408] bf16 tensor (272 MiB) per drafter layer less at the step's peak, which is the
    end of the forward (the loss), with the same gradients bit for bit."""
    if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
        return _silu_mul(gate, up)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(_silu_mul, gate, up, use_reentrant=False, preserve_rng_state=False)  # no randomness in it


def _sum_of_squares(t: torch.Tensor, rows: int = 4096) -> float:
    """Sum of t's squared entries in float64, `rows` rows at a time: no float32 copy of a whole
    borrowed matrix (4.7 GiB each at a 27B target's vocabulary, per rank, at every start)."""
    return sum(float(c.double().pow(2).sum()) for c in t.split(rows))


class DFlashDrafter(nn.Module):
    """`forward(states, anchors, anchor_tokens)` -> block hidden states [B, A, block, H] (normed);
    `logits(hidden)` applies the target's frozen head."""

    def __init__(self, config: DrafterConfig, head: TargetHead, device: torch.device | str | None = None,
                 borrowed_dtype: torch.dtype = torch.float32):
        """The trainable weights are allocated on `device` (default: the CPU) and drawn once, by
        `reset_parameters` from torch's current seed (a GPU draws other numbers than the CPU).
        They are built on the meta device first: nn.Linear's own initialisation, which
        `reset_parameters` replaces anyway, took 26 s of the 37 s this constructor took at
        Qwen3.6-27B's shapes (1.84 B weights, one CPU thread), and the 8 s of drawing them on the
        CPU are milliseconds on a GPU.

        The borrowed, frozen `embed` and `lm_head` stay where `head` has them, in `borrowed_dtype`.
        Under bf16 autocast the head's matmul runs in bf16 anyway, so bf16 storage changes nothing
        there and halves the largest tensors of the step (2 x 4.7 GiB in fp32 at a 27B target's
        vocabulary); a bf16 checkpoint's tensors are then borrowed as read, not copied (float32
        copies of them cost 10 GB of host memory per rank at that vocabulary)."""
        super().__init__()
        c = self.config = config
        if head.vocab_size != c.vocab_size or head.hidden_size != c.hidden_size:
            raise InputError(f"the target's embeddings are {head.vocab_size} x {head.hidden_size}, the drafter "
                             f"was built for {c.vocab_size} x {c.hidden_size}: is this the same target model?")
        n_ctx = len(c.capture_layers) * c.hidden_size
        with torch.device("meta"):
            self.fc = nn.Linear(n_ctx, c.hidden_size, bias=False)
            self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_layers))
            self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
            self.mask_embedding = nn.Parameter(torch.empty(c.hidden_size)) if c.learned_mask else None
        self.to_empty(device=device if device is not None else "cpu")  # only the trainable part is registered yet
        # what the init reads of the head, from its own values (a float32 head borrowed in bf16 is rounded)
        self._head_rms_row = math.sqrt(_sum_of_squares(head.lm_head) / head.lm_head.shape[0])
        self._embed_rms = math.sqrt(_sum_of_squares(head.embed) / head.embed.numel()) if c.learned_mask else 0.0
        self.embed = nn.Parameter(head.embed.detach().to(borrowed_dtype), requires_grad=False)
        self.lm_head = self.embed if head.tied else nn.Parameter(head.lm_head.detach().to(borrowed_dtype),
                                                                 requires_grad=False)
        # "sdpa": a dense boolean mask (CPU, small shapes); "flex": flex-attention block masks,
        # compiled on GPU, where the dense mask of a 4K-token, 512-anchor sample would not fit.
        # None: by the device of each forward's tensors (a CUDA host's `eval --device cpu` runs on CPU)
        self.attention: str | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Fresh weights, scaled so that the frozen head's first logits are those of a guess, not
        of a confident mistake (issue 24). Two things decide it, both fixed here:

        - The output scale. The final RMSNorm gives the hidden an RMS of 1 per dimension (a norm of
          sqrt(H): 24 at SmolLM2's width), so against head rows of norm r the logits of a random
          direction have a standard deviation of ~r (3.2 for SmolLM2: cross-entropy ~14 against
          ln V = 10.8), and many times that along directions the embeddings share. The target
          pairs its head with states its own layers trained for; a fresh drafter has none, so its
          final norm starts at 1 / (RMS of the head's row norms): logits of std ~1.
        - The mask slots' input. The learned mask embedding started as the mean embedding: the
          one direction every token shares (norm 2.2 of SmolLM2's 3.2 per row). Normed, it put
          logits of std 17.5 on the whole vocabulary (mean cross-entropy 99), and 15 of a
          block's 16 slots start from it. It now starts as a random vector at the embeddings'
          per-dimension scale, like an unused vocabulary row (DFlash's mask token).

        SmolLM2, a fresh default drafter on real states: step-1 loss 56-59 and grad norm ~590
        before, ~12 and ~66 after. Only initial values change: a checkpoint's weights load as saved.
        """
        c = self.config
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=c.initializer_range)
            elif isinstance(m, nn.RMSNorm) and m.weight is not None:
                nn.init.ones_(m.weight)
        with torch.no_grad():
            self.norm.weight.fill_(1.0 / max(self._head_rms_row, 1e-6))
            if self.mask_embedding is not None:
                self.mask_embedding.normal_(0.0, max(self._embed_rms, 1e-6))

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint holds: every weight except the target's borrowed ones."""
        return {k: v for k, v in self.named_parameters() if v.requires_grad}

    def load_trainable(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Copy saved trainable weights in (checkpoint or export), refusing missing or misshapen ones."""
        trainable = self.trainable_state()
        missing = sorted(set(trainable) - set(weights))
        if missing:
            raise InputError(f"{source} lacks weights {missing}: it was saved by a different drafter")
        with torch.no_grad():
            for name, p in trainable.items():
                if p.shape != weights[name].shape:
                    raise InputError(f"{source}: weight {name} is {tuple(weights[name].shape)}, the drafter's is "
                                     f"{tuple(p.shape)}")
                p.copy_(weights[name])

    def context(self, states: torch.Tensor) -> torch.Tensor:
        """Stored states [B, T, L, H] -> context features [B, T, H].

        Without autocast the states are cast to fc's dtype (fp32). Under autocast they are left as
        stored: autocast casts fc's input to its own dtype anyway, so an fp32 copy would be cast
        straight back to bf16 and only cost a temporary (1.7 GiB at batch 4 x 4096 x 5 x 5120)."""
        b, t = states.shape[:2]
        x = states.reshape(b, t, -1)
        if not torch.is_autocast_enabled(x.device.type):
            x = x.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(x))

    def block_inputs(self, anchor_tokens: torch.Tensor) -> torch.Tensor:
        """[B, A] anchor tokens -> [B, A * block, H] embeddings: the anchor, then mask tokens."""
        c = self.config
        b, a = anchor_tokens.shape
        first = F.embedding(anchor_tokens, self.embed)  # [B, A, H]
        mask = self.mask_embedding if self.mask_embedding is not None else self.embed[c.mask_token_id]
        rest = mask.to(first.dtype).expand(b, a, c.block_size - 1, c.hidden_size)
        return torch.cat((first[:, :, None], rest), dim=2).reshape(b, a * c.block_size, c.hidden_size)

    def forward(self, states: torch.Tensor, anchors: torch.Tensor, anchor_tokens: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, t = states.shape[:2]
        a, bs = anchors.shape[1], c.block_size
        device = anchors.device
        context = self.context(states)
        offsets = torch.arange(bs, device=device)
        q_pos = (anchors[:, :, None] + offsets).reshape(b, a * bs)
        kv_pos = torch.cat((torch.arange(t, device=device).expand(b, t), q_pos), dim=1)
        flex = (self.attention or ("flex" if device.type == "cuda" else "sdpa")) == "flex"
        mask = (self._block_mask if flex else self._dense_mask)(anchors, t)
        x = self.block_inputs(anchor_tokens).to(context.dtype)
        for layer in self.layers:
            x = layer(x, context, q_pos, kv_pos, mask)
        return self.norm(x).view(b, a, bs, c.hidden_size)

    def _dense_mask(self, anchors: torch.Tensor, t: int) -> torch.Tensor:
        """[B, A*block, T + A*block] bool: context key j is visible to block i iff j < anchor_i;
        block keys only within their own block."""
        b, a = anchors.shape
        bs, device = self.config.block_size, anchors.device
        sees_ctx = torch.arange(t, device=device)[None, None, :] < anchors[:, :, None]  # [B, A, T]
        sees_ctx = sees_ctx[:, :, None, :].expand(b, a, bs, t).reshape(b, a * bs, t)
        block_id = torch.arange(a, device=device).repeat_interleave(bs)
        sees_block = (block_id[:, None] == block_id[None, :]).expand(b, a * bs, a * bs)
        return torch.cat((sees_ctx, sees_block), dim=2)

    def _block_mask(self, anchors: torch.Tensor, t: int):
        """The same mask as a flex-attention BlockMask, built from the anchors tile by tile
        (`_tiled_block_mask`): neither the dense [B, 1, Q, KV] mask that an eager
        `create_block_mask` materialises first (1 GiB at 4K tokens, 512 anchors, block 16) nor a
        compiled `create_block_mask`, which compiles again for new shapes (three times for the
        lengths and batch sizes of one epoch) before the first step can run."""
        bs = self.config.block_size

        def visible(bi, h, q_idx, kv_idx):
            block = q_idx // bs
            return torch.where(kv_idx < t, kv_idx < anchors[bi, block], (kv_idx - t) // bs == block)

        return _tiled_block_mask(anchors, t, bs, visible)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.lm_head.to(hidden.dtype).t()



TILE = 128  # flex-attention's block: a BlockMask lists, per 128 query rows, the 128-key tiles they see


def _tiled_block_mask(anchors: torch.Tensor, t: int, bs: int, mask_mod):
    """The drafter's BlockMask computed at tile level from the anchors ([B, A]: block k's rows see
    context keys < anchors[k] and the keys of block k after the T context keys): per (query tile,
    key tile) whether some row sees some key (a partial tile, where `mask_mod` decides) or every row
    every key (a full tile). Equal to `create_block_mask(mask_mod, B, None, A*bs, T + A*bs)`, tile
    for tile (tests/test_block_mask.py), in a few small tensor ops of [B, Q/128, KV/128]."""
    from torch.nn.attention.flex_attention import BlockMask

    b, a = anchors.shape
    q_len, kv_len = a * bs, t + a * bs
    dev = anchors.device
    j = torch.arange(-(-q_len // TILE), device=dev)  # query tiles
    k0 = (j * TILE) // bs  # the first and last block with rows in each
    k1 = torch.clamp(((j + 1) * TILE - 1) // bs, max=a - 1)
    ks = k0[:, None] + torch.arange(-(-TILE // bs) + 1, device=dev)
    inside = ks <= k1[:, None]
    per = anchors[:, ks.clamp(max=a - 1)]  # [B, tiles, blocks per tile]
    amax = per.masked_fill(~inside, -1).amax(-1)[:, :, None]
    amin = per.masked_fill(~inside, torch.iinfo(per.dtype).max).amin(-1)[:, :, None]
    lo = torch.arange(-(-kv_len // TILE), device=dev) * TILE  # key tiles: [lo, hi)
    hi = torch.clamp(lo + TILE, max=kv_len)
    own_lo, own_hi = (t + k0 * bs)[:, None], (t + (k1 + 1) * bs)[:, None]  # the tile's blocks' own keys
    seen = ((lo < t) & (lo < amax)) | ((hi > t) & (lo < own_hi) & (hi > own_lo))
    all_context = (lo >= t) | (torch.clamp(hi, max=t) <= amin)
    all_own = (hi <= t) | ((k0 == k1)[:, None] & (torch.clamp(lo, min=t) >= own_lo) & (hi <= own_hi))
    whole = (((j + 1) * TILE) <= q_len)[:, None] & (lo + TILE <= kv_len)  # no row or key past the ends
    full = whole & all_context & all_own

    def listed(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # counts, then the tiles first
        order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True)
        return tiles.sum(-1, dtype=torch.int32)[:, None], order[:, None].to(torch.int32)

    return BlockMask.from_kv_blocks(*listed(seen & ~full), *listed(full), BLOCK_SIZE=TILE, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len))


@functools.cache
def _flex_attention(device: torch.device):
    """flex_attention, compiled where it runs fused (CUDA); eager elsewhere (correct, slow: tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device.type == "cuda" else flex_attention


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
