"""Distillation (`layertap train --objective kl|ce+kl`, issue 24): the teacher made from a run's
stored final state is the target's own next-token distribution (norm, head and offset right);
the KL objective is zero at the teacher, reaches the drafter's weights, weighs masked slots 0
and computes in chunks what it computes whole; the command trains on it, refuses a run without
final states, and resumes to the same loss curve."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from layertap.cli import main as cli
from layertap.storage.store import open_store
from layertap.train import ShardStream
from layertap.train.checkpoint import LATEST, load_drafter_files, step_prefix
from layertap.train.objective import Distill, _capped, dflash_loss, teacher_positions
from layertap.storage.errors import ConfigError, InputError
from layertap.train.target_head import head_transform, load_final_norm, load_target_head
from test_extract import write_chats
from test_objective import toy_batch, toy_drafter
from tiny_models import tiny_model_dir

FAST = ["--batch-size", "4", "--block-size", "4", "--max-anchors", "8", "--lr", "1e-2"]


# targets whose forward transforms the head's logits: the teacher must too
TRANSFORMS = {"granite": {"logits_scaling": 0.5}, "gemma3_text": {"final_logit_softcapping": 3.0}}


def peaked_target(root: Path, model_type: str) -> str:
    """A tiny random target whose final norm weight is far from its initial value (a norm left
    out, or its weight, or Qwen3.5's (1 + weight) read as weight, shows) and whose head is scaled
    up, so its next-token distributions are peaked: argmax margins far above bf16 rounding."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(root, model_type, **TRANSFORMS.get(model_type, {}))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        norm = model.model.norm.weight
        norm.add_(0.5 * torch.randn(norm.shape, generator=g))
        model.lm_head.weight.mul_(50)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def make_run(tmp_path_factory):
    """(target folder, local run) for a model type and --final-state, each made once."""
    targets: dict[str, str] = {}
    runs: dict[tuple[str, str], str] = {}

    def make(model_type: str = "qwen3", final_state: str = "prenorm") -> tuple[str, str]:
        if model_type not in targets:
            targets[model_type] = peaked_target(tmp_path_factory.mktemp("models"), model_type)
        if (model_type, final_state) not in runs:
            tmp = tmp_path_factory.mktemp(f"run-{model_type}-{final_state}")
            out = str(tmp / "run")
            assert cli(["extract", "--model", targets[model_type], "--dataset", write_chats(tmp / "chats.jsonl", 24),
                        "--out", out, "--layers", "1,3", "--max-length", "64", "--dtype", "float32",
                        "--final-state", final_state, "--shard-bytes", "20KB", "--log-dir", str(tmp / "logs")]) == 0
            runs[model_type, final_state] = out
        return targets[model_type], runs[model_type, final_state]

    return make


def metrics(out: str) -> list[dict]:
    return [json.loads(line) for line in open_store(out).get("metrics.jsonl").decode().splitlines()]


# -- the teacher ---------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type,final_state", [("qwen3", "prenorm"), ("qwen3", "postnorm"),
                                                    ("qwen3_5_text", "prenorm"), ("granite", "prenorm"),
                                                    ("gemma3_text", "postnorm")])
def test_the_teacher_is_the_targets_own_next_token_distribution(make_run, model_type, final_state):
    """Slot k of the block at anchor a predicts token a+k: its teacher, from the stored final
    state, must be what a plain HF forward of the tokens before a+k gives for the next token;
    for Granite (logits divided by logits_scaling) and Gemma (soft-capped logits) as well."""
    from transformers import AutoModelForCausalLM

    target, run = make_run(model_type, final_state)
    sample = max(ShardStream(run), key=lambda s: s["input_ids"].shape[0])
    ids, final = sample["input_ids"], sample["final_state"]
    assert final.shape == (ids.shape[0], 64) and final.dtype == torch.bfloat16
    transform = head_transform(target)
    assert (transform.scale, transform.softcap) == {"granite": (2.0, None), "gemma3_text": (1.0, 3.0)}.get(
        model_type, (1.0, None))
    distill = Distill(ce=False, norm=load_final_norm(target) if final_state == "prenorm" else None,
                      scale=transform.scale, softcap=transform.softcap)
    head = load_target_head(target).lm_head.float()
    block, n = 4, ids.shape[0]
    anchors = torch.tensor([[0, n // 2, n - block]])
    rows = torch.tensor([i * block + k for i in range(3) for k in range(1, block)])
    at = teacher_positions(anchors, rows, block, n)
    teacher = torch.softmax(_capped(distill.teacher_states(final[at]) @ head.t(), distill.softcap), -1)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([torch.softmax(model(ids[None, :int(anchors[0, r // block]) + r % block]).logits[0, -1], -1)
                            for r in rows.tolist()])
    # states stored in bf16: their rounding, doubled in the logits by Granite's scale (exact on fp32 states)
    assert float((teacher - want).abs().max()) < (0.04 if model_type == "granite" else 0.02)
    assert torch.equal(teacher.argmax(-1), want.argmax(-1))
    if model_type in TRANSFORMS:  # the head's output as it is, not transformed: another distribution
        untransformed = torch.softmax(Distill(ce=False, norm=distill.norm).teacher_states(final[at]) @ head.t(), -1)
        assert float((untransformed - want).abs().max()) > 0.2
    else:
        assert float(want.max(-1).values.mean()) > 0.3  # peaked: a wrong norm, head or offset could not pass
    # without the norm (or one position off), the distributions are far apart
    plain = torch.softmax(final[at].float() @ head.t(), -1)
    shifted = torch.softmax(distill.teacher_states(final[at - 1]) @ head.t(), -1)
    assert float((shifted - want).abs().max()) > 0.2
    if final_state == "prenorm":
        assert float((plain - want).abs().max()) > 0.2


@pytest.mark.parametrize("model_type,config,want", [
    ("qwen3", {}, (1.0, None)),
    ("granite", {"logits_scaling": 8.0}, (0.125, None)),  # divides the logits
    ("hyperclovax", {"logits_scaling": 0.5}, (0.5, None)),  # the same name, multiplying them
    ("cohere", {"logit_scale": 0.0625}, (0.0625, None)),
    ("minicpm3", {"dim_model_base": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "q_lora_rank": 32,
                  "kv_lora_rank": 32, "v_head_dim": 16, "num_key_value_heads": 4},
     (0.25, None)),  # the states divided by hidden_size / dim_model_base before the head
    ("gemma3_text", {"final_logit_softcapping": 30.0}, (1.0, 30.0)),
    ("gemma2", {"final_logit_softcapping": 30.0}, (1.0, 30.0)),  # built for eager attention: it refuses sdpa
])
def test_the_head_transform_is_read_from_the_targets_own_forward(tmp_path, model_type, config, want):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**kw, **config})).save_pretrained(tmp_path)
    from tiny_models import tiny_tokenizer

    tiny_tokenizer().save_pretrained(tmp_path)
    t = head_transform(str(tmp_path))
    assert (t.scale, t.softcap) == pytest.approx(want)


def test_a_head_with_a_bias_is_refused_for_distillation(tmp_path):
    """Phi's head adds a bias to the logits, which the borrowed head (a matrix) does not hold."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tiny_models import tiny_tokenizer

    config = AutoConfig.for_model("phi", vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="its head adds a bias.*train with --objective ce"):
        head_transform(str(tmp_path))


@pytest.mark.slow
def test_the_final_norm_from_the_smollm2_gguf_is_the_models_own(monkeypatch):
    """The GGUF path: llama.cpp's output_norm (eps from the GGUF) computes what transformers'
    dequantized model's final norm does."""
    from activations import smollm2_folder
    from layertap.extract.embedded import smollm2_gguf
    from layertap.extract.model import decoder_of, load_target

    reference = smollm2_folder()  # transformers' own reading of the GGUF, saved (extract/embedded.py)
    monkeypatch.setenv("LAYERTAP_CACHE_DIR", "off")  # read the GGUF itself, as for a user's GGUF
    folder, name = smollm2_gguf()
    norm = load_final_norm(folder, name)
    model = load_target(reference, dtype=torch.float32).model
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        assert torch.allclose(norm(x), decoder_of(model).norm(x), rtol=1e-5, atol=1e-5)


# -- the objective -------------------------------------------------------------------------------

class TeacherOracle(nn.Module):
    """Outputs, at slot k of the block at anchor a, the teacher's own vector for token a+k (the
    final state at a+k-1 through the norm): its logits are the teacher's. `scale` is its weight."""

    def __init__(self, inner: nn.Module, final: torch.Tensor, distill: Distill):
        super().__init__()
        self.config, self.lm_head = inner.config, inner.lm_head
        self.scale = nn.Parameter(torch.ones(()))
        b, t, h = final.shape
        self.teacher = distill.teacher_states(final.reshape(-1, h)).view(b, t, h)

    def forward(self, states, anchors, anchor_tokens):
        b, a = anchors.shape
        bs, (t, h) = self.config.block_size, self.teacher.shape[1:]
        pos = (anchors[:, :, None] + torch.arange(bs) - 1).clamp(0, t - 1).reshape(b, -1, 1)
        return torch.gather(self.teacher, 1, pos.expand(-1, -1, h)).view(b, a, bs, h) * self.scale


def distill_batch(vocab: int, loss_mask: torch.Tensor | None = None) -> dict:
    batch = toy_batch(vocab, loss_mask)
    batch["final_state"] = torch.randn(3, 20, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    return batch


def random_norm() -> nn.Module:
    norm = nn.RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(32, generator=torch.Generator().manual_seed(5)))
    return norm.requires_grad_(False)


def test_kl_is_zero_at_the_teacher_and_positive_and_trainable_elsewhere():
    d = toy_drafter(vocab=50)
    batch = distill_batch(50)
    distill = Distill(ce=False, norm=random_norm())
    oracle = TeacherOracle(d, batch["final_state"], distill)
    r = dflash_loss(oracle, batch, torch.Generator().manual_seed(0), distill=distill)
    assert r.weight > 0 and abs(float(r.loss.detach())) < 1e-5 and abs(float(r.kl)) < 1e-5
    with torch.no_grad():
        oracle.scale.fill_(0.5)  # the drafter's distribution, flatter than the teacher's
    assert float(dflash_loss(oracle, batch, torch.Generator().manual_seed(0), distill=distill).loss) > 1e-3
    both = Distill(ce=True, norm=distill.norm)
    with torch.no_grad():
        oracle.scale.fill_(1.0)
    r = dflash_loss(oracle, batch, torch.Generator().manual_seed(0), distill=both)
    ce = dflash_loss(oracle, batch, torch.Generator().manual_seed(0))
    assert float(r.loss) == pytest.approx(float(ce.loss), abs=1e-5)  # ce+kl at the teacher: the CE alone

    r = dflash_loss(d, batch, torch.Generator().manual_seed(0), distill=distill)
    assert float(r.loss) > 0.01 and float(r.kl) == pytest.approx(float(r.loss))
    r.loss.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in d.trainable_state().values())
    assert d.lm_head.grad is None and d.embed.grad is None and distill.norm.weight.grad is None


def test_slots_the_loss_mask_leaves_out_weigh_nothing():
    """A final state at q is the teacher of token q+1 only: where loss_mask[q+1] is 0 it must not
    matter, where it is 1 it must."""
    mask = torch.ones(3, 20, dtype=torch.uint8)
    mask[:, 5:11] = 0
    batch = distill_batch(50, mask)
    d, distill = toy_drafter(vocab=50), Distill(ce=False, norm=random_norm())

    def loss(b: dict) -> torch.Tensor:
        return dflash_loss(d, b, torch.Generator().manual_seed(0), distill=distill).loss.detach()

    base = loss(batch)
    unused = batch["final_state"].clone()
    unused[:, 4:10] += 3  # the teachers of tokens 5..10
    unused[:, 19:] += 3  # of token 20, past every sample's end
    assert torch.equal(loss(dict(batch, final_state=unused)), base)
    used = batch["final_state"].clone()
    used[:, 11:17] += 3  # the teachers of tokens 12..17
    assert not torch.allclose(loss(dict(batch, final_state=used)), base)
    none = dflash_loss(d, distill_batch(50, torch.zeros_like(mask)), torch.Generator().manual_seed(0), distill=distill)
    assert float(none.loss) == 0.0 and none.weight == 0.0


@pytest.mark.parametrize("ce,temperature", [(False, 1.0), (True, 1.0), (False, 2.0), (True, 0.5)])
def test_chunked_distillation_equals_the_unchunked_path(ce, temperature):
    d = toy_drafter(vocab=40)
    batch = distill_batch(40)
    distill = Distill(ce=ce, temperature=temperature, norm=random_norm())

    def run(chunk_rows):
        d.zero_grad(set_to_none=True)
        r = dflash_loss(d, batch, torch.Generator().manual_seed(0), chunk_rows=chunk_rows, distill=distill)
        r.loss.backward()
        return r, {k: p.grad.clone() for k, p in d.trainable_state().items()}

    ref, ref_grads = run(0)
    for chunk in (1, 7, None):
        got, grads = run(chunk)
        assert torch.allclose(got.loss, ref.loss, rtol=1e-5) and torch.allclose(got.kl, ref.kl, rtol=1e-5)
        assert torch.equal(got.correct, ref.correct)
        for k, g in ref_grads.items():
            # atol: float32 sums in another order (a chunk a row) differ by an ulp near zero (1.5e-7 once)
            assert torch.allclose(grads[k], g, rtol=1e-4, atol=1e-6), (chunk, k, float((grads[k] - g).abs().max()))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the GPU's precision: bf16 matmuls, fp32 softmaxes
        low, _ = run(7)
    assert low.loss.dtype == torch.float32 and torch.allclose(low.loss, ref.loss, rtol=3e-2)


@pytest.mark.parametrize("chunk_rows", [0, 3, None])
def test_a_soft_capped_teacher_is_capped_in_the_loss(chunk_rows):
    """Gemma's soft cap on the target's logits reaches the teacher in both loss paths (a hand-made
    KL against capped logits), and through dflash_loss: a cap changes its loss."""
    from layertap.train.objective import head_distill_loss

    g = torch.Generator().manual_seed(3)
    hidden, teacher, head = (torch.randn(9, 16, generator=g), torch.randn(9, 16, generator=g) * 3,
                             torch.randn(30, 16, generator=g))
    labels, weights = torch.randint(0, 30, (9,), generator=g), torch.rand(9, generator=g)
    cap, t = 2.0, 1.5
    p = torch.log_softmax(cap * torch.tanh(teacher @ head.t() / cap) / t, -1)
    q = torch.log_softmax(hidden @ head.t() / t, -1)
    want = ((p.exp() * (p - q)).sum(-1) * t * t * weights).sum()
    loss, _, kl = head_distill_loss(hidden, head, labels, weights, teacher, ce=False, temperature=t, softcap=cap,
                                    chunk_rows=chunk_rows)
    assert torch.allclose(loss, want, rtol=1e-5) and torch.allclose(kl, want, rtol=1e-5)

    d, batch = toy_drafter(vocab=40), distill_batch(40)
    plain, capped = (dflash_loss(d, batch, torch.Generator().manual_seed(0), chunk_rows=chunk_rows,
                                 distill=Distill(ce=False, norm=random_norm(), softcap=c)).loss for c in (None, 0.5))
    assert abs(float(plain) - float(capped)) > 0.1 * float(plain)


def test_teacher_positions_are_the_state_before_each_predicted_token():
    anchors = torch.tensor([[2, 7], [0, 5]])
    rows = torch.arange(2 * 2 * 4)  # [B=2, A=2, block=4], flattened
    at = teacher_positions(anchors, rows, 4, 10).view(2, 2, 4)
    assert at[0, 1].tolist() == [6, 7, 8, 9]  # slot k of anchor 7 predicts 7+k from the state at 7+k-1
    assert at[1, 0, 1:].tolist() == [10, 11, 12]  # sample 1 starts at row 10 of the flattened [B, T]


# -- the command ---------------------------------------------------------------------------------

def test_train_with_kl_on_a_prenorm_run_lowers_the_loss(make_run, tmp_path, caplog):
    target, run = make_run("qwen3", "prenorm")
    out = str(tmp_path / "kl")
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "25", "--objective", "kl",
                *FAST]) == 0
    assert "objective: kl (KL from the target's distribution through its frozen final norm and head" in caplog.text
    m = metrics(out)
    assert [r["step"] for r in m] == list(range(1, 26))
    assert all(r["kl"] == pytest.approx(r["loss"]) for r in m)
    first, last = sum(r["loss"] for r in m[:5]) / 5, sum(r["loss"] for r in m[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    state = json.loads(open_store(out).get(f"{step_prefix(25)}/state.json"))
    assert state["config"]["objective"] == "kl" and state["config"]["distill_temperature"] == 1.0


def test_train_with_kl_on_a_granite_target_scales_the_teachers_logits_as_granite_does(make_run, tmp_path, caplog):
    target, run = make_run("granite", "prenorm")
    out = str(tmp_path / "kl")
    with caplog.at_level(logging.INFO, logger="layertap.train.trainer"):
        assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "2", "--objective", "kl",
                    *FAST]) == 0
    assert "the target's forward transforms its head's logits (scale 2): the teacher's are made the same way" \
        in caplog.text
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_distillation_without_a_final_state_is_refused(make_run, tmp_path, capsys):
    target, run = make_run("qwen3", "none")
    assert cli(["train", "--data", run, "--model", target, "--out", str(tmp_path / "o"), "--objective", "kl",
                *FAST]) == 2
    err = capsys.readouterr().err
    assert "error: --objective kl learns the target's next-token distribution" in err
    assert "extract with --final-state prenorm" in err and not (tmp_path / "o" / "checkpoints").exists()
    assert cli(["train", "--data", run, "--model", target, "--out", str(tmp_path / "o"), "--objective", "kl",
                "--distill-temperature", "0"]) == 2
    assert "--distill-temperature must be > 0" in capsys.readouterr().err


def test_resume_repeats_the_loss_curve_with_ce_plus_kl(make_run, tmp_path, capsys):
    """A run cut after its step-4 checkpoint and resumed equals the run that never stopped; the
    objective is part of what a resume must share."""
    target, run = make_run("qwen3", "postnorm")
    args = ["--data", run, "--model", target, "--steps", "12", "--save-every", "4", "--keep-checkpoints", "5",
            "--objective", "ce+kl", "--distill-temperature", "2", *FAST]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert cli(["train", *args, "--out", str(whole)]) == 0
    shutil.copytree(whole, cut)
    for step in (8, 12):  # as if killed after the checkpoint at step 4
        shutil.rmtree(cut / step_prefix(step))
    (cut / LATEST).write_text(json.dumps({"step": 4, "prefix": step_prefix(4)}))
    assert cli(["train", *args, "--out", str(cut), "--resume"]) == 0
    a, b = metrics(str(whole)), metrics(str(cut))
    assert [r["step"] for r in b] == list(range(1, 13)) and all(math.isfinite(r["kl"]) for r in b)
    keys = ("step", "samples_digest", "loss", "kl", "lr")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    wa, wb = load_drafter_files(open_store(str(whole)))[1], load_drafter_files(open_store(str(cut)))[1]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    capsys.readouterr()
    assert cli(["train", *args, "--out", str(cut), "--resume", "--objective", "ce"]) == 2
    assert "objective: checkpoint 'ce+kl', now 'ce'" in capsys.readouterr().err


def test_a_checkpoint_from_before_the_objective_setting_resumes_as_ce(make_run, tmp_path):
    target, run = make_run("qwen3", "none")
    out = tmp_path / "old"
    args = ["--data", run, "--model", target, "--out", str(out), "--save-every", "2", *FAST]
    assert cli(["train", *args, "--steps", "2"]) == 0
    state_file = out / step_prefix(2) / "state.json"
    state = json.loads(state_file.read_text())
    assert state["config"].pop("objective") == "ce" and "distill_temperature" not in state["config"]
    state_file.write_text(json.dumps(state))
    assert cli(["train", *args, "--steps", "4", "--resume"]) == 0
    assert [r["step"] for r in metrics(str(out))] == [1, 2, 3, 4] and "kl" not in metrics(str(out))[0]


def test_a_gguf_target_ending_in_a_layernorm_is_refused_for_distillation(tmp_path):
    """gpt2, falcon, bloom, starcoder2 GGUFs store a LayerNorm (output_norm.bias, no RMS epsilon):
    it was read as an RMSNorm, bias dropped, eps 1e-6, and --objective kl trained against a wrong
    teacher with no error."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "ln.gguf"), "gpt2")
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.add_tensor("output_norm.bias", np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InputError, match=r"\(gpt2\) ends in a LayerNorm, not an RMSNorm .*--objective ce"):
        load_final_norm(str(tmp_path), "ln.gguf")
