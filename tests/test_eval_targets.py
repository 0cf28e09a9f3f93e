"""Which targets `layertap eval` decodes, and that it decodes the one the drafter was trained for:
a hybrid with cacheless layers (nemotron_h) equals greedy decoding, a model that takes only a cache
of its own (MiniMax) is refused by name, and a --model other than the drafter's target is refused.
Also `layertap train --resume` with drafter flags the checkpoint's drafter contradicts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.extract.model import load_target
from layertap.storage.store import open_store
from layertap.train.checkpoint import export_drafter
from layertap.train.drafter import DFlashDrafter, default_config
from layertap.train.speculative import TargetRunner, greedy_decode, speculative_decode
from layertap.train.target_head import load_target_head
from test_eval_hybrid import one_thread  # noqa: F401  (autouse: one torch thread)
from test_extract import write_chats
from test_train import FAST, OracleDrafter
from tiny_models import tiny_model_dir, tiny_tokenizer

PROMPTS = ["the quick brown fox", "def main(): return 42", "Speculative decoding drafts tokens"]


def tiny_target(root: Path, model_type: str, **extra) -> str:
    """A random-init 4-layer `model_type` of the tiny tokenizer's vocabulary, saved with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        **extra)
    torch.manual_seed(0)
    folder = root / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def test_a_hybrid_with_cacheless_mlp_layers_decodes_as_greedy(tmp_path):
    """nemotron_h's mlp layers ('-') get a DummyLayer in transformers' cache: nothing to roll back,
    yet eval refused the target. Mamba, mlp and attention layers: rejections at a block's start and
    in its middle, and all accepted, must each leave the output of plain greedy decoding."""
    folder = tiny_target(tmp_path, "nemotron_h", hybrid_override_pattern="M-M*", mamba_num_heads=4,
                         mamba_head_dim=32, ssm_state_size=8, n_groups=1, chunk_size=16)
    t = load_target(folder, dtype=torch.float32)
    assert "mlp" in t.model.config.layer_types
    runner = TargetRunner(t.model, [0, 3])
    assert runner.hybrid
    for text in PROMPTS:
        prompt = t.tokenizer(text)["input_ids"]
        greedy = greedy_decode(runner, prompt, 16, eos=set())
        for hits in (0, 2, 5):
            oracle = OracleDrafter(greedy + [0] * 16, len(prompt), hits, block_size=6, vocab=t.model.config.vocab_size)
            assert speculative_decode(runner, oracle, prompt, 16, eos=set()).tokens == greedy, (text, hits)
    assert runner.seconds["reforward"] > 0


def test_a_model_that_takes_only_its_own_cache_is_refused_naming_it(tmp_path, capsys):
    """MiniMax passes the rollback check (linear and full attention), then its first forward raised
    transformers' ValueError for the DynamicCache: a traceback out of `layertap eval`."""
    folder = tiny_target(tmp_path, "minimax", layer_types=["linear_attention", "full_attention"] * 2,
                         num_local_experts=2, num_experts_per_tok=1, block_size=16)
    head = load_target_head(folder)
    out = str(tmp_path / "drafter")
    export_drafter(open_store(out), DFlashDrafter(default_config(head, [0, 1], mask_token_id=3, block_size=4), head))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    assert cli(["eval", "--drafter", out, "--model", folder, "--prompts", str(prompts), "--no-baseline",
                "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "error: `layertap eval` cannot decode the target (model_type 'minimax') with a DynamicCache" in err


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, str]:
    """A tiny qwen3 target, its run, and a drafter trained on it for 2 steps (checkpoint at step 2)."""
    root = tmp_path_factory.mktemp("trained")
    target = tiny_model_dir(root / "models", "qwen3", num_layers=4)
    run, out = str(root / "run"), str(root / "drafter")
    assert cli(["extract", "--model", target, "--dataset", write_chats(root / "chats.jsonl", 12), "--out", run,
                "--layers", "1,3", "--max-length", "64", "--log-dir", str(root / "logs")]) == 0
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "2", "--save-every", "2",
                *FAST, "--log-dir", str(root / "logs")]) == 0
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    return {"target": target, "run": run, "out": out, "prompts": str(prompts), "root": str(root)}


def eval_cli(trained: dict[str, str], *args: str) -> int:
    return cli(["eval", "--drafter", trained["out"], "--prompts", trained["prompts"], "--no-baseline",
                "--max-new-tokens", "4", *args])


def test_eval_refuses_a_target_other_than_the_drafters(trained, tmp_path, capsys):
    """A llama of the qwen3 target's vocabulary and width gave a tau with no word: the drafter's
    config now records the run's target hashes, compared as training compares --model with the run's."""
    recorded = json.loads(open_store(trained["out"]).get("drafter/config.json"))["target"]
    manifest = json.loads(open_store(trained["run"]).get("manifest.json"))["config"]
    assert recorded["model_config_sha256"] == manifest["model_config_sha256"]
    assert recorded["tokenizer_sha256"] == manifest["tokenizer_sha256"]
    other = tiny_model_dir(tmp_path, "llama", num_layers=4)  # the same tokenizer, another config
    assert eval_cli(trained, "--model", other) == 2
    err = capsys.readouterr().err
    assert (f"the target {other} is not the one the drafter at {trained['out']} was trained for "
            f"({trained['target']}): config.json sha256: the drafter's {recorded['model_config_sha256']}, "
            "--model's ") in err
    assert "tokenizer sha256" not in err and "pass --model (and --gguf-file) with the model it was trained for" in err
    assert eval_cli(trained) == 0  # no --model: the recorded target, which matches


def test_a_drafter_without_target_hashes_is_checked_by_model_type_and_warned_of(trained, tmp_path, caplog):
    """A drafter exported before the hashes were recorded still loads; another model type is warned
    of, not refused (the same model may have been moved or copied since)."""
    store = open_store(str(tmp_path / "old"))
    config = json.loads(open_store(trained["out"]).get("drafter/config.json"))
    config["target"] = {k: config["target"][k] for k in ("model", "gguf_file", "model_type", "final_state")}
    store.put("drafter/config.json", json.dumps(config).encode())
    store.put("drafter/model.safetensors", open_store(trained["out"]).get("drafter/model.safetensors"))
    other = tiny_model_dir(tmp_path, "llama", num_layers=4)
    args = ["eval", "--drafter", store.uri, "--prompts", trained["prompts"], "--no-baseline", "--max-new-tokens", "4"]
    with caplog.at_level(logging.WARNING):
        assert cli([*args, "--model", other]) == 0
    assert f"the target {other} is a 'llama', but the drafter at {store.uri} was trained for a 'qwen3'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert cli(args) == 0
    assert "was trained for a" not in caplog.text


def test_a_target_with_another_chat_template_is_warned_of(trained, tmp_path, caplog):
    """The same weights and tokenizer with another chat template (a copy whose template was edited)
    rendered the prompts otherwise without a word: tau of a text the drafter may never have seen."""
    import shutil

    recorded = json.loads(open_store(trained["out"]).get("drafter/config.json"))["target"]
    assert recorded["chat_template_sha256"] == \
        json.loads(open_store(trained["run"]).get("manifest.json"))["config"]["chat_template_sha256"]
    copy = tmp_path / "copy"
    shutil.copytree(trained["target"], copy)
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "EDITED " + tiny_tokenizer().chat_template
    (copy / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        assert eval_cli(trained, "--model", str(copy)) == 0
    assert f"the chat template of {copy} is not the one the drafter at {trained['out']} was trained on" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert eval_cli(trained) == 0
    assert "the chat template of" not in caplog.text


@pytest.mark.parametrize("flag, value, key", [("--drafter-layers", "2", "num_layers"),
                                              ("--mask-token-id", "5", "mask_token_id")])
def test_resume_refuses_drafter_flags_the_checkpoint_contradicts(trained, tmp_path, capsys, flag, value, key):
    """On --resume the checkpoint's drafter config wins: these flags were silently ignored. The
    checkpoint's own value resumes (as leaving the flag out does)."""
    import shutil

    out = str(tmp_path / "out")
    shutil.copytree(trained["out"], out)
    saved = json.loads(open_store(out).get("checkpoints/step-00000002/state.json"))["drafter"][key]
    assert str(saved) != value
    args = ["train", "--data", trained["run"], "--model", trained["target"], "--out", out, "--steps", "3", "--resume",
            *FAST, "--log-dir", str(tmp_path / "logs")]
    assert cli([*args, flag, value]) == 2
    err = capsys.readouterr().err
    assert (f"cannot resume: {flag} {value}, but the checkpoint's drafter has {key} {saved}" in err
            and f"leave out {flag} (or pass {flag} {saved})" in err)
    assert cli([*args, flag, str(saved)]) == 0


def test_a_revision_alone_differing_is_warned_of_not_refused(caplog):
    """The hub's newer snapshot of the same model (a README commit) has another revision but the
    same config and tokenizer: eval refused it; now it warns. A config that differs is refused."""
    from layertap.storage.errors import InputError
    from layertap.train.speculative import check_drafter_target

    recorded = {"model": "org/m", "gguf_file": None, "model_type": "qwen3", "model_config_sha256": "c1",
                "tokenizer_sha256": "t1", "model_revision": "aaaa"}
    info = {"model": "org/m", "gguf_file": None, "model_type": "qwen3", "model_config_sha256": "c1",
            "tokenizer_sha256": "t1", "revision": "bbbb", "tokenizer_vocab_size": 100}
    with caplog.at_level(logging.WARNING):
        check_drafter_target(recorded, info, "s3://b/drafter")
    assert "another revision than the drafter at s3://b/drafter was trained for (revision: the drafter's aaaa" in caplog.text
    with pytest.raises(InputError, match="config.json sha256: the drafter's c1, --model's c2"):
        check_drafter_target(recorded, {**info, "model_config_sha256": "c2"}, "s3://b/drafter")


def test_a_rejection_before_a_cut_bonus_token_counts_in_the_acceptance_by_position(tmp_path):
    """Two hits a step, block 6: with max_new cutting only the last step's bonus token, that step's
    rejection of its third draft was verified all the same, but it read as unknown: the third
    position's acceptance came out 0/1 instead of 0/2. An EOS accepted before a rejection still
    leaves the positions past it unknown."""
    from layertap.train.speculative import _tau

    t = load_target(tiny_model_dir(tmp_path, "llama", num_layers=4), dtype=torch.float32)
    runner = TargetRunner(t.model, [1, 3])
    prompt = t.tokenizer(PROMPTS[0])["input_ids"]
    greedy = greedy_decode(runner, prompt, 40, eos=set())
    oracle = OracleDrafter(greedy + [0] * 16, len(prompt), 2, block_size=6, vocab=t.model.config.vocab_size)
    whole = speculative_decode(runner, oracle, prompt, 7, set())  # 1 + 3 + 3 tokens: both steps whole
    cut = speculative_decode(runner, oracle, prompt, 6, set())  # the second step's bonus token cut
    assert (whole.accepted, cut.accepted, cut.drafts, cut.complete) == ([3, 3], [3, 2], [2, 2], [True, True])
    assert _tau([cut], 6)[1][:3] == _tau([whole], 6)[1][:3] == [1.0, 1.0, 0.0]
    # an EOS that is a step's last accepted draft (indices 2, 5, 8, ...: 1 token of prefill, then 3 a step)
    i = next(i for i in range(2, 38, 3) if greedy[i] not in greedy[:i])
    ended = speculative_decode(runner, oracle, prompt, 40, {greedy[i]})
    assert ended.tokens == greedy[:i + 1] and ended.drafts[-1] == 2 and ended.complete[-1] is False


def test_a_target_that_refuses_sdpa_extracts_trains_and_evaluates(tmp_path, capsys):
    """Gemma 2's class refuses sdpa. Extraction defaulted to it (an error), and `train`'s target
    check built the target for it: a run extracted with --attn-implementation eager could not be
    trained at all. "auto" (the default) takes sdpa where the class supports it, else eager; an
    explicit sdpa is refused naming the flag, before anything is written."""
    folder = tiny_target(tmp_path, "gemma2", final_logit_softcapping=30.0)
    chats = write_chats(tmp_path / "chats.jsonl", 12)
    run, out = tmp_path / "run", tmp_path / "out"
    base = ["extract", "--model", folder, "--dataset", chats, "--layers", "1,2", "--max-length", "128"]
    assert cli([*base, "--out", str(tmp_path / "sdpa"), "--attn-implementation", "sdpa"]) == 2
    assert "cannot run attention implementation 'sdpa' (--attn-implementation)" in capsys.readouterr().err
    assert not (tmp_path / "sdpa").exists()
    for impl in ("flash_attention_2", "bogus"):  # flash-attn not installed here: an ImportError traceback
        assert cli([*base, "--out", str(tmp_path / impl), "--attn-implementation", impl]) == 2
        assert f"cannot run attention implementation '{impl}' (--attn-implementation)" in capsys.readouterr().err
    assert cli([*base, "--out", str(run), "--final-state", "prenorm"]) == 0
    assert cli(["train", "--data", str(run), "--model", folder, "--out", str(out), "--steps", "2", "--objective",
                "ce+kl", *FAST]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    capsys.readouterr()
    assert cli(["eval", "--drafter", str(out / "drafter"), "--model", folder, "--prompts", str(prompts),
                "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 1
