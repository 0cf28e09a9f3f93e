"""A target's RMSNorms as one fused kernel each: their own formula, compiled by torch.compile.

Eager PyTorch runs an RMSNorm as six kernels (upcast, square, mean, rsqrt, two multiplies, the
downcast), each a full pass over the states in fp32. On a Qwen3.6-27B-shaped forward on an H200
those passes were ~18% of GPU time (docs/benchmarks.md, the profile of one 16,384-token batch:
pow 32 ms, mean 25 ms, fp32 multiplies 96 + 20 ms, dtype copies 95 ms, of 1,547 ms), the
largest cost after the matmuls. Compiled, each norm is one read and one write.

Each norm class of the target's layers is matched to one of the formulas below *by behaviour*:
a copy with random weights runs on random states, and a formula is chosen only where it gives
the class's own output bit for bit in eager mode; its compiled version must then agree within a
bf16 rounding (inductor keeps the class's dtype casts: `emulate_precision_casts`; on CPU the
states came out bit-identical, tests/test_fused_norms.py). A class that no formula matches, or
whose compile fails (at the probe or later, for another layout or dtype), keeps or goes back to
its own forward, and the log says so: a transformers release that changes a norm is not fused
into another formula.
"""

from __future__ import annotations

import copy
import inspect
import logging
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

SOURCE = "torch.compile (via layertap)"


def _scaled(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama, Qwen2/3, SmolLM2: the weight multiplies the normalized states cast back."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5/3.6, Qwen3-Next, Gemma: a zero-centred weight, (1 + w), applied in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def _gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The gated-deltanet output norm (Qwen3.5/3.6, Qwen3-Next): normalize, scale, times silu(gate)."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.to(torch.float32))).to(dtype)


PLAIN: dict[str, Callable] = {"scaled": _scaled, "offset": _offset}
GATED: dict[str, Callable] = {"gated": _gated}
_COMPILED: dict[tuple[str, str], Callable] = {}


def fuse_norms(model: nn.Module, layers: list[nn.Module], *, backend: str = "inductor") -> dict[str, str]:
    """Route every RMSNorm instance in `layers` (and the decoder's final norm, `model`'s
    ``norm``) to its compiled formula. Returns {class name: formula} for the classes routed;
    the others are logged and left as they are. `backend` is torch.compile's ("eager" in tests
    that check the routing without paying for code generation)."""
    modules = [m for layer in layers for m in layer.modules()]
    final = getattr(model, "norm", None)
    if isinstance(final, nn.Module):
        modules.append(final)
    by_class: dict[type, list[nn.Module]] = {}
    for m in modules:
        if _is_norm(m) and "_layertap_norm" not in m.__dict__:  # not routed already
            by_class.setdefault(type(m), []).append(m)
    routed: dict[str, str] = {}
    for cls, instances in by_class.items():
        name = _match(instances[0], backend)
        if name is None:
            continue
        for m in instances:
            _route(m, name, backend)
        routed[cls.__name__] = name
        log.info("kernels: %d x %s fused by torch.compile (formula %s)", len(instances), cls.__name__, name)
    return routed


def unfuse_norms(model: nn.Module) -> int:
    """Give every routed norm its own forward back; returns how many."""
    n = 0
    for m in model.modules():
        if "_layertap_norm" in m.__dict__:
            del m.forward, m._layertap_norm
            n += 1
    return n


def norm_choice(module: nn.Module) -> str | None:
    """Where a routed norm's kernel comes from (e.g. "torch.compile (via layertap), offset"), else None."""
    routed = module.__dict__.get("_layertap_norm")
    return None if routed is None else f"{SOURCE}, {routed[0]}"


def _is_norm(m: nn.Module) -> bool:
    """A leaf module named like an RMSNorm, with one 1-D weight, no bias and an epsilon."""
    weight = getattr(m, "weight", None)
    return ("RMSNorm" in type(m).__name__ and not list(m.children()) and isinstance(weight, torch.Tensor)
            and weight.dim() == 1 and getattr(m, "bias", None) is None and _eps(m) is not None
            and weight.device.type != "meta")


def _eps(m: nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(m, attr, None)
        if isinstance(value, float):
            return value
    return None


def _forward_arity(m: nn.Module) -> int | None:
    """How many tensors the class's forward takes: 1 (the states) or 2 (states and a gate); None
    for any other signature (optional or variadic parameters: not a norm these formulas cover)."""
    params = [p for name, p in inspect.signature(type(m).forward).parameters.items() if name != "self"]
    plain = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
    return len(params) if plain and len(params) in (1, 2) else None


def _match(module: nn.Module, backend: str) -> str | None:
    """The formula that gives `module`'s own output exactly, checked compiled; None if none does."""
    cls = type(module).__name__
    arity = _forward_arity(module)
    if arity is None or (arity == 2 and getattr(module, "activation", "silu") not in ("silu", "swish")):
        log.info("kernels: %s stays eager: its forward is not one the fused formulas cover", cls)
        return None
    probe = copy.deepcopy(module)
    with torch.no_grad():
        probe.weight.normal_(0.0, 0.5, generator=torch.Generator(probe.weight.device).manual_seed(0))
    dtype, device, dim = probe.weight.dtype, probe.weight.device, probe.weight.numel()
    gen = torch.Generator(device).manual_seed(1)
    with torch.inference_mode():  # inputs and calls as in the forwards: the probe's compiled graph is theirs too
        x = (torch.randn(2, 7, dim, generator=gen, device=device) * 3).to(dtype)
        args = (x, (torch.randn(2, 7, dim, generator=gen, device=device) * 2).to(dtype)) if arity == 2 else (x,)
        try:
            want = probe(*args)
        except Exception as e:  # not a norm over the last dimension of this width, after all
            log.info("kernels: %s stays eager: it does not take [.., %d] states (%s)", cls, dim, type(e).__name__)
            return None
        for name, fn in (GATED if arity == 2 else PLAIN).items():
            try:
                same = torch.equal(fn(*args, probe.weight, _eps(probe)), want)
            except Exception:
                same = False
            if not same:
                continue
            try:
                _route(probe, name, backend)
                got = probe(*args)
            except Exception as e:  # no compiler, an unsupported device: the eager forward stays
                log.warning("kernels: %s stays eager: torch.compile of its norm failed (%s: %s)",
                            cls, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
                return None
            if got.dtype != want.dtype or not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2):
                log.warning("kernels: %s stays eager: its compiled norm differs from it by up to %.3g",
                            cls, float((got.float() - want.float()).abs().max()))
                return None
            return name
    log.info("kernels: %s stays eager: no fused formula reproduces it", cls)
    return None


def _compiled(name: str, backend: str) -> Callable:
    """One compiled function per formula, shared by every norm. Inputs come flattened to
    [tokens, width] with both sizes dynamic, so a formula compiles once per dtype (twice with
    dynamo's own graph for a single token), whatever the batch, length or head layout; and not
    `fullgraph`: should dynamo still reach its recompile limit, it runs the formula eagerly
    instead of failing the forward."""
    key = (name, backend)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile({**PLAIN, **GATED}[name], dynamic=True, backend=backend,
                                      options={"emulate_precision_casts": True} if backend == "inductor" else None)
    return _COMPILED[key]


def _route(module: nn.Module, name: str, backend: str) -> None:
    module._layertap_norm = (name, backend)
    module.forward = types.MethodType(_gated_forward if name in GATED else _plain_forward, module)


def _plain_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    name, backend = self._layertap_norm
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    try:
        return _compiled(name, backend)(flat, _plain(self.weight), _eps(self)).view(hidden_states.shape)
    except Exception as e:  # a later compile (another dtype, layout, device) failed: this norm goes eager
        _give_up(self, e)
        return type(self).forward(self, hidden_states)


def _gated_forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    if gate.shape != hidden_states.shape:  # a broadcast gate: the class's own forward handles it
        return type(self).forward(self, hidden_states, gate)
    name, backend = self._layertap_norm
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    try:
        out = _compiled(name, backend)(flat, gate.reshape(flat.shape), _plain(self.weight), _eps(self))
    except Exception as e:
        _give_up(self, e)
        return type(self).forward(self, hidden_states, gate)
    return out.view(hidden_states.shape)


def _give_up(module: nn.Module, error: Exception) -> None:
    """Route `module` back to its own forward, saying why (once per module)."""
    del module.forward, module._layertap_norm
    log.warning("kernels: %s back to its eager forward: its compiled norm failed (%s: %s)", type(module).__name__,
                type(error).__name__, (str(error).splitlines() or [""])[0][:200])


def _plain(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor: dynamo keeps a Parameter's sizes static, which would pin the
    states' width too (a graph per width: hidden size, head dim)."""
    return weight.detach()
