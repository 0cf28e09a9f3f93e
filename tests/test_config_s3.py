"""The "s3" object of a --config file: it configures S3 stores only, so one file serves a command
whose stores are S3 and local folders mixed, and a misspelt setting in it is named by every
command, even one whose stores are all local."""

from __future__ import annotations

import json

import pytest

from layertap.cli import main as cli
from layertap.manifests.manifest import create_or_resume
from layertap.storage.errors import ConfigError
from layertap.storage.local import LocalStore
from layertap.storage.store import open_configured_store, open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir

GOOD = {"s3": {"addressing_style": "path", "part_size": "8MiB"}}
BOGUS = {"s3": {"bogus": 1}}
NAMED = "unknown settings ['bogus']; known: ['addressing_style', 'checksum_mode',"


def config(tmp_path, values: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(values))
    return str(path)


def test_open_configured_store_checks_the_settings_and_gives_them_to_s3_alone(tmp_path, s3_bucket):
    local = open_configured_store(str(tmp_path / "run"), GOOD["s3"])
    assert isinstance(local, LocalStore)
    s3 = open_configured_store(f"s3://{s3_bucket}/run/", GOOD["s3"])
    assert (s3.uri, s3.options.addressing_style, s3.options.part_size) == (f"s3://{s3_bucket}/run", "path", 8 << 20)
    s3.put("k", b"v")  # path-style requests reach the server
    assert open_store(f"s3://{s3_bucket}/run").get("k") == b"v"
    for uri in (str(tmp_path / "run"), f"s3://{s3_bucket}/run"):
        with pytest.raises(ConfigError, match=r"unknown settings \['bogus'\]"):
            open_configured_store(uri, BOGUS["s3"])


def test_an_endpoint_of_the_wrong_type_is_refused_without_echoing_it(tmp_path):
    """`{"s3": {"endpoint_url": ["http://u:pw@h"]}}` was refused with the value, password and all."""
    with pytest.raises(ConfigError, match="endpoint_url must be .*, got a list$") as err:
        open_configured_store(str(tmp_path / "run"), {"endpoint_url": ["http://user:S3CRET@host:9000"]})
    assert "S3CRET" not in str(err.value)


def test_extract_into_a_local_folder_takes_the_settings_and_names_a_misspelt_one(tmp_path, capsys):
    """A bogus key was silently accepted by extract on a local --out (and refused by train)."""
    model = tiny_model_dir(tmp_path / "models", "qwen3")
    argv = ["extract", "--model", model, "--dataset", write_chats(tmp_path / "chats.jsonl", 4),
            "--out", str(tmp_path / "run"), "--layers", "1,3", "--max-length", "64", "--log-dir", str(tmp_path)]
    assert cli([*argv, "--config", config(tmp_path, BOGUS)]) == 2
    assert NAMED in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert cli([*argv, "--config", config(tmp_path, GOOD)]) == 0


def test_a_config_files_size_of_zero_or_less_is_refused_as_the_flags_is(tmp_path, capsys):
    """A number in a --config file skipped the size check: {"window": 0} was taken, and every
    worker then waited for good for room in a window of 0 bytes."""
    model = tiny_model_dir(tmp_path / "models", "qwen3")
    argv = ["extract", "--model", model, "--dataset", write_chats(tmp_path / "chats.jsonl", 4),
            "--out", str(tmp_path / "run"), "--layers", "1,3", "--max-length", "64", "--log-dir", str(tmp_path)]
    for setting, value in (("window", 0), ("window", -1), ("shard_bytes", 0)):
        assert cli([*argv, "--config", config(tmp_path, {setting: value})]) == 2
        err = capsys.readouterr().err
        assert f"invalid size {value!r}: must be positive" in err and setting.replace("_", "-") in err, err
        # the message names the flag, which was not typed: and where the value came from
        assert f"({setting!r} in config file {str(tmp_path / 'config.json')!r})" in err, err
    assert not (tmp_path / "run").exists()


def test_submit_with_local_stores_takes_the_settings_and_names_a_misspelt_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm-here"))  # a dry run needs no Slurm command
    run = {"model": "m", "codec": "bf16-zstd", "dtype": "bfloat16", "max_length": 64, "final_state": "none"}
    create_or_resume(open_store("x"), config=run, dataset={"fingerprint": "f"}, token_counts=[10] * 20,
                     bytes_per_token=10.0, shard_bytes=1000)
    train = ["submit", "train", "--dry-run", "--gpus-per-node", "2", "--data", "x", "--out", "d"]
    extract = ["submit", "extract", "--dry-run", "--nodes", "1", "--out", "fresh"]
    for argv in (train, extract):
        assert cli([*argv, "--config", config(tmp_path, GOOD)]) == 0, capsys.readouterr().err
        capsys.readouterr()
        assert cli([*argv, "--config", config(tmp_path, BOGUS)]) == 2
        assert NAMED in capsys.readouterr().err


def test_layertap_s3_variables_set_the_commands_without_a_config_file(tmp_path, capsys, monkeypatch):
    """`status`, `verify`, `inspect` and `export` take no --config: their S3 settings (a shorter read
    timeout, fewer tries against a hung store) come from LAYERTAP_S3_<SETTING>; a --config file's
    setting wins over the variable; a misspelt or mistyped variable is named."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens: refused at once
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    assert cli(["status", "s3://bucket/run"]) == 5
    assert "(tried 3 times)" in capsys.readouterr().err  # unreachable_attempts's default
    monkeypatch.setenv("LAYERTAP_S3_UNREACHABLE_ATTEMPTS", "2")
    assert cli(["status", "s3://bucket/run"]) == 5
    assert "(tried 2 times)" in capsys.readouterr().err
    configured = open_configured_store("s3://bucket/run", {"unreachable_attempts": 4, "read_timeout_s": 7})
    assert (configured.options.unreachable_attempts, configured.options.read_timeout_s) == (4, 7)
    monkeypatch.setenv("LAYERTAP_S3_READ_TIMEOUT", "10")
    assert cli(["status", "s3://bucket/run"]) == 2
    assert "the environment (LAYERTAP_S3_* variables): unknown settings ['read_timeout']" in capsys.readouterr().err
    monkeypatch.delenv("LAYERTAP_S3_READ_TIMEOUT")
    monkeypatch.setenv("LAYERTAP_S3_MAX_ATTEMPTS", "many")
    assert cli(["status", "s3://bucket/run"]) == 2
    assert "max_attempts 'many': must be an integer" in capsys.readouterr().err
