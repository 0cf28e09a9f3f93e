"""The cut target model and its capture hooks, against plain HF forwards of the whole model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from activations import smollm2_folder
from layertap.extract.embedded import sharegpt_conversations
from layertap.extract.inputs import TokenizedSample, tokenize_rows
from layertap.extract.model import Capture, default_layers, load_target
from tiny_models import tiny_model_dir

ARCHS = ["qwen3", "qwen3_5_text", "llama"]
NUM_LAYERS = 6  # qwen3_5_text: layers 0-2 and 4-5 gated deltanet, layer 3 full attention
BATCH_MATE_RATIO = 2.0  # see _batch_mate_check

@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: tiny_model_dir(root, arch, NUM_LAYERS) for arch in ARCHS}


def _batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens, right-padded (pad id 0) with a 0/1 attention mask."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.zeros(len(lengths), t, dtype=torch.long)
    mask = torch.zeros(len(lengths), t, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask


def _reference(model, ids, mask):
    """HF's own forward of the WHOLE model: hidden_states plus the last layer's pre-norm output."""
    last = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, o: last.setdefault("h", o))
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    finally:
        handle.remove()
    h = last["h"]
    return out.hidden_states, (h[0] if isinstance(h, tuple) else h)


def _expected(hidden_states, prenorm, layers, num_layers):
    # Layer k is HF hidden_states[k+1], except that HF's last entry is after the final norm: the
    # last decoder layer's own output is the pre-norm state.
    return torch.stack([prenorm if k == num_layers - 1 else hidden_states[k + 1] for k in layers], dim=2)


def test_the_language_models_config_is_read_inside_a_multimodal_wrapper(tmp_path, capsys):
    """Qwen3.5/3.6 (the 27B target) ship a multimodal config.json: the language model's sizes sit
    in its `text_config`, none at the top. Every reader of them (submit's layer check, import's,
    export's verifier check, the target head, the kernel report) takes them from there."""
    import json

    import transformers
    from layertap.cli import main as cli
    from layertap.extract.config import text_config

    wrapper = transformers.Qwen3_5Config(text_config={"num_hidden_layers": 12, "hidden_size": 64})
    doc = wrapper.to_dict()
    assert "num_hidden_layers" not in doc and text_config(doc)["num_hidden_layers"] == 12
    assert text_config(wrapper).num_hidden_layers == 12 and text_config(wrapper.get_text_config()) is \
        wrapper.get_text_config()
    for empty in (None, {}):  # nothing inside: the top level's
        assert text_config({"num_hidden_layers": 4, "text_config": empty})["num_hidden_layers"] == 4
    model = tmp_path / "qwen3.6"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(doc))
    assert cli(["submit", "extract", "--dry-run", "--out", str(tmp_path / "run"), "--model", str(model),
                "--layers", "1,12"]) == 2
    assert "capture layer 12 is out of range: the model has 12 decoder layers" in capsys.readouterr().err


def test_default_layers_match_dflash():
    assert default_layers(64) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_layers(36) == [1, 9, 17, 25, 33]
    assert default_layers(30) == [1, 8, 14, 20, 27]  # SmolLM2: 7.5 -> 8 and 20.5 -> 20, half to even
    assert default_layers(64, 3) == [1, 31, 61]
    assert default_layers(64, 1) == [32]
    assert default_layers(6) == [1, 2, 3]  # a shallow model has fewer distinct layers: no repeats
    with pytest.raises(ValueError):
        default_layers(64, 0)
    with pytest.raises(ValueError):
        default_layers(3)


@pytest.fixture(scope="module")
def references(model_dirs):
    """Per architecture: a right-padded batch and HF's forward of the whole model on it."""
    out = {}
    for arch, folder in model_dirs.items():
        ref = load_target(folder)
        ids, mask = _batch([23, 9, 16], ref.info["vocab_size"])
        out[arch] = (ids, mask, *_reference(ref.model, ids, mask))
    return out


@pytest.mark.parametrize("final_state", ["none", "prenorm", "postnorm"])
@pytest.mark.parametrize("arch", ARCHS)
def test_capture_equals_full_hf_forward(model_dirs, references, arch, final_state):
    ids, mask, hs, prenorm = references[arch]
    target = load_target(model_dirs[arch])
    layers = [0, 3, NUM_LAYERS - 1] if final_state != "none" else [1, 3]

    hidden, final = Capture(target.model, layers, final_state)(ids, mask)

    assert hidden.shape == (3, 23, len(layers), 64) and hidden.dtype == torch.bfloat16
    assert torch.equal(hidden, _expected(hs, prenorm, layers, NUM_LAYERS))  # bit-exact
    if final_state == "none":
        assert final is None
    else:
        assert torch.equal(final, hs[-1] if final_state == "postnorm" else prenorm)


@pytest.mark.parametrize("arch", ARCHS)
def test_cut_model_has_fewer_layers_and_no_lm_head(model_dirs, arch):
    target = load_target(model_dirs[arch])
    model = target.model
    head_calls, norm_calls = [], []
    model.lm_head.register_forward_hook(lambda *a: head_calls.append(1))
    model.model.norm.register_forward_hook(lambda *a: norm_calls.append(1))
    before = sum(p.numel() for p in model.parameters())

    cap = Capture(model, [1, 3], "none")

    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    if hasattr(model.config, "layer_types"):
        assert len(model.config.layer_types) == 4
    if arch == "qwen3_5_text":
        assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.lm_head is None
    assert sum(p.numel() for p in model.parameters()) < before
    ids, mask = _batch([12, 7], target.info["vocab_size"])
    hidden, final = cap(ids, mask)
    assert hidden.shape == (2, 12, 2, 64) and final is None
    assert head_calls == [] and norm_calls == []  # neither the head nor the final norm ran
    assert (cap.layers, cap.final_state, cap.num_layers, cap.kept_layers, cap.hidden_size) == ([1, 3], "none",
                                                                                              NUM_LAYERS, 4, 64)
    with pytest.raises(ValueError, match="already cut"):
        Capture(model, [0], "none")


def test_final_state_keeps_every_layer(model_dirs):
    target = load_target(model_dirs["qwen3_5_text"])
    Capture(target.model, [1], "postnorm")
    assert len(target.model.model.layers) == NUM_LAYERS and target.model.lm_head is None
    assert isinstance(target.model.model.norm, torch.nn.Module)
    assert not isinstance(target.model.model.norm, torch.nn.Identity)


@pytest.mark.parametrize("layers, match", [
    ([NUM_LAYERS], "out of range.*6 decoder layers"),
    ([-1], "out of range"),
    ([1, 1], "repeat"),
    ([], "no capture layers"),
    ([1.0], "not an integer"),
])
def test_bad_layers_error_before_any_change(model_dirs, layers, match):
    target = load_target(model_dirs["llama"])
    with pytest.raises(ValueError, match=match):
        Capture(target.model, layers, "none")
    with pytest.raises(ValueError, match="final_state"):
        Capture(target.model, [1], "logits")
    assert len(target.model.model.layers) == NUM_LAYERS and target.model.lm_head is not None


def test_left_padding_is_refused(model_dirs):
    target = load_target(model_dirs["llama"])
    cap = Capture(target.model, [1], "none")
    ids, mask = _batch([5, 3], target.info["vocab_size"])
    with pytest.raises(ValueError, match="pad on the right"):
        cap(ids, mask.flip(1))


def _batch_mate_check(cap: Capture, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Compare each sample's states in the right-padded batch with the same sample run alone.

    They are not bit-identical: a padded sample is computed inside a longer [B, T] problem, and
    the matmul and attention kernels block and accumulate differently for different shapes, so
    bf16 rounds differently. The yardstick is bf16's own error: the same weights with float32
    activations. Batch-mates must change a sample's states by no more than bf16 rounding
    already does: two equally valid bf16 evaluations with independent roundings differ by about
    sqrt(2) times either one's error against float32, so BATCH_MATE_RATIO = 2 is rounding noise
    with headroom (per sample and captured tensor, Frobenius norm). A real defect (padding
    leaking into real tokens, shifted positions) exceeds it by orders of magnitude.
    Note: this casts the model to float32.
    """
    hidden, final = cap(ids, mask)
    lengths = mask.sum(1).tolist()
    alone = [cap(ids[i:i + 1, :n]) for i, n in enumerate(lengths)]
    torch.nn.Module.float(cap.model)  # bypass HF's refusal for GGUF-loaded ("quantized") models
    exact = [cap(ids[i:i + 1, :n]) for i, n in enumerate(lengths)]
    out = {"max_abs": 0.0, "max_rel": 0.0, "max_token_rel": 0.0, "max_rel_fp32": 0.0, "max_ratio": 0.0}
    for i, n in enumerate(lengths):
        for j in range(hidden.shape[2] + (final is not None)):
            def pick(h, f, row):
                return (h[row, :n, j] if j < hidden.shape[2] else f[row, :n]).float()
            batch, solo, ref = pick(hidden, final, i), pick(*alone[i], 0), pick(*exact[i], 0)
            diff, bf16_err = (batch - solo).norm(), (solo - ref).norm()
            out["max_abs"] = max(out["max_abs"], (batch - solo).abs().max().item())
            out["max_rel"] = max(out["max_rel"], (diff / ref.norm()).item())
            out["max_token_rel"] = max(out["max_token_rel"],
                                       ((batch - solo).norm(dim=-1) / ref.norm(dim=-1)).max().item())
            out["max_rel_fp32"] = max(out["max_rel_fp32"], (bf16_err / ref.norm()).item())
            if diff > 0:
                out["max_ratio"] = max(out["max_ratio"], (diff / bf16_err).item())
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_mates_do_not_change_a_sample(model_dirs, arch):
    target = load_target(model_dirs[arch])
    cap = Capture(target.model, [0, 2, NUM_LAYERS - 1], "postnorm")
    ids, mask = _batch([40, 11, 27, 5], target.info["vocab_size"], seed=1)
    found = _batch_mate_check(cap, ids, mask)
    print(f"{arch}: batch-mates {found}")
    assert found["max_ratio"] <= BATCH_MATE_RATIO


def test_load_target_info_and_errors(model_dirs, tmp_path):
    target = load_target(model_dirs["qwen3_5_text"])
    info = target.info
    assert info["model"] == model_dirs["qwen3_5_text"] and info["revision"] is None
    assert (info["model_type"], info["hidden_size"], info["num_layers"]) == ("qwen3_5_text", 64, NUM_LAYERS)
    assert info["vocab_size"] == info["tokenizer_vocab_size"] == len(target.tokenizer)
    assert info["dtype"] == "bfloat16" and next(target.model.parameters()).dtype == torch.bfloat16
    assert not target.model.training
    # A hub cache snapshot folder is named by its commit: that is the revision.
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / commit
    shutil.copytree(model_dirs["llama"], snapshot)
    assert load_target(str(snapshot)).info["revision"] == commit
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_target(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        load_target(model_dirs["llama"], gguf_file="missing.gguf")


@pytest.mark.slow
def test_smollm2_capture(tmp_path):
    """The real model: capture == HF forward of the whole model, and batch-mate invariance.
    (Its weights from the folder layertap converts the GGUF into; the test below compares that
    folder with the GGUF.)"""
    target = load_target(smollm2_folder())
    info = target.info
    assert (info["model_type"], info["hidden_size"], info["num_layers"], info["vocab_size"]) == (
        "llama", 576, 30, 49152)
    samples = [s for s in tokenize_rows(list(sharegpt_conversations(8)), target.tokenizer, 48)
               if isinstance(s, TokenizedSample)][:3]
    samples[1] = TokenizedSample(samples[1].sample_id, samples[1].input_ids[:29], samples[1].loss_mask[:29])
    lengths = [len(s) for s in samples]
    ids = torch.full((3, max(lengths)), target.tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, :len(s)], mask[i, :len(s)] = s.input_ids, 1
    hs, prenorm = _reference(target.model, ids, mask)
    layers = default_layers(30) + [29]

    cap = Capture(target.model, layers, "postnorm")  # cuts the model: after the reference forward
    hidden, final = cap(ids, mask)

    assert torch.equal(hidden, _expected(hs, prenorm, layers, 30))
    assert torch.equal(final, hs[-1])
    found = _batch_mate_check(cap, ids, mask)
    print(f"smollm2: batch-mates {found}")
    assert found["max_ratio"] <= BATCH_MATE_RATIO


def test_loading_a_hybrid_names_its_kernel_path_and_a_gpu_on_the_fallback_warns(model_dirs, caplog):
    """`extract`, `eval` and `estimate --measure` load through load_target: one line names the
    kernels each layer type runs, and on CUDA the reference fallback is a warning with the fix."""
    from layertap.extract.kernels import describe, log_kernel_paths

    with caplog.at_level("INFO", logger="layertap.extract.kernels"):
        target = load_target(model_dirs["qwen3_5_text"], dtype=torch.float32)
    lines = [r for r in caplog.records if r.name == "layertap.extract.kernels"]
    assert len(lines) == 1 and lines[0].levelname == "INFO", [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    # 6 layers: 3 gated deltanet, 1 full attention, 2 gated deltanet
    assert "linear_attention x5" in msg and "full_attention x1" in msg and "attention=sdpa" in msg
    paths = describe(target.model)
    linear = {c.function: c for c in paths["linear_attention"]}
    assert {"chunk_gated_delta_rule", "causal_conv1d_fn"} <= set(linear)
    try:
        import fla  # noqa: F401
        has_fla = True
    except Exception:
        has_fla = False
    assert linear["chunk_gated_delta_rule"].fast is has_fla
    assert f"chunk_gated_delta_rule={'fast' if has_fla else 'fallback'}" in msg

    caplog.clear()
    with caplog.at_level("INFO", logger="layertap.extract.kernels"):
        log_kernel_paths(target.model, "cuda:0")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    if not has_fla:
        assert len(warnings) == 1 and "chunk_gated_delta_rule" in warnings[0] and "layertap[gpu]" in warnings[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="layertap.extract.kernels"):
        log_kernel_paths(target.model, "cpu")  # a CPU run is not told to install GPU kernels
    assert not [r for r in caplog.records if r.levelname == "WARNING"]

    plain = load_target(model_dirs["qwen3"], dtype=torch.float32)
    assert {k: [str(c) for c in v] for k, v in describe(plain.model).items()} == {"full_attention": ["attention=sdpa"]}


@pytest.mark.slow
def test_the_embedded_gguf_is_converted_once_into_a_folder_that_loads_the_same_target(tmp_path, monkeypatch, caplog):
    """The Quickstart's GGUF, read by transformers as a user's GGUF would be, against the folder
    layertap converts it into on first use: the same info, weights, tokenizer, chat template and
    states; the next load converts nothing."""
    import logging

    from layertap.extract import embedded
    from layertap.extract.embedded import smollm2_gguf

    monkeypatch.setenv("LAYERTAP_CACHE_DIR", "off")
    direct = load_target(*smollm2_gguf(), dtype=torch.float32)
    cache = tmp_path / "cache"
    monkeypatch.setenv("LAYERTAP_CACHE_DIR", str(cache))
    stale = Path(f"{embedded.converted_path(cache)}.4242.tmp")  # a converter killed mid-write
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"torn")
    with caplog.at_level(logging.INFO, logger="layertap"):
        cached = load_target(*smollm2_gguf(), dtype=torch.float32)
        embedded._converted.cache_clear()  # as a new process: finds the folder on disk
        again = load_target(*smollm2_gguf(), dtype=torch.float32)
    assert sum("converting the embedded SmolLM2" in r.getMessage() for r in caplog.records) == 1
    folders = [p for p in cache.iterdir() if p.is_dir()]
    assert folders == [embedded.converted_path(cache)]  # the stale one removed, no temporary left
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in folders[0].iterdir())  # readable by a shared cache
    assert cached.info == direct.info == again.info  # what a manifest pins: the GGUF, not the folder
    want, got = direct.model.state_dict(), cached.model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    rows = list(sharegpt_conversations(6))
    a = [s for s in tokenize_rows(rows, direct.tokenizer, 128) if isinstance(s, TokenizedSample)]
    b = [s for s in tokenize_rows(rows, cached.tokenizer, 128) if isinstance(s, TokenizedSample)]
    assert len(a) >= 5 and [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in a] == \
        [(s.sample_id, s.input_ids.tolist(), s.loss_mask.tolist()) for s in b]
    with torch.inference_mode():
        x = direct.model(input_ids=a[0].input_ids[None], output_hidden_states=True).hidden_states
        y = cached.model(input_ids=a[0].input_ids[None], output_hidden_states=True).hidden_states
    assert all(torch.equal(p, q) for p, q in zip(x, y))


def test_only_the_embedded_gguf_is_redirected_and_an_unwritable_cache_reads_the_gguf(tmp_path, monkeypatch, caplog):
    from layertap.extract.embedded import checkpoint, smollm2_gguf

    folder, name = smollm2_gguf()
    assert checkpoint(str(tmp_path), "other.gguf") == (str(tmp_path), "other.gguf")
    assert checkpoint(str(tmp_path), None) == (str(tmp_path), None)
    (tmp_path / name).write_bytes(b"a file of the same name elsewhere")
    assert checkpoint(str(tmp_path), name) == (str(tmp_path), name)
    monkeypatch.setenv("LAYERTAP_CACHE_DIR", "off")
    assert checkpoint(folder, name) == (folder, name)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LAYERTAP_CACHE_DIR", str(blocker / "cache"))
    assert checkpoint(folder, name) == (folder, name)
    assert "reading the GGUF instead" in caplog.text and str(blocker / "cache") in caplog.text
