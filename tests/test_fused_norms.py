"""Fused RMSNorms (extract.fused_norms): each norm class is matched to a formula by its own
output, every instance then runs the compiled formula, and the captured states do not change."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from layertap.extract.fused_norms import fuse_norms, unfuse_norms
from layertap.extract.kernels import describe
from layertap.extract.model import Capture

SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=300, tie_word_embeddings=False)
HYBRID = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
EXPECTED = {
    "qwen3_5_text": {"Qwen3_5RMSNorm": "offset", "Qwen3_5RMSNormGated": "gated"},
    "qwen3_next": {"Qwen3NextRMSNorm": "offset", "Qwen3NextRMSNormGated": "gated"},
    "llama": {"LlamaRMSNorm": "scaled"},
}


def _model(model_type: str, layers: int = 4):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(SIZES, num_hidden_layers=layers, **(HYBRID if model_type != "llama" else {}),
              **(MOE if model_type == "qwen3_next" else {}))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **kw), dtype=torch.bfloat16).eval()
    with torch.no_grad():  # norms' weights away from their init (0 or 1), where formulas could coincide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model.requires_grad_(False)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's own compiles: dynamo's cache (per code object, all backends) starts empty."""
    from layertap.extract import fused_norms

    torch._dynamo.reset()
    fused_norms._COMPILED.clear()
    yield
    torch._dynamo.reset()
    fused_norms._COMPILED.clear()


class CountingBackend:
    """A torch.compile backend that runs dynamo's graph eagerly and counts the calls into it."""

    def __init__(self):
        self.graphs = self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


def _norm_calls(capture, ids) -> int:
    """How many times RMSNorm modules run in one captured forward."""
    n = 0

    def count(*_):
        nonlocal n
        n += 1

    hooks = [m.register_forward_hook(count) for m in capture.decoder.modules() if "RMSNorm" in type(m).__name__]
    with torch.no_grad():
        capture(ids, torch.ones_like(ids))
    for h in hooks:
        h.remove()
    return n


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_every_norm_runs_its_compiled_formula_and_the_captured_states_stay_the_same(model_type):
    model = _model(model_type)
    capture = Capture(model, [1, 3])
    ids = torch.randint(1, 300, (2, 23), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = capture(ids, mask)[0].clone()
    backend = CountingBackend()
    routed = fuse_norms(capture.decoder, list(capture.decoder.layers), backend=backend)
    assert routed == EXPECTED[model_type]
    calls = _norm_calls(capture, ids)
    backend.calls = 0
    with torch.no_grad():
        after = capture(ids, mask)[0]
    assert torch.equal(after, before)  # the formulas are the classes' own, op for op
    assert backend.calls == calls > 0  # ... and every norm of the forward went through the compiled graph
    with torch.no_grad():  # other batch sizes and lengths, one token included: no graph per shape
        for b, t in ((1, 1), (1, 9), (3, 17), (2, 40)):
            capture(torch.ones(b, t, dtype=torch.long), torch.ones(b, t, dtype=torch.long))
    # per formula, whatever the batch, length or width: contiguous states, strided ones (q/k norms
    # of a projection's chunk) and a single token; a graph per width or per shape would exceed it
    assert backend.graphs <= 3 * len(set(routed.values()))
    assert unfuse_norms(model) == sum(1 for m in model.modules() if type(m).__name__ in routed)
    backend.calls = 0
    with torch.no_grad():
        assert torch.equal(capture(ids, mask)[0], before)
    assert backend.calls == 0


def test_the_kernel_line_names_the_fused_norms_beside_the_attention():
    model = _model("qwen3_5_text")
    fuse_norms(model.model, list(model.model.layers), backend=CountingBackend())
    paths = {kind: [str(c) for c in choices] for kind, choices in describe(model).items()}
    assert "rms_norm=fast (torch.compile (via layertap), gated; torch.compile (via layertap), offset)" \
        in paths["linear_attention"]
    assert paths["full_attention"] == ["attention=sdpa", "rms_norm=fast (torch.compile (via layertap), offset)"]


class FailingOnFp32(CountingBackend):
    """A compiler that cannot compile float32 graphs: what a later compile failing looks like."""

    def __call__(self, gm, example_inputs):
        if any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in example_inputs):
            raise RuntimeError("injected: no float32 kernels here")
        return super().__call__(gm, example_inputs)


def test_a_compile_failing_after_routing_sends_the_norm_back_to_its_own_forward(caplog):
    model = _model("llama")
    capture = Capture(model, [1, 3])
    ids = torch.randint(1, 300, (2, 11), generator=torch.Generator().manual_seed(5))
    backend = FailingOnFp32()
    assert fuse_norms(capture.decoder, list(capture.decoder.layers), backend=backend) == {"LlamaRMSNorm": "scaled"}
    model.float()  # the next forward needs float32 graphs
    with caplog.at_level(logging.WARNING, logger="layertap.extract.fused_norms"):
        got = capture(ids, torch.ones_like(ids))[0]
    assert "LlamaRMSNorm back to its eager forward: its compiled norm failed" in caplog.text
    assert not any("_layertap_norm" in m.__dict__ for m in model.modules())  # all of them, each once
    unfused = capture(ids, torch.ones_like(ids))[0]
    assert torch.equal(got, unfused)


class Fp32WeightRMSNorm(nn.Module):
    """An RMSNorm whose weight multiplies in fp32 before the cast: none of the formulas."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim).to(torch.bfloat16))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(x.dtype)


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, dtype=torch.bfloat16)
        self.norm = Fp32WeightRMSNorm(dim)


def test_a_norm_no_formula_reproduces_keeps_its_own_forward(caplog):
    layers = [Block(64), Block(64)]
    with caplog.at_level(logging.INFO, logger="layertap.extract.fused_norms"):
        assert fuse_norms(nn.Module(), layers, backend=CountingBackend()) == {}
    assert "Fp32WeightRMSNorm stays eager: no fused formula reproduces it" in caplog.text
    assert all("forward" not in b.norm.__dict__ for b in layers)


@pytest.mark.slow  # inductor writes and builds C++ for the CPU: ~40 s here
def test_inductor_fused_norms_give_the_same_states_on_cpu():
    """The real compiler (what a GPU run uses, there emitting Triton): the states of a hybrid
    target with every norm fused match the eager ones to within float rounding."""
    model = _model("qwen3_5_text")
    capture = Capture(model, [1, 3])
    ids = torch.randint(1, 300, (2, 41), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = capture(ids, torch.ones_like(ids))[0].float()
        assert fuse_norms(capture.decoder, list(capture.decoder.layers)) == EXPECTED["qwen3_5_text"]
        after = capture(ids[:, :29], torch.ones_like(ids[:, :29]))[0].float()  # another length: no recompile needed
    err = (after - before[:, :29]).norm() / before[:, :29].norm()
    assert err < 1e-3, float(err)
