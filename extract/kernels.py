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

import dataclasses
import functools
import inspect
import logging
import sys
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch
from torch import nn

from layertap.extract.config import text_config
from layertap.extract.fused_norms import norm_choice
from layertap.extract.fused_projections import projection_choice
from layertap.extract.split_conv import is_split

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'layertap[gpu]' (flash-linear-attention; see README, 'Fast kernels')"
# The fix per package transformers looks for (KernelChoice.package); layertap[gpu] brings fla alone
INSTALL_HINTS = {"fla": INSTALL_HINT, "causal_conv1d": "pip install causal-conv1d (it builds CUDA code at install)",
                 "mamba_ssm": "pip install mamba-ssm (it builds CUDA code at install)"}


@dataclass(frozen=True, slots=True)
class KernelChoice:
    """One function a layer type calls and where transformers will take it from."""

    layer_type: str  # e.g. "linear_attention"
    function: str  # the kernel's name in its package, e.g. "chunk_gated_delta_rule"
    package: str  # the package that provides the fast version, e.g. "fla"
    fast: bool | None  # None: this transformers does not say (its wrappers changed)
    source: str  # the module the implementation comes from

    def __str__(self) -> str:
        if self.function in ("attention", "projections", "short_conv"):
            return f"{self.function}={self.source}"
        where = {True: f"fast ({self.source})", False: "fallback (torch reference)", None: "unknown"}[self.fast]
        return f"{self.function}={where}"


def describe(model: nn.Module) -> dict[str, list[KernelChoice]]:
    """Per layer type of `model` (its decoder's ``layer_types``), the kernels with a fast/fallback
    choice; attention layers are named by the attention implementation. Empty for models whose
    layers have no such choice (plain attention-only models report only their attention)."""
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    out: dict[str, list[KernelChoice]] = {}
    seen: set[tuple[str, type]] = set()
    fused: dict[str, set[str]] = {}  # per layer type, where its routed norms' kernels come from
    groups: dict[str, set[str]] = {}  # per layer type, its projections fused into one matmul each
    split: set[str] = set()  # layer types whose short convolution runs per q/k/v span
    for kind, layer in zip(_layer_types(model), _layers(model)):
        choices = out.setdefault(kind, [])
        for module in layer.modules():
            if group := projection_choice(module):
                groups.setdefault(kind, set()).add(group)
            if is_split(module):
                split.add(kind)
            if (kind, type(module)) in seen:
                continue
            seen.add((kind, type(module)))
            if source := norm_choice(module):
                fused.setdefault(kind, set()).add(source)
            found = (_wrapper_choice(kind, value) for _, value in _called_functions(type(module)))
            choices.extend(sorted((c for c in found if c is not None and c not in choices), key=lambda c: c.function))
    for kind in out:
        if "attention" in kind and kind != "linear_attention" and not out[kind]:
            out[kind].append(KernelChoice(kind, "attention", attn, True, attn))
    for kind, sources in fused.items():  # norms last: one entry per layer type
        out[kind].append(KernelChoice(kind, "rms_norm", "torch", True, "; ".join(sorted(sources))))
    for kind, names in groups.items():
        out[kind].append(KernelChoice(kind, "projections", "torch", True, "fused " + ", ".join(sorted(names))))
    for kind in split:
        out[kind].append(KernelChoice(kind, "short_conv", "torch", True, "split per q/k/v (via layertap)"))
    return out


def provenance(model: nn.Module) -> dict[str, Any]:
    """What computed `model`'s states beyond its run's identity, for a shard's HEAD
    (`extra.produced_by`): the device, each layer type's kernels as the kernel line names them,
    and the versions of the packages they come from. Workers of one run may differ here (a GPU
    with the fast kernels, one on the fallbacks, fused or eager norms): their states then differ
    by bf16 rounding, and each shard says which produced it (fused projections included). Read at
    each shard's start, so a norm sent back to its eager forward (fused_norms) shows from the next
    shard on."""
    param = next(model.parameters())
    device = torch.cuda.get_device_name(param.device) if param.is_cuda else param.device.type
    kernels = {kind: [str(c) for c in choices] for kind, choices in describe(model).items() if choices}
    return {"device": device, "kernels": kernels, "software": software_versions()}


@functools.cache
def software_versions() -> dict[str, str]:
    """The installed versions of layertap and of the packages that compute its states."""
    out = {}
    for dist in ("layertap", "torch", "transformers", "flash-linear-attention", "fla-core", "triton"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return out


def log_kernel_paths(model: nn.Module, device: str) -> dict[str, list[KernelChoice]]:
    """One INFO line naming each layer type's kernel path; a WARNING on CUDA where one falls back."""
    paths = describe(model)
    counts = Counter(_layer_types(model))
    parts = [f"{kind} x{counts[kind]}: " + ", ".join(str(c) for c in choices)
             for kind, choices in paths.items() if choices]
    if parts:
        log.info("kernels: %s", "; ".join(parts))
    # `*_update` functions step one token of a cached decode, which extraction never runs (and eval
    # rarely): their fallback is named in the line above, not warned of
    slow = [c for choices in paths.values() for c in choices if c.fast is False and not c.function.endswith("_update")]
    if slow and str(device).startswith("cuda"):
        names = ", ".join(sorted({c.function for c in slow}))
        pkgs = sorted({c.package for c in slow})
        hints = "; ".join(dict.fromkeys(INSTALL_HINTS.get(p, f"install the {p} package") for p in pkgs))
        log.warning("kernels: %s run on transformers' reference PyTorch fallback on this GPU (%s not "
                    "installed or not importable): correct but slower; install the fast kernels: %s",
                    names, ", ".join(pkgs), hints)
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
    if "linear_attention" not in _layer_types(model):  # the adapter speaks the gated deltanets' calls only
        return []
    try:
        from fla.modules.causal_conv1d import causal_conv1d as fla_conv
    except Exception:  # not installed, or no Triton/GPU build: keep transformers' choice
        return []
    patched = []
    for mod, name, value in _module_functions(model):
        choice = _wrapper_choice("linear_attention", value) if name == "causal_conv1d_fn" else None
        if choice is not None and choice.fast is False:
            setattr(mod, name, _fla_conv_adapter(fla_conv, value))
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
    for mod, name, value in _module_functions(model):
        names = _wrapper_closure(value)
        if names is None or not names["is_new_implementation"] or not callable(names.get("torch_function")):
            continue
        choice = _wrapper_choice("", value)
        setattr(mod, name, _by_device(value, names["torch_function"],
                                      dataclasses.replace(choice, source=f"{choice.source}; torch reference on CPU")))
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
        # fla's kernel reads rows of any stride (its "non-standard layout"): the columns of a fused
        # projection's output (extract.fused_projections) go in as they are, not copied
        out, _ = fla_conv(x if x.stride(-1) == 1 else x.contiguous(), weight, bias, activation=activation,
                          cu_seqlens=kwargs.get("cu_seq_lens_q"))
        return out.transpose(1, 2)

    causal_conv1d_fn._layertap_kernel = ("causal_conv1d_fn", "fla", "fla.modules.causal_conv1d (via layertap)")
    return causal_conv1d_fn


def _plain_function(value):
    """The function behind `value`: itself, or the one a `kernels` Func module calls. With the
    `kernels` package installed, transformers >= 5.25 turns each function the Hub may replace into
    an nn.Module whose forward calls the decorated function (a closure variable `func`)."""
    forward = getattr(type(value), "forward", None) if isinstance(value, nn.Module) else None
    if not inspect.isfunction(forward):
        return value
    try:
        inner = inspect.getclosurevars(forward).nonlocals.get("func")
    except (TypeError, ValueError):
        return value
    return inner if inspect.isfunction(inner) else value


def _wrapper_closure(value) -> dict | None:
    """The closure of a transformers fast/fallback wrapper (`implementation`, `torch_function`,
    `is_new_implementation`, `func_name`, `package`), or None for any other function."""
    value = _plain_function(value)
    if not inspect.isfunction(value):
        return None
    try:
        names = inspect.getclosurevars(value).nonlocals
    except (TypeError, ValueError):
        return None
    return names if "is_new_implementation" in names and "func_name" in names else None


def _wrapper_choice(kind: str, value) -> KernelChoice | None:
    """What a transformers fast/fallback wrapper (or layertap's adapter) will run, else None."""
    tagged = getattr(value, "_layertap_kernel", None)
    if tagged is not None:
        return KernelChoice(kind, tagged[0], tagged[1], True, tagged[2])
    names = _wrapper_closure(value)
    if names is None:
        return None
    impl = names.get("implementation")
    return KernelChoice(kind, str(names["func_name"]), str(names.get("package", "?")),
                        bool(names["is_new_implementation"]), getattr(impl, "__module__", None) or "?")


def _called_functions(cls: type) -> list[tuple[str, object]]:
    """(name, value) of the module-level names `cls.forward` refers to, and those of the modeling
    module's own functions it calls, transitively: transformers >= 5.25 calls the short convolution
    (`causal_conv1d_fn`) from a helper (`causal_conv1d_forward`), not from the layer's forward."""
    module = sys.modules.get(cls.__module__)
    own = vars(module) if module is not None else None
    out: dict[str, object] = {}
    todo = [getattr(cls, "forward", None)]
    seen: set[int] = set()
    while todo:
        fn = todo.pop()
        try:
            names = inspect.getclosurevars(inspect.unwrap(fn)).globals
        except (AttributeError, TypeError, ValueError):
            continue
        for name, value in names.items():
            out.setdefault(name, value)
            inner = _plain_function(value)
            if inspect.isfunction(inner) and inner.__globals__ is own and id(inner) not in seen:
                seen.add(id(inner))
                todo.append(inner)
    return list(out.items())


def _module_functions(model: nn.Module) -> list[tuple[object, str, object]]:
    """(modeling module, name, function) of each module-level function the layers' forwards
    call, once each: the globals a reroute replaces."""
    out, seen = [], set()
    for layer in _layers(model):
        for cls in {type(m) for m in layer.modules()}:
            mod = sys.modules.get(cls.__module__)
            for name, value in _called_functions(cls):
                if mod is not None and getattr(mod, name, None) is value and (mod.__name__, name) not in seen:
                    seen.add((mod.__name__, name))
                    out.append((mod, name, value))
    return out


def _layers(model: nn.Module) -> list[nn.Module]:
    from layertap.extract.model import decoder_of  # that module imports this one

    return list(decoder_of(model).layers)


def _layer_types(model: nn.Module) -> list[str]:
    """Each decoder layer's type: the config's ``layer_types``, or "attention" for models without."""
    config = text_config(model.config)
    n = len(_layers(model))
    return list(getattr(config, "layer_types", None) or [])[:n] or ["attention"] * n
