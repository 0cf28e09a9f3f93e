"""Messages for a prefix given to the wrong command: `verify` of a `layertap train` output, and
`eval --drafter` of a speculators export (what `export-drafter --to speculators` wrote), each
made by the real commands on a tiny extraction."""

from __future__ import annotations

from pathlib import Path

import pytest

from layertap.cli import main as cli
from test_extract import write_chats
from tiny_models import tiny_model_dir, tiny_tokenizer

MASK_ID = tiny_tokenizer().convert_tokens_to_ids("<think>")  # in the vocabulary: the drafter exports


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, str, str]:
    """(target, run, training output): a drafter trained one step on a tiny extraction."""
    tmp = tmp_path_factory.mktemp("ux")
    target = tiny_model_dir(tmp / "models", "qwen3")
    run, out = str(tmp / "run"), str(tmp / "drafter")
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 6), "--out", run,
                "--layers", "1,3", "--max-length", "48", "--log-dir", str(tmp / "logs")]) == 0
    assert cli(["train", "--data", run, "--model", target, "--out", out, "--steps", "1", "--batch-size", "2",
                "--block-size", "4", "--max-anchors", "4", "--mask-token-id", str(MASK_ID)]) == 0
    return target, run, out


def test_verify_of_a_training_output_says_what_it_is_and_names_its_run(trained, tmp_path, capsys):
    """It said "manifest.json is missing (run `layertap extract` to start one)", though `status`
    recognizes the prefix as a training output."""
    _, run, out = trained
    capsys.readouterr()
    assert cli(["verify", out]) == 2
    err = capsys.readouterr().err
    assert f"{out} is a `layertap train` output" in err and "verify re-reads the shards of an extraction run" in err
    assert f"`layertap verify {run}` checks the run it trained on" in err and "layertap extract` to start" not in err
    assert cli(["verify", str(tmp_path / "nothing")]) == 2  # neither: the message it had
    assert "manifest.json is missing" in capsys.readouterr().err
    # train --data too, and a folder of runs names them, as `status` does
    assert cli(["train", "--data", out, "--out", str(tmp_path / "d2"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert f"{out} is a `layertap train` output" in err and f"it trained on {run}, which --data may name" in err
    assert cli(["train", "--data", str(Path(run).parent), "--out", str(tmp_path / "d3"), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "manifest.json is missing" in err and "Under it: " in err and "run/ (run)" in err


def test_eval_of_a_speculators_export_asks_for_the_training_output(trained, tmp_path, capsys):
    """It said "not a layertap drafter config (format None)"."""
    target, _, out = trained
    dest = str(tmp_path / "spec")
    assert cli(["export-drafter", out, "--to", "speculators", dest]) == 0
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n')
    capsys.readouterr()
    assert cli(["eval", "--drafter", dest, "--model", target, "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert "a speculators export (config.json with speculators_model_type 'dflash'" in err, err
    assert "`layertap eval --drafter` takes the `layertap train` output it was exported from" in err


def test_a_model_folder_without_config_is_a_clear_error_naming_its_gguf(tmp_path, capsys):
    """A GGUF's folder given without --gguf-file (an easy mistake) was a ValueError traceback from
    transformers' tokenizer backend, from extract, estimate and eval alike (`load_target`)."""
    folder = tmp_path / "gguf-only"
    folder.mkdir()
    (folder / "model.Q4.gguf").write_bytes(b"GGUF")
    chats = write_chats(tmp_path / "chats.jsonl", 2)
    for command in (["extract", "--model", str(folder), "--dataset", chats, "--out", str(tmp_path / "run")],
                    ["estimate", "--model", str(folder), "--dataset", chats, "--layers", "1"]):
        assert cli(command) == 2, command
        err = capsys.readouterr().err
        assert f"the target {str(folder)!r} has no config.json" in err and "pass --gguf-file model.Q4.gguf" in err, \
            (command, err)
    assert not (tmp_path / "run").exists()
