"""`layertap eval` on gated-deltanet hybrids (qwen3_5_text, qwen3_next): speculative decoding must
equal plain greedy decoding although the linear-attention layers' states cannot be cropped, and a
drafter trained on the target's own states must beat an untrained one. Tiny random-init targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.extract.model import load_target
from test_train import OracleDrafter
from tiny_models import tiny_model_dir, tiny_tokenizer
from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.speculative import TargetRunner, greedy_decode, speculative_decode
from layertap.train.target_head import TargetHead

REPO = Path(__file__).resolve().parents[1]
HYBRIDS = ["qwen3_5_text", "qwen3_next"]
LAYERS = [1, 3]  # a gated-deltanet layer and the full-attention one
PROMPTS = ["the quick brown fox", "Hello there! How are you", "def main(): return 42", "1. 2. 3.",
           "Speculative decoding drafts tokens", "you are a helpful assistant", "lazy dog", "I am fine"]


def tiny_hybrid_dir(root: Path, model_type: str) -> str:
    """A 4-layer random-init hybrid (3 gated-deltanet layers, then full attention) and its tokenizer."""
    if model_type == "qwen3_5_text":
        return tiny_model_dir(root, model_type, num_layers=4)
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    torch.manual_seed(0)
    folder = root / f"{model_type}-4L"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def one_thread():
    """Tests share few cores with other processes, where torch's spinning thread pool crawls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tmp_path_factory) -> str:
    return tiny_hybrid_dir(tmp_path_factory.mktemp("models"), request.param)


def test_speculative_decoding_equals_greedy_with_rejections_mid_block(hybrid):
    t = load_target(hybrid, dtype=torch.float32)
    assert {"linear_attention", "full_attention"} == set(t.model.config.layer_types)
    runner = TargetRunner(t.model, LAYERS)
    assert runner.hybrid
    head = TargetHead(t.model.get_input_embeddings().weight.detach(), t.model.lm_head.weight.detach(), False,
                      {"num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "intermediate_size": 128})
    drafter = DFlashDrafter(default_config(head, LAYERS, mask_token_id=len(t.tokenizer), block_size=4), head).eval()
    for text in PROMPTS:
        prompt = t.tokenizer(text)["input_ids"]
        greedy = greedy_decode(runner, prompt, 24, eos=set())
        assert len(greedy) == 24
        # 0 and 2 hits of 5 drafts: rejected at the block's start and in its middle; 5: all accepted
        for hits in (0, 2, 5):
            oracle = OracleDrafter(greedy + [0] * 16, len(prompt), hits, block_size=6, vocab=t.model.config.vocab_size)
            spec = speculative_decode(runner, oracle, prompt, 24, eos=set())
            assert spec.tokens == greedy, (text, hits)
            assert spec.accepted[:-1] == [hits + 1] * (len(spec.accepted) - 1)
        assert speculative_decode(runner, drafter, prompt, 24, eos=set()).tokens == greedy, text
    assert runner.seconds["snapshot"] > 0 and runner.seconds["reforward"] > 0


class CropOnly(TargetRunner):
    """Verifies without a snapshot, so `keep` only crops the attention layers' KV, as for an
    attention-only target: the gated-deltanet states keep the rejected drafts."""

    def verify(self, ids):
        self._verified = (self.length, list(ids), None)
        return self.step(ids)


def test_without_the_rollback_the_output_would_differ(hybrid):
    """The check above can fail: with the attention-only path's crop alone the output changes."""
    t = load_target(hybrid, dtype=torch.float32)
    runner = CropOnly(t.model, LAYERS)
    prompt = t.tokenizer(PROMPTS[0])["input_ids"]
    greedy = greedy_decode(runner, prompt, 24, eos=set())
    oracle = OracleDrafter(greedy + [0] * 16, len(prompt), 2, block_size=6, vocab=t.model.config.vocab_size)
    assert speculative_decode(runner, oracle, prompt, 24, eos=set()).tokens != greedy


def test_a_cache_that_cannot_roll_back_is_refused(tmp_path):
    """Sliding-window layers mixed with linear attention keep only the window: refused, with the kinds."""
    t = load_target(tiny_hybrid_dir(tmp_path, "qwen3_5_text"), dtype=torch.float32)
    t.model.config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    t.model.config.sliding_window = 8
    with pytest.raises(ValueError, match=r"DynamicSlidingWindowLayer.*cannot roll back"):
        TargetRunner(t.model, LAYERS)


def test_a_mamba_target_whose_block_forward_ignores_its_cache_is_refused(tmp_path):
    """transformers' Mamba-1 computes a forward of several tokens from an empty state whatever is
    cached: its cache passed the rollback check, and every output differed from greedy decoding
    ("equals plain greedy decoding: NO", exit 1, no reason)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("mamba", vocab_size=300, hidden_size=32, state_size=8, num_hidden_layers=4)
    with pytest.raises(ValueError, match=r"cannot verify drafts on a 'mamba' target: .* ignores the state cached"):
        TargetRunner(AutoModelForCausalLM.from_config(config), LAYERS)


def test_a_transformers_without_linear_attention_cache_layers_is_named(tmp_path, monkeypatch):
    """transformers 5.0 (the floor pyproject allows) has no linear-attention cache layers: an
    AttributeError came out of `layertap eval` on a hybrid."""
    from transformers import cache_utils

    t = load_target(tiny_hybrid_dir(tmp_path, "qwen3_5_text"), dtype=torch.float32)
    monkeypatch.delattr(cache_utils, "LinearAttentionAndFullAttentionLayer")
    with pytest.raises(ValueError, match=r"linear-attention cache layers \(LinearAttentionAndFullAttentionLayer\), "
                                         r"which transformers .* lacks: upgrade it"):
        TargetRunner(t.model, LAYERS)


def self_distilled_rows(target: str, path: Path, n: int, new_tokens: int) -> str:
    """Pre-tokenized chats whose answers are the target's own greedy continuations: a random target
    does not answer like any dataset, so a drafter can only learn it from what it generates."""
    t = load_target(target, dtype=torch.float32)
    runner = TargetRunner(t.model, LAYERS)
    with open(path, "w") as f:
        for i in range(n):
            prompt = list(t.tokenizer.apply_chat_template([{"role": "user", "content": f"question {i}?"}],
                                                          tokenize=True, add_generation_prompt=True)["input_ids"])
            answer = greedy_decode(runner, prompt, new_tokens, eos=set())
            mask = [0] * len(prompt) + [1] * len(answer)
            f.write(json.dumps({"input_ids": prompt + answer, "loss_mask": mask}) + "\n")
    return str(path)


@pytest.mark.slow
def test_eval_cli_on_a_trained_drafter_beats_the_untrained_one(hybrid, tmp_path, capsys):
    data = self_distilled_rows(hybrid, tmp_path / "rows.jsonl", 40, 40)
    run, out = str(tmp_path / "run"), str(tmp_path / "drafter")
    assert cli(["extract", "--model", hybrid, "--dataset", data, "--out", run, "--layers", "1,3",
                "--max-length", "128", "--log-dir", str(tmp_path / "logs")]) == 0
    assert cli(["train", "--data", run, "--model", hybrid, "--out", out, "--steps", "300", "--batch-size", "4",
                "--block-size", "4", "--max-anchors", "8", "--lr", "1e-2", "--log-dir", str(tmp_path / "logs")]) == 0
    prompts = tmp_path / "prompts.jsonl"  # held out: questions the drafter never saw answered
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {900 + i}?"}]}) + "\n"
                               for i in range(8)))
    capsys.readouterr()
    assert cli(["eval", "--drafter", out, "--model", hybrid, "--prompts", str(prompts), "--max-new-tokens", "24",
                "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["matches_greedy"] is True and r["prompts"] == 8 and 8 < r["tokens_generated"] <= 8 * 24
    assert r["tau_untrained"] < r["tau"] < 4, r  # tau counts the bonus token: 1 at worst, block_size at best
    assert 0 < r["acceptance_per_position"][0] < 1  # some drafts were rejected, so rollback ran
    assert r["rollback_s"]["reforward"] > 0 and r["speculative_s"] > 0
    assert cli(["eval", "--drafter", out, "--model", hybrid, "--prompts", str(prompts), "--limit", "1",
                "--max-new-tokens", "8", "--no-baseline"]) == 0
    text = capsys.readouterr().out
    assert "output equals plain greedy decoding: yes" in text and "hybrid target rollback:" in text
    assert text.startswith(f"drafter {out} (exported) on target {hybrid} (a hybrid: its recurrent state rolled back "
                           "after each rejected draft), cpu float32, up to 8 new tokens a prompt\n")
    assert r["target_hybrid"] is True and r["drafter"] == out and r["checkpoint_step"] is None


def test_eval_rollback_bench_runs_in_tiny_mode(tmp_path):
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "eval_rollback.py"), "--tiny", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["target"] for r in rows} == {"qwen3", "qwen3_5_text"}
    for r in rows:
        assert r["s_per_token"] > 0 and r["matches_greedy"] and 1 <= r["tau"] <= r["block_size"]
        if r["target"] == "qwen3":  # the attention-only path only crops
            assert r["rollback_fraction"] == 0
        else:  # a snapshot before every verify; a re-forward only after a rejection
            assert 0 < r["rollback_fraction"] < 1 and r["snapshot_s"] > 0
            assert (r["reforward_s"] > 0) == (r["hits"] < r["block_size"] - 1)
