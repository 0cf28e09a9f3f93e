"""`layertap extract`'s refusals and warnings on what it is given (id lists, --gguf-file, a dataset
that yields nothing, a --max-length past the model's context), and its progress count after a
stop: the real CLI on tiny random-init models, real dataset files and a real local store."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

import test_worker
from layertap.cli import main as cli
from layertap.extract.config import ExtractConfig, parse_ids, parse_shard_ids
from layertap.extract.run import prepare_target
from layertap.manifests.preemption import Interrupted
from layertap.manifests.status import run_status
from layertap.storage.errors import ConfigError
from test_extract import write_chats
from tiny_models import tiny_model_dir

worker_capture = test_worker.capture  # a fixture: the tiny model of the shard loop's tests


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "llama", num_layers=4)


def _extract(model: str, data: str, tmp_path: Path, *extra: str) -> list[str]:
    return ["extract", "--model", model, "--dataset", data, "--out", str(tmp_path / "run"),
            "--log-dir", str(tmp_path / "logs"), "--max-length", "64", *extra]


def test_a_reversed_range_is_refused_and_repeated_ids_count_once(model, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"range '3-2' is reversed"):
        parse_ids("1,3-2")
    assert parse_shard_ids("0,0") == [0] and parse_shard_ids("0-3,2-5,1") == [0, 1, 2, 3, 4, 5]
    assert parse_ids("1,1") == [1, 1]  # repeated capture layers are refused, not folded
    data = write_chats(tmp_path / "chats.jsonl", 4)
    for flag, ids in (("--layers", "1,3-2"), ("--shards", "0,3-1")):
        assert cli(_extract(model, data, tmp_path, flag, ids)) == 2
        err = capsys.readouterr().err
        assert f"{flag}: invalid id list '{ids}': range '{ids.split(',')[1]}' is reversed" in err
    assert cli(_extract(model, data, tmp_path, "--layers", "1,1")) == 2
    assert "capture layers repeat" in capsys.readouterr().err
    assert not (tmp_path / "run" / "manifest.json").exists()
    # a static assignment naming shard 0 twice answers for one shard
    assert cli(_extract(model, data, tmp_path, "--shard-bytes", "8KB", "--shards", "0,0")) == 0
    out = capsys.readouterr().out
    assert "the 1 shard(s) of --shards are done" in out
    # the report above it said "the same `layertap extract` command finishes the pending shards": it does not
    assert "nothing is running: `layertap extract` with the other tasks' --shards, or without --shards" in out
    assert "the same `layertap extract`" not in out


def test_gguf_file_without_model_is_refused_not_replaced_by_the_embedded_model(tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 2)
    args = ["extract", "--gguf-file", "mine-Q4_K_M.gguf", "--dataset", data, "--out", str(tmp_path / "run"),
            "--log-dir", str(tmp_path / "logs")]
    assert cli(args) == 2
    assert "--gguf-file 'mine-Q4_K_M.gguf' needs --model (the folder or hub id holding it)" in capsys.readouterr().err
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_a_dataset_no_row_of_which_yields_a_sample_is_refused_before_the_plan(model, tmp_path, capsys):
    """Chat content in OpenAI's content-parts form is no text: every row is skipped, as `plan`
    finds; extract must not "complete" with nothing stored and suggest training on it."""
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                                         {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]}
            for i in range(4)]
    rows.append({"id": "no-answer", "messages": [{"role": "user", "content": "hello?"}]})
    data = tmp_path / "parts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(_extract(model, str(data), tmp_path)) == 2
    captured = capsys.readouterr()
    assert "no row of the dataset yields a sample to store: all 5 rows read were skipped (bad_message: 4, " \
           "no_supervised_pair: 1)" in captured.err
    assert "layertap train" not in captured.out
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_rows_whose_answers_begin_past_max_length_are_told_to_raise_it(model, tmp_path, capsys):
    """A prompt longer than --max-length leaves no answer token in the cut: the rows were skipped as
    `no_supervised_pair` and the error blamed the dataset's shape; they have their own reason now,
    and the error says to raise --max-length."""
    rows = [{"id": f"r{i}", "messages": [{"role": "user", "content": "tell me " * 60},
                                         {"role": "assistant", "content": "a fine answer, of several words"}]}
            for i in range(3)]
    data = tmp_path / "long_prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(_extract(model, str(data), tmp_path)) == 2
    err = capsys.readouterr().err
    assert "all 3 rows read were skipped (answer_past_max_length: 3); raise --max-length: the answers of some rows " \
           "begin past it" in err and "accepted shape" not in err
    assert cli(_extract(model, str(data), tmp_path, "--max-length", "1024")) == 0  # the same rows, stored


def test_a_max_length_past_the_models_context_is_warned_about(model, tmp_path, caplog):
    """The tiny model's config says max_position_embeddings 512."""
    for max_length, warned in ((512, False), (600, True)):
        caplog.clear()
        cfg = ExtractConfig(out=str(tmp_path / "run"), model=model, max_length=max_length, dtype="float32")
        with caplog.at_level(logging.WARNING, logger="layertap.extract"):
            prepare_target(cfg)
        said = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
        assert bool(said) == warned, said
    assert said[0].startswith("--max-length 600 is above the model's max_position_embeddings 512")


def test_a_stop_takes_the_aborted_shards_records_back_from_the_progress_count(tmp_path, worker_capture):
    """A stop signal in shard 1's forwards, after some of its records were written: they are
    reported abandoned before the stop goes up, or the last progress line counts them as done."""
    run = test_worker.Run(str(tmp_path / "store"), worker_capture)
    start, written = run.start, []

    def start_then_stop(claim, counted):
        def count(rec) -> None:
            written.append(claim.shard)
            counted(rec)

        started = start(claim, count)
        if claim.shard == 1:
            deadline = time.time() + 10
            while 1 not in written and time.time() < deadline:  # a record of the shard written
                time.sleep(0.01)
            raise Interrupted("a stop signal")
        return started

    run.start = start_then_stop
    loop = run.loop(overlap=False)
    with pytest.raises(Interrupted):
        loop.run(run.queue(loop))
    assert written.count(1) > 0 and run.abandoned == [(1, written.count(1))]
    assert run_status(run.store)["shards_done"] == 1


def test_with_shards_the_progress_counts_the_tasks_samples_not_the_runs(model, tmp_path, caplog):
    """An array task's progress said '70/600 samples (12%) ... ETA' when its shards were done:
    the total and the ETA were the whole run's."""
    data = write_chats(tmp_path / "chats.jsonl", 12)
    caplog.set_level(logging.INFO)
    assert cli(_extract(model, data, tmp_path, "--shard-bytes", "8KB", "--shards", "1")) == 0
    plan = json.loads((tmp_path / "run" / "manifest.json").read_text())["shards"]
    mine, run = plan[1][1] - plan[1][0], plan[-1][1]  # [start, end, tokens] per shard
    assert len(plan) > 2 and mine < run
    [last] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("extract: ")][-1:]
    assert last.startswith(f"extract: {mine:,}/{mine:,} rows (100%)"), last


def test_a_rerun_with_another_limit_is_told_what_the_run_read(model, tmp_path, capsys):
    """The dataset's fingerprint covers --limit: a rerun with another one was refused with two
    opaque hashes, and nothing said that --limit (not the file) differed."""
    data = write_chats(tmp_path / "chats.jsonl", 8)
    assert cli(_extract(model, data, tmp_path, "--limit", "4", "--shard-bytes", "8KB", "--shards", "0")) == 0
    capsys.readouterr()
    assert cli(_extract(model, data, tmp_path, "--limit", "5")) == 2
    err = capsys.readouterr().err
    assert "dataset fingerprint: run has" in err and f"the run read {data} with --limit 4)" in err


def test_shards_a_new_run_will_not_have_are_refused_before_its_manifest_is_written(model, tmp_path, capsys):
    """`--shards 3` on a new prefix whose plan has one shard was refused after the manifest was
    written: the half-made run then refused the corrected command ('a different configuration')."""
    data = write_chats(tmp_path / "chats.jsonl", 4)
    assert cli(_extract(model, data, tmp_path, "--shards", "0,3")) == 2
    assert "--shards names 3, which the run does not have (it has shards 0-0)" in capsys.readouterr().err
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
    assert cli(_extract(model, data, tmp_path, "--max-length", "128")) == 0  # the corrected command


def test_a_log_folder_that_cannot_be_written_is_an_error_naming_it(model, tmp_path, capsys):
    """--log-dir naming a file, or the default ./layertap-logs of a job started in a read-only checkout:
    an OSError traceback, exit 1."""
    data = write_chats(tmp_path / "chats.jsonl", 2)
    (tmp_path / "afile").write_text("")
    args = _extract(model, data, tmp_path)
    args[args.index("--log-dir") + 1] = str(tmp_path / "afile")
    assert cli(args) == 2
    err = capsys.readouterr().err
    assert f"error: cannot write the log file {tmp_path / 'afile' / 'extract-rank0.log'}" in err
    assert "give --log-dir a folder this process can write" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
