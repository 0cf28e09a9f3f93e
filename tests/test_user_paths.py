"""What a user meets around a run: a rerun with nothing to do, Ctrl-C, a model named another way,
the forward dtype chosen for the device, the console's output. Real tiny models, real processes."""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from layertap.cli import main as cli
from layertap.extract.config import cpu_has_native_bf16, resolve_dtype
from layertap.manifests import layout
from layertap.manifests.records import decode_commit, decode_failure
from layertap.storage.reader import ShardReader
from layertap.storage.store import open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "llama")


@pytest.fixture
def model(tiny_llama, tmp_path) -> Path:
    """A copy of the tiny model this test may change (delete its weights, link to it)."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "tiny" / "model"))


def extract_args(model, data, out, logs, *more: str) -> list[str]:
    return ["extract", "--model", str(model), "--dataset", str(data), "--out", str(out), "--layers", "1,3",
            "--max-length", "32", "--shard-bytes", "20KB", "--log-dir", str(logs), *more]


def committed_ids(store) -> Counter:
    return Counter(i for o in store.list(layout.COMMITS) for i in decode_commit(store.get(o.key), o.key).sample_ids)


# -- no work, no model -------------------------------------------------------------------------


def test_a_rerun_with_nothing_to_do_never_loads_the_weights(model, tmp_path, capsys):
    """The weights file is deleted after the first run: the reruns that have nothing to do still
    answer (from the manifest, the model's config and tokenizer, one scan of the commits), a
    changed configuration is still refused, and only a rerun with work needs the weights."""
    data = write_chats(tmp_path / "chats.jsonl", 10)
    out, logs = tmp_path / "run", tmp_path / "logs"
    assert cli(extract_args(model, data, out, logs, "--shards", "0")) == 0  # plans the run, does shard 0
    store = open_store(str(out))
    assert len(json.loads(store.get("manifest.json"))["shards"]) >= 2
    (model / "model.safetensors").unlink()
    before = sorted(o.key for o in store.list())
    capsys.readouterr()

    assert cli(extract_args(model, data, out, logs, "--shards", "0")) == 0
    assert "the 1 shard(s) of --shards are done" in capsys.readouterr().out
    log = (logs / "extract-rank0.log").read_text()
    assert "nothing to do: each of the 1 shard(s) of --shards is committed" in log
    assert log.count("forward dtype") == 1  # the weights were loaded once: by the first run
    assert sorted(o.key for o in store.list()) == before

    changed = extract_args(model, data, out, logs, "--shards", "0", "--max-length", "40")
    assert cli(changed) == 2
    assert "max_length: run has 32, now 40" in capsys.readouterr().err

    assert cli(extract_args(model, data, out, logs)) == 2  # the other shards are work: it needs the weights
    assert "could not load target model" in capsys.readouterr().err


def test_training_a_run_without_commits_fails_before_the_target_loads(model, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 6)
    run = tmp_path / "run"
    assert cli(["plan", "--model", str(model), "--dataset", str(data), "--out", str(run), "--layers", "1,3",
                "--max-length", "32"]) == 0  # a manifest, no shard yet
    (model / "model.safetensors").unlink()  # loading the target head would fail on this
    capsys.readouterr()
    for target in (["--model", str(model)], []):  # given, or the one the manifest records
        assert cli(["train", "--data", str(run), *target, "--out", str(tmp_path / "drafter"), "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert f"no committed shards with samples at {run}" in err and "could not load" not in err
        assert not (tmp_path / "drafter").exists()  # refused under --out's lease: the lease/ folder stayed


def test_training_from_no_run_leaves_its_out_untouched(tmp_path, capsys):
    """A wrong --data was refused after --out's lease was taken: the refused command left
    `--out/lease/` behind."""
    out = tmp_path / "drafter"
    assert cli(["train", "--data", str(tmp_path / "no-run-here"), "--out", str(out), "--steps", "2"]) == 2
    assert "no run at" in capsys.readouterr().err and not out.exists()


# -- Ctrl-C ------------------------------------------------------------------------------------


def test_a_stop_that_found_no_shard_open_does_not_say_one_was_released(capsys, monkeypatch):
    """A Ctrl-C during a shard's last forward waits for it, and the shard commits: the run may be
    complete, yet the message said a shard in progress was released and told to resume."""
    from layertap.extract.run import AtStop, _stopped
    from layertap.manifests.preemption import Interrupted

    monkeypatch.setattr(sys, "argv", ["layertap", "extract", "--out", "run1"])
    _stopped(Interrupted("Ctrl-C (SIGINT)"), 0, AtStop())
    err = capsys.readouterr().err
    assert "no shard was in progress here; run the same command again to go on from where the run is (it does " \
           "nothing if the run is complete):\n  layertap extract --out run1" in err and "released" not in err
    # on a CPU a shard is often one forward: the one under way ended and committed; that was said as none open
    _stopped(Interrupted("Ctrl-C (SIGINT)"), 0, AtStop(finished=[4]))
    err = capsys.readouterr().err
    assert "interrupted: committed shards are kept, shard(s) 4 in their last forward when it came finished and " \
           "committed; run the same command again to go on" in err and "no shard was in progress" not in err


@pytest.mark.slow
def test_ctrl_c_releases_the_shard_as_interrupted_and_says_how_to_resume(model, tmp_path):
    data = write_chats(tmp_path / "chats.jsonl", 60)
    out = tmp_path / "run"
    # one forward per sample, ~15 samples per shard: a shard is open long enough to be interrupted
    argv = extract_args(model, data, out, tmp_path / "logs", "--max-length", "48", "--batch-tokens", "48",
                        "--shard-bytes", "150KB")
    cmd = [sys.executable, "-m", "layertap", *argv]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # as at a terminal: SIGINT not ignored, whatever the shell that started the tests did with it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    store = open_store(str(out))
    deadline = time.time() + 300
    # shard 0 committed and shard 1 being written: the signal lands inside a claim
    while not (store.exists(layout.commit_key(0)) and store.list_pending_uploads(f"{layout.SHARDS}000001")) \
            and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted: committed shards are kept, shard(s) 1 in progress released; run the same command " \
           "again to resume:\n  layertap extract --model " in err

    failures = [decode_failure(store.get(o.key), o.key) for o in store.list(layout.FAILURES)]
    assert [f.shard for f in failures] == [1]
    for f in failures:
        assert f.preempted and (f.error_type, f.error) == ("Interrupted", "Ctrl-C (SIGINT)")
    assert not list(store.list(layout.LEASES)) and store.list_pending_uploads() == []
    # `status` tells an interrupted shard from a failed one: not a failure (exit 3, not 4)
    status = subprocess.run([sys.executable, "-m", "layertap", "status", str(out)], capture_output=True,
                            text=True, env=env, timeout=120)
    assert status.returncode == 3, status.stdout + status.stderr
    assert "0 failed" in status.stdout and "1 interrupted" in status.stdout and "FAILED" not in status.stdout
    assert "INTERRUPTED shard 1" in status.stdout

    assert subprocess.run(cmd, capture_output=True, env=env, timeout=600).returncode == 0
    ids = committed_ids(store)
    assert len(ids) == 60 and set(ids.values()) == {1}


# -- the same model, named another way ----------------------------------------------------------


def test_a_model_folder_named_another_way_resumes_the_run(model, tmp_path, monkeypatch, capsys):
    """Relative in one working directory, absolute or through a symlink in another (a Slurm job's):
    the same folder, the same run. A copy of it elsewhere is another model."""
    write_chats(tmp_path / "chats.jsonl", 10)
    monkeypatch.chdir(tmp_path)
    assert cli(extract_args("tiny/model", "chats.jsonl", "run", "logs", "--shards", "0")) == 0
    manifest = json.loads(open_store(str(tmp_path / "run")).get("manifest.json"))
    assert manifest["config"]["model"] == str(model.resolve())  # stored resolved: readable from anywhere
    assert manifest["dataset"]["path"] == str((tmp_path / "chats.jsonl").resolve())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(model, elsewhere / "link")
    monkeypatch.chdir(elsewhere)
    assert cli(extract_args("link", tmp_path / "chats.jsonl", tmp_path / "run", "logs", "--shards", "1")) == 0
    assert cli(extract_args(model, tmp_path / "chats.jsonl", tmp_path / "run", "logs")) == 0
    assert "COMPLETE" in capsys.readouterr().out

    copy = shutil.copytree(model, tmp_path / "copy")
    assert cli(extract_args(copy, tmp_path / "chats.jsonl", tmp_path / "run", "logs")) == 2
    assert f"model: run has '{model.resolve()}', now '{Path(copy).resolve()}'" in capsys.readouterr().err


def test_the_embedded_model_named_by_its_folder_is_the_default_runs_model(tmp_path, capsys):
    """A run made without --model records `embedded:<gguf>`; the same model named by its folder and
    file was another identity, and the run refused it ('model: run has embedded:..., now ...')."""
    from layertap.extract.embedded import smollm2_gguf

    folder, name = smollm2_gguf()
    data, out = write_chats(tmp_path / "chats.jsonl", 6), str(tmp_path / "run")
    assert cli(["plan", "--dataset", data, "--out", out, "--max-length", "64"]) == 0
    assert json.loads(open_store(out).get("manifest.json"))["config"]["model"] == f"embedded:{name}"
    capsys.readouterr()
    assert cli(["plan", "--model", folder, "--gguf-file", name, "--dataset", data, "--out", out, "--max-length", "64",
                "--dry-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["existing_run"]


def test_a_run_that_recorded_a_relative_model_path_resumes_from_its_directory(model, tmp_path, monkeypatch, capsys):
    """Runs made before paths were resolved recorded the string typed: from the same working
    directory, under either spelling, they still resume; from another, the relative one is gone."""
    write_chats(tmp_path / "chats.jsonl", 10)
    monkeypatch.chdir(tmp_path)
    assert cli(extract_args("tiny/model", "chats.jsonl", "run", "logs")) == 0
    path = tmp_path / "run" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["config"].update(model="tiny/model", tokenizer="tiny/model")  # as an older layertap wrote it
    path.write_text(json.dumps(manifest))
    capsys.readouterr()
    for spelling in ("tiny/model", str(model), "./tiny/model"):
        assert cli(extract_args(spelling, "chats.jsonl", "run", "logs")) == 0, capsys.readouterr().err
    monkeypatch.chdir(tmp_path / "tiny")
    assert cli(extract_args("model", tmp_path / "chats.jsonl", tmp_path / "run", "logs")) == 2
    assert "model: run has 'tiny/model', now " in capsys.readouterr().err


# -- the forward dtype --------------------------------------------------------------------------


def test_dtype_auto_is_bf16_on_cuda_and_float32_on_cpus_without_native_bf16():
    assert resolve_dtype("auto", "cuda:0")[0] == "bfloat16"
    assert resolve_dtype("float32", "cuda")[0] == "float32" and resolve_dtype("bfloat16", "cpu")[0] == "bfloat16"
    native = cpu_has_native_bf16()
    assert resolve_dtype("auto", "cpu")[0] == ("bfloat16" if native else "float32")
    if os.path.exists("/proc/cpuinfo") and os.uname().machine == "x86_64":  # torch's probe and the kernel agree
        flags = {w for line in open("/proc/cpuinfo") if line.startswith("flags") for w in line.split()}
        assert native == bool(flags & {"avx512_bf16", "amx_bf16"})


def test_a_run_records_the_dtype_asked_for_and_each_shard_the_one_computed_in(model, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 8)
    out, logs = tmp_path / "run", tmp_path / "logs"
    assert cli(extract_args(model, data, out, logs)) == 0  # the default: auto
    store = open_store(str(out))
    assert json.loads(store.get("manifest.json"))["config"]["dtype"] == "auto"
    chosen, why = resolve_dtype("auto", "cpu")
    assert f"forward dtype {chosen} ({why}); states are stored as bf16" in (logs / "extract-rank0.log").read_text()
    for o in store.list(layout.COMMITS):
        meta = ShardReader(store, decode_commit(store.get(o.key), o.key).data_key).meta
        assert meta.extra["forward_dtype"] == chosen

    # A run that pinned a dtype keeps it: the default follows it, the other one is refused.
    pinned, other = ("float32", "bfloat16") if chosen == "bfloat16" else ("bfloat16", "float32")
    out2 = tmp_path / "run2"
    assert cli(extract_args(model, data, out2, logs, "--dtype", pinned, "--shards", "0")) == 0
    assert cli(extract_args(model, data, out2, logs)) == 0
    log = (logs / "extract-rank0.log").read_text()
    assert f"forward dtype {pinned}: the run at {out2} was made with --dtype {pinned}" in log
    assert f"forward dtype {pinned} (--dtype)" in log.rsplit("rank 0/1: run", 1)[1]
    capsys.readouterr()
    assert cli(extract_args(model, data, out2, logs, "--dtype", other)) == 2
    assert f"dtype: run has '{pinned}', now '{other}'" in capsys.readouterr().err
    # ... and an "auto" run takes a worker's explicit choice: each worker picks for its device anyway
    assert cli(extract_args(model, data, out, logs, "--dtype", other)) == 0


def test_a_run_planned_by_another_job_meanwhile_is_taken_in_its_own_terms(model, tmp_path, monkeypatch):
    """Two jobs start on one new prefix: this one (--dtype auto) finds no run, tokenizes, and loses
    the manifest's create to the other (--dtype pinned). It compared its own settings with the
    winner's raw: "dtype: run has 'float32', now 'auto'", an error, where a rerun adopts the run's
    dtype. It now compares as a resume does, and loads the model again in the run's dtype."""
    import dataclasses

    import layertap.extract.run as run

    data = write_chats(tmp_path / "chats.jsonl", 8)
    out, logs = tmp_path / "run", tmp_path / "logs"
    chosen, _ = resolve_dtype("auto", "cpu")
    pinned = "float32" if chosen == "bfloat16" else "bfloat16"
    planning = run.write_plan

    def the_other_job_first(store, cfg, identity, fingerprint, counts, existing=None):
        if counts is not None and not store.exists(layout.MANIFEST):
            planning(store, cfg, dataclasses.replace(identity, dtype=pinned), fingerprint, counts)
        return planning(store, cfg, identity, fingerprint, counts, existing)

    monkeypatch.setattr(run, "write_plan", the_other_job_first)
    assert cli(extract_args(model, data, out, logs)) == 0
    store = open_store(str(out))
    assert json.loads(store.get("manifest.json"))["config"]["dtype"] == pinned
    assert f"forward dtype {pinned}: the run at {out} was made with --dtype {pinned}" in \
        (logs / "extract-rank0.log").read_text()
    commits = list(store.list(layout.COMMITS))  # computed in the run's dtype: the model was loaded again in it
    assert commits and all(ShardReader(store, decode_commit(store.get(o.key), o.key).data_key).meta
                           .extra["forward_dtype"] == pinned for o in commits)


# -- the console --------------------------------------------------------------------------------


def test_off_a_terminal_progress_is_plain_lines_and_the_summary_has_units(model, tmp_path, capsys):
    data = write_chats(tmp_path / "chats.jsonl", 10)
    logs = tmp_path / "logs"
    assert cli(extract_args(model, data, tmp_path / "run", logs)) == 0
    assert "\r" not in capsys.readouterr().err  # no bar redrawn in a log
    log = (logs / "extract-rank0.log").read_text()
    assert "INFO layertap.progress: extract: 11/11 rows (100%)" in log  # rows, skipped ones too
    assert "{'" not in log  # no raw dict
    done = log.split("rank 0 done: ", 1)[1].splitlines()
    assert done[0].endswith("shard(s) committed")
    assert " samples, " in done[1] and " tokens (+" in done[1] and "KiB of states stored as " in done[1]
    assert " tokens/s, " in done[2] and "MiB/s stored: forward " in done[2] and " s, encode " in done[2]


def test_a_slow_pace_is_given_as_seconds_per_unit(monkeypatch):
    """A CPU training step of 30 s showed as "0.0 steps/s"."""
    from layertap.extract import console

    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    bar = console.PlainProgress(10, desc="train", unit="step")
    clock[0] += 60
    bar.update(2)
    assert ", 30.0 s/step, 60 s elapsed, ETA 4 min" in bar.line()
    fast = console.PlainProgress(100, desc="extract", unit="sample")
    clock[0] += 2
    fast.update(50)
    assert "25.0 samples/s" in fast.line()


def test_no_eta_is_shown_while_extraction_waits_for_its_window(monkeypatch):
    """Waiting on a full --window, the rate falls with every second waited: the ETA grew by a minute every
    30 s ("10/30 samples ... ETA 31 min; waiting: window full") while nothing could move."""
    import tqdm as tqdm_module

    from layertap.extract import console

    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    plain = console.PlainProgress(30, desc="extract", unit="sample")
    clock[0] += 30
    plain.update(10)
    # disable=False: off a terminal, `quiet_library_bars` (run by an earlier test in this process) turns off
    # the bars that do not say
    bar = tqdm_module.tqdm(total=30, desc="extract", unit="sample", file=io.StringIO(), initial=10, disable=False)
    for shown in (plain, bar):
        console.pause(shown, True)
        shown.set_postfix_str("waiting: window full")
        text = shown.line() if shown is plain else str(shown)
        assert "ETA" not in text and "<" not in text and "waiting: window full" in text
        console.pause(shown, False)
    assert "ETA 60 s" in plain.line() and "<" in str(bar)  # open again: the ETA is back


def test_the_last_progress_line_is_not_said_twice(monkeypatch, caplog):
    """Steps of 30 s or more log a line each: the last step's line came again at the close, a
    checkpoint's line between them."""
    from layertap.extract import console

    clock = [100.0]
    monkeypatch.setattr(console.time, "monotonic", lambda: clock[0])
    with caplog.at_level("INFO", logger=console.log.name):
        bar = console.PlainProgress(2, desc="train", unit="step")
        for _ in range(2):
            clock[0] += 31
            bar.update(1)
        bar.close()
    lines = [r.getMessage().split(",")[0] for r in caplog.records]
    assert lines == ["train: 1/2 steps (50%)", "train: 2/2 steps (100%)"]
    stopped = console.PlainProgress(3, desc="train", unit="step")
    clock[0] += 31
    stopped.update(1)
    caplog.clear()
    with caplog.at_level("INFO", logger=console.log.name):
        stopped.close()  # short of its total: the last line says so, without the ETA the logged one had
    assert len(caplog.records) == 1 and "ETA" not in caplog.records[0].getMessage()


def test_on_a_terminal_log_lines_are_written_above_the_bar(monkeypatch):
    from layertap.extract.console import progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    root = logging.getLogger()
    console = logging.StreamHandler(term)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root.addHandler(console)
    try:
        bar = progress(10, desc="extract", unit="sample")
        bar.update(3)
        bar.refresh()
        logging.getLogger("layertap.extract").warning("shard 1 committed")
        bar.close()
        logging.getLogger("layertap.extract").warning("after the bar")
        assert root.handlers[-1] is console  # put back once the bar is closed
    finally:
        root.removeHandler(console)
    lines = term.getvalue().split("\n")
    [line] = [l for l in lines if "shard 1 committed" in l]
    assert line.rsplit("\r", 1)[-1] == "WARNING shard 1 committed"  # the bar was cleared first, not prefixed
    assert "3/10" in term.getvalue() and "WARNING after the bar" in lines


def test_off_a_terminal_library_bars_are_turned_off():
    """transformers' GGUF conversion draws a tqdm bar of its own: into a Slurm log, not at all."""
    code = ("import sys; from layertap.extract.console import quiet_library_bars; {} from tqdm.auto import tqdm; "
            "list(tqdm(range(3), desc='Converting')); print('bars:', tqdm(total=1, disable=False).disable)")
    for call, shown in (("", True), ("quiet_library_bars();", False)):
        p = subprocess.run([sys.executable, "-c", code.format(call)], capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert p.returncode == 0, p.stderr
        assert ("Converting" in p.stderr) is shown
        assert "bars: False" in p.stdout  # a bar that asks to be drawn still is
