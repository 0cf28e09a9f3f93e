"""The kernel line as a user meets it: `layertap extract` on a hybrid target names its kernels."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.records import decode_commit
from layertap.storage.reader import ShardReader
from layertap.storage.store import open_store
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


def test_extract_on_a_hybrid_target_logs_its_kernel_path(tmp_path, capsys):
    model = tiny_model_dir(tmp_path, "qwen3_5_text", 4)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}?"},
                                                     {"role": "assistant", "content": "an answer " * (i + 1)}]}) + "\n"
                            for i in range(3)))
    p = subprocess.run([sys.executable, "-m", "layertap", "extract", "--model", model, "--dataset", str(data),
                        "--out", str(tmp_path / "run"), "--layers", "1,3", "--dtype", "float32",
                        "--max-length", "64", "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    # our line, not transformers' own hub_kernels warnings (which some installs print as well)
    lines = [line for line in p.stderr.splitlines() if re.search(r"INFO \S+: kernels: ", line)]
    assert len(lines) == 1, p.stderr[-3000:]  # one line, at the start, before any shard
    assert "linear_attention x3: " in lines[0] and "chunk_gated_delta_rule=" in lines[0]
    assert "full_attention x1: attention=sdpa" in lines[0]
    assert p.stderr.index(lines[0]) < p.stderr.index("committed")
    # each shard's HEAD says what computed its states: the kernels of that line, the device, the versions
    store = open_store(str(tmp_path / "run"))
    keys = [o.key for o in store.list(layout.COMMITS)]
    assert keys
    versions = subprocess.run([sys.executable, "-c", "import torch, transformers; print(torch.__version__, "
                               "transformers.__version__)"], capture_output=True, text=True, check=True).stdout.split()
    for key in keys:
        produced_by = ShardReader(store, decode_commit(store.get(key), key).data_key).meta.extra["produced_by"]
        assert produced_by["device"] == "cpu"
        assert set(produced_by["kernels"]) == {"linear_attention", "full_attention"}
        for kind, choices in produced_by["kernels"].items():
            assert f"{kind} x{3 if kind == 'linear_attention' else 1}: {', '.join(choices)}" in lines[0]
        assert [produced_by["software"]["torch"], produced_by["software"]["transformers"]] == versions
    # and `layertap inspect` shows it
    data_key = decode_commit(store.get(keys[0]), keys[0]).data_key
    assert cli(["inspect", f"{tmp_path / 'run'}/{data_key}"]) == 0
    out = capsys.readouterr().out
    assert "produced on cpu with layertap=" in out and f"torch={versions[0]}" in out
    assert f"    linear_attention: {', '.join(produced_by['kernels']['linear_attention'])}" in out


def _fla_site() -> Path:
    """flash-linear-attention and Triton installed apart (as `layertap[gpu]` brings them on a GPU
    machine), cached between runs: with them importable transformers picks fla's Triton kernels."""
    site = Path(os.environ.get("LAYERTAP_TEST_CACHE", Path.home() / ".cache" / "layertap-tests")) / "fla-triton-site"
    if not all((site / name).is_dir() for name in ("fla", "triton", "einops")):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                        "flash-linear-attention==0.6.0", "fla-core==0.6.0", "triton==3.6.0", "einops==0.8.2"], check=True, timeout=600)
    return site


FORWARD = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO)
from layertap.extract.model import load_target, Capture
from transformers import AutoModelForCausalLM
folder, out, how = sys.argv[1:]
if how == "plain":  # transformers alone: the kernels it picked at import, on CPU tensors
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
else:
    model = load_target(folder, dtype=torch.float32).model
    from layertap.extract.kernels import use_fla_short_conv  # CUDA tensors only: on CPU, the reference
    print("short conv routed in", use_fla_short_conv(model), file=sys.stderr)
capture = Capture(model, [1, 3])
ids = torch.arange(1, 41).reshape(2, 20) % 97
hidden, _ = capture(ids, torch.ones_like(ids))
torch.save(hidden, out)
"""


@pytest.mark.slow  # installs flash-linear-attention and Triton (a 188 MB wheel) once, into the test cache
def test_a_cpu_forward_on_a_machine_with_fla_takes_the_reference_kernels(tmp_path):
    """On a GPU machine with the fast kernels installed, transformers sends every hybrid forward
    to Triton, CPU tensors too (which fails). load_target routes CPU tensors to the reference:
    the same states as on a machine without fla."""
    model = tiny_model_dir(tmp_path, "qwen3_5_text", 4)
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def forward(how: str, with_fla: bool) -> subprocess.CompletedProcess:
        path = str(REPO) + (os.pathsep + str(_fla_site()) if with_fla else "")
        return subprocess.run([sys.executable, "-c", FORWARD, model, str(tmp_path / f"{how}-{with_fla}.pt"), how],
                              capture_output=True, text=True, timeout=600, env=dict(env, PYTHONPATH=path))

    plain = forward("plain", with_fla=True)
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.25"):  # later ones send CPU tensors to the reference themselves
        assert plain.returncode != 0, "transformers ran fla on CPU tensors: this test no longer exercises the fix"
    ours = forward("layertap", with_fla=True)
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert "chunk_gated_delta_rule=fast (fla" in ours.stderr and "torch reference on CPU" in ours.stderr
    # the short convolution is found where transformers >= 5.25 calls it (from causal_conv1d_forward)
    assert "short conv routed in ['transformers.models.qwen3_5.modeling_qwen3_5']" in ours.stderr, ours.stderr[-3000:]
    reference = forward("layertap", with_fla=False)
    assert reference.returncode == 0, reference.stderr[-3000:]
    import torch

    assert torch.equal(torch.load(tmp_path / "layertap-True.pt"), torch.load(tmp_path / "layertap-False.pt"))


def test_a_kernels_package_transformers_does_not_accept_does_not_stop_the_load(tmp_path):
    """transformers >= 5.25 loads every model through the `kernels` package (Hub kernels) unless
    told not to, and refuses to load where that package is at a version it does not accept: a
    user's environment where another package pinned it, or the H200 image (whose `layertap extract`
    failed so on 2026-12-04). layertap picks its kernels itself and loads with use_kernels=False."""
    model = tiny_model_dir(tmp_path, "qwen3_5_text", 4)
    site = tmp_path / "site"
    (site / "kernels").mkdir(parents=True)
    (site / "kernels" / "__init__.py").write_text("")
    (site / "kernels-0.0.1.dist-info").mkdir()
    (site / "kernels-0.0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.1\n")
    code = ("import sys, torch; from layertap.extract.model import load_target; "
            "print(type(load_target(sys.argv[1], dtype=torch.float32).model).__name__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "Qwen3_5ForCausalLM"


def test_the_fallback_warning_names_each_packages_own_fix_and_skips_decode_only_functions(caplog):
    """On CUDA the warning names what to install per package: `layertap[gpu]` brings
    flash-linear-attention alone, so a mamba hybrid (nemotron_h: causal_conv1d and mamba_ssm
    kernels) is told those packages. A `*_update` function (one token of a cached decode, never
    run by extraction) is named in the kernel line but not warned of."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from layertap.extract.kernels import describe, log_kernel_paths

    config = AutoConfig.for_model("nemotron_h", vocab_size=128, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  hybrid_override_pattern="M*M-", mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                                  ssm_state_size=16, chunk_size=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    packages = {c.package for choices in describe(model).values() for c in choices if c.fast is False}
    assert packages, "transformers names no fallback of nemotron_h's mamba layers: this test checks nothing"
    with caplog.at_level("INFO", logger="layertap.extract.kernels"):
        log_kernel_paths(model, "cuda:0")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "layertap[gpu]" not in warnings[0] or "fla" in packages, warnings[0]
    if "mamba_ssm" in packages:
        assert "pip install mamba-ssm" in warnings[0]
    if "causal_conv1d" in packages:
        assert "pip install causal-conv1d" in warnings[0]
    assert "_update" not in warnings[0].split(" run on ")[0], warnings[0]
