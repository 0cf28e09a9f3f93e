"""`layertap verify` withdrawing bad shards while a run is extracted, killed part way, or run
twice at once; and workers of a run deleted under them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.records import Producer, decode_commit
from layertap.manifests.state import scan
from layertap.manifests.status import run_status, verify_run
from layertap.manifests.work import WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.writer import ShardWriter
import layertap.storage.store
from layertap.storage.store import open_store

WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def corrupt(store, shard: int) -> str:
    """Flip a byte in the middle of the shard's committed data object; its key."""
    commit = decode_commit(store.get(layout.commit_key(shard)), "commit")
    data = bytearray(store.get(commit.data_key))
    data[len(data) // 2] ^= 0xFF
    store.put(commit.data_key, bytes(data))
    return commit.data_key


def finish(store, manifest, claim, skip: int | None = None) -> bool:
    """Work a claim as fake_worker does; `skip`: a sample index left out as skipped (other counts)."""
    meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    with claim:
        with ShardWriter(store.open_writer(claim.data_key), meta) as w:
            for i in range(claim.plan.start, claim.plan.end):
                if i != skip:
                    w.write_sample(fake_worker.make_sample(i))
            info = w.close()
        skipped = [{"sample_id": f"s{skip:05d}", "reason": "too_long"}] if skip is not None else []
        return claim.commit(info, skipped=skipped)


def tally_keys(store, shard: int) -> list[str]:
    return [o.key for o in store.list(f"{layout.TALLY}{shard:06d}.")]


def feed_keys(store, shard: int) -> list[str]:
    return [o.key for o in store.list(layout.FEED) if layout.parse_feed(o.key)[1] == shard]


def committed_truth(store) -> tuple[int, int]:
    """Samples and tokens of the commit records themselves."""
    commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
    return sum(c.num_records for c in commits), sum(c.num_tokens for c in commits)


def test_a_withdrawal_is_no_failed_attempt_of_the_live_extraction(store_uri):
    """`verify` during an extraction with `--retries 0`: its withdrawal was an ordinary failure
    record, which the workers counted as the shard's failed attempt and gave the shard up (a
    follow trainer then ended its epoch without it). It is a record of its own now: the
    extraction redoes the shard, and `status` shows it withdrawn by verify, with the reason."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(0), poll_s=0.2, retries=0)
    committed, withdrawn = [], None
    for claim in queue:
        if finish(store, manifest, claim):
            committed.append(claim.shard)
        if withdrawn is None:
            withdrawn = claim.shard
            corrupt(store, withdrawn)
            assert [b["shard"] for b in verify_run(store).bad] == [withdrawn]
            st = scan(store, manifest)
            assert st.state(withdrawn) == "failed" and st.attempt_failures(withdrawn) == 0
            failed = run_status(store)["failed"]
            assert [(f["shard"], f["withdrawn"], f["stopped"]) for f in failed] == [(withdrawn, True, False)]
            assert "withdrawn by `layertap verify`" in failed[0]["error"] and "checksum mismatch" in failed[0]["error"]
    assert sorted(committed) == sorted(list(range(len(manifest.shards))) + [withdrawn])
    assert queue.given_up == set() and list(store.list(layout.GIVEN_UP)) == []
    assert run_status(store)["complete"] and verify_run(store).bad == []


def test_a_verify_killed_after_withdrawing_a_commit_leaves_no_tally_beside_the_redos(store_uri, monkeypatch):
    """A verify killed right after it deleted a bad commit left the commit's tally marker; the
    redo (other counts) added its own, and `status` counted whichever sorts last, for good. The
    markers go before the commit now: the redo's is the shard's only one."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    corrupt(store, 2)
    real_delete = store.delete

    def delete(key):
        real_delete(key)
        if key == layout.commit_key(2):
            raise KeyboardInterrupt("verify killed")

    monkeypatch.setattr(store, "delete", delete)
    with pytest.raises(KeyboardInterrupt):
        verify_run(store)
    monkeypatch.undo()
    queue = WorkQueue(store, manifest, Producer.current(0), poll_s=0.2)
    assert [finish(store, manifest, claim, skip=manifest.shards[2].start) for claim in queue] == [True]
    redo = decode_commit(store.get(layout.commit_key(2)), "commit")
    assert [layout.parse_tally(k)[1]["records"] for k in tally_keys(store, 2)] == [redo.num_records]
    status = run_status(store)
    assert (status["samples_done"], status["tokens_done"]) == committed_truth(store)
    assert status["samples_skipped"] == 1


def test_status_and_verify_go_by_the_commit_not_a_stray_tally_marker(store_uri):
    """A second marker of a committed shard (what a killed verify left before): `status` counts the
    commit's numbers, and `verify` leaves the shard its commit's marker alone, also where only a
    wrong one was left."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    truth = committed_truth(store)
    [good] = tally_keys(store, 2)
    stray = good.replace(".r", ".r99", 1)  # sorts after the good one: it was the one counted
    store.put(stray, b"")
    status = run_status(store)
    assert (status["samples_done"], status["tokens_done"]) == truth
    assert verify_run(store).bad == [] and tally_keys(store, 2) == [good]
    store.delete(good)
    store.put(stray, b"")
    assert verify_run(store).bad == [] and tally_keys(store, 2) == [good]


def test_verify_deletes_only_the_withdrawn_commits_feed_key_not_a_redos(store_uri, monkeypatch):
    """A shard withdrawn and redone by a live extraction before verify ends: verify deleted every
    feed key of the shard at its end, the redo's too, so follow consumers found the redo only at
    their next full listing (300 s). Only the withdrawn commit's keys go now."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    old_data = corrupt(store, 0)
    [old_feed] = feed_keys(store, 0)
    real_delete = store.delete

    def delete(key):
        real_delete(key)
        if key == old_data:  # the withdrawal's last step: a live extraction redoes the shard meanwhile
            assert fake_worker.work(store_uri, shards=[0]) == [0]

    monkeypatch.setattr(store, "delete", delete)
    assert [b["shard"] for b in verify_run(store).bad] == [0]
    monkeypatch.undo()
    [new_feed] = feed_keys(store, 0)
    assert new_feed != old_feed and layout.parse_feed(new_feed)[0] >= layout.parse_feed(old_feed)[0]
    assert store.exists(layout.commit_key(0)) and run_status(store)["complete"]


@pytest.mark.parametrize("redone", [False, True], ids=["withdrawn", "withdrawn-and-redone"])
def test_a_commit_another_verify_withdrew_meanwhile_is_skipped_not_withdrawn(store_uri, monkeypatch, caplog, redone):
    """Two verifies at once: one withdraws a bad shard while the other looks at it. The second read
    a commit gone since its scan as "unreadable" and withdrew it again (a second failure record);
    with a redo committed in between, it withdrew the good new commit and orphaned its data. A
    commit that went or changed is skipped now, and said so."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    corrupt(store, 3)
    real_get = store.get

    def get(key, *args, **kwargs):
        first = key == layout.commit_key(3) and key not in seen
        seen.append(key)
        if first and not redone:  # the other verify withdraws it before this one reads it
            assert [b["shard"] for b in verify_run(open_store(store_uri)).bad] == [3]
        data = real_get(key, *args, **kwargs)
        if first and redone:  # ... after this one read it, and an extraction redoes the shard at once
            assert [b["shard"] for b in verify_run(open_store(store_uri)).bad] == [3]
            assert fake_worker.work(store_uri, shards=[3]) == [3]
        return data

    seen: list[str] = []
    monkeypatch.setattr(store, "get", get)
    result = verify_run(store)
    monkeypatch.undo()
    assert result.bad == [] and result.to_json()["gone"] == [3] and "shard 3: its commit went or changed" in caplog.text
    assert len(list(store.list(layout.failure_prefix(3)))) == 1  # the other verify's withdrawal only
    if redone:
        commit = decode_commit(store.get(layout.commit_key(3)), "commit")
        assert store.exists(commit.data_key) and len(tally_keys(store, 3)) == 1
        assert run_status(store)["complete"] and verify_run(store).bad == []
    else:
        [failure] = run_status(store)["failed"]
        assert failure["shard"] == 3 and failure["withdrawn"]


def test_a_worker_waiting_behind_the_window_stops_when_its_run_is_deleted(store_uri):
    """`layertap delete --force` of a run whose worker waits behind a --window (it holds no lease):
    the worker woke as the data went and committed into the deleted prefix. It checks that
    manifest.json exists before each claim, and stops saying why."""
    store = open_store(store_uri)
    fake_worker.plan(store)
    here = Path(__file__).parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(WORKER + [store_uri, "--window", "1"], stderr=subprocess.PIPE, text=True, env=env)
    seen = ""
    deadline = time.time() + 60
    while "window full" not in seen and time.time() < deadline:  # one shard committed: it waits
        line = proc.stderr.readline()
        if not line:
            break
        seen += line
    assert "window full" in seen, seen
    assert cli(["delete", store_uri, "--yes", "--force"]) == 0
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("the worker went on with the deleted run (and waits behind the window again)")
    assert proc.returncode != 0
    assert f"the run at {store.uri} was deleted (manifest.json is gone): stopping" in err, err[-3000:]
    assert list(store.list()) == [], "nothing was written into the deleted prefix"


def test_verify_that_skipped_a_shard_does_not_exit_as_if_all_were_checked(store_uri, monkeypatch, capsys):
    """A verify that skipped a shard whose commit another verify withdrew said "run verify again"
    and exited 0, so `layertap verify && layertap train ...` went on unchecked: it exits 3 now."""
    fake_worker.work(store_uri)
    corrupt(open_store(store_uri), 3)
    store = open_store(store_uri)
    real_get, seen = store.get, []

    def get(key, *args, **kwargs):
        if key == layout.commit_key(3) and key not in seen:  # the other verify withdraws it first
            seen.append(key)
            assert [b["shard"] for b in verify_run(open_store(store_uri)).bad] == [3]
        return real_get(key, *args, **kwargs)

    monkeypatch.setattr(store, "get", get)
    monkeypatch.setattr(layertap.storage.store, "open_store", lambda uri: store)
    assert cli(["verify", store_uri]) == 3
    assert "skipped 1 shard(s) whose commit went or changed" in capsys.readouterr().out
    monkeypatch.undo()
    assert cli(["verify", store_uri]) == 0  # the withdrawn shard is no longer committed: all checked


def test_verify_meeting_another_runs_shard_withdraws_nothing(tmp_path, capsys):
    """Shards were withdrawn in order as they were checked: a bad shard before one of another run
    (two runs sharing a prefix) had lost its commit when verify stopped with "Nothing was
    withdrawn". Every shard is checked first now."""
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    fake_worker.work(ours)
    fake_worker.work(theirs)
    store, other = open_store(ours), open_store(theirs)
    corrupt(store, 0)
    commit = decode_commit(other.get(layout.commit_key(4)), "commit")
    store.delete(decode_commit(store.get(layout.commit_key(4)), "commit").data_key)
    store.put(commit.data_key, other.get(commit.data_key))  # shard 4's commit and data are the other run's
    store.put(layout.commit_key(4), other.get(layout.commit_key(4)))
    assert cli(["verify", ours]) == 2
    assert "Nothing was withdrawn" in capsys.readouterr().err
    assert store.exists(layout.commit_key(0)) and not list(store.list(layout.FAILURES))


def test_a_corrupt_commit_without_its_tally_is_a_problem_not_the_end_of_the_report(store_uri, capsys):
    """Its ManifestError escaped `status` (exit 2, "no run there", with the key named relative to
    the run), where one bad record is a problem to report (exit 1) beside the rest."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    store.put(layout.commit_key(3), b"{")
    store.delete_many([o.key for o in store.list(f"{layout.TALLY}000003.")])
    assert cli(["status", store_uri]) == 1
    captured = capsys.readouterr()
    assert "shards" in captured.out
    assert f"{store_uri.rstrip('/')}/commits/000003.json: corrupt commit record" in captured.err
    assert "run `layertap verify` to withdraw it" in captured.err


def test_a_commit_record_whose_version_is_damaged_is_withdrawn_not_taken_for_a_newer_one(store_uri, capsys):
    """A null or text version read as "a newer layertap wrote this": verify stopped on the whole
    run (exit 2) while status called it complete."""
    import json

    fake_worker.work(store_uri)
    store = open_store(store_uri)
    record = json.loads(store.get(layout.commit_key(3)))
    record["version"] = None
    store.put(layout.commit_key(3), json.dumps(record).encode())
    assert cli(["verify", store_uri]) == 1
    assert not store.exists(layout.commit_key(3))
