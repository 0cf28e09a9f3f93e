"""`layertap import` checks what `layertap extract` checks: a sample `layertap train` cannot learn
from (a token id outside the target's vocabulary, a NaN or infinite state, a loss mask of other
values than 0/1, no two consecutive supervised tokens) is skipped with its reason in its shard's
commit, and `--layers` the target does not have (out of range, repeated) are refused before
anything is written, in extraction's words; the last layer is warned of, as extraction does.

The files are written by layertap's own writers of each layout (the real formats, read by
speculators' and SpecForge's readers in test_interop_data.py); the target is the tiny qwen3 (6
layers, hidden size 64), as a safetensors folder and as a GGUF."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.extract.interop import import_run
from layertap.manifests import layout
from layertap.manifests.records import decode_commit
from layertap.storage.errors import ConfigError
from layertap.storage.foreign import writer
from layertap.storage.reader import ShardReader
from layertap.storage.records import Sample
from layertap.storage.store import open_store
from test_interop_data import gguf_target
from tiny_models import tiny_model_dir, tiny_tokenizer

VOCAB = len(tiny_tokenizer())
LAYERS = {"specforge": "1,3", "modelopt": "1,3", "speculators": "2,4"}  # layertap's 1,3 in each convention
STEM = {"specforge": "rows_0-2000/data_{}.ckpt", "modelopt": "s{}.pt", "speculators": "hidden_states/hs_{}.safetensors"}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


def sample(i: int, tokens: int = 24) -> Sample:
    """A sample of 2 capture layers of the tiny target, its second half supervised."""
    g = torch.Generator().manual_seed(i)
    mask = torch.zeros(tokens, dtype=torch.uint8)
    mask[tokens // 2:] = 1
    return Sample(f"s{i}", torch.randint(0, VOCAB, (tokens,), generator=g), mask,
                  torch.randn(tokens, 2, 64, generator=g).to(torch.bfloat16),
                  torch.randn(tokens, 64, generator=g).to(torch.bfloat16))


def spoiled(i: int, reason: str | None, fmt: str) -> Sample:
    """Sample i, spoiled as the reviewer's SpecForge files were (a token id 60000, a NaN, an Inf, a
    loss mask value 3, an all-zero loss mask); the Inf goes into the final state where the layout
    has one."""
    s = sample(i)
    if reason == "bad_token_id":
        s.input_ids[5] = 60000
    elif reason == "nan":
        s.hidden_states[7, 1, 3] = float("nan")
    elif reason == "inf":
        (s.hidden_states[9, 0] if fmt == "specforge" else s.final_state[9])[11] = float("inf")
    elif reason == "bad_loss_mask":
        s.loss_mask[-1] = 3
    elif reason == "no_supervised_pair":
        s.loss_mask.zero_()
    return s


SPOILED = [None, "bad_token_id", "nan", "inf", "bad_loss_mask", None, "no_supervised_pair"]
CODE = {"nan": "non_finite", "inf": "non_finite"}


def write_files(folder: Path, fmt: str, samples: list[Sample]) -> str:
    out = writer(fmt, open_store(str(folder)))
    for i, s in enumerate(samples):
        out.write(i, s)
    out.close()
    return str(folder)


def imported(uri: str) -> tuple[list[Sample], list[dict]]:
    store = open_store(uri)
    commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
    return [s for c in commits for s in ShardReader(store, c.data_key)], [s for c in commits for s in c.skipped]


@pytest.mark.parametrize("fmt, model", [("specforge", "folder"), ("specforge", "gguf"), ("speculators", "folder"),
                                        ("modelopt", "folder")])
def test_an_import_skips_samples_train_cannot_learn_from(target, tmp_path, capsys, fmt, model):
    """They were imported (exit 0) and training then hit an IndexError or NaN losses. The vocabulary
    is the target's: config.json's vocab_size, or the GGUF's token_embd rows."""
    src = write_files(tmp_path / "src", fmt, [spoiled(i, r, fmt) for i, r in enumerate(SPOILED)])
    where = [target] if model == "folder" else [gguf_target(target, tmp_path / "gguf"), "--gguf-file", "tiny.gguf"]
    back = str(tmp_path / "back")
    assert cli(["import", src, "--from", fmt, "--out", back, "--layers", LAYERS[fmt], "--model", *where]) == 0
    out = capsys.readouterr().out
    stored, skipped = imported(back)
    assert sorted(int(re.search(r"\d+$", s.sample_id)[0]) for s in stored) == [0, 5]
    assert all(bool(torch.isfinite(s.hidden_states).all()) for s in stored)
    expect = {i: CODE.get(r, r) for i, r in enumerate(SPOILED) if r}
    assert len(skipped) == len(expect)
    by_file = {next(i for i in expect if STEM[fmt].format(i) in s["detail"]): s for s in skipped}
    assert {i: s["reason"] for i, s in by_file.items()} == expect
    assert f"token id 60000 at position 5 is outside the target's vocabulary [0, {VOCAB})" in by_file[1]["detail"]
    assert "1 NaN or infinite value(s) in its hidden states, the first at token 7" in by_file[2]["detail"]
    assert (f"1 NaN or infinite value(s) in its {'hidden states' if fmt == 'specforge' else 'final state'}, the "
            "first at token 9") in by_file[3]["detail"]
    assert "loss_mask holds 3 at position 23; it must hold only 0 and 1" in by_file[4]["detail"]
    assert "no two consecutive supervised tokens (loss_mask has 0 of 24 tokens set)" in by_file[6]["detail"]
    assert "2/7 stored, 5 skipped" in out


def test_an_import_records_the_targets_folder_as_extract_does(target, tmp_path, monkeypatch):
    """The manifest kept --model as typed: `train` run from another working directory (a Slurm
    job's) found no such folder, and a resume naming it another way was refused as another model."""
    src = write_files(tmp_path / "src", "specforge", [sample(i) for i in range(3)])
    (tmp_path / "models").symlink_to(Path(target).parent)
    monkeypatch.chdir(tmp_path)
    relative = f"models/{Path(target).name}"
    assert cli(["import", src, "--from", "specforge", "--out", "back", "--layers", "1,3", "--model", relative]) == 0
    manifest = json.loads(open_store(str(tmp_path / "back")).get(layout.MANIFEST))
    assert manifest["config"]["model"] == os.path.realpath(target)
    assert cli(["import", src, "--from", "specforge", "--out", "back", "--layers", "1,3", "--model", target]) == 0


def two_layer_specforge(folder: Path) -> str:
    """SpecForge files of 2 capture layers without layertap's export note: nothing but the target
    says which layer ids are possible."""
    return write_files(folder, "specforge", [sample(i) for i in range(2)])


def test_an_import_refuses_layers_the_target_does_not_have_before_writing(target, tmp_path, capsys):
    """Extraction refuses them (extract/model.py); import took them, and the run's layer ids were
    wrong from then on. The layer count comes from config.json or the GGUF's block_count."""
    src = two_layer_specforge(tmp_path / "src")
    back = tmp_path / "back"
    for model in ([target], [gguf_target(target, tmp_path / "gguf"), "--gguf-file", "tiny.gguf"]):
        assert cli(["import", src, "--from", "specforge", "--out", str(back), "--layers", "1,9",
                    "--model", *model]) == 2
        err = capsys.readouterr().err
        assert ("--layers 1,9: capture layer 9 is out of range: the model has 6 decoder layers, ids 0..5" in err
                and f"per {model[0]}'s {'tiny.gguf' if len(model) > 1 else 'config.json'}" in err), err
        assert not back.exists()
    # repeated ids (the command line's id list may fold them into one; the planner refuses them itself)
    with pytest.raises(ConfigError, match=r"^--layers 3,3: capture layers repeat$"):  # no config.json to blame
        import_run(open_store(src), "specforge", open_store(str(back)), layers=[3, 3], model=target, codec="bf16-zstd")
    assert not back.exists()


def test_a_speculators_import_names_layers_in_both_conventions(target, tmp_path, capsys, caplog):
    """speculators' id 7 is layertap's 6, past a 6-layer target's last (5). An import that goes
    ahead says the conversion too: ids given in layertap's convention made a run off by one
    without a word (files without an export note cannot be checked)."""
    src = write_files(tmp_path / "src", "speculators", [sample(i) for i in range(2)])
    back = tmp_path / "back"
    assert cli(["import", src, "--from", "speculators", "--out", str(back), "--layers", "2,7",
                "--model", target]) == 2
    err = capsys.readouterr().err
    assert "--layers 2,7 (speculators' ids; layertap's 1,6): capture layer 6 is out of range" in err, err
    assert not back.exists()
    with caplog.at_level("INFO"):
        assert cli(["import", src, "--from", "speculators", "--out", str(back), "--layers", "2,4",
                    "--model", target]) == 0
    assert "capture layers [2, 4] (speculators' ids, as --layers names them) are layertap's [1, 3]" in caplog.text


def test_an_import_of_the_last_layer_warns_as_extraction_does(target, tmp_path, caplog):
    """The last decoder layer's output is never gathered by vLLM or SGLang for a drafter."""
    src = two_layer_specforge(tmp_path / "src")
    with caplog.at_level("WARNING"):
        assert cli(["import", src, "--from", "specforge", "--out", str(tmp_path / "a"), "--layers", "1,5",
                    "--model", target]) == 0
    assert any("capture layer 5 is the output of the target's last decoder layer" in r.getMessage()
               and "these files hold it, so for a servable drafter capture again" in r.getMessage()
               for r in caplog.records)
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert cli(["import", src, "--from", "specforge", "--out", str(tmp_path / "b"), "--layers", "1,4",
                    "--model", target]) == 0
    assert not [r for r in caplog.records if "last decoder layer" in r.getMessage()]


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
@pytest.mark.parametrize("value", [256, 0.5])
def test_a_loss_mask_value_a_byte_cannot_hold_is_refused_not_cast(target, tmp_path, fmt, value):
    """The readers cast a foreign mask to uint8 before the check: 256 and 0.5 became 0 and the
    sample was imported with that token silently left out of training."""
    src = tmp_path / "src"
    write_files(src, fmt, [sample(0), sample(1)])
    path = src / STEM[fmt].format(1)
    d = torch.load(path, weights_only=True)
    d["loss_mask"] = d["loss_mask"].to(torch.float32 if isinstance(value, float) else torch.int64)
    d["loss_mask"][20] = value
    torch.save(d, path)
    back = str(tmp_path / "back")
    assert cli(["import", str(src), "--from", fmt, "--out", back, "--layers", LAYERS[fmt], "--model", target]) == 0
    stored, skipped = imported(back)
    assert len(stored) == 1 and stored[0].sample_id.endswith("0") and len(skipped) == 1
    assert skipped[0]["reason"] == "bad_loss_mask"
    assert f"loss_mask holds {value} at position 20; it must hold only 0 and 1" in skipped[0]["detail"]


def test_an_import_of_the_packaged_smollm2_records_it_as_extract_does():
    """An export of a Quickstart run names its target `embedded:<gguf>`; `import` resolved that to the
    package's folder and recorded this machine's site-packages path, a name no other machine has."""
    from layertap.extract.embedded import embedded_id, smollm2_gguf

    folder, gguf = smollm2_gguf()
    assert embedded_id(folder, gguf) == f"embedded:{gguf}"
    assert embedded_id(folder + "/", gguf) == f"embedded:{gguf}"  # the same folder named otherwise
    assert embedded_id(folder, None) is None and embedded_id("/tmp", gguf) is None
