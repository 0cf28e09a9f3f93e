"""`layertap status`: exit codes for scripts, the rate and ETA lines, binary units, that it writes
nothing, and the status of a `layertap train` output. Real runs (fake_worker's real leases,
shards and commits; a real tiny extraction and training), local and on the moto S3 server."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.storage.units import listing, size
from layertap.manifests.status import recent_rate
from layertap.storage.store import open_store


def status(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli(["status", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def snapshot(store) -> list[tuple[str, str, int]]:
    return [(o.key, o.version, o.size) for o in store.list()]


@pytest.mark.moto_only
def test_exit_codes_rate_and_eta(store_uri, capsys):
    store = open_store(store_uri)
    done = fake_worker.work(store_uri, shards=[0, 1, 2])
    assert done == [0, 1, 2]
    total = len(fake_worker.plan(store).shards)

    # Pending shards, nobody working: exit 3, a rate (of the run's last commits), no ETA.
    rc, out, _ = status(capsys, store_uri)
    assert rc == 3, out
    js = json.loads(status(capsys, store_uri, "--json")[1])
    assert js["eta_s"] is None and js["tokens_per_s"] > 0 and js["rate_until"] == "last commit"
    # a run seconds old: its rate is over those seconds ("over the 10 min before" of an 18 s run misled)
    assert 1 <= js["rate_over_s"] < 60  # the span the rate divides by: "over the 0 s" was shown
    assert "rate     " in out and f"tokens/s over the {js['rate_over_s']} s before the last commit (last commit" in out
    assert "ETA" not in out and "finishes the pending shards" in out  # only those: not "failed and pending"

    # A live worker holds shard 3: now the rate runs to now and gives an ETA.
    store.put(layout.lease_key(3, 1, 600), b"{}")
    rc, out, _ = status(capsys, store_uri)
    assert rc == 3 and re.search(r"tokens/s over the last \d+ s, ETA ", out) and "nothing is running" not in out
    js = json.loads(status(capsys, store_uri, "--json")[1])
    assert js["shards_running"] == 1 and js["eta_s"] > 0 and js["rate_until"] == "now"
    store.delete(layout.lease_key(3, 1, 600))

    # A failed shard: exit 4 once nothing runs, whatever else is pending.
    fake_worker.work(store_uri, fail_shard=3)
    rc, out, _ = status(capsys, store_uri)
    assert rc == 4 and "FAILED shard 3" in out
    assert status(capsys, store_uri, "--json")[0] == 4
    # ... but 3 while a worker runs (it may retry the shard): a script waiting on 3 stopped at the first
    # failure a retry would mend
    store.delete_many([layout.commit_key(5), *(o.key for o in store.list(f"{layout.TALLY}000005."))])
    lease = layout.lease_key(5, 1, 600)  # a worker at work on shard 5 (pending again)
    store.put(lease, b"{}")
    js = json.loads(status(capsys, store_uri, "--json")[1])
    assert js["shards_running"] == 1 and js["shards_failed"] == 1
    assert status(capsys, store_uri)[0] == 3
    store.delete(lease)

    # Complete: exit 0, no ETA; sizes in binary units, as `estimate` prints them.
    assert fake_worker.work(store_uri) == [3, 5]
    rc, out, _ = status(capsys, store_uri)
    js = json.loads(status(capsys, store_uri, "--json")[1])
    assert rc == 0 and "COMPLETE" in out and "ETA" not in out and js["shards_done"] == total
    assert f"bytes    {size(js['bytes_stored'])} stored, {size(js['bytes_raw'])} raw" in out
    assert " KiB stored" in out and " GB" not in out and " MB" not in out


def test_bytes_at_rest_leave_out_the_data_training_consumed(store_uri, capsys):
    """`bytes_stored` is every committed shard's data, ever; `bytes_at_rest` what is still there
    once a window run's training consumed and deleted some (the text line says both)."""
    from layertap.manifests.consumption import delete_consumed, record_consumed

    store = open_store(store_uri)
    fake_worker.work(store_uri)
    stored = {s: t["bytes"] for s, t in (layout.parse_tally(o.key) for o in store.list(layout.TALLY))}
    rc, out, _ = status(capsys, store_uri, "--json")
    js = json.loads(out)
    assert js["bytes_stored"] == js["bytes_at_rest"] == sum(stored.values())
    assert "at rest" not in status(capsys, store_uri)[1]

    record_consumed(store, rank=0, world_size=1, shards=[1, 4], step=5)
    assert delete_consumed(store) == [1, 4]
    js = json.loads(status(capsys, store_uri, "--json")[1])
    at_rest = sum(b for s, b in stored.items() if s not in (1, 4))
    assert js["bytes_stored"] == sum(stored.values()) and js["bytes_at_rest"] == at_rest
    assert at_rest == sum(o.size for o in store.list(layout.SHARDS))  # what the bucket holds
    rc, out, _ = status(capsys, store_uri)
    assert rc == 0 and f"bytes    {size(js['bytes_stored'])} stored, {size(js['bytes_raw'])} raw" in out
    assert f"; {size(at_rest)} at rest now ({size(stored[1] + stored[4])} deleted with the shards training " \
           "consumed)" in out


def test_recent_rate_leaves_out_the_first_commits_tokens():
    # Shards committed at t=100, 110, 120 with 50 tokens each: 100 tokens made in 20 s.
    times, tokens = {0: 100.0, 1: 110.0, 2: 120.0}, {0: 50, 1: 50, 2: 50}
    assert recent_rate(times, tokens, end=120.0) == 5.0
    assert recent_rate(times, tokens, end=140.0) == 2.5  # nothing since: the rate falls
    assert recent_rate(times, tokens, end=120.0 + 700) is None  # all older than the window
    assert recent_rate({0: 100.0}, {0: 50}, end=100.0) is None  # one commit is no rate
    # `now` errs behind the store's clock and `modified` is rounded up: commits stamped a second
    # past `end` are counted (three fast commits gave no rate with a live worker)
    assert recent_rate({0: 100.5, 1: 101.0, 2: 101.0}, tokens, end=100.2) == 100.0


def test_sizes_are_binary():
    assert [size(n) for n in (0, 1023, 1024, 5 * 2**20, 1.5 * 2**30, 123 * 2**30, 3 * 2**40)] == [
        "0 B", "1023 B", "1.00 KiB", "5.00 MiB", "1.50 GiB", "123 GiB", "3.00 TiB"]


def test_lists_in_messages_say_how_many_more():
    """One rule for every message's list (seven hand-made ones said " ..." or "and N more", or cut
    the list without a word)."""
    assert listing(range(3)) == "0, 1, 2" and listing([]) == ""
    assert listing(range(2000), 2) == "0, 1 and 1,998 more"
    assert listing((f"s3://b/{k}" for k in "abc"), 1) == "s3://b/a and 2 more"


def test_status_writes_nothing(store_uri, capsys):
    """Every state at once (committed, failed, leased, a commit without its tally marker): the
    store's listing, versions included, is the same after text and JSON status."""
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0, 1, 2])
    fake_worker.work(store_uri, shards=[3], fail_shard=3)
    store.put(layout.lease_key(4, 1, 600), b"{}")
    tally = next(o.key for o in store.list(layout.TALLY))
    store.delete(tally)
    before = snapshot(store)
    assert status(capsys, store_uri)[0] == 3  # a failed shard, and a worker at work: 3 until it ends
    rc, out, _ = status(capsys, store_uri, "--json")
    assert rc == 3 and json.loads(out)["samples_done"] == sum(
        json.loads(store.get(o.key))["num_records"] for o in store.list(layout.COMMITS))
    assert snapshot(store) == before


# -- a training output ---------------------------------------------------------------------------


def test_trainer_key_names_match():
    """manifests/ repeats the trainer's key names (it must not import torch): they must agree."""
    from layertap.manifests import train_output
    from layertap.train import checkpoint, trainer

    assert train_output.METRICS == trainer.METRICS
    assert train_output.LATEST == checkpoint.LATEST
    assert train_output.EXPORT_CONFIG == checkpoint.EXPORT_CONFIG


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """A real tiny extraction (local folder) and 6 steps of `layertap train` on it."""
    from test_extract import write_chats
    from tiny_models import tiny_model_dir

    tmp = tmp_path_factory.mktemp("trained")
    target = tiny_model_dir(tmp / "models", "qwen3")
    data, out = str(tmp / "run"), str(tmp / "drafter")
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 24), "--out", data,
                "--layers", "1,3", "--max-length", "64", "--shard-bytes", "20KB", "--log-dir", str(tmp / "logs")]) == 0
    assert cli(["train", "--data", data, "--model", target, "--out", out, "--steps", "6", "--save-every", "4",
                "--batch-size", "4", "--block-size", "4", "--max-anchors", "8", "--log-dir", str(tmp / "logs")]) == 0
    return {"data": data, "out": out}


def test_status_of_a_training_output(trained, capsys):
    out_uri = trained["out"]
    store = open_store(out_uri)
    last = json.loads(store.get("metrics.jsonl").decode().splitlines()[-1])
    before = snapshot(store)
    rc, out, err = status(capsys, out_uri)
    assert rc == 0, err
    assert f"training output at {out_uri}  (data {trained['data']})" in out
    assert f"steps       6 of 6, in epoch {last['epoch'] + 1}\n" in out  # counted from 1, as the steps are
    assert f"last loss   {last['loss']:.4f} at step 6" in out
    assert f"checkpoint  step 6: {out_uri}/checkpoints/step-00000006" in out
    assert "drafter     exported" in out and "COMPLETE" in out
    rc, out, err = status(capsys, out_uri, "--shards")  # a run's flag: said, not ignored in silence
    assert rc == 0 and f"training output at {out_uri}" in out
    assert f"--shards lists a run's shard objects, and {out_uri} is a training output (`layertap status " \
           f"{trained['data']} --shards`" in err
    js = json.loads(status(capsys, out_uri, "--json")[1])
    assert (js["kind"], js["step"], js["checkpoint_step"], js["loss"], js["complete"]) == ("training", 6, 6,
                                                                                           last["loss"], True)
    assert snapshot(store) == before
    # the last step as the checkpoint records it (an --epochs run's too: its config holds no --steps)
    state_key = "checkpoints/step-00000006/state.json"
    state = store.get(state_key)
    store.put(state_key, json.dumps(dict(json.loads(state), total_steps=9, config=dict(
        json.loads(state)["config"], steps=None, epochs=2))).encode())
    assert "steps       6 of 9, in epoch" in status(capsys, out_uri)[1]
    store.put(state_key, state)

    # As a run killed after its checkpoint leaves it: no exported drafter. Not complete: exit 3.
    for o in list(store.list("drafter/")):
        store.delete(o.key)
    rc, out, _ = status(capsys, out_uri)
    assert rc == 3 and "not exported yet" in out and "--resume" in out and "COMPLETE" not in out
    # eval of it (or of the run itself) says what to do: a checkpoint's --step, the output of a train
    prompts = Path(out_uri).parent / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    capsys.readouterr()
    assert cli(["eval", "--drafter", out_uri, "--prompts", str(prompts)]) == 2
    assert "its training has not finished (checkpoints kept: steps 4, 6); evaluate a checkpoint with --step 6" in \
        capsys.readouterr().err
    assert cli(["eval", "--drafter", trained["data"], "--prompts", str(prompts)]) == 2
    assert "it is an extraction's run; give --drafter the --out of a `layertap train` on it" in capsys.readouterr().err

    # A last step of padding alone as an earlier version wrote it (NaN, which is not JSON): --json
    # stays strict JSON, and the loss is the last step's that had one, as `train`'s closing line says
    # (status said "none" while train said "final loss 7.2561 (step 11; ...)").
    # A step of padding (no supervised slot) and one that diverged (NaN with weight behind it) are
    # told apart, as train's closing line does (both were "padding").
    metrics = store.get("metrics.jsonl")
    padding = dict(last, step=7, loss=float("nan"), acc_per_position=[None] * len(last["acc_per_position"]))
    diverged = dict(last, step=8, loss=None)
    store.put("metrics.jsonl", metrics + b"".join(json.dumps(r).encode() + b"\n" for r in (padding, diverged)))
    rc, out, _ = status(capsys, out_uri)
    assert (f"last loss   {last['loss']:.4f} at step 6 (after it, 1 step(s) held only zero-weighted padding (samples "
            "the extraction skipped); 1 step(s) had a NaN or infinite loss and made no update") in out
    text = status(capsys, out_uri, "--json")[1]
    js = json.loads(text, parse_constant=lambda c: pytest.fail(f"status --json printed {c}"))
    assert (js["step"], js["loss"], js["loss_step"], js["acc_first"]) == (8, last["loss"], 6, last["acc_first"])
    assert js["steps_without_loss"] == {"padding": 1, "not_finite": 1}
    # no step with a loss at all: the text says why there is none
    store.put("metrics.jsonl", json.dumps(dict(padding, step=1)).encode() + b"\n")
    rc, out, _ = status(capsys, out_uri)
    assert "last loss   none at step 1 (1 step(s) held only zero-weighted padding (samples the extraction skipped))" in out
    assert json.loads(status(capsys, out_uri, "--json")[1])["loss"] is None
    store.put("metrics.jsonl", metrics)


def test_a_command_given_an_export_or_a_drafter_for_a_run_says_what_it_holds(tmp_path, capsys):
    """`train --data` (or verify) at a `layertap export` of a run, or at an exported drafter, said
    "run `layertap extract` to start one"."""
    export, drafter = tmp_path / "export", tmp_path / "drafter"
    export.mkdir()
    (export / "layertap-export.json").write_text(json.dumps({"format": "speculators", "layers": [1, 3]}))
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    assert cli(["verify", str(export)]) == 2
    assert f"format speculators): give the run itself, or import the files into a run first (`layertap import " \
           f"{export} --from speculators --out PREFIX`)" in capsys.readouterr().err
    assert cli(["train", "--data", str(drafter), "--out", str(tmp_path / "o")]) == 2
    assert "It holds an exported drafter (config.json, model.safetensors), not an extraction's run" in \
        capsys.readouterr().err


def test_status_of_neither_a_run_nor_a_training_output(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hello")
    rc, out, err = status(capsys, str(tmp_path))
    assert rc == 2 and out == ""
    assert "manifest.json is missing" in err and "nor is it a `layertap train` output" in err


def test_status_of_an_output_whose_trainer_was_killed_before_its_first_checkpoint(tmp_path, capsys):
    """A trainer killed before its first checkpoint leaves its lease alone, gone stale: status said
    "no run ... (run `layertap extract` to start one)". It is a training output, and says so."""
    import os

    lease = tmp_path / "lease" / "000001.ttl60"
    lease.parent.mkdir()
    lease.write_text(json.dumps({"holder": {"host": "n1", "pid": 7, "token": "t"}}))
    os.utime(lease, (time.time() - 600, time.time() - 600))  # not renewed for 10 min: its trainer is gone
    rc, out, err = status(capsys, str(tmp_path))
    assert rc == 3 and f"training output at {tmp_path}" in out and "checkpoint  none yet" in out, err
    assert "training stopped before its first checkpoint (killed, or it failed: its log says why); the same " \
        "`layertap train` command starts it again" in out
    assert cli(["delete", "--yes", str(tmp_path)]) == 0  # a training output, as status says: not refused as none
    assert f"training output at {tmp_path}: 1 object(s)" in capsys.readouterr().out


def test_a_window_runs_trainer_killed_on_this_machine_is_not_running_while_its_lease_is_fresh(tmp_path, capsys):
    """kill -9 of a --delete-consumed trainer: for up to a lease's ttl `status` of the run said the
    window opens "as training consumes", while `status` of its output said the trainer exited."""
    import os
    import socket
    import subprocess

    from layertap.manifests.consumption import claim_consumer, consumer_state
    from layertap.manifests.liveness import pid_namespace

    uri, drafter = str(tmp_path / "run"), str(tmp_path / "drafter")
    store = open_store(uri)
    fake_worker.plan(store)
    fake_worker.work(uri, shards=[0, 1])
    store.put(layout.CONSUMED_WINDOW, json.dumps({"window": 1000}).encode())
    claim_consumer(store, drafter)
    dead = subprocess.Popen(["true"])
    dead.wait()
    holder = {"host": socket.gethostname(), "pid": dead.pid, "pid_ns": pid_namespace()}
    open_store(drafter).put("lease/000001.ttl600", json.dumps(holder).encode())  # fresh for 10 min
    assert consumer_state(open_store(drafter).uri) == "stopped"
    assert "THE TRAINER IS NOT RUNNING" in status(capsys, uri)[1]
    open_store(drafter).put("lease/000001.ttl600", json.dumps(dict(holder, pid=os.getpid())).encode())
    assert consumer_state(open_store(drafter).uri) == "running"  # one alive here is


def test_status_says_extraction_waits_for_its_window_not_that_nothing_runs(tmp_path, capsys):
    """Workers waiting for a full --window hold no lease: status said "nothing is running: the same
    layertap extract command finishes ...", and a user following it started a second extractor."""
    uri = str(tmp_path / "run")
    store = open_store(uri)
    m = fake_worker.plan(store)
    fake_worker.work(uri, shards=[0, 1])
    store.put(layout.CONSUMED_WINDOW, json.dumps({"window": 1000}).encode())
    from layertap.manifests.consumption import claim_consumer

    from layertap.manifests.output_lease import OutputLease

    claim_consumer(store, str(tmp_path / "drafter"))  # a --delete-consumed trainer (without one, status says so)
    # no lease seen on its output (one this machine cannot see: a node-local folder): not taken for a stop
    assert "NOT RUNNING" not in status(capsys, uri)[1]
    trainer = OutputLease(open_store(str(tmp_path / "drafter")), ttl_s=1.0)
    trainer.acquire()  # running: it holds its output's lease
    rc, out, _ = status(capsys, uri)
    assert rc == 3 and "of a 1000 B --window: full, extraction waits for training to consume" in out
    assert "no shard is running, and no extraction worker waits for the window (none has a record under waiting/ " \
        "renewed in the last 5 min: stopped, or killed): the same `layertap extract`" in out \
        and "nothing is running" not in out
    assert "NOT RUNNING" not in out
    # A stall the trainer reports (window full, training waiting for data: for good): status said workers wait
    # "as training consumes"; it shows the trainer's STALLED report while the trainer renews it
    from layertap.manifests.consumption import clear_stall, record_stall

    store.put(layout.waiting_key("w1"), json.dumps({"host": "n1", "pid": 1}).encode())
    record_stall(store, "rank 0", "STALLED: extraction waits for training to consume (...)")
    out = status(capsys, uri)[1]
    assert "  STALLED (the trainer's report, 0 s ago): STALLED: extraction waits for training to consume" in out, out
    assert "1 extraction worker(s) wait for the window to open" in out and "as training consumes" not in out
    assert json.loads(status(capsys, uri, "--json")[1])["stalled"]["who"] == "rank 0"
    clear_stall(store)
    out = status(capsys, uri)[1]
    assert "STALLED" not in out and "wait for the window to open, as training consumes" in out
    store.delete(layout.waiting_key("w1"))
    # The trainer gone (stalled out, crashed: its lease left to go stale): status said the window opens "as
    # training consumes", and the workers waited for good
    trainer._stop.set()
    trainer._beat.join()
    time.sleep(1.5)
    out = status(capsys, uri)[1]
    assert "THE TRAINER IS NOT RUNNING: this run's --delete-consumed trainer holds no live lease on its output " \
        "(stopped, queued again, or its lease went stale)" in out
    assert "wait for the window to open, as training consumes" not in out
    assert json.loads(status(capsys, uri, "--json")[1])["deleting_trainer"] == "stopped"  # for scripts too
    assert "it stalled" not in out and "with a larger --window" not in out
    # ... after a stall: the same commands would stall again, so the window must grow first
    record_stall(store, "rank 0", "STALLED: extraction waits for training to consume (...)")
    out = status(capsys, uri)[1]
    assert "window does not open: it stalled (its report below): restart the extraction with a larger --window " \
        "(Slurm: scancel its waiting tasks, submit again with it), then start the trainer again with its `layertap " \
        "train` command and --resume" in out
    assert "goes on once a --delete-consumed trainer consumes (with a larger --window: the trainer stalled" in out
    # the trainer gave up on the stall and renews its report no more: still said an hour on
    import os as _os

    report = Path(uri) / layout.CONSUMED_STALL
    _os.utime(report, (time.time() - 3600, time.time() - 3600))
    out = status(capsys, uri)[1]
    assert "it stalled (its report below): restart the extraction with a larger --window" in out
    assert "STALLED (the trainer's report, 1 h" in out or "STALLED (the trainer's report, 60 min" in out, out
    clear_stall(store)
    trainer.release()
    # stopped by Ctrl-C or a signal: a checkpoint saved and the lease released (not left to go stale), which
    # was taken for a trainer at work
    assert "NOT RUNNING" not in status(capsys, uri)[1]  # nothing of a training there: not seen from here
    open_store(str(tmp_path / "drafter")).put("checkpoints/latest.json", b'{"step": 4}')
    assert "THE TRAINER IS NOT RUNNING" in status(capsys, uri)[1]
    open_store(str(tmp_path / "drafter")).put("drafter/config.json", b"{}")  # its training ended: exported
    out = status(capsys, uri)[1]
    assert "THE TRAINER HAS FINISHED" in out and "NOT RUNNING" not in out
    assert json.loads(status(capsys, uri, "--json")[1])["window"] == 1000
    assert json.loads(status(capsys, uri, "--json")[1])["deleting_trainer"] == "finished"
    store.put(layout.CONSUMED_WINDOW, json.dumps({"window": 10**12}).encode())  # open: no worker waits on it
    out = status(capsys, uri)[1]
    assert "--window" in out and ": full, extraction waits" not in out and "nothing is running" in out
    assert len(m.shards) > 2


def test_status_of_the_parent_of_runs_names_what_is_under_it(store_uri, capsys):
    """A user who gave the prefix above their runs got "no run" and no word of what is there."""
    fake_worker.work(f"{store_uri}/run1")
    parent = open_store(store_uri)
    parent.put("drafter1/metrics.jsonl", b"{}\n")
    parent.put("misc/notes.txt", b"not ours")
    parent.put("team/run9/manifest.json", b"{}")  # a run deeper down: the list looked whole without it
    rc, out, err = status(capsys, store_uri)
    assert rc == 2 and out == ""
    assert "Under it: drafter1/ (training output), run1/ (run); and 2 other folder(s) (misc/, team/), not looked " \
           "into" in err
    assert f"`layertap status {parent.uri.rstrip('/')}/drafter1`" in err
    # runs only deeper (a bucket's root): it said nothing of what is there
    rc, _, err = status(capsys, f"{store_uri}/team")
    assert rc == 2 and "run9/ (run)" in err
    deep = open_store(f"{store_uri}/deep")
    deep.put("misc/notes.txt", b"not ours")
    deep.put("team/run9/manifest.json", b"{}")
    rc, _, err = status(capsys, deep.uri)
    assert rc == 2 and "Its folders misc/, team/ are no run nor output; runs may lie deeper in them: " \
        f"`layertap status {deep.uri.rstrip('/')}/FOLDER`" in err


def test_status_of_an_export_or_an_exported_drafter_says_what_it_is(tmp_path, capsys):
    """`verify` named them; `status`, the command users point at things, said only "no run"."""
    export, drafter = open_store(str(tmp_path / "export")), open_store(str(tmp_path / "drafter"))
    export.put("layertap-export.json", json.dumps({"format": "specforge"}).encode())
    export.put("rows_0-2000/data_0.ckpt", b"")  # SpecForge's folders: no run below it either
    drafter.put("config.json", b"{}")
    drafter.put("model.safetensors", b"")
    rc, _, err = status(capsys, export.uri)
    assert rc == 2 and "It holds a `layertap export` of a run (layertap-export.json, format specforge)" in err
    assert "runs may lie deeper" not in err
    assert cli(["verify", export.uri]) == 2 and "It holds a `layertap export`" in capsys.readouterr().err
    rc, _, err = status(capsys, drafter.uri)
    assert rc == 2 and "It holds an exported drafter" in err


@pytest.mark.moto_only
def test_status_shards_lists_each_shards_object_for_inspect(store_uri, capsys):
    store = open_store(store_uri)
    fake_worker.work(store_uri, fail_shard=2)
    store.put(f"{layout.SHARDS}000001-deadbeef0000.lts", b"left by a crashed attempt")  # two objects for shard 1
    rc, out, _ = status(capsys, store_uri, "--shards", "--json")
    shards = json.loads(out)["shards"]
    assert rc == 4 and [e["shard"] for e in shards] == list(range(len(fake_worker.plan(store).shards)))
    for e in shards:
        if e["state"] == "done":
            commit = json.loads(store.get(layout.commit_key(e["shard"])))
            assert e["object"] == f"{store.uri.rstrip('/')}/{commit['data_key']}"  # the committed one, even for 1
            assert e["records"] == commit["num_records"] and e["bytes"] == commit["bytes"]
            capsys.readouterr()
            assert cli(["inspect", e["object"]]) == 0  # the name `inspect` takes
            # the shard's id alone (without its digest) was "no object": now its object is named
            by_id = f"{store.uri.rstrip('/')}/shards/{e['shard']:06d}.lts"
            assert cli(["inspect", by_id]) == 2
            err = capsys.readouterr().err
            assert "did you mean " in err and e["object"] in err
        else:
            assert (e["state"], e["object"], e["shard"]) == ("failed", None, 2) and "injected" in e["error"]
    rc, out, _ = status(capsys, store_uri, "--shards")
    assert "  shard   state     records      tokens     stored  object (or last error)" in out
    # a failed shard's row names its last error (it said "failed" alone; the docs promised its error)
    assert re.search(r"^  000002  failed\s+RuntimeError: .*injected", out, re.M)
    assert out.count(f"{store.uri.rstrip('/')}/shards/") == len(shards) - 1


def test_inspect_names_a_missing_bucket_as_every_command_does(s3_endpoint, capsys):
    assert cli(["inspect", "s3://no-such-bucket-here/run1/shards/000000.lts"]) == 2
    assert "bucket 'no-such-bucket-here' does not exist" in capsys.readouterr().err


def test_a_shard_stopped_from_outside_is_interrupted_not_failed(store_uri, capsys):
    """A stop record (`.stop.json`: a takeover, a store outage, a signal) is no fault of the
    shard's: `status` counts it interrupted (exit 3, not 4), as `submit` does."""
    store = open_store(store_uri)
    fake_worker.work(store_uri, shards=[0])
    store.put(layout.failure_key(1, 1, "tok", 1, stopped=True), b"{}")  # e.g. TransientStoreError: not preempted
    rc, out, _ = status(capsys, store_uri)
    assert rc == 3 and "0 failed" in out and "1 interrupted" in out
    assert "INTERRUPTED shard 1 (stopped on " in out and out.rstrip().endswith("a rerun finishes it")
    store.put(layout.lease_key(2, 1, 600), b"{}")  # a worker at work on another shard: it may take shard 1 too
    rc, out, _ = status(capsys, store_uri)
    assert out.rstrip().endswith("a worker at work takes it if it may, else a rerun finishes it"), out
    store.delete(layout.lease_key(2, 1, 600))
    # stopped again and again, and a worker at it once more (a store failing every upload of it): said so,
    # where "1 running, 0 failed" hid it
    for ms in (2, 3):
        store.put(layout.failure_key(1, ms, "tok", ms, stopped=True), b"{}")
    store.put(layout.lease_key(1, 4, 600), b"{}")
    rc, out, _ = status(capsys, store_uri)
    assert rc == 3 and "1 running" in out and "INTERRUPTED" not in out
    assert "RETRYING shard 1: running again after 3 attempts that stopped or failed, the last on host " in out, out
    assert [f["shard"] for f in json.loads(status(capsys, store_uri, "--json")[1])["retrying"]] == [1]


def test_tally_markers_written_before_truncation_was_counted_still_read():
    """A run in progress when layertap began naming truncation in the marker reads as 0 cut."""
    new = layout.tally_key(7, 3, 120, 4000, 9000, 1, 2)
    assert layout.parse_tally(new) == (7, {"records": 3, "tokens": 120, "bytes": 4000, "raw_bytes": 9000,
                                           "skipped": 1, "truncated": 2})
    assert layout.parse_tally(new.removesuffix(".c2")) == (7, {"records": 3, "tokens": 120, "bytes": 4000,
                                                               "raw_bytes": 9000, "skipped": 1, "truncated": 0})


def test_verify_and_delete_refuse_fewer_than_one_thread(tmp_path, capsys):
    """`verify --threads 0` was a ValueError traceback from the thread pool; `delete` took 0 as 1."""
    fake_worker.work(str(tmp_path / "run"))
    for command in (["verify", str(tmp_path / "run"), "--threads", "0"],
                    ["delete", str(tmp_path / "run"), "--threads", "-1", "--yes"]):
        assert cli(command) == 2
        err = capsys.readouterr().err
        assert f"error: --threads must be at least 1, got {command[3]}" in err and "Traceback" not in err
    assert open_store(str(tmp_path / "run")).exists(layout.MANIFEST)  # nothing deleted


def test_status_measures_the_window_as_its_gate_does_and_bears_an_unreadable_trainer_record(tmp_path, capsys,
                                                                                             caplog):
    """The gate counts every object under shards/ (a crashed attempt's leftover too), status only
    the committed bytes: with the window full by the gate's count, workers waited while status said
    "nothing is running" (and counted no waiting worker). And an unreadable consumed/trainer.json
    made text status an error (exit 2, no report) where --json reported."""
    from layertap.manifests.consumption import WindowGate, at_rest
    from layertap.manifests.records import Producer

    uri = str(tmp_path / "run")
    store = open_store(uri)
    fake_worker.plan(store)
    fake_worker.work(uri, shards=[0, 1, 2])
    store.put(f"{layout.SHARDS}000003-leftover.lts", b"x" * 3000)  # killed between its close and its commit
    committed = json.loads(status(capsys, uri, "--json")[1])["bytes_at_rest"]
    gate = WindowGate(store, committed + 1000, producer=Producer.current(0), shards=[3])
    gate.record()
    store.put(layout.waiting_key(Producer.current(0).token), json.dumps({"shard": 3}).encode())  # a worker waits
    s = json.loads(status(capsys, uri, "--json")[1])
    assert s["window_at_rest"] == at_rest(store).bytes == committed + 3000 and s["workers_waiting"] == 1
    assert json.loads(status(capsys, uri, "--json", "--shards")[1])["window_at_rest"] == s["window_at_rest"]
    out = status(capsys, uri)[1]
    assert "full, extraction waits for training to consume" in out and "1 extraction worker(s) wait" in out
    assert "nothing is running" not in out
    store.put(layout.CONSUMER, b"not json")
    rc, out, _ = status(capsys, uri)
    assert rc == 3 and "window" in out and "trainer.json is unreadable" in caplog.text


def test_a_checkpoints_age_is_read_on_the_stores_clock(tmp_path, monkeypatch):
    """The age took this machine's time minus the store's stamp: off by any skew between them (a
    lease's age beside it already used the store's clock)."""
    from layertap.manifests.train_output import training_status

    store = open_store(str(tmp_path / "out"))
    store.put("checkpoints/latest.json", json.dumps({"step": 1, "prefix": "checkpoints/step-00000001"}).encode())
    written = next(iter(store.list("checkpoints/latest.json"))).modified
    monkeypatch.setattr(store, "now", lambda: written + 100.0)
    monkeypatch.setattr(time, "time", lambda: written + 5000.0)  # this machine's clock, an hour and more ahead
    assert training_status(store)["checkpoint_age_s"] == 100.0


def test_status_does_not_import_torch(tmp_path):
    """Building the parser imported every command's module and the status path reached the codecs:
    `layertap status`, the command a script polls, imported torch each time (seconds)."""
    import subprocess
    import sys

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    probe = ("import sys; from layertap.cli import main; rc = main(['status', sys.argv[1]]); "
             "print('torch' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", probe, uri], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "7/7 done" in p.stdout, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == "False"


def test_submitting_training_does_not_import_torch(tmp_path):
    """`layertap submit train` reads the training settings on a login node (train.config), and
    `layertap.train`'s package imported its loader, and with it torch (seconds, more on a shared
    filesystem), for a script it writes and hands to sbatch."""
    import subprocess
    import sys

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    probe = ("import sys; from layertap.cli import main; rc = main(['submit', 'train', '--dry-run', '--data', "
             "sys.argv[1], '--out', sys.argv[2], '--model', 'm']); print('torch' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", probe, uri, str(tmp_path / "out")], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert p.returncode == 0 and "layertap train" in p.stdout, p.stdout + p.stderr
    assert p.stdout.splitlines()[-1] == "False"


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["stauts", "run"], []])
def test_version_help_and_a_mistyped_command_do_not_import_torch(argv):
    """With no command named, the parser was built with every command's arguments, which imports
    each command's module: `layertap --version` took 1.8 s on 2 cores, importing torch."""
    import subprocess
    import sys

    probe = ("import sys, json; from layertap.cli import main\n"
             "try:\n    rc = main(json.loads(sys.argv[1]))\nexcept SystemExit as e:\n    rc = e.code\n"
             "print('torch' in sys.modules, file=sys.stderr); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", probe, json.dumps(argv)], capture_output=True, text=True, timeout=120)
    # no command at all: the commands (it said only "the following arguments are required: COMMAND")
    expected = {"--version": (0, "layertap "), "--help": (0, "status"), "stauts": (2, "invalid choice: 'stauts'"),
                None: (2, "export-drafter")}
    rc, text = expected[argv[0] if argv else None]
    assert p.returncode == rc and text in p.stdout + p.stderr, p.stdout + p.stderr
    assert p.stderr.splitlines()[-1] == "False"


def test_a_store_that_does_not_answer_exits_5_not_2(capsys, monkeypatch):
    """A script waiting on `status` (or running verify, inspect, delete) must tell an outage it can
    wait out from "no run there" (2): both exited 2."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    rc, out, err = status(capsys, "s3://acts/run1")
    assert rc == 5 and "cannot reach the S3 endpoint http://127.0.0.1:9" in err and out == ""
    # so do the other commands that only read (or delete): verify, inspect and delete exited 2
    for argv in (["verify", "s3://acts/run1"], ["inspect", "s3://acts/run1/shards/000000-x.lts"],
                 ["delete", "--yes", "s3://acts/run1"]):
        assert cli(argv) == 5, argv
        assert "cannot reach the S3 endpoint http://127.0.0.1:9" in capsys.readouterr().err
    # and so does every other command (extract and train exited 2, as for a mistake to fix)
    assert cli(["export", "s3://acts/run1", "/tmp/nonexistent-x", "--to", "specforge"]) == 5


def test_the_closing_hint_of_a_finished_run_looks_at_its_drafter_output_first(tmp_path):
    """A rerun of a finished extraction ("nothing to do") suggested `layertap train ... --out RUN-drafter`
    where that output held a training already: the suggested command was refused."""
    from layertap.manifests.cli import train_hint

    run = str(tmp_path / "run")
    assert train_hint(run).endswith(f"layertap train --data {run} --out {run}-drafter")
    Path(f"{run}-drafter").mkdir()
    Path(f"{run}-drafter", "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    hint = train_hint(run)
    assert hint.startswith(f"{run}-drafter holds a training of a drafter already: `layertap status {run}-drafter`")
    assert hint.endswith(f"layertap train --data {run} --out {run}-drafter-2")
