"""Fused projections (extract.fused_projections): each group of sibling Linears that a forward
calls on the same states runs as one matmul, and the captured states do not change."""

from __future__ import annotations

import copy
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from layertap.extract.fused_projections import fuse_projections, fused_count, unfuse_projections
from layertap.extract.model import Capture
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=300, tie_word_embeddings=False)
HYBRID = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
# 4 layers: qwen3_5_text and qwen3_next are three linear-attention layers, then one full-attention one
EXPECTED = {
    "qwen3_5_text": {"in_proj_qkv+in_proj_z+in_proj_b+in_proj_a": 3, "q_proj+k_proj+v_proj": 1,
                     "gate_proj+up_proj": 4},
    # the MoE blocks' experts are fused tensors, not Linears; the shared expert is a gated MLP
    "qwen3_next": {"in_proj_qkvz+in_proj_ba": 3, "q_proj+k_proj+v_proj": 1, "gate_proj+up_proj": 4},
    "qwen3": {"q_proj+k_proj+v_proj": 4, "gate_proj+up_proj": 4},
}


def _model(model_type: str, dtype=torch.float32, layers: int = 4):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SIZES, num_hidden_layers=layers, **(HYBRID if model_type != "qwen3" else {}),
              **(MOE if model_type == "qwen3_next" else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=dtype).eval()
    return model.requires_grad_(False)


class CountingMatmuls(TorchDispatchMode):
    """Counts the matrix multiplications the forward dispatches."""

    MATMULS = {torch.ops.aten.linear.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
               torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default}

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.MATMULS
        return func(*args, **(kwargs or {}))


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_group_runs_as_one_matmul_and_the_captured_states_stay_the_same(model_type, dtype):
    model = _model(model_type, dtype)
    reference = Capture(copy.deepcopy(model), [1, 3])
    capture = Capture(model, [1, 3])
    params = _numel(model)
    assert fuse_projections(list(capture.decoder.layers)) == EXPECTED[model_type]
    assert _numel(model) == params  # the members' weights moved into the fused ones, none kept twice
    assert fused_count(model) == sum(EXPECTED[model_type].values())
    assert not any(type(m) is nn.Linear and name.rsplit(".", 1)[-1] in ("q_proj", "in_proj_z", "up_proj")
                   for name, m in model.named_modules())

    ids = torch.randint(1, 300, (2, 23), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0  # a padded row: the gated deltanet zeroes its padded states before projecting
    with CountingMatmuls() as unfused:
        want = reference(ids, mask)[0]
    with CountingMatmuls() as fused:
        got = capture(ids, mask)[0]
    # one GEMM per group instead of one per member
    saved = sum((name.count("+")) * n for name, n in EXPECTED[model_type].items())
    assert fused.n == unfused.n - saved > 0
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16 GEMMs of another width may round the same sums differently; the states agree to bf16
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    # no group keeps its output (a 16,384-token batch's is hundreds of MB per layer) past its owner's forward
    assert all(g._output is None for g in model.modules() if hasattr(g, "spans"))

    assert unfuse_projections(model) == sum(EXPECTED[model_type].values())  # the model as shipped, again
    assert fused_count(model) == 0 and _numel(model) == params
    assert sorted(model.state_dict()) == sorted(reference.model.state_dict())
    with CountingMatmuls() as again:
        torch.testing.assert_close(capture(ids, mask)[0], want, rtol=0, atol=0)
    assert again.n == unfused.n


def test_a_member_called_on_other_states_computes_its_own_columns():
    """A forward may feed a member something other than the group's input: the member's own
    output then, not a slice of another tensor's."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, n, bias=True) for n in (4, 2, 2))

        def forward(self, x, y):
            return torch.cat([self.q_proj(x), self.k_proj(y), self.v_proj(x), self.k_proj(x)], -1)

    torch.manual_seed(1)
    block = TwoInputs()
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    want = block(x, y)
    assert fuse_projections([block]) == {"q_proj+k_proj+v_proj": 1}
    torch.testing.assert_close(block(x, y), want)
    torch.testing.assert_close(block(y, x), TwoInputs.forward(_unfused_twin(block), y, x))
    assert block.k_proj.bias.shape == (2,) and block.k_proj.in_features == 8 and block.k_proj.out_features == 2


def _unfused_twin(block: nn.Module) -> nn.Module:
    """Plain Linears with the fused members' weights."""
    twin = nn.Module()
    for name in ("q_proj", "k_proj", "v_proj"):
        s = getattr(block, name)
        lin = nn.Linear(s.in_features, s.out_features)
        lin.weight.data.copy_(s.weight)
        lin.bias.data.copy_(s.bias)
        setattr(twin, name, lin)
    return twin


def test_a_forward_that_raised_does_not_leave_its_output_for_the_next():
    class Raising(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(8, 4, bias=False), nn.Linear(8, 4, bias=False)
            self.fail = True

        def forward(self, x):
            g = self.gate_proj(x)
            if self.fail:
                raise RuntimeError("injected")
            return g * self.up_proj(x)

    torch.manual_seed(2)
    block = Raising()
    fuse_projections([block])
    with pytest.raises(RuntimeError, match="injected"):
        block(torch.randn(2, 8))
    block.fail = False
    x = torch.randn(2, 8)
    w = block._layertap_fused_gate_proj_up_proj.weight
    torch.testing.assert_close(block(x), (x @ w[:4].T) * (x @ w[4:].T))


def test_groups_that_are_not_plain_linears_of_one_input_are_left_alone(caplog):
    class Quantized(nn.Linear):
        pass

    block = nn.Module()
    block.q_proj, block.k_proj, block.v_proj = nn.Linear(8, 4), Quantized(8, 2), nn.Linear(8, 2)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = nn.Linear(8, 4), nn.Linear(6, 4)  # another input width
    hooked = nn.Module()
    hooked.gate_proj, hooked.up_proj = nn.Linear(8, 4), nn.Linear(8, 4)
    hooked.up_proj.register_forward_hook(lambda *a: None)
    with torch.device("meta"):
        meta = nn.Module()
        meta.gate_proj, meta.up_proj = nn.Linear(8, 4), nn.Linear(8, 4)
    with caplog.at_level(logging.INFO, logger="layertap.extract.fused_projections"):
        assert fuse_projections([block, mlp, hooked, meta]) == {}
    assert fused_count(nn.ModuleList([block, mlp, hooked, meta])) == 0
    assert "fused" not in caplog.text


def chat_rows(path: Path) -> Path:
    """Three short chats, as a user's dataset file."""
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}?"},
                                                     {"role": "assistant", "content": "an answer " * (i + 1)}]}) + "\n"
                            for i in range(3)))
    return path


def _extract(tmp_path, model: str, data, name: str, **env) -> tuple[str, dict[str, torch.Tensor]]:
    """`layertap extract` as a user runs it: its stderr, and the stored states by sample id."""
    from layertap.manifests import layout
    from layertap.manifests.records import decode_commit
    from layertap.storage.reader import ShardReader
    from layertap.storage.store import open_store

    p = subprocess.run([sys.executable, "-m", "layertap", "extract", "--model", model, "--dataset", str(data),
                        "--out", str(tmp_path / name), "--layers", "1,3", "--dtype", "float32",
                        "--max-length", "64", "--log-dir", str(tmp_path / f"logs-{name}")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **env))
    assert p.returncode == 0, p.stderr[-3000:]
    store = open_store(str(tmp_path / name))
    states = {}
    for o in store.list(layout.COMMITS):
        for s in ShardReader(store, decode_commit(store.get(o.key), o.key).data_key):
            states[s.sample_id] = s.hidden_states.float()
    return p.stderr, states


def test_extract_fuses_the_projections_when_asked_and_stores_the_same_states(tmp_path):
    """LAYERTAP_FUSED_PROJECTIONS=1: the kernel line names the fused groups per layer type, and
    the stored states are the unfused run's (fp32 forward, stored in bf16: within a rounding)."""
    model, data = tiny_model_dir(tmp_path, "qwen3_5_text", 4), chat_rows(tmp_path / "rows.jsonl")
    plain_log, plain = _extract(tmp_path, model, data, "plain")
    fused_log, fused = _extract(tmp_path, model, data, "fused", LAYERTAP_FUSED_PROJECTIONS="1")
    line = next(x for x in fused_log.splitlines() if re.search(r"INFO \S+: kernels: linear_attention", x))
    assert "projections=fused gate_proj+up_proj, in_proj_qkv+in_proj_z+in_proj_b+in_proj_a" in line
    assert "projections=fused gate_proj+up_proj, q_proj+k_proj+v_proj" in line.split("full_attention x1")[1]
    assert "projections=" not in plain_log
    assert sorted(fused) == sorted(plain) and len(plain) == 3
    for sid, want in plain.items():
        torch.testing.assert_close(fused[sid], want, rtol=1e-2, atol=1e-2)
