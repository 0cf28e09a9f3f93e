"""`layertap export-drafter --to speculators`: the exported drafter loads in speculators' own
`DFlashDraftModel` (the real package, 0.9.0) and gives layertap's logits on the same inputs.

The drafter is trained by the real trainer on a real tiny extraction, with an in-vocabulary mask
token (`--mask-token-id`); a drafter with a learned mask embedding is refused, and so is a target
folder without tokenizer files when no mask id is given."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.records import decode_commit
from layertap.storage.reader import ShardReader
from layertap.storage.store import open_store
from layertap.train.checkpoint import load_drafter_files
from layertap.train.drafter import DFlashDrafter
from layertap.train.export import speculators_name
from layertap.train.target_head import load_target_head
from test_extract import write_chats
from tiny_models import tiny_model_dir, tiny_tokenizer

# Not skipped when missing: CI installs it (tests/run.sh), and a missing package is a failure here.
import speculators  # noqa: E402,F401
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig  # noqa: E402
from loguru import logger  # noqa: E402

logger.remove()  # speculators logs through loguru to the stderr it saw at import, which pytest's capture closes

FAST = ["--batch-size", "4", "--block-size", "4", "--max-anchors", "8", "--lr", "1e-2"]
MASK_ID = tiny_tokenizer().convert_tokens_to_ids("<think>")  # a special token the ChatML chats never use


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


@pytest.fixture(scope="module")
def run(target, tmp_path_factory) -> str:
    tmp = tmp_path_factory.mktemp("run")
    out = str(tmp / "run")
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 16), "--out", out,
                "--layers", "1,3", "--max-length", "64", "--log-dir", str(tmp / "logs")]) == 0
    return out


@pytest.fixture(scope="module")
def trained(run, target, tmp_path_factory) -> str:
    """A drafter trained a few steps with an in-vocabulary mask token."""
    out = str(tmp_path_factory.mktemp("drafter") / "out")
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "4",
                "--mask-token-id", str(MASK_ID), *FAST]) == 0
    return out


def first_sample(run: str):
    store = open_store(run)
    commit = decode_commit(store.get(layout.commit_key(0)), "commit")
    return next(iter(ShardReader(store, commit.data_key)))


def layertap_logits(train_out: str, target: str, states: torch.Tensor, anchors: torch.Tensor,
                    tokens: torch.Tensor) -> torch.Tensor:
    config, weights = load_drafter_files(open_store(train_out))
    drafter = DFlashDrafter(config, load_target_head(target))
    drafter.load_trainable(weights, "the export")
    drafter.attention = "sdpa"
    with torch.no_grad():
        hidden = drafter(states[None].float(), anchors[None], tokens[anchors][None])
        return drafter.logits(hidden).reshape(1, -1, config.vocab_size)


def speculators_logits(dest: str, attn: str, states: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor,
                       loss_mask: torch.Tensor, monkeypatch) -> torch.Tensor:
    """speculators' own forward up to the draft logits, at our anchors (its anchor sampling is random)."""
    import speculators.models.dflash.core as core

    config = DFlashSpeculatorConfig.from_pretrained(dest)
    config.transformer_layer_config._attn_implementation = attn
    model = DFlashDraftModel.from_pretrained(dest, config=config).float().eval()
    assert not model.embed_tokens.weight.isnan().any() and not model.lm_head.weight.isnan().any()
    monkeypatch.setattr(core, "select_anchors", lambda mask, n, bs: (anchors, torch.ones(len(anchors), dtype=torch.bool)))
    t = states.shape[0]
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            states.reshape(1, t, -1).float(), tokens[None].long(), loss_mask[None].long(),
            torch.zeros(1, t, states.shape[-1]), torch.zeros(1, t, dtype=torch.long), max_anchors=len(anchors))
    return logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_exported_drafter_gives_layertap_logits_in_speculators(trained, run, target, tmp_path, attn, monkeypatch,
                                                                capsys):
    dest = str(tmp_path / "spec")
    assert cli(["export-drafter", trained, "--to", "speculators", dest]) == 0
    assert "aux_hidden_state_layer_ids [2, 4]" in capsys.readouterr().out
    config = json.loads(Path(dest, "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashDraftModel"]
    # vLLM releases that translate the key read false as `dflash_config.causal` for every layer: the
    # drafter, trained attending both ways inside a block, was served causal there
    assert config["sliding_window_non_causal"] is True
    assert config["aux_hidden_state_layer_ids"] == [2, 4]  # layertap's layers 1, 3 as HF hidden_states indices
    assert config["mask_token_id"] == MASK_ID < config["draft_vocab_size"]
    target_rope = json.loads(Path(target, "config.json").read_text())["rope_parameters"]
    assert config["transformer_layer_config"]["rope_parameters"] == {"rope_type": "default",
                                                                     "rope_theta": target_rope["rope_theta"]}
    assert config["speculators_config"]["verifier"] == {"name_or_path": os.path.realpath(target),
                                                        "architectures": ["Qwen3ForCausalLM"]}
    from safetensors import safe_open

    with safe_open(os.path.join(dest, "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith(("embed_tokens", "lm_head", "mask_embedding")) for n in names)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names

    sample = first_sample(run)
    valid = torch.nonzero(sample.loss_mask[:-4]).flatten()
    anchors = valid[torch.linspace(0, len(valid) - 1, 3).long()].unique()
    ours = layertap_logits(trained, target, sample.hidden_states, anchors, sample.input_ids)
    theirs = speculators_logits(dest, attn, sample.hidden_states, anchors, sample.input_ids, sample.loss_mask,
                                monkeypatch)
    assert ours.shape == theirs.shape == (1, len(anchors) * 4, config["draft_vocab_size"])
    diff = float((ours - theirs).abs().max())
    print(f"speculators {attn}: max |diff| {diff:.3g} over {ours.numel()} logits")
    assert diff <= 1e-5
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_a_drafter_trained_on_layers_out_of_order_is_served_in_layer_order(target, tmp_path, monkeypatch):
    """`--layers 3,1` trains fc on the states concatenated 3 then 1; vLLM (and speculators' data)
    hand them over in layer order. The export lists the ids ascending and reorders fc's input
    columns, so speculators fed the ascending states gives layertap's logits."""
    run, out, dest = str(tmp_path / "run"), str(tmp_path / "out"), str(tmp_path / "spec")
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp_path / "chats.jsonl", 8), "--out", run,
                "--layers", "3,1", "--max-length", "64", "--log-dir", str(tmp_path / "logs")]) == 0
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "4",
                "--mask-token-id", str(MASK_ID), *FAST]) == 0
    assert cli(["export-drafter", out, "--to", "speculators", dest]) == 0
    assert json.loads(Path(dest, "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 4]
    sample = first_sample(run)
    valid = torch.nonzero(sample.loss_mask[:-4]).flatten()
    anchors = valid[torch.linspace(0, len(valid) - 1, 3).long()].unique()
    ours = layertap_logits(out, target, sample.hidden_states, anchors, sample.input_ids)
    ascending = sample.hidden_states[:, [1, 0]]  # layers 1, 3
    theirs = speculators_logits(dest, "sdpa", ascending, anchors, sample.input_ids, sample.loss_mask, monkeypatch)
    assert float((ours - theirs).abs().max()) <= 1e-5


def test_the_last_decoder_layer_as_a_capture_layer_is_warned_of_at_extraction_and_export(target, tmp_path, caplog):
    """vLLM and SGLang gather a drafter's target states at the inputs of the decoder layers: the
    last layer's output (layertap's 5 of a 6-layer target, HF index 6) is never among them. The
    extraction says so before any work, the export again (it still writes the checkpoint)."""
    run, out, dest = str(tmp_path / "run"), str(tmp_path / "out"), str(tmp_path / "spec")
    chats = write_chats(tmp_path / "chats.jsonl", 8)
    with caplog.at_level("WARNING"):
        assert cli(["extract", "--model", target, "--dataset", chats, "--out", run, "--layers", "1,5",
                    "--max-length", "64", "--log-dir", str(tmp_path / "logs")]) == 0
    warned = [r.getMessage() for r in caplog.records if "last decoder layer" in r.getMessage()]
    assert len(warned) == 1 and "capture layer 5" in warned[0] and "HF hidden_states index 6" in warned[0]
    # a rerun with shards left: said once too (twice: as its model's config was checked, then as its weights loaded)
    caplog.clear()
    first = sorted(Path(run, "commits").glob("*.json"))[0]
    first.unlink()
    with caplog.at_level("WARNING"):
        assert cli(["extract", "--model", target, "--dataset", chats, "--out", run, "--layers", "1,5",
                    "--max-length", "64", "--log-dir", str(tmp_path / "logs")]) == 0
    assert len([r for r in caplog.records if "last decoder layer" in r.getMessage()]) == 1
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "2",
                "--mask-token-id", str(MASK_ID), *FAST]) == 0
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert cli(["export-drafter", out, "--to", "speculators", dest]) == 0
    assert any("capture layer 5" in r.getMessage() and "written all the same" in r.getMessage()
               for r in caplog.records)
    assert json.loads(Path(dest, "config.json").read_text())["aux_hidden_state_layer_ids"] == [2, 6]

    caplog.clear()  # the usual layers: no warning
    with caplog.at_level("WARNING"):
        assert cli(["extract", "--model", target, "--dataset", chats, "--out", str(tmp_path / "run2"), "--layers",
                    "1,4", "--max-length", "64", "--log-dir", str(tmp_path / "logs2")]) == 0
    assert not [r for r in caplog.records if "last decoder layer" in r.getMessage()]


def test_export_to_s3_writes_the_same_bytes(trained, tmp_path, s3_bucket):
    local, remote = str(tmp_path / "spec"), f"s3://{s3_bucket}/drafters/spec"
    assert cli(["export-drafter", trained, "--to", "speculators", local]) == 0
    assert cli(["export-drafter", trained, "--to", "speculators", remote]) == 0
    store = open_store(remote)
    for name in ("model.safetensors", "config.json"):
        assert store.get(name) == Path(local, name).read_bytes()


def test_a_tokenizer_that_fills_the_embedding_gets_its_spare_special_token_as_the_mask(run, target, tmp_path, capsys,
                                                                                     caplog):
    """The tiny tokenizer, like SmolLM2's, fills its embedding: len(tokenizer) was the default mask
    id, outside the vocabulary, and the drafter learned a mask embedding that export refused. Now
    the unused special token ('</think>', 4) is the mask, named in the log, and the drafter exports."""
    out = str(tmp_path / "out")
    with caplog.at_level("INFO"):
        assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "2", *FAST]) == 0
    assert any("mask token is its unused special token '</think>' (id 4)" in r.getMessage() for r in caplog.records)
    config, weights = load_drafter_files(open_store(out))
    assert config.mask_token_id == 4 and not config.learned_mask and "mask_embedding" not in weights
    assert cli(["export-drafter", out, "--to", "speculators", str(tmp_path / "spec")]) == 0
    assert json.loads((tmp_path / "spec" / "config.json").read_text())["mask_token_id"] == 4


def test_learned_mask_embedding_is_refused_naming_the_option(run, target, tmp_path, capsys, caplog):
    """The refusal points at train's warning at its start: an id asked for past the vocabulary (a
    typo too) had none, only the id train chose itself."""
    out = str(tmp_path / "out")
    vocab = load_target_head(target).vocab_size
    with caplog.at_level("WARNING"):
        assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "2", "--mask-token-id",
                    str(vocab), *FAST]) == 0
    assert f"--mask-token-id {vocab} is outside the target's vocabulary of {vocab} ids" in caplog.text
    config, weights = load_drafter_files(open_store(out))
    assert config.learned_mask and "mask_embedding" in weights  # an id past the vocabulary, asked for
    capsys.readouterr()
    assert cli(["export-drafter", out, "--to", "speculators", str(tmp_path / "spec")]) == 2
    err = capsys.readouterr().err
    assert "--mask-token-id" in err and "mask embedding" in err and not (tmp_path / "spec").exists()


def test_a_full_tokenizer_without_a_spare_token_learns_a_mask_and_is_warned_of(tmp_path, caplog):
    from layertap.train.trainer import mask_token_id
    from tiny_models import QWEN3_TEMPLATE

    tok = tiny_tokenizer(QWEN3_TEMPLATE)  # its template writes <think> and </think>: no special token is spare
    tok.save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        assert mask_token_id(str(tmp_path), None, len(tok)) == len(tok)
    assert any("has no unused special token" in r.getMessage() and "export-drafter --to speculators" in
               r.getMessage() for r in caplog.records)


def test_the_spare_special_token_has_no_role_and_is_not_in_the_chat_template():
    """SmolLM2's tokenizer fills its embedding (49,152 ids), so len(tokenizer) is no mask token
    vLLM can serve; ids 0-2 are its end of text and ChatML markers, 3-16 StarCoder's code markup."""
    from layertap.train.trainer import spare_special_token
    from tiny_models import smollm2_tokenizer

    assert spare_special_token(smollm2_tokenizer(), 49152) == (16, "<empty_output>")
    assert spare_special_token(smollm2_tokenizer(), 10) == (9, "<issue_comment>")  # inside the vocabulary only


def test_a_target_without_tokenizer_files_is_refused_not_mask_id_1(run, target, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(target, name), bare / name)
    assert cli(["train", "--data", run, "--model", str(bare), "--out", str(tmp_path / "out"), "--steps", "2",
                *FAST]) == 2
    err = capsys.readouterr().err
    assert "no usable tokenizer" in err and "--mask-token-id" in err
    # with an explicit id the tokenizer is not needed
    assert cli(["train", "--data", run, "--model", str(bare), "--out", str(tmp_path / "out2"), "--steps", "2",
                "--mask-token-id", str(MASK_ID), *FAST]) == 0


def test_every_drafter_weight_has_a_speculators_name():
    from layertap.train.drafter import DrafterConfig
    from layertap.train.target_head import TargetHead

    c = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                      vocab_size=50, capture_layers=[1, 3], mask_token_id=3)
    embed = torch.randn(50, 32)
    names = DFlashDrafter(c, TargetHead(embed, embed, True)).trainable_state()
    theirs = {speculators_name(n) for n in names}
    assert len(theirs) == len(names) == 3 + 2 * 11


def test_a_drafter_of_the_embedded_smollm2_takes_the_verifiers_config_from_its_converted_folder(caplog):
    """The target it records is SmolLM2's GGUF: the export warned that it knew no
    max_position_embeddings (and wrote 32768) while the converted folder in layertap's cache holds
    the model's config.json (8192)."""
    from types import SimpleNamespace

    from layertap.extract.embedded import smollm2_gguf
    from layertap.train.export import _verifier

    folder, gguf = smollm2_gguf()
    # recorded as its GGUF (a run extracted with --model/--gguf-file), or as the Quickstart's `embedded:`
    for target in ({"model": folder, "gguf_file": gguf}, {"model": f"embedded:{gguf}"}):
        name, config = _verifier(SimpleNamespace(target=target), None)
        # named by the converted folder, which speculators loads (the GGUF folder or `embedded:` it could not)
        assert os.path.isfile(os.path.join(name, "model.safetensors")) and config["max_position_embeddings"] == 8192
        assert config["architectures"] == ["LlamaForCausalLM"]
    assert "not a local folder" not in caplog.text and "do not load as a verifier" not in caplog.text
    # but a name no other machine has: said, with how to serve it elsewhere
    assert caplog.text.count(f"safetensors conversion in this machine's cache ({name}), not a hub id") == 2
    assert "copy that folder there and pass --verifier with its path" in caplog.text


def test_a_drafter_of_another_gguf_target_is_exported_with_a_warning_to_name_the_verifier(tmp_path, caplog):
    from types import SimpleNamespace

    from layertap.train.export import _verifier

    (tmp_path / "model.Q8_0.gguf").write_bytes(b"GGUF")
    name, config = _verifier(SimpleNamespace(target={"model": str(tmp_path), "gguf_file": "model.Q8_0.gguf"}), None)
    assert name == str(tmp_path) and config is None
    assert "GGUF file (model.Q8_0.gguf in" in caplog.text and "pass --verifier" in caplog.text


def test_a_drafter_still_training_is_exported_from_its_checkpoint(trained, target, tmp_path, caplog):
    """No drafter/ yet (a run still training): the latest checkpoint's drafter is exported (its
    AdamW moments, twice the weights in fp32, no longer read for nothing: not asserted here). A
    --verifier that is no local folder is warned of, as a recorded one is: its config was
    written with no architectures and a 32768 context without a word."""
    import shutil

    from safetensors.torch import load_file

    from layertap.train.checkpoint import load_drafter_files, load_latest

    out = tmp_path / "out"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "drafter")
    step = load_latest(open_store(str(out)), tensors=False).step
    dest = str(tmp_path / "spec")
    with caplog.at_level("WARNING"):
        assert cli(["export-drafter", str(out), "--to", "speculators", dest, "--verifier", "org/not-here"]) == 0
    assert "the verifier 'org/not-here' is not a local folder" in caplog.text
    _, weights = load_drafter_files(open_store(str(out)), step)
    exported = load_file(os.path.join(dest, "model.safetensors"))
    assert len(exported) == len(weights)


def test_export_refuses_a_dest_holding_other_files_and_replaces_an_earlier_export(trained, target, tmp_path, capsys):
    """DEST given as the target's own folder (a slip of the argument order) would lose the target's
    model.safetensors and config.json: refused, nothing written. An earlier export is replaced."""
    before = {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()}
    assert cli(["export-drafter", trained, "--to", "speculators", target]) == 2
    err = capsys.readouterr().err
    assert "holds other files" in err and "tokenizer" in err and "choose an empty folder or prefix" in err
    assert {p.name: p.read_bytes() for p in Path(target).iterdir() if p.is_file()} == before

    lone = tmp_path / "lone"  # a model folder of weights and config only: its config is no drafter's
    lone.mkdir()
    (lone / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    (lone / "model.safetensors").write_bytes(b"weights")
    assert cli(["export-drafter", trained, "--to", "speculators", str(lone)]) == 2
    assert "is not a speculators DFlash drafter's" in capsys.readouterr().err
    (lone / "config.json").unlink()
    assert cli(["export-drafter", trained, "--to", "speculators", str(lone)]) == 2
    assert "without a config.json" in capsys.readouterr().err
    assert (lone / "model.safetensors").read_bytes() == b"weights"

    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest)]) == 0
    first = (dest / "model.safetensors").read_bytes()
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--dtype", "bfloat16"]) == 0
    assert sorted(p.name for p in dest.iterdir()) == ["config.json", "model.safetensors"]
    assert len((dest / "model.safetensors").read_bytes()) < len(first)  # replaced by the bf16 export


def test_an_export_cut_short_leaves_no_loadable_pair_and_its_rerun_finishes(trained, tmp_path, monkeypatch):
    """A re-export cut short while it wrote the weights deleted the earlier config first and left
    weights alone, which the rerun then refused ("without a config.json"): the earlier export was
    lost and the same command failed. The config now says an export is under way, which no loader
    takes, and the rerun replaces."""
    import layertap.train.export as export

    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest)]) == 0

    def cut(*args, **kwargs):
        (dest / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # Ctrl-C

    with monkeypatch.context() as m:
        m.setattr(export, "write_safetensors", cut)
        assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--dtype", "bfloat16"]) == 130
    config = json.loads((dest / "config.json").read_text())
    assert config["speculators_model_type"] == export.UNDER_WAY
    with pytest.raises(Exception):  # the pair cut short is no drafter speculators loads
        DFlashDraftModel.from_pretrained(str(dest))
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest)]) == 0
    assert DFlashDraftModel.from_pretrained(str(dest)) is not None


@pytest.mark.parametrize("text, said", [('{"hidden_size": 32, "vocab_size": 50,', "cannot be read as a model config"),
                                        ('{"hidden_size": "32b"}', "hidden_size '32b', not whole numbers"),
                                        ('[1, 2]', "is not a model config")])
def test_a_verifier_config_that_is_no_model_config_is_named_not_a_traceback(trained, tmp_path, capsys, text, said):
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    (verifier / "config.json").write_text(text)
    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--verifier", str(verifier)]) == 2
    assert said in capsys.readouterr().err and not dest.exists()


def test_a_verifier_of_another_width_or_vocabulary_is_refused(trained, tmp_path, capsys):
    """--verifier was read for its architectures only: a model of another width or vocabulary was
    written into the config, which vLLM fails to load (or serves with no draft accepted)."""
    other = tiny_model_dir(tmp_path / "other", "llama", num_layers=4, hidden_size=128)
    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--verifier", other]) == 2
    err = capsys.readouterr().err
    assert f"the verifier {other} is not the model the drafter was trained for: hidden_size 128" in err
    assert not dest.exists()


def test_a_verifier_without_the_capture_layers_is_refused(trained, tmp_path, capsys):
    """A 3-layer verifier of the same width and vocabulary for a drafter trained on layers 1 and 3 of
    a 6-layer target: exported with exit 0, vLLM gathering a state the verifier does not have."""
    other = tiny_model_dir(tmp_path / "other", "qwen3", num_layers=3)
    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--verifier", other]) == 2
    err = capsys.readouterr().err
    assert f"the verifier {other} has 3 decoder layers, but the drafter was trained on the states of layers [1, 3] " \
        "(layertap's ids; [3] do not exist in it)" in err, err
    assert not dest.exists()


@pytest.mark.parametrize("where", ["missing", "no config"])
def test_a_verifier_path_that_is_no_model_folder_is_refused(trained, tmp_path, capsys, monkeypatch, where):
    """A mistyped path exported with a warning and exit 0: a config naming no architectures and a
    verifier speculators then failed to load ("Repo id must be in the form 'repo_name'"). `~` is
    read as the shell reads it (`--verifier=~/x` reaches layertap unexpanded)."""
    verifier = tmp_path / "verifier"
    if where == "no config":
        verifier.mkdir()
    dest = tmp_path / "spec"
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--verifier=~/verifier"]) == 2
    said = "no config.json in it" if where == "no config" else "no such folder"
    assert f"--verifier '{verifier}' is not a model folder on this machine ({said})" in capsys.readouterr().err
    assert not dest.exists()


def test_a_relative_verifier_folder_is_named_by_its_absolute_path(trained, target, tmp_path, monkeypatch):
    """`--verifier ./target` was written into config.json as given: a server started in another
    folder (vLLM's, speculators') looked for the verifier there, or on the hub."""
    monkeypatch.chdir(os.path.dirname(target))
    dest = tmp_path / "spec"
    assert cli(["export-drafter", trained, "--to", "speculators", str(dest), "--verifier",
                "./" + os.path.basename(target)]) == 0
    written = json.loads((dest / "config.json").read_text())
    assert written["speculators_config"]["verifier"]["name_or_path"] == os.path.abspath(target)
