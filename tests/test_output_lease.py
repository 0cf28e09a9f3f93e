"""One trainer per training output: `manifests.output_lease` on a folder and on the moto S3
server, and two real `layertap train` processes started on one --out."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from layertap.manifests import layout
from layertap.manifests.liveness import pid_namespace
from layertap.manifests.output_lease import OutputLease, OutputLeaseTaken, live_holder

HERE = Path(__file__).parent


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _keys(store) -> list[str]:
    """The lease keys, not their holders' beats (`layout.beat_key`)."""
    return sorted(o.key for o in store.list("lease/") if layout.beat_of(o.key) is None)


def test_a_held_output_refuses_a_second_trainer_once_its_lease_is_renewed(store):
    with OutputLease(store, ttl_s=4.0) as first:
        held = live_holder(store)
        assert held is not None and held.holder["pid"] == os.getpid() and held.key == first.key
        started = time.time()
        with pytest.raises(OutputLeaseTaken, match=f"pid {os.getpid()} on {socket.gethostname()}"):
            OutputLease(store, ttl_s=4.0, poll_s=0.1).acquire()
        # refused on the renewal (every ttl/4; on S3, one stamped in a later whole second), not at the ttl
        assert time.time() - started < 4.0
        assert _keys(store) == [first.key] and not first.lost.is_set()
    assert not list(store.list("lease/")) and live_holder(store) is None  # released, beats too: the next starts at once
    with OutputLease(store, ttl_s=2.0) as second:
        assert second.generation == 1


def test_an_array_tasks_lease_names_it_as_squeue_does(store, monkeypatch):
    """Task 0 of array job 5 runs as SLURM_JOB_ID 6: its lease said "Slurm job 6" (`submit
    regenerate`: "task 0 is at work now (Slurm job 6)"), a number squeue shows no one; 5_0 it is."""
    monkeypatch.setenv("SLURM_JOB_ID", "6")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "5")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    with OutputLease(store, ttl_s=4.0):
        assert live_holder(store).holder["slurm_job"] == "5_0"
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID")  # a job of its own: its id
    with OutputLease(store, ttl_s=4.0):
        assert "Slurm job 6;" in live_holder(store).describe(store.now())


def test_a_holder_that_died_elsewhere_is_taken_over_once_its_lease_is_stale(store):
    store.put("lease/000003.ttl1.5", json.dumps({"host": "another-node", "pid": 1234, "slurm_job": "77"}).encode())
    held = live_holder(store)
    assert held is not None and "Slurm job 77" in held.describe(store.now())
    started = time.time()
    with OutputLease(store, ttl_s=30.0, poll_s=0.1) as lease:
        assert 0.5 < time.time() - started < 15  # waited for the stale lease, no longer
        assert lease.generation == 4 and _keys(store) == ["lease/000004.ttl30"]  # the stale one removed


def test_a_holder_gone_from_this_host_is_taken_over_at_once(store):
    here = {"host": socket.gethostname(), "pid_ns": pid_namespace()}
    store.put("lease/000001.ttl600", json.dumps({**here, "pid": _dead_pid()}).encode())
    started = time.time()
    with OutputLease(store, ttl_s=600.0) as lease:
        assert time.time() - started < 10 and lease.generation == 2


def test_a_holder_taken_over_stops_before_its_next_write(store):
    lease = OutputLease(store, ttl_s=0.8)
    lease.acquire()
    try:
        lease.check()
        # what a trainer does that found this one's lease stale (a stall longer than the ttl)
        store.put("lease/000002.ttl600", json.dumps({"host": "another-node", "pid": 1}).encode())
        assert lease.lost.wait(5)
        with pytest.raises(OutputLeaseTaken, match="took .* over"):
            lease.check()
    finally:
        lease.release()
    assert _keys(store) == ["lease/000002.ttl600"]  # its own lease gone, the newer holder's left alone


def test_a_stalled_holder_whose_key_came_back_as_anothers_knows_it_lost(store):
    """Generations restart once every lease is gone: A stalls past its ttl, B takes over and
    finishes, C takes the output under A's old key. A's heartbeat saw no newer generation and
    went on renewing C's lease, and A's release deleted it."""
    a = OutputLease(store, ttl_s=0.5)
    a.acquire()
    a._stop.set()  # A stalls: no more heartbeats
    a._beat.join()
    time.sleep(0.6)
    with OutputLease(store, ttl_s=30.0, poll_s=0.1) as b:
        assert b.generation == 2
    c = OutputLease(store, ttl_s=0.5)
    c.acquire()
    try:
        assert c.key == a.key  # the same key, another holder
        assert not a.holds()
        with pytest.raises(OutputLeaseTaken):
            a.check()
        a.release()
        assert _keys(store) == [c.key] and live_holder(store).holder["token"] == c.token  # C's lease left alone
    finally:
        c.release()


def test_two_newcomers_racing_for_a_free_output_get_one_holder(store):
    leases = [OutputLease(store, ttl_s=2.0, poll_s=0.1) for _ in range(2)]
    errors: list[BaseException] = []

    def take(lease):
        try:
            lease.acquire()
        except OutputLeaseTaken as e:
            errors.append(e)

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        held = [lease for lease in leases if lease.key is not None]
        assert len(held) == 1 and len(errors) == 1 and _keys(store) == [held[0].key]
    finally:
        for lease in leases:
            lease.release()


def test_a_newcomer_that_lists_just_before_another_claims_does_not_evict_it(store):
    """`acquire` found no live holder in one listing and took the next generation from a second: a
    trainer A that claimed generation 1 between them was followed by B's generation 2, whose claim
    deleted A's lease, and A stopped, told it had stalled. The one listing answers both now."""
    first = OutputLease(store, ttl_s=2.0, poll_s=0.1)

    class ClaimsAfterTheFirstListing:
        """B's view of the store: A claims right after B's first listing of the leases."""

        def __init__(self, inner):
            self.inner, self.listings = inner, 0

        def list(self, prefix: str = "", *args, **kwargs):
            listed = list(self.inner.list(prefix, *args, **kwargs))
            if prefix.startswith("lease/"):
                self.listings += 1
                if self.listings == 1:
                    first.acquire()
            return iter(listed)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    second = OutputLease(ClaimsAfterTheFirstListing(store), ttl_s=2.0, poll_s=0.1)
    try:
        with pytest.raises(OutputLeaseTaken, match="another `layertap train` is writing to"):
            second.acquire()
        assert first.holds() and _keys(store) == [first.key] and second.key is None
    finally:
        first.release()
        second.release()


def test_a_second_train_on_one_out_is_refused_and_status_names_the_first(tmp_path, capsys):
    """Two real trainers: the first waits for a run that is not there yet (--follow) and holds
    --out; the second is refused, naming it, and `status` of the output says who trains there.
    Killed (SIGKILL: no release), the first leaves its lease, and a trainer started again on
    this host takes the output over at once."""
    from layertap.cli import main as cli

    env = dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1")
    out = str(tmp_path / "out")
    args = [sys.executable, "-m", "layertap", "train", "--data", str(tmp_path / "run"), "--out", out, "--follow",
            "--follow-poll-s", "0.5", "--model", str(tmp_path / "no-model")]

    def start(name: str) -> tuple[subprocess.Popen, Path]:
        """A trainer, once it waits for the run (holding --out)."""
        err = tmp_path / f"{name}.err"
        with err.open("w") as f:
            p = subprocess.Popen(args, env=env, cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=f)
        deadline = time.time() + 120
        while time.time() < deadline and "waiting for" not in err.read_text():
            assert p.poll() is None, err.read_text()[-3000:]
            time.sleep(0.2)
        return p, err

    first, first_err = start("first")
    try:
        assert (Path(out) / "lease").is_dir(), first_err.read_text()[-3000:]

        second = subprocess.run(args, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"another `layertap train` is writing to {out} (pid {first.pid} on" in second.stderr
        assert "Stop that one first, or give this one another --out" in second.stderr

        capsys.readouterr()
        assert cli(["status", out]) == 3  # not complete
        shown = capsys.readouterr().out
        assert f"trainer     running: pid {first.pid} on {socket.gethostname()}" in shown
        assert "checkpoint  none yet" in shown and "not exported yet: training is running" in shown

        first.send_signal(signal.SIGKILL)
        first.wait(30)
        # its lease lives until its TTL, but it is gone from here: status said "running" while
        # `train --resume` here took the output over at once
        assert cli(["status", out]) == 3
        shown = capsys.readouterr().out
        assert f"trainer     exited: pid {first.pid} on {socket.gethostname()} is gone from this machine" in shown
        assert "running" not in shown and "stopped before its first checkpoint" in shown  # none: nothing to resume
        again, again_err = start("again")
        try:
            assert "is no longer running here: taking the output over" in again_err.read_text()
            assert live_holder(_open(out)).holder["pid"] == again.pid
        finally:
            again.send_signal(signal.SIGINT)
            again.wait(60)
    finally:
        first.kill()
        first.wait(30)


def _open(uri: str):
    from layertap.storage.store import open_store

    return open_store(uri)


def test_a_trainer_taken_over_mid_run_stops_without_writing_again(tmp_path, capsys, monkeypatch):
    """Its lease went stale (here: a short ttl, and another holder's newer generation put by hand
    once the first checkpoint is there): the trainer stops at its next checkpoint, every rank
    alike, and writes no checkpoint after that nor the drafter."""
    import fake_worker
    from layertap.cli import main as cli
    from layertap.train import trainer
    from tiny_models import tiny_model_dir

    monkeypatch.setattr(trainer, "OutputLease", lambda store: OutputLease(store, ttl_s=0.4))
    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), tmp_path / "out"
    fake_worker.work(uri)
    latest = out / "checkpoints" / "latest.json"

    def take_over():
        while not latest.exists():
            time.sleep(0.01)
        (out / "lease" / "000009.ttl600").write_text(json.dumps({"host": "another-node", "pid": 1}))

    thief = threading.Thread(target=take_over, daemon=True)
    thief.start()
    rc = cli(["train", "--data", uri, "--model", target, "--out", str(out), "--steps", "100000", "--save-every", "2",
              "--batch-size", "2", "--block-size", "4", "--max-anchors", "8"])
    assert rc == 2
    assert f"another trainer took {out} over" in capsys.readouterr().err
    taken = json.loads(latest.read_text())["step"]
    time.sleep(0.5)
    assert json.loads(latest.read_text())["step"] == taken < 100000 and not (out / "drafter").exists()
    # nothing of a later checkpoint either: not even a rank's loader position
    assert max(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-")) == f"step-{taken:08d}"
    assert sorted(p.name for p in (out / "lease").iterdir()) == ["000009.ttl600"]


def test_a_trainer_stopped_before_its_steps_releases_the_output(tmp_path):
    """SIGTERM (a preemption) while a follow trainer waits for its run killed it by the default
    handler: no exit 143 for a requeue, and its lease stayed, holding off a restart elsewhere for
    a ttl."""
    out = tmp_path / "out"
    args = [sys.executable, "-m", "layertap", "train", "--data", str(tmp_path / "run"), "--out", str(out), "--follow",
            "--follow-poll-s", "0.5", "--model", str(tmp_path / "no-model")]
    err = tmp_path / "train.err"
    with err.open("w") as f:
        p = subprocess.Popen(args, env=dict(os.environ, PYTHONPATH=str(HERE.parent), OMP_NUM_THREADS="1"),
                             cwd=HERE.parent, stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.time() + 120
    while time.time() < deadline and "waiting for" not in err.read_text():
        assert p.poll() is None, err.read_text()[-3000:]
        time.sleep(0.2)
    assert live_holder(_open(str(out))) is not None
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 143, err.read_text()[-3000:]
    assert "received SIGTERM outside the training steps" in err.read_text()
    assert not out.exists()  # released, and the output it had made held nothing else: removed


class _SignalOnce:
    """`store`, sending this process SIGUSR1 as the first call of `method` returns: a stop signal
    landing at that instant."""

    def __init__(self, store, method: str):
        self._store, self._method, self.sent = store, method, False

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if name != self._method or self.sent:
            return attr

        def call(*args, **kwargs):
            done = attr(*args, **kwargs)
            self.sent = True
            os.kill(os.getpid(), signal.SIGUSR1)
            return done
        return call


@pytest.mark.parametrize("at", ["put_if_absent", "delete"])
def test_a_stop_signal_in_the_claim_or_release_leaves_no_lease(store, at):
    """A stop landing while the lease is claimed (`put_if_absent`) or released (`delete`) broke
    into it: the lease stayed on the store and a rerun elsewhere waited a ttl for it. The stop is
    raised once the claim or release is done, and the output is free."""
    from layertap.manifests.preemption import Preempted, StopSignals
    signalling = _SignalOnce(store, at)
    with pytest.raises(Preempted):
        with StopSignals(at_once=True, signals=(signal.SIGUSR1,)), OutputLease(signalling, ttl_s=600):
            assert _keys(store)
            time.sleep(1)  # a stop at the claim raises before this block
    assert signalling.sent
    assert live_holder(store) is None and list(store.list("lease/")) == []


def test_a_trainer_taken_over_while_it_writes_a_checkpoint_neither_commits_it_nor_deletes_data(tmp_path, capsys,
                                                                                                 monkeypatch):
    """The lease was looked at once, before a checkpoint's files (minutes at a large drafter): a
    trainer that stalled past the ttl there and lost the output still pointed latest.json at its
    checkpoint, over the new trainer's output, wrote the watermarks of a step that one never
    reached and deleted the shards it resumes on. The takeover lands mid-save here (another
    holder's newer lease, put as that save writes its files)."""
    import fake_worker
    from layertap.cli import main as cli
    from layertap.manifests.consumption import consumed_shards
    from layertap.storage.store import open_store
    from layertap.train import trainer
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri, out = str(tmp_path / "run"), tmp_path / "out"
    fake_worker.work(uri)
    real, saves, consumed = trainer.save_checkpoint, [], []

    def save_while_taken_over(store, snap, keep, **kw):
        saves.append(snap.step)
        if len(saves) == 2:
            (out / "lease" / "000009.ttl600").write_text(json.dumps({"host": "another-node", "pid": 1}))
            consumed.extend(sorted(consumed_shards(open_store(uri))))
        return real(store, snap, keep, **kw)

    monkeypatch.setattr(trainer, "save_checkpoint", save_while_taken_over)
    rc = cli(["train", "--data", uri, "--model", target, "--out", str(out), "--follow", "--follow-poll-s", "0.5",
              "--delete-consumed", "--save-every", "4", "--batch-size", "2", "--shuffle-buffer", "2",
              "--block-size", "4", "--max-anchors", "8"])
    assert rc == 2 and f"another trainer took {out} over" in capsys.readouterr().err
    assert len(saves) == 2 and json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == saves[0]
    assert sorted(consumed_shards(open_store(uri))) == consumed  # nothing consumed (or deleted) past the first
    assert not (out / "drafter").exists()


def test_status_names_the_running_trainers_last_step_and_a_trainer_that_no_longer_steps(tmp_path, capsys):
    """Every rank hung in a collective (one stopped, SIGSTOP, a dead NIC): rank 0's lease thread kept
    renewing, and `status` said "trainer running ... renewed 1 s ago" for the backend's whole timeout.
    Each beat says the last step and how long ago it ended; past 10 minutes without one (and not
    waiting for extraction) status says so, and how to see where the ranks are."""
    from layertap.cli import main as cli
    from layertap.storage.store import open_store

    out = open_store(str(tmp_path / "drafter"))
    said = {"step": 7, "step_age_s": 2.0, "waiting_for_data": False}
    lease = OutputLease(out, ttl_s=0.4, poll_s=0.05)
    lease.progress = lambda: dict(said)
    with lease:
        def shown() -> str:
            time.sleep(0.3)  # a beat or more since `said` changed
            assert cli(["status", out.uri]) == 3
            return capsys.readouterr().out

        text = shown()
        assert "trainer     running: pid" in text and "; step 7 ended 2 s ago" in text, text
        assert "NO STEP" not in text
        said.update(step_age_s=700.0)
        text = shown()
        assert "; step 7 ended 12 min ago" in text and "NO STEP FOR 12 min: its ranks may hang" in text, text
        assert f"`kill -USR2 {os.getpid()}` prints each process's stacks" in text
        said.update(waiting_for_data=True)  # a follow trainer waiting for extraction is not hung
        text = shown()
        assert "it waits for extraction" in text and "NO STEP" not in text, text
        said.update(waiting_for_data=False, saving_checkpoint=True)  # nor one writing a long checkpoint
        text = shown()
        assert "it writes a checkpoint" in text and "NO STEP" not in text, text
        said.update(saving_checkpoint=False, waiting_for_data=True)
        time.sleep(0.3)
        assert cli(["status", out.uri, "--json"]) == 3
        trainer = json.loads(capsys.readouterr().out)["trainer"]
        assert trainer["last_step"] == 7 and trainer["last_step_s_ago"] >= 700 and trainer["waiting_for_data"]


def test_the_trainer_tells_its_lease_its_last_step(tmp_path, monkeypatch):
    """What each beat says comes from the training loop: the last step, how long ago it ended, and no
    wait for data outside follow mode (the lease test above sets `progress` by hand)."""
    sys.path.insert(0, str(HERE))
    import fake_worker
    from layertap.cli import main as cli
    from layertap.train import trainer
    from tiny_models import tiny_model_dir

    said = []

    class Recording(OutputLease):
        def release(self) -> None:
            said.append(self.progress() if self.progress is not None else None)
            super().release()

    monkeypatch.setattr(trainer, "OutputLease", Recording)
    run = str(tmp_path / "run")
    fake_worker.work(run)
    model = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    assert cli(["train", "--data", run, "--model", model, "--out", str(tmp_path / "d"), "--steps", "3",
                "--batch-size", "2", "--block-size", "4", "--max-anchors", "8"]) == 0
    [last] = said
    assert last["step"] == 3 and 0 <= last["step_age_s"] < 60 and last["waiting_for_data"] is False, last
    assert last["saving_checkpoint"] is False
