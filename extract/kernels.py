"""Which kernels a hybrid target's layers will run: the fast packages or transformers' fallbacks.

transformers picks, once at import, an optimized implementation for each of the gated-deltanet
layers' functions (chunk and recurrent delta rule from `flash-linear-attention`, the short
convolution from `causal-conv1d`) and otherwise runs a reference PyTorch version that is correct
but slow: 6,550 vs 9,450 tokens/s for a Qwen3.6-27B-shaped forward on an H200
(docs/benchmarks.md). A 35 TB extraction on the slow path costs ~45% more GPU-hours, and
transformers only says so once, deep in the log, at the first forward. `describe` reads the
choice transformers made (the closure of its fallback wrapper) so the start of a run can name
it, and `log_kernel_paths` warns on CUDA with the fix.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'layertap[gpu]' (flash-linear-attention; see README, 'Fast kernels')"


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One function a layer type calls and where transformers will take it from."""

    layer_type: str  # e.g. "linear_attention"
    function: str  # the kernel's name in its package, e.g. "chunk_gated_delta_rule"
    package: str  # the package that provides the fast version, e.g. "fla"
    fast: bool | None  # None: this transformers does not say (its wrappers changed)
    source: str  # the module the implementation comes from

    def __str__(self) -> str:
        if self.function == "attention":
            return f"attention={self.source}"
        where = {True: f"fast ({self.source})", False: "fallback (torch reference)", None: "unknown"}[self.fast]
        return f"{self.function}={where}"


def describe(model: nn.Module) -> dict[str, list[KernelChoice]]:
    """Per layer type of `model` (its decoder's ``layer_types``), the kernels with a fast/fallback
    choice; attention layers are named by the attention implementation. Empty for models whose
    layers have no such choice (plain attention-only models report only their attention)."""
    config = getattr(model, "config", None)
    layers = _layers(model)
    types = list(getattr(getattr(_text_config(config), "layer_types", None), "__iter__", lambda: [])())
    attn = getattr(config, "_attn_implementation", None) or "eager"
    out: dict[str, list[KernelChoice]] = {}
    seen: set[tuple[str, type]] = set()
    for i, layer in enumerate(layers):
        kind = types[i] if i < len(types) else "attention"
        choices = out.setdefault(kind, [])
        for module in layer.modules():
            cls = type(module)
            if (kind, cls) in seen:
                continue
            seen.add((kind, cls))
            choices.extend(c for c in _choices(kind, cls) if c not in choices)
    for kind in out:
        if "attention" in kind and kind != "linear_attention" and not out[kind]:
            out[kind].append(KernelChoice(kind, "attention", attn, True, attn))
    return out


def log_kernel_paths(model: nn.Module, device: str) -> dict[str, list[KernelChoice]]:
    """One INFO line naming each layer type's kernel path; a WARNING on CUDA where one falls back."""
    paths = describe(model)
    counts = _counts(model)
    parts = [f"{kind} x{counts.get(kind, 0)}: " + ", ".join(str(c) for c in choices)
             for kind, choices in paths.items() if choices]
    if parts:
        log.info("kernels: %s", "; ".join(parts))
    slow = [c for choices in paths.values() for c in choices if c.fast is False]
    if slow and str(device).startswith("cuda"):
        names = ", ".join(sorted({c.function for c in slow}))
        pkgs = ", ".join(sorted({c.package for c in slow}))
        log.warning("kernels: %s run on transformers' reference PyTorch fallback on this GPU (%s not "
                    "installed or not importable): correct but slower; install the fast kernels with %s",
                    names, pkgs, INSTALL_HINT)
    return paths


def use_fla_short_conv(model: nn.Module) -> list[str]:
    """Run the gated-deltanet layers' short convolution (`causal_conv1d_fn`) on flash-linear-
    attention's Triton kernel where transformers would take its reference PyTorch fallback.

    transformers only looks for the `causal-conv1d` package, which compiles CUDA code at install;
    fla (already needed for the delta rule) ships the same operation as a Triton kernel working
    on the [batch, time, channels] layout the layer holds anyway, so the fallback's transposing
    copies go too. CUDA tensors only; anything else still takes the fallback. Returns the modeling
    modules patched (none when fla is missing or the fast package is installed).
    """
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    except Exception:  # not installed, or no Triton/GPU build: keep transformers' choice
        return []
    patched = []
    for layer in _layers(model):
        for module in layer.modules():
            mod = sys.modules.get(type(module).__module__)
            current = getattr(mod, "causal_conv1d_fn", None)
            if mod is None or current is None or mod.__name__ in patched:
                continue
            choice = _wrapper_choice("linear_attention", current)
            if choice is None or choice.fast is not False:
                continue
            mod.causal_conv1d_fn = _fla_conv_adapter(fla_conv, current)
            patched.append(mod.__name__)
    if patched:
        log.info("kernels: causal_conv1d_fn routed to flash-linear-attention's Triton kernel in %s",
                 ", ".join(patched))
    return patched


def keep_cpu_on_reference(model: nn.Module) -> list[str]:
    """Send CPU tensors to transformers' reference code where it chose a GPU-only kernel.

    transformers picks a layer's kernel once, at import, whatever device the model is later put
    on: on a GPU machine with flash-linear-attention installed, a hybrid target on the CPU (an
    `estimate --measure` there, a test) would call Triton kernels with CPU tensors and fail. Each
    such function is replaced by one that takes the reference for CPU tensors and the fast kernel
    otherwise. Returns the functions rerouted."""
    done = []
    for layer in _layers(model):
        for module in layer.modules():
            mod = sys.modules.get(type(module).__module__)
            try:
                referenced = inspect.getclosurevars(inspect.unwrap(type(module).forward)).globals
            except (AttributeError, TypeError, ValueError):
                continue
            for name, value in referenced.items():
                if mod is None or getattr(mod, name, None) is not value or not inspect.isfunction(value):
                    continue
                try:
                    names = inspect.getclosurevars(value).nonlocals
                except (TypeError, ValueError):
                    continue
                if not names.get("is_new_implementation") or not callable(names.get("torch_function")):
                    continue
                setattr(mod, name, _by_device(value, names["torch_function"], KernelChoice(
                    "", str(names["func_name"]), str(names.get("package", "?")), True,
                    f"{getattr(names.get('implementation'), '__module__', '?')}; torch reference on CPU")))
                done.append(f"{mod.__name__}.{name}")
    return done


def _by_device(fast, reference, choice: KernelChoice):
    accepted = set(inspect.signature(reference).parameters)

    def dispatch(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is not None and not first.is_cuda:
            return reference(*args, **{k: v for k, v in kwargs.items() if k in accepted})
        return fast(*args, **kwargs)

    dispatch._layertap_kernel = (choice.function, choice.package, choice.source)
    return dispatch


def _fla_conv_adapter(fla_conv, fallback):
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if not hidden_states.is_cuda or kwargs.get("seq_idx") is not None:
            return fallback(hidden_states, weight, bias, activation=activation, **kwargs)
        x = hidden_states.transpose(1, 2)  # [B, D, T] -> [B, T, D]: the layer's own layout, no copy
        out, _ = fla_conv(x.contiguous(), weight, bias, activation=activation,
                          cu_seqlens=kwargs.get("cu_seq_lens_q"))
        return out.transpose(1, 2)

    causal_conv1d_fn._layertap_kernel = ("causal_conv1d_fn", "fla", "fla.modules.causal_conv1d (via layertap)")
    return causal_conv1d_fn


def _wrapper_choice(kind: str, value) -> KernelChoice | None:
    """What a transformers fast/fallback wrapper (or layertap's adapter) will run, else None."""
    tagged = getattr(value, "_layertap_kernel", None)
    if tagged is not None:
        return KernelChoice(kind, tagged[0], tagged[1], True, tagged[2])
    if not inspect.isfunction(value):
        return None
    try:
        names = inspect.getclosurevars(value).nonlocals
    except (TypeError, ValueError):
        return None
    if "is_new_implementation" not in names or "func_name" not in names:
        return None
    impl = names.get("implementation")
    return KernelChoice(kind, str(names["func_name"]), str(names.get("package", "?")),
                        bool(names["is_new_implementation"]), getattr(impl, "__module__", None) or "?")


def _choices(kind: str, cls: type) -> list[KernelChoice]:
    """The fast/fallback wrappers of transformers that `cls.forward` calls."""
    try:
        referenced = inspect.getclosurevars(inspect.unwrap(cls.forward)).globals
    except (AttributeError, TypeError, ValueError):
        return []
    found = [c for c in (_wrapper_choice(kind, v) for v in referenced.values()) if c is not None]
    return sorted(found, key=lambda c: c.function)


def _layers(model: nn.Module) -> list[nn.Module]:
    for candidate in (getattr(model, "model", None), model):
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return list(layers)
    return []


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _counts(model: nn.Module) -> dict[str, int]:
    types = getattr(_text_config(getattr(model, "config", None)), "layer_types", None) or []
    n = len(_layers(model))
    counts: dict[str, int] = {}
    for kind in list(types)[:n] or ["attention"] * n:
        counts[kind] = counts.get(kind, 0) + 1
    return counts
