"""The gated deltanet's forward without the copies of its q, k and v: the short convolution run per span.

transformers' gated-deltanet layer (Qwen3.5/3.6) convolves its q|k|v projection as one tensor and
splits the result into three column views. fla's delta rule makes every input contiguous first,
so each layer copies q, k and v again (strided copies: 141 of the 223 `direct_copy` calls, part of
the 7.5% of a Qwen3.6-27B-shaped batch that copies took on an H200, docs/bench/gpu_extract.json's
12-04 profile), and joins its single output chunk with `torch.cat` (one more copy). The
convolution is depthwise, so it runs per span as well: three calls of the same kernel on column
slices (fla's reads rows of any stride) write q, k and v contiguous, and nothing is copied.

`split_conv` gives each such layer this forward for calls without a cache (extraction's; a
cached decode, as `layertap eval` runs, keeps the layer's own). A layer is routed only after its
own forward and this one agreed on a probe input, on its own weights and device; the module-level
kernels (the delta rule, the convolution) are the ones the layer's modeling module holds at call
time, so layertap's kernel routing applies as for the layer's own forward.

Opt-in (LAYERTAP_SPLIT_CONV=1, extract) until an H200 run shows it wins: bench/gpu_extract.py's
`split` variant measures it.
"""

from __future__ import annotations

import logging
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

_DELTA_RULE_NAMES = ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule")
_NEEDS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj", "A_log", "dt_bias")


def split_conv(layers: list[nn.Module]) -> int:
    """Route every gated-deltanet module of `layers` whose own forward this one reproduces; returns
    how many. Others keep their forward, and the log says why."""
    routed = refused = 0
    for layer in layers:
        for m in layer.modules():
            if not _candidate(m) or "forward" in m.__dict__:
                continue
            if _agrees(m):
                m.forward = types.MethodType(_forward, m)
                routed += 1
            else:
                refused += 1
    if routed:
        log.info("kernels: %d gated-deltanet layers convolve q, k and v apart (no copies before the delta rule)",
                 routed)
    if refused:
        log.warning("kernels: %d gated-deltanet layers keep their own forward: the split convolution did not "
                    "reproduce it", refused)
    return routed


def unsplit_conv(model: nn.Module) -> int:
    """Give every routed layer its own forward back; returns how many."""
    n = 0
    for m in model.modules():
        if is_split(m):
            del m.forward
            n += 1
    return n


def is_split(module: nn.Module) -> bool:
    """Whether `module` runs this forward."""
    return getattr(module.__dict__.get("forward"), "__func__", None) is _forward


def _candidate(m: nn.Module) -> bool:
    return (type(m).__name__.endswith("GatedDeltaNet") and all(hasattr(m, a) for a in _NEEDS)
            and _delta_rule(sys.modules.get(type(m).__module__)) is not None and m.A_log.device.type != "meta")


def _delta_rule(mod):
    """The chunked delta rule the layer's modeling module calls (its name differs across transformers
    releases), looked up at call time: the function layertap's kernel routing put there, if any."""
    return next((f for f in (getattr(mod, n, None) for n in _DELTA_RULE_NAMES) if callable(f)), None)


@torch.no_grad()
def _agrees(m: nn.Module) -> bool:
    """This forward against the layer's own on a probe input (2 x 24 tokens, one padded row)."""
    p = m.in_proj_qkv.weight
    g = torch.Generator(p.device).manual_seed(0)
    x = torch.randn(2, 24, p.shape[1], generator=g, device=p.device).to(p.dtype)
    mask = torch.ones(2, 24, dtype=torch.long, device=p.device)
    mask[1, 17:] = 0
    try:
        want = type(m).forward(m, x, attention_mask=mask)
        got = _forward(m, x, attention_mask=mask)
    except Exception as e:  # a layer of another shape than this forward assumes
        log.info("kernels: %s keeps its forward (%s: %s)", type(m).__name__, type(e).__name__, e)
        return False
    tol = 1e-4 if p.dtype == torch.float32 else 3e-2  # another summation order in bf16
    return got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _forward(self: nn.Module, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """transformers' gated-deltanet forward for calls without a cache, its convolution per span."""
    if cache is not None or "cache_params" in kwargs:  # a decode: the layer's own forward keeps the states
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    mod = sys.modules[type(self).__module__]
    hidden_states = mod.apply_mask_to_padding_states(hidden_states, attention_mask)
    batch, seq, _ = hidden_states.shape
    mixed = self.in_proj_qkv(hidden_states).transpose(1, 2)  # [B, C, T], the layout the convolution takes
    z = self.in_proj_z(hidden_states).reshape(batch, seq, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    weight, bias = self.conv1d.weight.squeeze(1), self.conv1d.bias
    spans = (0, self.key_dim, 2 * self.key_dim, 2 * self.key_dim + self.value_dim)
    query, key, value = (
        mod.causal_conv1d_fn(mixed[:, lo:hi], weight[lo:hi], None if bias is None else bias[lo:hi],
                             activation=self.activation, **kwargs).transpose(1, 2).reshape(batch, seq, -1, dim)
        for lo, hi, dim in zip(spans, spans[1:], (self.head_k_dim, self.head_k_dim, self.head_v_dim)))
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # fp32, as the layer's own
    out, _ = _delta_rule(mod)(query, key, value, g=g, beta=beta, initial_state=None, output_final_state=False,
                              use_qk_l2norm_in_kernel=True, cu_seqlens=kwargs.pop("cu_seq_lens_q", None), **kwargs)
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, seq, -1))
