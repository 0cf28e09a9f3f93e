"""What a new user following the README met (a hunt of 2026-12-04): a Slurm --time sbatch would
refuse passed the dry run; `--resume` on an empty --out started over without a word; training a
run whose extraction is unfinished said so only at INFO; the plain progress line of a log file
showed the previous step's loss."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from layertap.extract.console import PlainProgress
from layertap.slurm.scripts import JobOptions, slurm_seconds
from layertap.storage.errors import ConfigError
from layertap.storage.store import open_store


@pytest.mark.parametrize("time", ["12h", "12hours", "1d", "4:00:00:00", "soon", "-5", "+60", "1_000", "1- 2"])
def test_a_time_limit_slurm_would_refuse_is_refused_before_the_dry_run(tmp_path, time):
    with pytest.raises(ConfigError, match=re.escape(f"--time '{time}' is not a Slurm time limit: give minutes")):
        JobOptions(job_name="x", logs=str(tmp_path), time=time)


@pytest.mark.parametrize("time,seconds", [("30", 1800), ("30:15", 1815), ("12:00:00", 43200), ("2-12", 216000),
                                          ("2-12:30", 217800), ("2-12:30:05", 217805), ("UNLIMITED", None),
                                          ("infinite", None), ("0", None), ("-1", None), ("00", None),
                                          ("0:00", None), ("0-0", None)])
def test_every_slurm_time_form_is_taken(tmp_path, time, seconds):
    JobOptions(job_name="x", logs=str(tmp_path), time=time, grace_s=0)
    assert slurm_seconds(time) == seconds


def test_the_plain_progress_line_shows_this_steps_numbers(caplog):
    """tqdm redraws on set_postfix; the plain line, printed by update, printed the last step's."""
    caplog.set_level(logging.INFO, logger="layertap.progress")
    bar = PlainProgress(3, desc="train", unit="step", every_s=0.0)
    for loss in (9.5, 8.25, 7.125):
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        bar.update(1)
    lines = [r.getMessage() for r in caplog.records]
    assert [line.rsplit("loss=", 1)[1] for line in lines] == ["9.500", "8.250", "7.125"]
    assert not any("refresh" in line for line in lines)


def test_the_last_progress_line_of_a_run_stopped_short_gives_no_eta(caplog):
    """A train stopped by a signal at step 1 of 6 ended on "..., ETA 22 min": nothing was going on."""
    caplog.set_level(logging.INFO, logger="layertap.progress")
    bar = PlainProgress(6, desc="train", unit="step", every_s=0.0)
    bar.update(1)
    bar.close()
    going, last = [r.getMessage() for r in caplog.records]
    assert "ETA" in going and "1/6 steps (17%)" in last and "ETA" not in last


def test_resume_into_an_empty_out_warns_and_training_an_unfinished_run_warns(tmp_path, caplog):
    """Both go on (a Slurm requeue passes --resume from its first start; a partial run may be what
    was meant), but a typo in --out, or a run still extracting, must not pass unseen."""
    import fake_worker
    from layertap.cli import main as cli
    from layertap.manifests import layout
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    held = sorted(o.key for o in store.list(layout.COMMITS))[-1]
    store.delete(held)  # its extraction has not committed it yet
    caplog.set_level(logging.WARNING)
    assert cli(["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out"), "--steps", "1",
                "--batch-size", "2", "--block-size", "4", "--max-anchors", "8", "--resume"]) == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("holds no checkpoint, so training starts at step 0" in w for w in warned), warned
    assert any("planned shards are committed; streaming those" in w and "extraction is not finished" in w
               for w in warned), warned


class _Refusing(torch.utils.data.IterableDataset):
    def __iter__(self):
        from layertap.train.follow import Stalled

        raise Stalled("r0: STALLED: extraction waits for training to consume. Stopping after 10 min of it.")
        yield


def test_a_user_error_in_a_dataloader_worker_reaches_the_trainer_as_raised():
    """torch re-raised it as "Caught Stalled in DataLoader worker process 0. Original Traceback
    ...", which `layertap train` printed whole after "error:" (a review finding)."""
    from layertap.train.follow import Stalled
    from layertap.train.loader import worker_error

    with pytest.raises(Stalled) as caught:
        next(iter(torch.utils.data.DataLoader(_Refusing(), num_workers=1, batch_size=None)))
    assert str(caught.value).startswith("Caught Stalled in DataLoader worker process 0")
    clean = worker_error(caught.value)
    assert type(clean) is Stalled
    assert str(clean) == "r0: STALLED: extraction waits for training to consume. Stopping after 10 min of it."
    plain = ValueError("Caught nothing")
    assert worker_error(plain) is plain


@pytest.mark.parametrize("uri", ["s3:/bucket/run", "s3:bucket/run", "S3://bucket/run", "s3a://bucket/run"])
def test_a_mistyped_s3_uri_is_refused_not_taken_for_a_local_folder(uri, tmp_path, monkeypatch, capsys):
    """`layertap status s3:/bucket/x` said "no run at /cwd/s3:/bucket/x" (a user hunt); extract
    would have written a local folder named "s3:"."""
    from layertap.cli import main as cli

    monkeypatch.chdir(tmp_path)
    assert cli(["status", uri]) == 2
    assert f"{uri!r} is not an S3 URI: write s3://bucket/prefix" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("uri", ["", " ", "file://"])
def test_an_empty_store_location_is_refused_not_taken_for_the_current_folder(uri, tmp_path, monkeypatch, capsys):
    """`--out "$RUN"` with RUN unset opened the current folder: status read a run there, if any, and
    extract would have written its shards beside the user's files."""
    from layertap.cli import main as cli

    monkeypatch.chdir(tmp_path)
    assert cli(["status", uri]) == 2
    assert f"no store location in {uri!r}: give s3://bucket/prefix or a folder (./ for the current one)" \
        in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
