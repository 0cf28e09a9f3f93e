"""The gated deltanet's short convolution per q/k/v span (extract.split_conv): the same states,
no copy of q, k or v before the delta rule, and a cached decode keeps the layer's own forward."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layertap.extract.model import Capture
from layertap.extract.split_conv import split_conv, unsplit_conv
from test_fused_projections import _model
from tiny_models import tiny_model_dir


class CountingOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n[str(func)] = self.n.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_split_convolution_gives_the_same_states_without_the_join(dtype):
    model = _model("qwen3_5_text", dtype)
    reference = Capture(copy.deepcopy(model), [1, 3])
    capture = Capture(model, [1, 3])
    assert split_conv(list(capture.decoder.layers)) == 3  # the three linear-attention layers of four
    ids = torch.randint(1, 300, (2, 23), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    with CountingOps() as own:
        want = reference(ids, mask)[0]
    with CountingOps() as split:
        got = capture(ids, mask)[0]
    assert torch.equal(got, want)  # the same arithmetic, channel by channel
    # the layer's own forward joins the delta rule's one chunk with torch.cat; this one does not
    assert split.n.get("aten.cat.default", 0) == own.n.get("aten.cat.default", 0) - 3
    assert unsplit_conv(model) == 3 and not any("forward" in m.__dict__ for m in model.modules())


def test_a_cached_decode_keeps_the_layers_own_forward():
    """`layertap eval` decodes with a cache (the recurrent and conv states): those calls must run the
    layer's own forward, and greedy generation gives the same tokens."""
    model = _model("qwen3_5_text")
    twin = copy.deepcopy(model)
    assert split_conv(list(model.model.layers)) == 3
    ids = torch.randint(1, 300, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = twin.generate(ids, max_new_tokens=6, do_sample=False)
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)


def test_a_layer_whose_forward_it_does_not_reproduce_keeps_its_own(monkeypatch, caplog):
    model = _model("qwen3_5_text")
    cls = type(model.model.layers[0].linear_attn)
    own = cls.forward
    monkeypatch.setattr(cls, "forward", lambda self, *a, **k: own(self, *a, **k) * 2)  # another transformers
    assert split_conv(list(model.model.layers)) == 0
    assert "3 gated-deltanet layers keep their own forward" in caplog.text
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_extract_splits_the_convolution_when_asked_and_stores_the_same_states(tmp_path):
    from test_fused_projections import _extract, chat_rows

    model, data = tiny_model_dir(tmp_path, "qwen3_5_text", 4), chat_rows(tmp_path / "rows.jsonl")
    _, plain = _extract(tmp_path, model, data, "plain")
    log, split = _extract(tmp_path, model, data, "split", LAYERTAP_SPLIT_CONV="1")
    line = next(x for x in log.splitlines() if re.search(r"INFO \S+: kernels: linear_attention", x))
    assert "short_conv=split per q/k/v (via layertap)" in line.split("full_attention")[0]
    assert sorted(split) == sorted(plain) and len(plain) == 3
    for sid, want in plain.items():
        assert torch.equal(split[sid], want)
