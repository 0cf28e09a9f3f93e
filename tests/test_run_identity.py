"""A rerun resumes a run only if it would compute the same states: the model's contents, not only its
name (the commit a hub id resolves to, a local folder's config.json), and what decides the tokens
(the tokenizer's vocabulary, the chat template) are part of the run's identity. Runs recorded
without these facts (earlier layertap versions) still resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest

from layertap.cli import main as cli
from tiny_models import tiny_model_dir

OLD_COMMIT, NEW_COMMIT = "1" * 40, "2" * 40
HASHES = ("model_config_sha256", "tokenizer_sha256", "chat_template_sha256")


def write_chats(path: Path, n: int = 12) -> str:
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"question {i}?"},
                    {"role": "assistant", "content": " ".join(["the quick brown fox"] * (1 + i % 4))}]
            f.write(json.dumps({"id": f"chat-{i}", "messages": msgs}) + "\n")
    return str(path)


def extract_args(model: str, tmp_path: Path, *more: str) -> list[str]:
    """A run of several shards of a few samples each."""
    return ["extract", "--model", model, "--dataset", write_chats(tmp_path / "chats.jsonl"), "--out",
            str(tmp_path / "run"), "--layers", "1", "--max-length", "32", "--batch-tokens", "64", "--shard-bytes",
            "8KB", "--log-dir", str(tmp_path / "logs"), *more]


def recorded(tmp_path: Path) -> dict:
    return json.loads((tmp_path / "run" / "manifest.json").read_text())["config"]


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> tuple[str, str]:
    """Two checkpoints of one architecture and tokenizer: only their weights differ."""
    root = tmp_path_factory.mktemp("models")
    return tuple(tiny_model_dir(root / str(seed), "llama", num_layers=4, seed=seed) for seed in (0, 1))


@pytest.fixture
def hub_repo(tiny_models, tmp_path, monkeypatch) -> Path:
    """`tiny/llama` in an offline HF cache with two snapshots, `main` at OLD_COMMIT; write a commit
    to the returned refs/main file to move it (as a download of a newer commit would)."""
    cache = tmp_path / "hf" / "hub"
    repo = cache / "models--tiny--llama"
    for commit, model in zip((OLD_COMMIT, NEW_COMMIT), tiny_models):
        shutil.copytree(model, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(OLD_COMMIT)
    # huggingface_hub reads these settings once, at import: set its copies too
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return repo / "refs" / "main"


def test_a_hub_id_whose_main_moved_is_refused(hub_repo, tmp_path, capsys):
    """The hub id names no fixed weights: the run records the commit it resolved to, and a rerun
    after `main` moved would compute the remaining shards with another model."""
    args = extract_args("tiny/llama", tmp_path)
    assert cli([*args, "--shards", "0"]) == 0
    assert recorded(tmp_path)["model_revision"] == OLD_COMMIT
    capsys.readouterr()

    hub_repo.write_text(NEW_COMMIT)
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"model_revision: run has '{OLD_COMMIT}', now '{NEW_COMMIT}'" in err
    assert "use the run's settings to resume it" in err

    hub_repo.write_text(OLD_COMMIT)  # the run's model again: it resumes
    assert cli(args) == 0
    assert "COMPLETE" in capsys.readouterr().out


def _edit_template(folder: Path) -> None:
    template = folder / "chat_template.jinja"
    text = template.read_text()
    template.write_text(text.replace("m['role'] +", "m['role'] + ' says' +", 1))
    assert template.read_text() != text


def _add_token(folder: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.add_tokens(["<|tool|>"], special_tokens=True)
    tok.save_pretrained(folder)


def _edit_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["rms_norm_eps"] = config["rms_norm_eps"] * 10
    (folder / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, key", [(_edit_template, "chat_template_sha256"), (_add_token, "tokenizer_sha256"),
                                       (_edit_config, "model_config_sha256")])
def test_a_model_folder_edited_in_place_is_refused(tiny_models, tmp_path, capsys, edit, key):
    """Same folder, other contents: the shards left would be rendered, tokenized or computed
    differently from those done. The refusal names what changed."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_models[0], folder)
    args = extract_args(str(folder), tmp_path)
    assert cli([*args, "--shards", "0"]) == 0
    before = recorded(tmp_path)
    assert before["model_revision"] is None and all(isinstance(before[k], str) for k in HASHES)
    capsys.readouterr()

    edit(folder)
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"{key}: run has {before[key]!r}, now '" in err
    assert [k for k in HASHES if f"{k}:" in err] == [key]  # each edit changes its own hash only


def test_a_run_recorded_without_these_facts_still_resumes(hub_repo, tmp_path, capsys):
    """A run made before layertap recorded the hashes, or that lost a hub id's revision, has
    nothing to compare them with: it resumes rather than being refused for good."""
    args = extract_args("tiny/llama", tmp_path)
    assert cli([*args, "--shards", "0"]) == 0
    manifest_file = tmp_path / "run" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    for key in HASHES:
        del manifest["config"][key]
    manifest["config"]["model_revision"] = None
    manifest_file.write_text(json.dumps(manifest, indent=1))
    capsys.readouterr()

    assert cli(args) == 0
    assert "COMPLETE" in capsys.readouterr().out
    assert recorded(tmp_path) == manifest["config"]  # the run keeps its own record
