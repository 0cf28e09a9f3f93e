"""Flags derived from the settings dataclasses (storage/flags.py) and the one error policy
(storage/errors.py, caught in layertap/cli.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest

from layertap.cli import build_parser, main
from layertap.extract.config import ExtractConfig
from layertap.manifests import layout
from layertap.storage.errors import ConfigError, UserError
from layertap.storage.flags import _help, flag_fields, flag_name
from layertap.train.config import TrainConfig


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("command,cls", [("extract", ExtractConfig), ("train", TrainConfig)])
def test_every_field_is_one_flag_whose_help_shows_the_fields_default(command, cls):
    parser = _subparser(command)
    by_dest: dict[str, list[argparse.Action]] = {}
    for a in parser._actions:
        by_dest.setdefault(a.dest, []).append(a)
    for f in dataclasses.fields(cls):
        if f.metadata.get("config_only"):
            assert f.name not in by_dest, f.name
            continue
        (action,) = by_dest[f.name]
        assert action.option_strings == [flag_name(f)] and action.default is None  # never overrides --config
        if f.default is not dataclasses.MISSING and f.default is not None and not isinstance(f.default, bool):
            assert "(default " in action.help, f.name
    assert set(by_dest) - {f.name for f in dataclasses.fields(cls)} == {"help", "config", "verbose"}


def test_help_renders_the_field_default():
    helps = {f.name: _help(f) for f in flag_fields(ExtractConfig)}
    assert helps["batch_tokens"].endswith("(default 16384)")
    assert helps["shard_bytes"].endswith("(default 1GB)")
    assert helps["dtype"].startswith("forward dtype (default auto: ")
    assert "default" not in helps["gguf_file"]
    assert {f.name: _help(f) for f in flag_fields(TrainConfig)}["memory_budget"].endswith("(default 4GiB)")
    # a help that says its default in its own words is not given a second one ("(default (0, 1))")
    from layertap.extract.regenerate import RegenerateConfig

    task = {f.name: _help(f) for f in flag_fields(RegenerateConfig)}["task"]
    assert task.endswith("(default 0/1)") and task.count("(default ") == 1
    out = subprocess.run([sys.executable, "-m", "layertap", "extract", "--help"], capture_output=True, text=True)
    assert "padded tokens per forward batch (default 16384)" in " ".join(out.stdout.split())


def test_config_file_keys_flags_override_and_unknown_keys_are_named(tmp_path):
    from layertap.extract.config import load_config

    path = tmp_path / "c.json"
    path.write_text(json.dumps({"out": "o", "batch_tokens": 8192, "max_length": 1024, "layers": [1, 2]}))
    parser = _subparser("extract")
    cfg = load_config(parser.parse_args(["--config", str(path), "--batch-tokens", "4096", "--shards", "0-2"]))
    assert (cfg.out, cfg.batch_tokens, cfg.max_length, cfg.layers, cfg.shards) == ("o", 4096, 1024, [1, 2], [0, 1, 2])
    path.write_text(json.dumps({"out": "o", "batch_tokenz": 1}))
    with pytest.raises(ConfigError, match=r"unknown settings \['batch_tokenz'\]"):
        load_config(parser.parse_args(["--config", str(path)]))
    # keys named as the flags are (--lease-ttl, whose field is lease_ttl_s): the help says so
    path.write_text(json.dumps({"out": "o", "lease_ttl": 30}))
    assert load_config(parser.parse_args(["--config", str(path)])).lease_ttl_s == 30
    path.write_text(json.dumps({"out": "o", "lease_ttl": 30, "lease_ttl_s": 40}))
    with pytest.raises(ConfigError, match=r"names 'lease_ttl' and 'lease_ttl_s', one setting"):
        load_config(parser.parse_args(["--config", str(path)]))


def test_a_bad_flag_is_one_error_line_naming_it_and_no_traceback(tmp_path):
    p = subprocess.run([sys.executable, "-m", "layertap", "extract", "--out", str(tmp_path / "r"),
                        "--batch-tokens", "0"], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr == "error: --batch-tokens must be positive, got 0\n"
    assert not (tmp_path / "r").exists()


def test_a_mistyped_flag_gets_its_commands_usage_and_the_flag_it_was_meant_to_be(capsys):
    """argparse reported a subcommand's unknown option at the top level: `usage: layertap [-h] ...
    COMMAND`, no word of the command's options."""
    with pytest.raises(SystemExit) as stop:
        main(["estimate", "--max-lenght", "5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "usage: layertap estimate" in err
    assert "unrecognized arguments: --max-lenght (did you mean --max-length?)" in err
    with pytest.raises(SystemExit):
        main(["status", "/tmp/nowhere", "extra"])
    assert "layertap status: error: unrecognized arguments: extra" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a subcommand's subcommand: `submit extract`'s usage, not `submit`'s
        main(["submit", "extract", "--dry-run", "--out", "r", "--nodse", "2"])
    err = capsys.readouterr().err
    assert "usage: layertap submit extract" in err and "(did you mean --nodes?)" in err


@pytest.mark.parametrize("argv,verbose", [
    (["-v", "status", "r"], True), (["status", "r", "-v"], True), (["status", "r"], False),
    (["extract", "--out", "r", "--verbose"], True),  # `accelerate launch -m layertap.extract ARGS` puts extract first
    (["-v", "submit", "extract", "--out", "r"], True), (["submit", "extract", "--out", "r", "-v"], True),
])
def test_verbose_goes_before_or_after_the_command(argv, verbose):
    """`-v` was the top level's alone: after the command it was an unrecognized argument, and
    `python -m layertap.extract` (or `accelerate launch -m layertap.train`) had no way to give it."""
    from layertap.cli import _command_in, _parse

    assert _parse(build_parser(_command_in(argv)), argv).verbose is verbose


def test_forced_shard_overlap_is_refused_with_a_window():
    """The window's bound counts on each worker finishing a shard before its next claim."""
    with pytest.raises(ConfigError, match="^--overlap-shards on cannot be used with --window"):
        ExtractConfig(out="o", overlap_shards="on", window="1GB")
    assert ExtractConfig(out="o", window="1GB").overlap_shards == "auto"  # auto: serial under a window


def test_train_config_errors_name_the_flag():
    with pytest.raises(ConfigError, match="^--grad-accum must be >= 1, got 0$"):
        TrainConfig(data="d", out="o", grad_accum=0)
    with pytest.raises(ConfigError, match="^--memory-budget: invalid size 'lots'"):
        TrainConfig(data="d", out="o", memory_budget="lots")


def test_user_errors_are_caught_once_at_the_top(monkeypatch, capsys):
    import layertap.extract.run as run

    def refuse(cfg):
        raise UserError("the thing is wrong: fix it")

    monkeypatch.setattr(run, "extract", refuse)
    assert main(["extract", "--out", "x"]) == 2
    assert capsys.readouterr().err == "error: the thing is wrong: fix it\n"


@pytest.mark.parametrize("bug", [RuntimeError("a bug"), KeyError("a bug")])
def test_a_bug_keeps_its_traceback(bug, monkeypatch):
    import layertap.extract.run as run

    def broken(cfg):
        raise bug

    monkeypatch.setattr(run, "extract", broken)
    with pytest.raises(type(bug)):
        main(["extract", "--out", "x"])


def test_a_libraries_value_error_keeps_its_traceback(monkeypatch):
    import layertap.extract.run as run

    monkeypatch.setattr(run, "extract", lambda cfg: json.loads("{"))  # raised inside json, not layertap
    with pytest.raises(json.JSONDecodeError):
        main(["extract", "--out", "x"])


def test_user_facing_errors_share_the_root():
    from layertap.manifests.manifest import ConfigMismatch, ManifestError
    from layertap.slurm.submit import SlurmError
    from layertap.storage.format import ShardError
    from layertap.storage.store import StoreError

    for cls in (StoreError, ShardError, ManifestError, ConfigMismatch, SlurmError, ConfigError):
        assert issubclass(cls, UserError), cls


def test_config_file_values_are_parsed_as_their_flags_and_type_checked(tmp_path):
    """A --config file's text is read as the flag's text ("1,3", "48", "16MB"), and a value of the
    wrong type is named there, not a TypeError (or a wrong message) deep inside."""
    from layertap.extract.config import load_config

    path, parser = tmp_path / "c.json", _subparser("extract")

    def config(**values):
        path.write_text(json.dumps({"out": "o", **values}))
        return load_config(parser.parse_args(["--config", str(path)]))

    cfg = config(layers="1,3", max_length="48", batch_tokens=256, shard_bytes="64KB", shards="0-2")
    assert (cfg.layers, cfg.max_length, cfg.shard_bytes, cfg.shards) == ([1, 3], 48, 64_000, [0, 1, 2])
    assert config(lease_ttl_s=30).lease_ttl_s == 30  # an int is a number
    for values, message in [({"max_length": "4k"}, "max_length '4k': must be an integer"),
                            ({"max_length": 4.5}, "max_length must be an integer, got 4.5"),
                            ({"layers": [1, "3"]}, "layers must be a list whose items are each an integer"),
                            ({"limit": True}, "limit must be an integer, got true"),
                            ({"s3": "fast"}, 's3 must be a JSON object, got "fast"')]:
        with pytest.raises(ConfigError, match=f"^config file '{path}': {message}"):
            config(**values)


def test_s3_options_of_a_config_file_are_named_and_sizes_parsed():
    from layertap.storage.store import open_store

    with pytest.raises(ConfigError, match=r"unknown settings \['bogus'\]; known: \['addressing_style', .*'part_size'"):
        open_store("s3://b/p", bogus=1)
    with pytest.raises(ConfigError, match="threads 'many': must be an integer"):
        open_store("s3://b/p", threads="many")
    assert open_store("s3://b/p", part_size="16MB").options.part_size == 16 * 10**6  # as --shard-bytes reads sizes
    for name in ("read_timeout_s", "connect_timeout_s"):  # botocore's refusal was reported as a bad endpoint URL
        for bad in (0, -1, float("nan"), float("inf")):
            with pytest.raises(ConfigError, match=f"^{name} must be a number of seconds above 0, got"):
                open_store("s3://b/p", **{name: bad})


def test_lease_ttl_and_retries_are_range_checked():
    """A lease is renewed every ttl/4: a TTL of 0 renews it in a tight loop and makes every lease
    stale at once; a negative one broke the heartbeat. One of 1e6 or inf was taken and named the
    lease key `.ttl1e+06`, which no reader parsed: the worker crashed at its commit and others
    took its running shard."""
    for ttl in (0, -5, 0.5, 86_401, 1e6, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="^--lease-ttl must be between 1 and 86400 seconds"):
            ExtractConfig(out="o", lease_ttl_s=ttl)
    for ttl in (1, 1.5, 12345.67, 86_400):
        key = layout.lease_key(3, 1, ExtractConfig(out="o", lease_ttl_s=ttl).lease_ttl_s)
        assert layout.parse_lease(key) == (3, 1, ttl), key
    with pytest.raises(ConfigError, match="^--retries must be 0 .* or more, got -1"):
        ExtractConfig(out="o", retries=-1)
    assert ExtractConfig(out="o", lease_ttl_s=1, retries=0).lease_ttl_s == 1


def test_a_shard_an_s3_upload_cannot_hold_is_refused_before_the_run():
    """S3 takes at most 10,000 parts: a 300 GB shard at 16 MiB parts failed at part 10,001, after
    156 GiB of it had been uploaded. A shard may store up to twice its planned bytes."""
    with pytest.raises(ConfigError, match=r"^--shard-bytes 279 GiB: .* give --shard-bytes at most 78.1 GiB .* or a "
                                          r"part_size of at least 58MiB in the \"s3\" settings of --config$"):
        ExtractConfig(out="s3://b/run", shard_bytes="300GB")
    assert ExtractConfig(out="s3://b/run", shard_bytes="300GB", s3={"part_size": "58MiB"}).shard_bytes == 300 * 10**9
    assert ExtractConfig(out="s3://b/run", shard_bytes="80GB").shard_bytes == 80 * 10**9
    assert ExtractConfig(out="local/run", shard_bytes="300GB").shard_bytes == 300 * 10**9  # a file has no parts


def test_train_counts_that_may_be_zero_must_not_be_negative():
    with pytest.raises(ConfigError, match="^--num-workers must be >= 0, got -1$"):
        TrainConfig(data="d", out="o", num_workers=-1)  # was torch's ValueError from inside the DataLoader
    with pytest.raises(ConfigError, match="^--keep-checkpoints must be >= 0, got -1$"):
        TrainConfig(data="d", out="o", keep_checkpoints=-1)
    assert TrainConfig(data="d", out="o", num_workers=0, keep_checkpoints=0).keep_checkpoints == 0  # 0: keep all
