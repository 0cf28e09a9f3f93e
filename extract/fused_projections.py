"""Sibling projections that read the same states run as one matmul: fewer, wider GEMMs.

A Qwen3.6-27B gated-deltanet layer projects its input four times (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`: 10,240, 6,144, 48 and 48 columns) and an attention layer three times
(q, k, v: 12,288, 1,024, 1,024). The H200 profile of one 16,384-token batch (docs/benchmarks.md,
12-04) ran the narrow ones at about half the efficiency of the wide ones (~48% vs ~81% of peak),
and each of the 48-column GEMMs is a launch of its own. Concatenating a group's weights along the
output dimension gives one GEMM whose output columns are the members' outputs side by side; each
member then returns its slice, a view. The arithmetic is the same dot products; only the
blocking of the GEMM changes (tests/test_fused_projections.py compares the captured states).

A member module is replaced by a `FusedSlice` that keeps the Linear's surface (`weight`, a view
of the fused weight; `in_features`, `out_features`). The first member called in the owner's
forward computes the whole group's output and the others called on *the same tensor* take their
slice of it; a member called on any other tensor computes its own columns alone, so a forward
that feeds the members different inputs is still right. The shared output is dropped when the
owning module's forward starts and when it returns.

Opt-in (LAYERTAP_FUSED_PROJECTIONS=1, on any device) until an H200 run shows it wins:
bench/gpu_extract.py's `fused` variant measures it.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

# Children of one module that a known forward calls on the same states, in the fused weight's order
GROUPS: tuple[tuple[str, ...], ...] = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),  # gated deltanet: Qwen3.5/3.6
    ("in_proj_qkvz", "in_proj_ba"),  # gated deltanet: Qwen3-Next
    ("q_proj", "k_proj", "v_proj"),  # attention
    ("gate_proj", "up_proj"),  # gated MLP
)


class FusedGroup(nn.Module):
    """The concatenated weight (and bias) of one group, and the group's output while its owner's
    forward runs."""

    def __init__(self, names: tuple[str, ...], members: list[nn.Linear]):
        super().__init__()
        self.names = names
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in members]), requires_grad=False)
        has_bias = members[0].bias is not None
        self.bias = (nn.Parameter(torch.cat([m.bias.detach() for m in members]), requires_grad=False)
                     if has_bias else None)
        ends = torch.tensor([m.out_features for m in members]).cumsum(0).tolist()
        self.spans = list(zip([0] + ends[:-1], ends))
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self.hooks: list = []  # the owner's hooks that clear the output: removed when unfused

    def output(self, x: torch.Tensor) -> torch.Tensor:
        if self._input is not x:
            self._input, self._output = x, F.linear(x, self.weight, self.bias)
        return self._output

    def clear(self) -> None:
        self._input = self._output = None


class FusedSlice(nn.Module):
    """One member of a `FusedGroup`: its columns of the group's output."""

    def __init__(self, group: FusedGroup, index: int, name: str):
        super().__init__()
        self.__dict__["group"] = group  # not a child: the owner holds the group (and its weight) once
        self.name = name
        self.lo, self.hi = group.spans[index]

    @property
    def in_features(self) -> int:
        return self.group.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.hi - self.lo

    @property
    def weight(self) -> torch.Tensor:
        return self.group.weight[self.lo:self.hi]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.bias
        return None if bias is None else bias[self.lo:self.hi]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.group
        if group._input is None or group._input is x:
            return group.output(x)[..., self.lo:self.hi]
        return F.linear(x, self.weight, self.bias)  # other states than the group's: this member alone

    def extra_repr(self) -> str:
        return f"{self.name}: columns [{self.lo}, {self.hi}) of a fused projection"


def fuse_projections(layers: list[nn.Module]) -> dict[str, int]:
    """Fuse every known group of projections in `layers`. Returns {"a+b+c": modules fused}; a
    group whose members are not plain Linears of one input width, dtype and device (quantized,
    hooked by accelerate, on the meta device) is left as it is."""
    fused: Counter[str] = Counter()
    for layer in layers:
        for owner in list(layer.modules()):
            for names, members in fusable_groups(owner):
                _fuse(owner, names, members)
                fused["+".join(names)] += 1
    for names, n in fused.items():
        log.info("kernels: %d x %s fused into one matmul each", n, names)
    return dict(fused)


def unfuse_projections(model: nn.Module) -> int:
    """Give every fused group of `model` its Linears back (copies of their columns); returns how
    many groups. A bench that measured the fused forward and lost runs the rest as shipped."""
    n = 0
    for owner in list(model.modules()):
        for key, group in list(owner._modules.items()):
            if not isinstance(group, FusedGroup):
                continue
            for name, child in list(owner._modules.items()):
                if isinstance(child, FusedSlice) and child.group is group:
                    linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                       device=group.weight.device, dtype=group.weight.dtype)
                    linear.weight = nn.Parameter(child.weight.clone(), requires_grad=False)
                    if child.bias is not None:
                        linear.bias = nn.Parameter(child.bias.clone(), requires_grad=False)
                    owner._modules[name] = linear
            for handle in group.hooks:
                handle.remove()
            del owner._modules[key]
            n += 1
    return n


def projection_choice(module: nn.Module) -> str | None:
    """The group a fused module stands for (e.g. "q_proj+k_proj+v_proj"), else None."""
    return "+".join(module.names) if isinstance(module, FusedGroup) else None


def fused_count(model: nn.Module) -> int:
    """How many groups of `model` run fused."""
    return sum(isinstance(m, FusedGroup) for m in model.modules())


def fusable_groups(owner: nn.Module) -> list[tuple[tuple[str, ...], list[nn.Linear]]]:
    """The groups of `owner`'s own children that `fuse_projections` would fuse: (names, Linears)."""
    groups = []
    for names in GROUPS:
        members = [owner._modules.get(n) for n in names]
        if _fusable(members):
            groups.append((names, members))
    return groups


def _fusable(members: list) -> bool:
    if not all(type(m) is nn.Linear for m in members):  # a subclass may quantize or reshape
        return False
    first = members[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and m.weight.device.type != "meta"
               and (m.bias is None) == (first.bias is None)
               and not (m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook"))
               for m in members)


def _fuse(owner: nn.Module, names: tuple[str, ...], members: list[nn.Linear]) -> None:
    group = FusedGroup(names, members)
    owner.add_module("_layertap_fused_" + "_".join(names), group)
    for i, name in enumerate(names):
        owner._modules[name] = FusedSlice(group, i, name)
    # cleared as the owner's forward starts (one that raised left its output behind) and as it ends
    group.hooks = [owner.register_forward_pre_hook(lambda module, args: group.clear()),
                   owner.register_forward_hook(lambda module, args, output: group.clear())]
