"""The DFlash trainer and `layertap eval`: real tiny extractions on a moto S3 server, real processes."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import torch

from layertap.cli import main as cli
from layertap.manifests.preemption import Interrupted, Preempted, StopSignals
from layertap.manifests.manifest import load_manifest
from layertap.storage.errors import InputError
from layertap.storage.store import open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir, tiny_tokenizer
from layertap.train.checkpoint import LATEST, load_drafter_files
from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.objective import block_targets, dflash_loss, sample_anchors
from layertap.train.speculative import Decoded, TargetRunner, greedy_decode, speculative_decode
from layertap.train.target_head import TargetHead, load_target_head

REPO = Path(__file__).resolve().parents[1]
# Small and fast: a 20 ms step, so a run of 100 steps is a couple of seconds.
FAST = ["--batch-size", "4", "--block-size", "4", "--max-anchors", "8", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


@pytest.fixture(scope="module")
def run(target, tmp_path_factory, s3_endpoint) -> str:
    """A finished extraction of 40 chats on the moto S3 server: the trainer's input."""
    bucket = f"train-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp("run")
    data = write_chats(tmp / "chats.jsonl", 40)
    uri = f"s3://{bucket}/runs/tiny"
    assert cli(["extract", "--model", target, "--dataset", data, "--out", uri, "--layers", "1,3",
                "--max-length", "64", "--shard-bytes", "20KB", "--log-dir", str(tmp / "logs")]) == 0
    return uri


@pytest.fixture(scope="module")
def prenorm_run(target, tmp_path_factory, s3_endpoint) -> str:
    """The same chats extracted with the final state (prenorm): what distillation trains on."""
    bucket = f"train-prenorm-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp("prenorm-run")
    uri = f"s3://{bucket}/runs/tiny"
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 40), "--out", uri,
                "--layers", "1,3", "--final-state", "prenorm", "--max-length", "64", "--shard-bytes", "20KB",
                "--log-dir", str(tmp / "logs")]) == 0
    return uri


def train_cli(*args: str) -> int:
    return cli(["train", *args])


def metrics(out: str) -> list[dict]:
    return [json.loads(line) for line in open_store(out).get("metrics.jsonl").decode().splitlines()]


# -- the drafter and its objective -------------------------------------------------------------

def toy_head(vocab: int = 50, hidden: int = 32, tied: bool = False) -> TargetHead:
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(vocab, hidden, generator=g)
    head = embed if tied else torch.randn(vocab, hidden, generator=g)
    return TargetHead(embed, head, tied, {"num_layers": 24, "num_heads": 4, "num_kv_heads": 2, "head_dim": 8,
                                          "intermediate_size": 64})


def test_a_block_sees_only_earlier_context_and_itself():
    head = toy_head()
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1, 2], mask_token_id=49, block_size=4), head)
    assert d.config.num_layers == 2 and d.mask_embedding is None  # 24 target layers; id 49 is inside the vocab
    states = torch.randn(1, 20, 2, 32)
    anchors, tokens = torch.tensor([[5, 12]]), torch.tensor([[3, 4]])
    base = d(states, anchors, tokens)

    def changed(new_states, new_tokens):
        return (d(new_states, anchors, new_tokens) - base).abs().amax(dim=(0, 2, 3)) > 1e-6

    later = states.clone()
    later[:, 12:] += 5  # at or after both anchors: invisible to both blocks
    assert changed(later, tokens).tolist() == [False, False]
    mid = states.clone()
    mid[:, 8] += 5  # after anchor 5, before anchor 12
    assert changed(mid, tokens).tolist() == [False, True]
    assert changed(states, torch.tensor([[3, 9]])).tolist() == [False, True]  # blocks do not see each other


@torch.no_grad()  # flex-attention has no CPU backward: bench/gpu_train.py compares gradients on a GPU
def test_flex_attention_block_mask_equals_the_dense_mask():
    """The GPU path (flex-attention BlockMask, run eagerly here) computes what the dense mask does."""
    head = toy_head()
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1, 2], mask_token_id=49, block_size=4), head)
    states = torch.randn(2, 20, 2, 32)
    anchors, tokens = torch.tensor([[5, 12, 0], [3, 9, 17]]), torch.tensor([[3, 4, 5], [6, 7, 8]])
    d.attention = "sdpa"
    dense = d(states, anchors, tokens)
    d.attention = "flex"
    assert torch.allclose(d(states, anchors, tokens), dense, atol=1e-5)


def test_the_attention_path_follows_the_tensors_device_not_the_host(monkeypatch):
    """A drafter built on a CUDA host took the flex path for good: `eval --device cpu` there ran
    flex-attention on CPU (eager, no backward). The path follows each forward's tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, tensors on CPU
    head = toy_head()
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1, 2], mask_token_id=49, block_size=4), head)
    states = torch.randn(2, 20, 2, 32)
    anchors, tokens = torch.tensor([[5, 12, 0], [3, 9, 17]]), torch.tensor([[3, 4, 5], [6, 7, 8]])
    d(states, anchors, tokens).square().mean().backward()  # flex on CPU: no backward
    assert d.layers[0].q_proj.weight.grad is not None


@torch.no_grad()
def test_context_under_autocast_skips_the_fp32_copy_and_matches():
    """Under autocast the stored bf16 states go to fc as they are (no fp32 temporary); the result is
    the one the fp32 round trip gave, since autocast casts fc's input back to bf16 either way."""
    head = toy_head()
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1, 2], mask_token_id=49, block_size=4), head)
    states = torch.randn(2, 20, 2, 32).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        via_fp32 = d.hidden_norm(d.fc(states.reshape(2, 20, -1).float()))
        assert torch.equal(d.context(states), via_fp32)
    assert d.context(states).dtype == torch.float32  # no autocast: cast to fc's dtype, as before


def test_the_drafters_norms_run_fused_under_bf16_autocast():
    """Under bf16 autocast a projection's bf16 output met a float32 norm weight (q/k norms, the
    context norm), and torch fell back to its unfused RMSNorm ("Mismatch dtype ... Cannot
    dispatch to fused implementation"): a candidate for the H200 step time. The weights stay
    float32 and train."""
    import warnings

    head = toy_head()
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1], mask_token_id=3, block_size=4, max_anchors=4), head)
    batch = {"input_ids": torch.randint(0, 50, (2, 12)), "loss_mask": torch.ones(2, 12, dtype=torch.uint8),
             "lengths": torch.tensor([12, 7]), "hidden_states": torch.randn(2, 12, 1, 32)}
    reference = dflash_loss(d, batch, torch.Generator().manual_seed(0)).loss.detach()
    with warnings.catch_warnings(record=True) as caught, torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        result = dflash_loss(d, batch, torch.Generator().manual_seed(0))
    assert not [w for w in caught if "Mismatch dtype" in str(w.message)], [str(w.message) for w in caught]
    assert abs(float(result.loss) - float(reference)) < 0.05 * float(reference)
    result.loss.backward()
    norm = d.layers[0].k_norm.weight
    assert norm.dtype == torch.float32 and norm.grad is not None and norm.grad.dtype == torch.float32


def test_anchors_weights_and_learned_mask_token():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.uint8)
    lengths = torch.tensor([10, 6])
    anchors, valid = sample_anchors(loss_mask, lengths, max_anchors=3, generator=torch.Generator().manual_seed(0))
    row0 = anchors[0][valid[0]].tolist()
    assert set(row0) <= {2, 3, 4, 7} and len(row0) == 3 and row0 == sorted(row0)
    assert set(anchors[1][valid[1]].tolist()) <= {0, 1, 2, 3, 4}  # a+1 must be inside the sample
    again, _ = sample_anchors(loss_mask, lengths, 3, torch.Generator().manual_seed(0))
    assert torch.equal(anchors, again)
    ids = torch.arange(20).view(2, 10)
    blocks = block_targets(ids, loss_mask, lengths, torch.tensor([[4, 0], [3, 0]]),
                           torch.tensor([[True, False], [True, False]]), block_size=4, gamma=7.0)
    w = blocks.weights
    assert w[0, 0].tolist() == pytest.approx([0, 1.0, 0.0, math.exp(-2 / 7)])  # pos 6 unmasked, pos 7 masked in
    assert w[1, 0].tolist() == pytest.approx([0, 1.0, math.exp(-1 / 7), 0.0])  # pos 6 is past length 6
    assert blocks.labels[0, 0].tolist() == [4, 5, 6, 7] and float(w[:, 1].sum()) == 0.0

    head = toy_head(tied=True)
    torch.manual_seed(0)
    d = DFlashDrafter(default_config(head, [1], mask_token_id=50, block_size=4, max_anchors=4), head)
    assert d.mask_embedding is not None and "mask_embedding" in d.trainable_state()
    assert "embed" not in d.trainable_state() and d.lm_head is d.embed
    batch = {"input_ids": torch.randint(0, 50, (2, 12)), "loss_mask": torch.ones(2, 12, dtype=torch.uint8),
             "lengths": torch.tensor([12, 7]), "hidden_states": torch.randn(2, 12, 1, 32)}
    result = dflash_loss(d, batch, torch.Generator().manual_seed(0))
    result.loss.backward()
    assert d.mask_embedding.grad is not None and d.embed.grad is None
    assert result.counted[0] == 0 and result.counted[1:].sum() > 0


def test_target_head_reads_only_the_embeddings(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    for tied in (False, True):
        config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_config(config)
        folder = tmp_path / f"tied-{tied}"
        model.save_pretrained(folder, max_shard_size="40KB")  # several files and an index
        assert (folder / "model.safetensors.index.json").exists()
        head = load_target_head(str(folder))
        assert head.tied is tied
        assert torch.equal(head.embed, model.get_input_embeddings().weight.detach())
        assert torch.equal(head.lm_head, model.get_output_embeddings().weight.detach())
        assert head.facts["num_layers"] == 2 and head.facts["num_kv_heads"] == 2
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_target_head(str(tmp_path / "nope"))


def test_target_head_refuses_an_untied_config_without_a_head(tmp_path):
    """A config that says the head is untied, with the head stored under a name layertap does not
    know, must not load as tied: the drafter would train against the embedding matrix."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 8,
                                                      "tie_word_embeddings": False}))
    save_file({"model.embed_tokens.weight": torch.randn(16, 8), "language_model.lm_head.weight": torch.randn(16, 8)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match="tie_word_embeddings is false.*model.safetensors.*lm_head.weight"):
        load_target_head(str(tmp_path))


@pytest.mark.slow
def test_target_head_from_the_smollm2_gguf(monkeypatch):
    """The GGUF path dequantizes the same embedding transformers loads (tied: no output tensor)."""
    from activations import smollm2_folder
    from layertap.extract.embedded import smollm2_gguf
    from layertap.extract.model import load_target

    reference = smollm2_folder()  # transformers' own dequantization, saved (extract/embedded.py)
    monkeypatch.setenv("LAYERTAP_CACHE_DIR", "off")  # read the GGUF itself, as for a user's GGUF
    folder, name = smollm2_gguf()
    head = load_target_head(folder, name)
    assert head.tied and head.embed.shape == (49152, 576) and head.facts["num_layers"] == 30
    model = load_target(reference, dtype=torch.float32).model
    assert torch.equal(head.embed, model.get_input_embeddings().weight)


# -- speculative decoding ----------------------------------------------------------------------

class OracleDrafter(torch.nn.Module):
    """Drafts the target's true greedy continuation for `hits` slots, then a wrong token: the
    verify/accept/crop logic must then produce exactly `hits + 1` tokens per step."""

    def __init__(self, greedy: list[int], prompt_len: int, hits: int, block_size: int, vocab: int):
        super().__init__()
        self.config = type("C", (), {"block_size": block_size})()
        self.greedy, self.prompt_len, self.hits, self.vocab = greedy, prompt_len, hits, vocab

    def forward(self, context, anchors, anchor_tokens):
        a = int(anchors[0, 0])
        start = a - self.prompt_len + 1  # greedy[i] sits at position prompt_len + i
        out = []
        for k in range(self.config.block_size):
            i = start + k - 1
            right = self.greedy[i] if 0 <= i < len(self.greedy) else 0
            tok = right if k <= self.hits else (right + 1) % self.vocab
            out.append(torch.nn.functional.one_hot(torch.tensor(tok), self.vocab).float())
        return torch.stack(out)[None, None]

    def logits(self, hidden):
        return hidden


def test_speculative_decoding_equals_greedy_and_counts_acceptance(target):
    from layertap.extract.model import load_target

    t = load_target(target, dtype=torch.float32)
    runner = TargetRunner(t.model, [1, 3])
    prompt = t.tokenizer("the quick brown fox")["input_ids"]
    greedy = greedy_decode(runner, prompt, 40, eos=set())
    assert len(greedy) == 40
    for hits in (0, 2, 5):
        oracle = OracleDrafter(greedy + [0] * 16, len(prompt), hits, block_size=6, vocab=t.model.config.vocab_size)
        spec = speculative_decode(runner, oracle, prompt, 40, eos=set())
        assert spec.tokens == greedy
        assert spec.accepted[:-1] == [hits + 1] * (len(spec.accepted) - 1)
        assert sum(spec.accepted) == len(greedy) - 1  # the last step counts only what fits under max_new
    # EOS drafted and accepted inside a block (not its bonus token): the answer, and the steps
    # that tau averages over, end there; nothing after the EOS is verified or counted.
    stop = next(i for i in range(6, len(greedy)) if greedy[i] not in greedy[:i] and i % 6 != 0)  # not a bonus
    eos = {greedy[stop]}
    oracle = OracleDrafter(greedy + [0] * 16, len(prompt), 5, block_size=6, vocab=t.model.config.vocab_size)
    spec = speculative_decode(runner, oracle, prompt, 40, eos=eos)
    assert spec.tokens == greedy_decode(runner, prompt, 40, eos=eos) == greedy[: stop + 1]
    assert sum(spec.accepted) == stop and len(spec.accepted) == -(-stop // 6)
    # A real (untrained) drafter: whatever it drafts, the output is the target's.
    head = TargetHead(t.model.get_input_embeddings().weight.detach(), t.model.lm_head.weight.detach(), False,
                      {"num_layers": 6, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128})
    drafter = DFlashDrafter(default_config(head, [1, 3], mask_token_id=len(t.tokenizer), block_size=4), head).eval()
    assert speculative_decode(runner, drafter, prompt, 40, eos=set()).tokens == greedy
    assert isinstance(spec, Decoded)


def test_acceptance_by_position_leaves_out_what_a_cut_step_did_not_reach(target):
    """An answer's last step is cut by max_new (or an accepted EOS) before any rejection: it
    must not read as a rejection at the positions past its cut."""
    from layertap.extract.model import load_target
    from layertap.train.speculative import _tau

    t = load_target(target, dtype=torch.float32)
    runner = TargetRunner(t.model, [1, 3])
    prompt = t.tokenizer("the quick brown fox")["input_ids"]
    # the oracle's drafts run past max_new: the last step's drafts are right too, only cut (an oracle whose
    # list ended at 40 drafted its padding there, a rejection the step's verify found)
    greedy = greedy_decode(runner, prompt, 46, eos=set())
    # every draft right: each step adds 6 tokens, the last one only the 3 left under max_new (40 = 1 + 6 x 6 + 3)
    oracle = OracleDrafter(greedy + [0] * 16, len(prompt), 5, block_size=6, vocab=t.model.config.vocab_size)
    spec = speculative_decode(runner, oracle, prompt, 40, eos=set())
    assert spec.accepted == [6] * 6 + [3] and spec.complete == [True] * 6 + [False]
    tau, per_position = _tau([spec], 6)
    assert tau == pytest.approx(39 / 7) and per_position == [1.0] * 5
    # two drafts right of five: every step is rejected at position 3, the last one cut after 2 tokens
    oracle = OracleDrafter(greedy + [0] * 16, len(prompt), 2, block_size=6, vocab=t.model.config.vocab_size)
    spec = speculative_decode(runner, oracle, prompt, 40, eos=set())
    assert spec.accepted == [3] * 13 and spec.complete == [True] * 13
    assert _tau([spec], 6)[1] == [1.0, 1.0, 0.0, 0.0, 0.0]
    # hand-made steps: a complete step that accepted 1 draft, and one cut after 2 accepted drafts
    steps = Decoded([], accepted=[2, 2], drafts=[1, 2], complete=[True, False])
    assert _tau([steps], 5)[1] == [1.0, 0.5, 0.0, 0.0]


# -- training ----------------------------------------------------------------------------------

def test_training_from_s3_lowers_the_loss_and_exports_the_drafter(run, target, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "120", "--save-every", "50", *FAST) == 0
    hint = capsys.readouterr().out  # the next command, whole: eval finds the target the drafter records
    assert f"layertap eval --drafter {out} --prompts HELD_OUT.jsonl" in hint
    m = metrics(out)
    assert [r["step"] for r in m] == list(range(1, 121))
    first, last = sum(r["loss"] for r in m[:10]) / 10, sum(r["loss"] for r in m[-10:]) / 10
    assert last < first - 0.3, (first, last)
    assert all(0 <= r["data_wait_fraction"] <= 1 and r["tokens_per_s"] > 0 for r in m)
    assert len(m[0]["acc_per_position"]) == 3
    config, weights = load_drafter_files(open_store(out))
    assert config.capture_layers == [1, 3] and config.block_size == 4
    # the tiny vocabulary has no free slot: the mask is its unused special token, '</think>'
    assert config.mask_token_id == tiny_tokenizer().convert_tokens_to_ids("</think>") and not config.learned_mask
    assert not any(k.startswith(("embed", "lm_head", "mask_embedding")) for k in weights)
    store = open_store(out)
    assert sorted(o.key.split("/")[1] for o in store.list("checkpoints/step-")
                  if o.key.endswith("state.json")) == ["step-00000100", "step-00000120"]  # keep 2
    assert json.loads(store.get(LATEST))["step"] == 120
    # layertap eval on held-out chats (the assistant turn is dropped) and a raw prompt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "question 99?"},
                                                {"role": "assistant", "content": "dropped"}]}) + "\n"
                       + json.dumps({"prompt": "the quick brown fox"}) + "\n")
    capsys.readouterr()
    assert cli(["eval", "--drafter", out, "--prompts", str(prompts), "--max-new-tokens", "12",
                "--json"]) == 0  # no --model: the one the drafter records
    report = json.loads(capsys.readouterr().out)
    assert report["matches_greedy"] is True and report["prompts"] == 2
    assert 1.0 <= report["tau"] <= 4 and 1.0 <= report["tau_untrained"] <= 4
    assert report["verify_steps"] >= 2 and len(report["acceptance_per_position"]) == 3
    # A kept checkpoint evaluates as a point of a learning curve: step 120's is the exported drafter.
    assert cli(["eval", "--drafter", out, "--prompts", str(prompts), "--max-new-tokens", "12", "--json",
                "--step", "120", "--no-baseline"]) == 0
    at_120 = json.loads(capsys.readouterr().out)
    assert at_120["checkpoint_step"] == 120 and at_120["tau"] == report["tau"]
    assert cli(["eval", "--drafter", out, "--prompts", str(prompts), "--step", "50"]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint of step 50" in err and "kept: [100, 120]" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt here"}) + "\n")
    assert cli(["eval", "--drafter", out, "--model", target, "--prompts", str(bad)]) == 2
    assert "bad.jsonl:1: expected" in capsys.readouterr().err
    # An output that already holds a run is not silently overwritten.
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "5", *FAST) == 2
    assert "pass --resume" in capsys.readouterr().err


def test_a_follow_epoch_of_a_real_extraction_counts_only_the_samples_it_stores(run, target, tmp_path, caplog):
    """The run's 41 rows hold one without an answer, which extraction skips and its plan knows of:
    the follow epoch is 40 samples (10 steps of 4), not 41 (11, the last of padding alone)."""
    manifest = load_manifest(open_store(run))
    assert manifest.num_samples == 41 and manifest.planned_records == 40
    out = str(tmp_path / "out")
    with caplog.at_level(logging.INFO, logger="layertap"):
        assert train_cli("--data", run, "--model", target, "--out", out, "--follow", "--follow-poll-s", "0.5",
                         *FAST) == 0
    assert [r["step"] for r in metrics(out)] == list(range(1, 11))
    assert "40 samples per epoch over 1 rank(s); 10 steps (10 per epoch)" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["ce", "ce+kl"])
def test_resume_after_sigkill_repeats_the_same_batches_and_losses(objective, target, tmp_path, request):
    run = request.getfixturevalue("run" if objective == "ce" else "prenorm_run")
    args = ["--data", run, "--model", target, "--steps", "60", "--save-every", "4", "--objective", objective, *FAST]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    whole = str(tmp_path / "whole")
    subprocess.run([sys.executable, "-m", "layertap", "train", *args, "--out", whole], check=True, env=env,
                   capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "layertap", "train", *args, "--out", str(killed)], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest.json"
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        if latest.exists() and json.loads(latest.read_text() or "{}").get("step", 0) >= 8:
            break
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    stopped_at = json.loads(latest.read_text())["step"]
    assert stopped_at < 60, "the run finished before it could be killed"
    p = subprocess.run([sys.executable, "-m", "layertap", "train", *args, "--out", str(killed), "--resume"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    a, b = metrics(whole), metrics(str(killed))
    assert [r["step"] for r in b] == list(range(1, 61))
    for x, y in zip(a, b):
        assert (x["step"], x["samples_digest"], x["loss"], x.get("kl"), x["lr"]) == \
            (y["step"], y["samples_digest"], y["loss"], y.get("kl"), y["lr"])
    wa, wb = load_drafter_files(open_store(whole))[1], load_drafter_files(open_store(str(killed)))[1]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_every_batch_of_an_epoch_is_trained_once_in_steps_that_end_with_it(run, target, tmp_path):
    """--grad-accum that does not divide the epoch's batches: the epoch's last step takes the
    batches left (none is skipped, no step reaches into the next epoch), and its gradient is
    the mean over them, as a full step's is over its own."""
    import xxhash

    from layertap.train import ShardStream, StreamConfig, StreamLoader

    loader = StreamLoader(ShardStream(run, config=StreamConfig(seed=0, shuffle_buffer=64)), batch_size=4)
    epochs = [[b["sample_id"] for b in loader] for _ in range(2)]
    n = len(epochs[0])

    def digests(grad_accum: int) -> list[str]:
        out = []
        for batches in epochs:
            for i in range(0, n, grad_accum):
                seen = xxhash.xxh64()
                for ids in batches[i:i + grad_accum]:
                    seen.update("\n".join(ids).encode() + b"\n")
                out.append(seen.hexdigest())
        return out

    def train(grad_accum: int, *more: str) -> list[dict]:
        out = str(tmp_path / f"ga{grad_accum}")
        assert train_cli("--data", run, "--model", target, "--out", out, "--epochs", "2", "--grad-accum",
                         str(grad_accum), *FAST, *more) == 0
        return metrics(out)

    assert n % 3
    m = train(3, "--save-every", "2")
    assert [r["samples_digest"] for r in m] == digests(3)
    steps = -(-n // 3)
    assert [r["epoch"] for r in m] == [0] * steps + [1] * steps
    # a resume inside the second epoch, after its first epoch's short step: the same steps again
    out = open_store(str(tmp_path / "ga3"))
    middle = 2 * steps - 2
    out.put(LATEST, json.dumps({"step": middle, "prefix": f"checkpoints/step-{middle:08d}"}).encode())
    assert train_cli("--data", run, "--model", target, "--out", out.uri, "--epochs", "2", "--grad-accum", "3",
                     "--save-every", "2", "--resume", *FAST) == 0
    assert [(r["samples_digest"], r["loss"]) for r in metrics(out.uri)] == [(r["samples_digest"], r["loss"]) for r in m]
    whole, short = train(n), train(2 * n)  # a step of all n batches; a step of 2n that has only n
    assert [r["samples_digest"] for r in short] == [r["samples_digest"] for r in whole] == digests(n)
    for a, b in zip(whole, short):
        assert (a["loss"], a["grad_norm"]) == pytest.approx((b["loss"], b["grad_norm"]), rel=1e-6)


def test_stop_signals_are_recorded_or_raised_and_the_old_handlers_come_back():
    """The one stop helper: training reads a recorded stop at its step boundary, extraction
    stops where it is; a second signal changes nothing, and the handlers before come back.
    A SIGINT the process was told to ignore (a background job, `nohup`) stays ignored."""
    # SIGINT as a foreground shell leaves it: pytest started in the background inherits it ignored
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT)
        with StopSignals(at_once=False, signals=(signal.SIGUSR1,)) as stop:
            assert stop.requested is None
            _deliver(signal.SIGUSR1)
            _deliver(signal.SIGUSR1)
            assert type(stop.requested) is Preempted and str(stop.requested) == "received SIGUSR1"
            assert stop.requested.exit_code == 143
        with StopSignals(at_once=False) as stop:  # training: Ctrl-C stops at the step, twice at once
            _deliver(signal.SIGINT)
            assert type(stop.requested) is Interrupted
            with pytest.raises(KeyboardInterrupt):
                _deliver(signal.SIGINT)
        with pytest.raises(Interrupted) as caught:
            with StopSignals(at_once=True):
                _deliver(signal.SIGINT)
        assert caught.value.exit_code == 130 and str(caught.value) == "Ctrl-C (SIGINT)"
        assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGINT)) == before
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with StopSignals(at_once=True):
            _deliver(signal.SIGINT)  # nothing raised
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


def _deliver(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.05)  # the handler runs in this thread at the next bytecode


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stop_signal_saves_a_checkpoint_and_exits_for_requeue(run, target, tmp_path, sig, code):
    """Slurm's preemption signal, or a user's Ctrl-C (which threw the run's progress away): stop at
    the next step with a checkpoint, exit 143 (130), resume to the end."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "layertap", "train", "--data", run, "--model", target, "--out", str(out),
            "--steps", "150", "--save-every", "1000", *FAST]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a shell's foreground
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and not (out / "checkpoints").exists():
        line = p.stderr.readline()
        if "step 10/150" in line:  # training is under way
            p.send_signal(sig)
            break
    assert p.wait(timeout=300) == code
    stopped = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    assert 10 <= stopped < 150 and len(metrics(str(out))) == stopped
    p = subprocess.run(args + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["step"] for r in metrics(str(out))] == list(range(1, 151))


def test_a_stop_signal_during_the_last_step_ends_the_run_as_it_would_have(run, target, tmp_path, monkeypatch):
    """Slurm's warning signal landing in the step that reaches --steps: the final checkpoint was
    saved and the command exited 143 without the export, so the finished run read as incomplete
    until a requeue loaded the target again only to export. It ends as an uninterrupted run ends."""
    import layertap.train.trainer as trainer

    stepping = trainer.train_step

    def signalled_at_the_last(run_, step, distill):
        if step == 3:  # the 4th and last step
            _deliver(signal.SIGTERM)
        return stepping(run_, step, distill)

    monkeypatch.setattr(trainer, "train_step", signalled_at_the_last)
    out = tmp_path / "out"
    assert cli(["train", "--data", run, "--model", target, "--out", str(out), "--steps", "4", *FAST]) == 0
    assert (out / "drafter" / "config.json").exists() and [r["step"] for r in metrics(str(out))] == [1, 2, 3, 4]


def test_a_resume_at_an_epochs_end_with_other_workers_says_the_order_changes(tmp_path, caplog):
    """Mid-epoch a position is per DataLoader worker and another count is refused; at an epoch's
    end it was taken in silence, though the worker split draws the epochs after in another order
    than the uninterrupted run's. Said now, with the count to keep it; not for 0 and 1 workers, one
    consumer each, which draw the same order."""
    import fake_worker
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    fake_worker.work(uri)  # 40 samples: 10 steps an epoch at batch size 4
    base = ["train", "--data", uri, "--model", target, "--out", out, "--batch-size", "4", "--block-size", "4",
            "--max-anchors", "8"]
    assert cli([*base, "--steps", "10"]) == 0
    with caplog.at_level("WARNING"):
        assert cli([*base, "--steps", "20", "--resume", "--num-workers", "1"]) == 0  # the same one consumer
    assert "--num-workers" not in caplog.text
    with caplog.at_level("WARNING"):
        assert cli([*base, "--steps", "30", "--resume", "--num-workers", "2"]) == 0
    assert "--num-workers 2, the checkpoint's run had 1: the epochs from here are drawn in another order" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert cli([*base, "--steps", "32", "--resume", "--num-workers", "2"]) == 0  # the count it was saved with
    assert "--num-workers" not in caplog.text


@pytest.mark.parametrize("workers", [(0, 3), (3, 0)], ids=["more_batches", "fewer_batches"])
def test_a_resume_with_other_workers_trains_the_epochs_left_at_their_new_size(tmp_path, workers):
    """40 samples at batch size 4 are 10 batches with 0 workers and 12 with 3 (spans of 14, 13, 13).
    A resume at an epoch's end with the other count computed the run's steps as if every epoch had
    the new size: 2 steps of a third epoch under --epochs 2, or the second epoch cut 2 batches short."""
    import fake_worker

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), str(tmp_path / "out")
    fake_worker.work(uri)
    base = ["train", "--data", uri, "--model", target, "--out", out, "--batch-size", "4", "--block-size", "4",
            "--max-anchors", "8"]
    before, after = workers
    assert cli([*base, "--epochs", "1", "--num-workers", str(before)]) == 0
    assert cli([*base, "--epochs", "2", "--resume", "--num-workers", str(after)]) == 0
    batches = {0: 10, 3: 12}
    per_epoch = [[r["step"] for r in metrics(out) if r["epoch"] == e] for e in (0, 1, 2)]
    assert [len(steps) for steps in per_epoch] == [batches[before], batches[after], 0]


def test_a_resume_that_trains_on_withdraws_the_earlier_export(run, target, tmp_path, capsys, monkeypatch):
    """An output trained to its end, resumed with more --steps and stopped before that end: its
    old drafter/ stayed, `status` called it COMPLETE and export-drafter took the old weights."""
    from layertap.train import trainer

    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "4", "--save-every", "2", *FAST) == 0
    assert (tmp_path / "out" / "drafter" / "config.json").exists()
    taken = trainer.train_step

    def failing_at_step_6(run_, step, distill=None):
        if step == 5:
            raise RuntimeError("the node went away")
        return taken(run_, step, distill)

    monkeypatch.setattr(trainer, "train_step", failing_at_step_6)
    with pytest.raises(RuntimeError, match="the node went away"):
        train_cli("--data", run, "--model", target, "--out", out, "--steps", "8", "--save-every", "1", "--resume",
                  *FAST)
    assert not (tmp_path / "out" / "drafter").exists() or not any((tmp_path / "out" / "drafter").iterdir())
    capsys.readouterr()
    assert cli(["status", out]) == 3  # incomplete: not the COMPLETE of the earlier export
    assert "steps       5 of 8" in capsys.readouterr().out
    monkeypatch.setattr(trainer, "train_step", taken)
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "8", "--resume", *FAST) == 0
    assert (tmp_path / "out" / "drafter" / "config.json").exists()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_loss_that_stays_nan_stops_training_with_a_clear_error(bad, run, target, tmp_path, capsys, caplog,
                                                                 monkeypatch):
    """NaN losses (NaN states in the data, a diverged --lr) made no update, silently: 'final loss
    nan', exit 0 and an untrained drafter exported. Now each is warned and five in a row stop it.
    An infinite one made NaN weights (clipping an infinite norm): it makes no update either."""
    from layertap.train import trainer
    from layertap.train.checkpoint import load_safetensors

    computed = trainer.dflash_loss

    def nan_from_step_3(model, batch, generator, **options):
        result = computed(model, batch, generator, **options)
        if len(calls) >= 2:
            result.loss = result.loss * bad
        calls.append(1)
        return result

    calls: list[int] = []
    monkeypatch.setattr(trainer, "dflash_loss", nan_from_step_3)
    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "50", "--save-every", "2", *FAST) == 2
    err = capsys.readouterr().err
    assert "steps 3-7: the loss or the gradients were NaN or infinite 5 steps in a row" in err
    assert "none of them updated the drafter (its checkpoints hold it as it was before them)" in err
    assert "step 3: the loss or the gradients are not finite" in caplog.text
    assert not (tmp_path / "out" / "drafter").exists()
    kept = [load_safetensors(open_store(out), f"checkpoints/step-{s:08d}/drafter.safetensors") for s in (4, 6)]
    for name, w in kept[0].items():  # no update after step 2: the checkpoints of steps 4 and 6 are equal, finite
        assert torch.isfinite(w).all() and torch.equal(w, kept[1][name]), name


def test_nan_losses_at_the_end_are_told_as_such_not_as_skipped_data(run, target, tmp_path, capsys, monkeypatch):
    """Fewer NaN steps in a row than stop training: the closing line said the steps after the last
    finite loss "held only zero-weighted padding: samples the extraction skipped" for any NaN loss,
    a divergence included. It is based on the step's loss weight now."""
    from layertap.train import trainer

    computed = trainer.dflash_loss
    calls: list[int] = []

    def nan_at_steps_5_and_6(model, batch, generator, **options):
        result = computed(model, batch, generator, **options)
        if len(calls) >= 4:
            result.loss = result.loss * float("nan")
        calls.append(1)
        return result

    monkeypatch.setattr(trainer, "dflash_loss", nan_at_steps_5_and_6)
    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "6", *FAST) == 0
    text = capsys.readouterr().out
    assert "(step 4; after it, 2 step(s) had a NaN or infinite loss and made no update (see the warnings))" in text
    assert "padding" not in text and "skipped" not in text
    records = [json.loads(x, parse_constant=lambda c: pytest.fail(f"metrics.jsonl holds {c}, not JSON"))
               for x in open_store(out).get("metrics.jsonl").decode().splitlines()]
    assert [r["loss"] is None for r in records] == [False] * 4 + [True] * 2  # strict JSON: null, not NaN
    from layertap.train.trainer import _final_loss

    # a step of zero weight (no supervised slot) is padding, whatever its loss says
    pad = {"loss": float("nan"), "acc_per_position": [None, None]}
    learned, bad = {"step": 1, "loss": 2.5, "acc_per_position": [0.5, None]}, dict(pad, acc_per_position=[0.1, 0.0])
    assert _final_loss([learned, pad, pad]) == (2.5, " (step 1; after it, 2 step(s) had nothing to learn (zero loss "
                                                      "weight: padding, e.g. for samples the extraction skipped))")
    assert _final_loss([learned, pad, bad])[1].endswith("1 step(s) had nothing to learn (zero loss weight: padding, "
                                                        "e.g. for samples the extraction skipped) and 1 step(s) had "
                                                        "a NaN or infinite loss and made no update (see the warnings))")
    assert _final_loss([learned]) == (2.5, "")
    assert _final_loss([learned, dict(pad, loss=None)])[0] == 2.5  # as metrics.jsonl writes it now


@pytest.mark.parametrize("flag, value, message", [
    ("--max-grad-norm", "-1", "--max-grad-norm must be > 0 and finite, got -1"),  # climbed the loss, exit 0
    ("--max-grad-norm", "0", "--max-grad-norm must be > 0 and finite, got 0"),  # learned nothing
    ("--lr", "nan", "--lr must be positive and finite, got nan"),  # AdamW's ValueError traceback
    ("--lr", "inf", "--lr must be positive and finite, got inf"),  # a non-finite drafter exported
    ("--weight-decay", "-1", "--weight-decay must be >= 0 and finite, got -1"),
    ("--weight-decay", "nan", "--weight-decay must be >= 0 and finite, got nan"),
    ("--distill-temperature", "inf", "--distill-temperature must be > 0 and finite, got inf"),
    ("--gamma", "0", "--gamma must be > 0 and finite, got 0"),
])
def test_optimizer_settings_outside_their_range_are_refused_naming_the_flag(tmp_path, capsys, flag, value, message):
    assert train_cli("--data", str(tmp_path / "run"), "--out", str(tmp_path / "o"), flag, value) == 2
    assert f"error: {message}" in capsys.readouterr().err


def test_a_target_other_than_the_runs_is_refused(run, target, tmp_path, capsys):
    """Another model of the same width trained to exit 0 against the wrong embeddings and head, and
    the drafter's config named the run's model. What the run recorded of its target is compared."""
    import shutil

    other = tiny_model_dir(tmp_path / "models", "qwen3", num_layers=8)  # hidden size 64, as the run's
    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", other, "--out", out, "--steps", "1", *FAST) == 2
    err = capsys.readouterr().err
    assert f"the target {other} is not the one the run at {run} was extracted from ({target}): " in err
    assert "config.json sha256: the run's " in err and "pass --model (and --gguf-file) with the model" in err
    assert not (tmp_path / "out" / "checkpoints").exists()
    copy = str(tmp_path / "copy")  # the same model elsewhere: the same hashes
    shutil.copytree(target, copy)
    assert train_cli("--data", run, "--model", copy, "--out", out, "--steps", "1", *FAST) == 0


def test_settings_that_defeat_training_are_warned_of(run, target, tmp_path, caplog, monkeypatch):
    """Accepted in silence: a batch larger than the data (all of training one step at the peak lr),
    --epochs beside --steps (dropped), and --log-dir without tensorboard (nothing written there)."""
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    logs = tmp_path / "tb"
    with caplog.at_level("WARNING"):
        assert train_cli("--data", run, "--model", target, "--out", str(tmp_path / "o"), "--steps", "1", "--epochs",
                         "2", "--log-dir", str(logs), *FAST[2:], "--batch-size", "64") == 0
    samples = load_manifest(open_store(run)).num_samples
    assert "a step takes 64 samples (--batch-size 64 x 1 rank(s) x --grad-accum 1), more than the" in caplog.text
    assert "--steps 1 and --epochs 2: --steps decides how long training runs" in caplog.text
    assert f"tensorboard is not installed: nothing is written under --log-dir {logs}" in caplog.text
    assert samples < 64


def test_another_architecture_is_warned_of_where_no_config_hash_is_compared(run, target, tmp_path, caplog):
    """A run without a config.json hash (extracted from a GGUF) compared the tokenizer alone: a Qwen2
    of the same width and tokenizer trained beside a Llama's run, and eval decoded with it, without a
    word. The model type is compared there: a warning (a Mistral GGUF loads as llama)."""
    store = open_store(run)
    manifest = store.get("manifest.json")
    made = json.loads(manifest)
    del made["config"]["model_config_sha256"]
    store.put("manifest.json", json.dumps(made).encode())
    try:
        other = tiny_model_dir(tmp_path / "models", "llama")  # the same tokenizer and width as the run's qwen3
        with caplog.at_level("WARNING"):
            assert train_cli("--data", run, "--model", other, "--out", str(tmp_path / "o"), "--steps", "1",
                             *FAST) == 0
        assert f"the target {other} is a 'llama', and the run's target a 'qwen3': is --model the same model" in \
            caplog.text
    finally:
        store.put("manifest.json", manifest)


def test_a_resume_at_the_end_trains_nothing_and_one_past_the_steps_is_refused(run, target, tmp_path, capsys,
                                                                             monkeypatch, caplog):
    """`--resume --steps 3` on a checkpoint at step 6 printed "trained 3 steps" and exported step 6's
    weights again. Past the end it is refused; at the end nothing is trained, said so, and the
    drafter is exported only if its export is missing."""
    from layertap.train import trainer

    out = str(tmp_path / "out")
    args = ("--data", run, "--model", target, "--out", out, *FAST, "--save-every", "2")
    assert train_cli(*args, "--steps", "4") == 0
    capsys.readouterr()
    exports: list[int] = []
    real = trainer.export_drafter
    monkeypatch.setattr(trainer, "export_drafter", lambda store, model: (exports.append(1), real(store, model)))
    assert train_cli(*args, "--steps", "4", "--resume") == 0
    text = capsys.readouterr().out
    assert f"nothing to train: the latest checkpoint in {out} is at step 4, where this run ends; its drafter was " \
           "already exported" in text and "trained 4 steps" not in text
    assert exports == [] and len(metrics(out)) == 4
    assert train_cli(*args, "--steps", "3", "--resume") == 2
    err = capsys.readouterr().err
    assert f"the latest checkpoint in {out} is at step 4, past the 3 steps of --steps 3: training cannot go back" in err
    assert "Pass --steps 4 or more" in err and exports == []
    (tmp_path / "out" / "drafter" / "config.json").unlink()  # stopped between its last checkpoint and the export
    assert train_cli(*args, "--steps", "4", "--resume") == 0
    assert "its drafter was exported now" in capsys.readouterr().out and exports == [1]
    assert (tmp_path / "out" / "drafter" / "config.json").exists()
    assert not [r for r in caplog.records if "learning-rate schedule" in r.getMessage()]  # the same end
    assert train_cli(*args, "--steps", "5", "--resume") == 0  # one more: not "trained 5 steps"
    assert "trained 1 step (step 5: resumed at step 4); final loss" in capsys.readouterr().out
    # ... on a schedule laid over 5 steps, not the 4 the checkpoint's run decayed to its floor over: said
    from layertap.train.config import TrainConfig

    cfg = TrainConfig(data=run, out=out, lr=1e-2)
    (told,) = [r.getMessage() for r in caplog.records if "learning-rate schedule" in r.getMessage()]
    assert told.startswith("training now ends at step 5, where the checkpoint's run was to end at step 4")
    assert f"step 5 runs at lr {trainer.lr_at(4, 5, cfg):.2e} instead of {trainer.lr_at(4, 4, cfg):.2e}" in told


def test_a_lost_latest_json_neither_restarts_the_training_nor_prunes_its_checkpoints(run, target, tmp_path, capsys,
                                                                                    caplog):
    """With checkpoints/latest.json gone (a first save stopped before it, or deleted as its damage's
    message advised), the output read as empty: a run without --resume was not refused, trained
    from step 0, and its first save's pruning deleted the intact checkpoints. A save killed while it
    streamed a file left that file for good; a metrics line cut short blocked the resume."""
    out = tmp_path / "out"
    args = ("--data", run, "--model", target, "--out", str(out), *FAST, "--save-every", "2")
    assert train_cli(*args, "--steps", "4") == 0
    (out / "checkpoints" / "latest.json").unlink()
    leftover = out / "checkpoints" / "step-00000004" / ".optimizer.safetensors.0aa97a02.part"
    leftover.write_bytes(b"x" * 1000)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "lo')  # the kill came mid-line
    capsys.readouterr()
    assert train_cli(*args, "--steps", "6") == 2
    assert "already holds checkpoints (latest: step 4); pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    with caplog.at_level(logging.INFO):
        assert train_cli(*args, "--steps", "6", "--resume") == 0
    assert "taking the newest, step 4" in caplog.text and "resumed from" in caplog.text
    assert "removed 1 unfinished file(s) a stopped save left" in caplog.text
    assert "1 line(s) are no step record" in caplog.text
    assert not leftover.exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest.json", "step-00000004", "step-00000006"]
    assert [m["step"] for m in metrics(str(out))] == [1, 2, 3, 4, 5, 6]


def test_resume_at_an_epoch_end_takes_shards_committed_since_and_mid_epoch_says_what_to_do(run, target, tmp_path,
                                                                                          capsys, caplog):
    """A run extraction kept committing to: "num_shards: state has 10, this stream has 14", which no
    `layertap train` flag could act on, even at an epoch's end, where nothing of the next epoch was read."""
    from layertap.manifests import layout

    src, data = open_store(run), open_store(str(tmp_path / "run"))
    for o in src.list():
        data.put(o.key, src.get(o.key))
    commits = sorted(o.key for o in data.list(layout.COMMITS))
    later = {k: data.get(k) for k in commits[-4:]}
    for k in later:  # not committed yet when training starts
        data.delete(k)
    out, mid = str(tmp_path / "out"), str(tmp_path / "mid")
    assert train_cli("--data", data.uri, "--model", target, "--out", out, "--epochs", "1", *FAST) == 0
    assert train_cli("--data", data.uri, "--model", target, "--out", mid, "--steps", "3", "--save-every", "2",
                     *FAST) == 0
    first = len(metrics(out))
    for k, v in later.items():
        data.put(k, v)
    assert train_cli("--data", data.uri, "--model", target, "--out", out, "--epochs", "2", "--resume", *FAST) == 0
    assert [r["epoch"] for r in metrics(out)] == [0] * first + [1] * 10  # 40 samples, batches of 4
    assert "the run's committed shards changed since the checkpoint" in caplog.text
    capsys.readouterr()
    assert train_cli("--data", data.uri, "--model", target, "--out", mid, "--steps", "6", "--resume", *FAST) == 2
    err = capsys.readouterr().err
    assert f"cannot resume {mid} from its checkpoint at step 3: it was saved in the middle of epoch 1" in err
    assert "train from the start on all of them (another --out" in err


def test_a_resume_over_another_run_at_the_same_data_says_so_in_a_line(run, prenorm_run, target, tmp_path, capsys):
    """--data deleted and extracted anew after training began: the resume printed the stream's
    library error, seven lines of "run_id: state has ..., this stream has ..." and advice to
    "construct the stream with the saved settings" (a user walk)."""
    from layertap.train import ShardStream

    data = open_store(str(tmp_path / "run"))
    for source in (run, prenorm_run):
        for o in data.list():
            data.delete(o.key)
        src = open_store(source)
        for o in src.list():
            data.put(o.key, src.get(o.key))
        if source == run:
            first = ShardStream(data.uri).run_id
            out = str(tmp_path / "out")
            assert train_cli("--data", data.uri, "--model", target, "--out", out, "--steps", "2", "--save-every", "1",
                             *FAST) == 0
    capsys.readouterr()
    assert train_cli("--data", data.uri, "--model", target, "--out", out, "--steps", "4", "--resume", *FAST) == 2
    err = capsys.readouterr().err
    assert (f"error: cannot resume {out} from its checkpoint at step 2: it trained on run {first} at {data.uri}, "
            f"which now holds another run ({ShardStream(data.uri).run_id}, extracted since)") in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_checkpoint_keeps_each_ranks_loader_position_apart_and_one_written_before_resumes(run, target, tmp_path,
                                                                                           capsys):
    """Gathered to rank 0 and kept in state.json, the positions (in the follow epoch every shard
    each consumer took) made every rank receive all of them: ~1.5 GB at 1,000 ranks and 36,000
    shards. Each rank writes its own now; a checkpoint of the earlier layout still resumes, and one
    missing a rank's position is refused, naming it."""
    import shutil

    whole, older = tmp_path / "whole", tmp_path / "older"
    args = ("--data", run, "--model", target, "--steps", "8", "--save-every", "4", *FAST)
    assert train_cli(*args, "--out", str(whole)) == 0
    step4 = whole / "checkpoints" / "step-00000004"
    state = json.loads((step4 / "state.json").read_text())
    folder = step4 / state["loader_states"]
    assert "loader" not in state and state["loader_states"].startswith("loader/")
    assert sorted(p.name for p in folder.iterdir()) == ["rank-00000.json"]
    position = json.loads((folder / "rank-00000.json").read_text())
    assert position["rank"] == 0 and position["epoch"] == 0

    # The same output as an earlier version left it at step 4: the position inside state.json.
    shutil.copytree(whole, older)
    shutil.rmtree(older / "checkpoints" / "step-00000008")
    shutil.rmtree(older / "drafter")
    shutil.rmtree(older / "checkpoints" / "step-00000004" / "loader")
    earlier = {k: v for k, v in state.items() if k != "loader_states"}
    (older / "checkpoints" / "step-00000004" / "state.json").write_text(json.dumps({**earlier, "loader": [position]}))
    (older / "checkpoints" / "latest.json").write_text(json.dumps({"step": 4, "prefix": "checkpoints/step-00000004"}))
    assert train_cli(*args, "--out", str(older), "--resume") == 0
    a, b = metrics(str(whole)), metrics(str(older))
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["loss"] for r in b[4:]] == pytest.approx([r["loss"] for r in a[4:]], rel=1e-5)

    step8 = json.loads((whole / "checkpoints" / "step-00000008" / "state.json").read_text())["loader_states"]
    assert step8 != state["loader_states"]  # a folder a save
    (whole / "checkpoints" / "step-00000008" / step8 / "rank-00000.json").unlink()
    capsys.readouterr()
    assert train_cli(*args, "--out", str(whole), "--steps", "12", "--resume") == 2
    err = capsys.readouterr().err
    assert "lacks rank 0's loader position" in err and f"step-00000008/{step8}/rank-00000.json" in err


def test_resume_refuses_other_settings(run, target, tmp_path, capsys, caplog):
    out = str(tmp_path / "out")
    # no --model: the target folder the run's manifest records
    assert train_cli("--data", run, "--out", out, "--steps", "4", "--save-every", "2", *FAST) == 0
    assert f"target model from the run's manifest: {target}" in caplog.text
    assert re.search(r"step 1 took \d+\.\d s", caplog.text)  # the first step's time (on a GPU: the compile)
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "8", "--resume", *FAST,
                     "--seed", "3") == 2
    err = capsys.readouterr().err
    assert "seed: checkpoint 0, now 3" in err
    assert f"Resume with the checkpoint's settings, or train anew into another --out than {out}" in err


def test_resume_takes_the_same_run_however_data_is_spelled(target, tmp_path, capsys, monkeypatch):
    """--resume compared --data as typed: `run1`, `run1/` and its absolute path were three runs.
    Checkpoints record the store's own URI now, and one written before (the path as typed,
    relative here) resumes too."""
    monkeypatch.chdir(tmp_path)
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp_path / "chats.jsonl", 12), "--out", "run1",
                "--layers", "1,3", "--max-length", "64", "--shard-bytes", "20KB", "--log-dir", "logs"]) == 0
    base = ("--model", target, "--out", "out", "--save-every", "2", *FAST)
    assert train_cli("--data", "run1", *base, "--steps", "2") == 0
    state_key = "checkpoints/step-00000002/state.json"
    out = open_store("out")
    assert json.loads(out.get(state_key))["config"]["data"] == str(tmp_path / "run1")
    assert train_cli("--data", f"{tmp_path}/run1/", *base, "--steps", "4", "--resume") == 0, capsys.readouterr().err
    state_key = "checkpoints/step-00000004/state.json"
    state = json.loads(out.get(state_key))
    state["config"]["data"] = "run1/"  # as the previous version recorded it
    out.put(state_key, json.dumps(state).encode())
    assert train_cli("--data", f"file://{tmp_path}/run1", *base, "--steps", "6", "--resume") == 0, \
        capsys.readouterr().err
    assert [r["step"] for r in metrics("out")] == list(range(1, 7))
    assert train_cli("--data", "run1", *base, "--steps", "8", "--resume", "--seed", "3") == 2  # still compared
    assert "seed: checkpoint 0, now 3" in capsys.readouterr().err


def test_s3_settings_of_a_config_apply_to_s3_stores_only(run, target, tmp_path, capsys):
    """Training from S3 into a local folder with path-style addressing (Ceph, MinIO) stopped at its
    start: the "s3" settings were handed to the local store too, which takes none."""
    config = tmp_path / "s3.json"
    config.write_text(json.dumps({"s3": {"addressing_style": "path", "part_size": "8MiB"}}))
    out = str(tmp_path / "out")
    assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "2", "--config", str(config),
                     *FAST) == 0, capsys.readouterr().err
    assert [r["step"] for r in metrics(out)] == [1, 2]
    config.write_text(json.dumps({"s3": {"bogus": 1}}))  # named, though the store it would reach is local
    assert train_cli("--data", str(tmp_path / "none"), "--model", target, "--out", out, "--config",
                     str(config)) == 2
    err = capsys.readouterr().err
    assert "unknown settings ['bogus']; known: ['addressing_style'," in err and "'part_size'" in err


def test_accelerates_own_gradient_accumulation_is_refused(run, target, tmp_path, capsys, monkeypatch):
    """`accelerate launch --gradient_accumulation_steps 4` (the env var it sets) made accelerate
    divide every loss by 4 on top of layertap's own mean: a step moved a quarter as far, clipped
    at 4x --max-grad-norm, silently."""
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    assert train_cli("--data", run, "--model", target, "--out", str(tmp_path / "out"), "--steps", "1", *FAST) == 2
    assert "accelerate's gradient accumulation is set to 4" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bad_arguments_are_clear_errors(run, target, tmp_path, capsys):
    assert train_cli("--model", target, "--out", str(tmp_path / "o")) == 2
    assert "missing --data" in capsys.readouterr().err
    assert train_cli("--data", str(tmp_path / "no-run"), "--model", target, "--out", str(tmp_path / "o")) == 2
    assert "no-run" in capsys.readouterr().err
    assert train_cli("--data", run, "--model", str(tmp_path / "missing"), "--out", str(tmp_path / "o")) == 2
    assert "does not exist" in capsys.readouterr().err
    assert train_cli("--data", run, "--model", target, "--out", str(tmp_path / "o"), "--fetch-threads", "0") == 2
    assert "error: --fetch-threads must be >= 1, got 0" in capsys.readouterr().err
    # named as the flags are (a user walk: "block_size must be >= 2" after "--block-size must be >= 1" took 1,
    # "shuffle_buffer must be >= 1 sample", "drafter num_layers must be >= 1")
    for flag, value, said in (("--block-size", "1", "--block-size must be >= 2 (the anchor and at least one drafted "
                                                    "token), got 1"),
                              ("--shuffle-buffer", "0", "--shuffle-buffer must be >= 1, got 0"),
                              ("--drafter-layers", "0", "--drafter-layers must be >= 1, got 0")):
        assert train_cli("--data", run, "--model", target, "--out", str(tmp_path / "o"), flag, value) == 2
        assert f"error: {said}" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_training_output_and_a_run_never_share_a_prefix(run, target, tmp_path, capsys):
    """Inside a run (or holding one), `layertap delete` of the one deleted the other, and `status`
    showed only the run; a run planned into a training output likewise."""
    data = open_store(run)
    before = sorted(o.key for o in data.list())
    for out in (run, f"{run}/drafter1", run.rsplit("/", 1)[0]):
        assert train_cli("--data", run, "--model", target, "--out", out, "--steps", "1", *FAST) == 2
        assert "overlap" in capsys.readouterr().err
    assert sorted(o.key for o in data.list()) == before
    other = open_store(str(tmp_path / "other-run"))
    other.put("manifest.json", data.get("manifest.json"))
    assert train_cli("--data", run, "--model", target, "--out", other.uri, "--steps", "1", *FAST) == 2
    assert "holds an extraction run" in capsys.readouterr().err
    trained = str(tmp_path / "trained")
    assert train_cli("--data", run, "--model", target, "--out", trained, "--steps", "1", *FAST) == 0
    from layertap.manifests.manifest import create_or_resume
    from layertap.storage.errors import ConfigError

    with pytest.raises(ConfigError, match="holds a training output"):
        create_or_resume(open_store(trained), config=load_manifest(data).config, dataset={"name": "x"},
                         token_counts=[10, 20], bytes_per_token=100.0)
    assert not os.path.exists(os.path.join(trained, "manifest.json"))


@pytest.mark.slow
def test_two_ranks_train_together_over_gloo(run, target, tmp_path):
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "layertap", "train", "--data", run, "--model", target, "--out", out, "--steps", "12",
           "--save-every", "6", *FAST]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    store = open_store(out)
    state = json.loads(store.get("checkpoints/step-00000012/state.json"))
    # each rank's position in a file of its own, written by that rank; state.json holds none
    assert state["world_size"] == 2 and "loader" not in state
    folder = state["loader_states"]
    positions = [json.loads(store.get(f"checkpoints/step-00000012/{folder}/rank-0000{r}.json")) for r in (0, 1)]
    assert [s["rank"] for s in positions] == [0, 1]
    m = metrics(out)
    assert len(m) == 12
    # 40 samples, 2 ranks x batch 4: each step sums the tokens of 8 samples from both ranks.
    single = str(tmp_path / "single")
    assert train_cli("--data", run, "--model", target, "--out", single, "--steps", "1", *FAST) == 0
    assert m[0]["tokens"] > metrics(single)[0]["tokens"]


def test_prefetched_batches_are_not_counted_until_taken(run):
    """The trainer's Prefetcher reads ahead on a thread; its state counts only the batches the
    trainer took, so a resume from it repeats none and skips none, across an epoch boundary too."""
    from layertap.train import ShardStream, StreamConfig, StreamLoader
    from layertap.train.loader import Prefetcher

    def loader() -> StreamLoader:
        return StreamLoader(ShardStream(run, config=StreamConfig(seed=5, shuffle_buffer=8)), batch_size=4)

    whole = loader()
    with Prefetcher(whole, depth=3) as p:
        plain = [p.wait_for_batch()["sample_id"] for _ in range(16)]  # 40 samples: 10 batches per epoch
    assert sorted(sum(plain[:10], [])) == sorted(set(sum(plain[:10], []))) and plain[10] != plain[0]
    for taken in (3, 11):
        ahead = loader()
        with Prefetcher(ahead, depth=3) as p:
            got = [p.wait_for_batch()["sample_id"] for _ in range(taken)]
            deadline = time.time() + 60
            while ahead.state_dict() == p.state_dict() and time.time() < deadline:
                time.sleep(0.01)  # the thread has read past what was taken
            state = p.state_dict()
        assert ahead.state_dict() != state and state["epoch"] == taken // 10
        assert got == plain[:taken]
        resumed = loader()
        resumed.load_state_dict(state)
        with Prefetcher(resumed) as p:
            assert [p.wait_for_batch()["sample_id"] for _ in range(16 - taken)] == plain[taken:]


def test_the_prefetcher_begins_no_epoch_past_the_trainers_last(run):
    """Past the last step the thread began the next epoch: DataLoader workers started and `depth`
    batches read for nothing, from shards --delete-consumed was deleting. Given `end_epoch`, it stops
    at that epoch's start, and a batch asked for past it is an error, not a wait for good."""
    from layertap.train import ShardStream, StreamConfig, StreamLoader
    from layertap.train.loader import Prefetcher

    class Counted(StreamLoader):
        passes = 0

        def __iter__(self):
            Counted.passes += 1
            return super().__iter__()

    loader = Counted(ShardStream(run, config=StreamConfig(seed=5, shuffle_buffer=8)), batch_size=4)
    with Prefetcher(loader, depth=3, end_epoch=1) as p:
        ends = [p.wait_for_batch()["ends_epoch"] for _ in range(10)]  # 40 samples: 10 batches
        assert ends == [False] * 9 + [True] and p.state_dict()["epoch"] == 1
        with pytest.raises(RuntimeError, match="past the last epoch"):
            p.wait_for_batch()
        p._thread.join(timeout=60)
        assert not p._thread.is_alive()
    assert Counted.passes == 1


def test_a_loader_error_reaches_the_training_thread(run):
    from layertap.train import ShardStream, StreamLoader
    from layertap.train.loader import Prefetcher

    def broken(samples):
        raise ValueError("collate failed on purpose")

    with Prefetcher(StreamLoader(ShardStream(run), batch_size=4, collate_fn=broken)) as p:
        for _ in range(2):  # and again on a later call
            with pytest.raises(ValueError, match="on purpose"):
                p.wait_for_batch()


def test_the_lr_warms_up_to_its_peak_and_decays_to_the_floor_at_the_last_step():
    """The ramp ended a step early: the peak ran twice, and a one-step warmup (any run of 25 to 49
    steps) started at the full lr; the last step stayed above lr x min_lr_ratio (0.122 in 10 steps)."""
    from layertap.train.config import TrainConfig
    from layertap.train.trainer import lr_at

    cfg = TrainConfig(data="x", out="y", lr=1.0)  # warmup 4% of the steps, the floor 10% of lr
    assert [lr_at(s, 25, cfg) for s in range(2)] == pytest.approx([0.5, 1.0])
    lrs = [lr_at(s, 100, cfg) for s in range(100)]
    assert lrs[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0]) and lrs[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(lrs[4:], lrs[5:]))
    assert lr_at(9, 10, cfg) == pytest.approx(0.1) and lr_at(0, 1, cfg) == pytest.approx(1.0)
