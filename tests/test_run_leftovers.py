"""A run's records are its own. `layertap delete` refuses a run that processes holding no shard
lease still write to (extraction workers waiting behind --window, the --delete-consumed trainer):
what they write after the delete listed the prefix outlives it. A new run is not planned over
such leftovers (it adopted their commits as done), and consumption records of another run delete
none of its data. A follow trainer resumed after a shard it took changed says what to do."""

from __future__ import annotations

import json
import os

import pytest
import xxhash

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout, manifest
from layertap.manifests.consumption import (WindowGate, claim_consumer, delete_consumed, record_consumed,
                                            watermarks)
from layertap.manifests.manifest import NoRun, load_manifest
from layertap.manifests.output_lease import OutputLease
from layertap.manifests.records import Producer, decode_commit
from layertap.manifests.work import WorkQueue
from layertap.storage.errors import ConfigError, InputError
from layertap.storage.format import ShardMeta
from layertap.storage.store import open_store
from layertap.storage.writer import ShardWriter
from layertap.train import ShardStream, StreamConfig

FOLLOW = dict(follow=True, follow_poll_s=0.3, shuffle_buffer=4, seed=3)


def data_shards(store) -> set[int]:
    return {layout.shard_of(o.key, layout.SHARDS) for o in store.list(layout.SHARDS)}


# -- layertap delete ----------------------------------------------------------------------------


def test_delete_refuses_a_run_whose_delete_consumed_trainer_runs(tmp_path, capsys):
    """The trainer holds no shard lease: its watermarks, written after the delete listed the run,
    were left behind (and its output's lease is what says it runs)."""
    uri, out = str(tmp_path / "run"), open_store(str(tmp_path / "out"))
    fake_worker.work(uri)
    store = open_store(uri)
    claim_consumer(store, out.uri)
    with OutputLease(out):
        assert cli(["delete", uri, "--yes"]) == 2
        err = capsys.readouterr().err
        assert f"--delete-consumed trainer of run {load_manifest(store).run_id}" in err
        assert f"(writing to {out.uri}) is running (pid {os.getpid()}" in err and "pass --force" in err
        assert store.exists(layout.MANIFEST) and data_shards(store)
    assert cli(["delete", uri, "--yes"]) == 0  # the trainer stopped
    assert list(store.list()) == []


def test_delete_refuses_an_incomplete_window_run(tmp_path, capsys):
    """Workers of a --window extraction wait for training without a lease, then commit again."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0, 1])
    store = open_store(uri)
    WindowGate(store, 10_000).record()
    assert cli(["delete", uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert "extracted under a --window of" in err and "(2 of 7 shards committed)" in err
    assert "Stop them first" in err and "pass --force" in err and store.exists(layout.MANIFEST)
    fake_worker.work(uri)  # complete: no worker has anything left to wait for
    assert cli(["delete", uri, "--yes"]) == 0 and list(store.list()) == []


# -- a new run over a deleted one's leftovers ------------------------------------------------------


def test_delete_of_a_run_with_s3_folder_markers_deletes_them_too(s3_bucket, s3_endpoint, capsys):
    """An S3 console's "Create folder" (s3fs, Hadoop S3A) leaves empty `run/` and `run/stats/`
    objects: `delete` refused them as objects not the run's, and with --force crashed on their key
    ("invalid object key ''") after it had deleted the run's commits, every rerun the same."""
    import boto3

    uri = f"s3://{s3_bucket}/marked"
    fake_worker.work(uri)
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    for marker in ("marked/", "marked/stats/"):
        s3.put_object(Bucket=s3_bucket, Key=marker, Body=b"")
    assert cli(["status", uri]) == 0  # not "objects that are not the run's"
    assert cli(["delete", uri, "--yes"]) == 0
    assert "Contents" not in s3.list_objects_v2(Bucket=s3_bucket, Prefix="marked")
    # only the markers of empty folders go, as a local folder's would
    other = open_store(f"s3://{s3_bucket}/other")
    for marker in ("other/", "other/full/", "other/empty/"):
        s3.put_object(Bucket=s3_bucket, Key=marker, Body=b"")
    other.put("full/data.bin", b"x")
    other.remove_empty_folders()
    left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket, Prefix="other")["Contents"])
    assert left == ["other/", "other/full/", "other/full/data.bin"]


def test_a_new_run_is_not_planned_over_a_deleted_runs_leftovers(store_uri, capsys):
    """A commit (or watermark) written while `layertap delete` ran survived it: a new run at the
    prefix counted it as done, then training failed on "the object says run A, the commit run B"."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    late = store.get(layout.commit_key(3))
    assert cli(["delete", store_uri, "--yes"]) == 0
    store.put(layout.commit_key(3), late)  # what a worker still running wrote after the delete's listing
    with pytest.raises(ConfigError, match=r"holds no run \(manifest.json is missing\) but a run's records under "
                                          r"commits/") as e:
        fake_worker.plan(store)
    assert f"`layertap delete --force {store.uri}`" in str(e.value) and not store.exists(layout.MANIFEST)
    capsys.readouterr()
    # status said "no run ... (run `layertap extract` to start one)", which extract then refused
    assert cli(["status", store_uri]) == 2
    err = capsys.readouterr().err
    assert "holds no run (manifest.json is missing) but a run's records under commits/" in err
    assert "run `layertap extract` to start one" not in err
    # verify, export and train said the same as status did before (and train to look under commits/ for runs)
    for argv in (["verify", store_uri], ["export", store_uri, "--to", "specforge", f"{store_uri}-export"],
                 ["train", "--data", store_uri, "--model", "m", "--out", f"{store_uri}-drafter", "--steps", "1"]):
        assert cli(argv) == 2, argv
        err = capsys.readouterr().err
        assert "holds no run (manifest.json is missing) but a run's records under commits/" in err, (argv, err)
        assert "run `layertap extract` to start one" not in err
    assert cli(["delete", store_uri, "--yes", "--force"]) == 0
    capsys.readouterr()

    record_consumed(store, rank=0, world_size=1, shards=[0, 1], step=3)  # a trainer's, after the delete
    with pytest.raises(ConfigError, match="records under consumed/ranks/"):
        fake_worker.plan(store)
    store.delete(layout.consumed_rank_key(0))
    assert fake_worker.plan(store).shards  # nothing left: a new run


def test_a_concurrent_creators_run_is_resumed_not_taken_for_leftovers(tmp_path, monkeypatch):
    """Another worker created the run (and began writing it) between this one's look for a
    manifest and its look for leftovers: it adopts that run."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0])
    store = open_store(uri)
    created = load_manifest(store)
    real, calls = manifest.load_manifest, []

    def not_yet_the_first_time(s):
        calls.append(1)
        if len(calls) == 1:
            raise NoRun("not created yet")
        return real(s)

    monkeypatch.setattr(manifest, "load_manifest", not_yet_the_first_time)
    assert fake_worker.plan(store).run_id == created.run_id


# -- consumption records of another run ------------------------------------------------------------


def test_consumption_records_of_another_run_delete_none_of_its_data(store_uri):
    """A trainer of a deleted run, still running, records what it consumed at the prefix a new
    run now uses: a --window worker's sweep deleted the new run's fresh, never-trained shards."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    run_id = load_manifest(store).run_id
    everything = data_shards(store)
    record_consumed(store, rank=0, world_size=1, shards=sorted(everything), step=9, run_id="0ldrun0ldrun")
    store.put(layout.consumed_marker_key(2), json.dumps({"run_id": "0ldrun0ldrun"}).encode())
    WindowGate(store, 1, sweep_every_s=0).check()  # a full window: the sweep
    assert data_shards(store) == everything
    assert delete_consumed(store, run_id=run_id) == [] and data_shards(store) == everything

    record_consumed(store, rank=0, world_size=1, shards=[0, 2], step=10, run_id=run_id)  # the run's own
    assert delete_consumed(store, run_id=run_id) == [0, 2] and data_shards(store) == everything - {0, 2}
    assert json.loads(store.get(layout.consumed_marker_key(0))) == {"run_id": run_id}
    assert json.loads(store.get(layout.consumed_marker_key(2))) == {"run_id": run_id}

    record_consumed(store, rank=0, world_size=1, shards=[0, 1, 2], step=11)  # as written before run ids
    assert delete_consumed(store, run_id=run_id) == [1]


def test_a_trainer_of_a_deleted_run_deletes_nothing_of_the_new_runs_data(store_uri):
    """The other way round: the old run's trainer, still running at the prefix (after `delete
    --force`, or its lease lapsed), found its own watermarks' shard ids in the new run's commits
    and deleted that run's data."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    everything = data_shards(store)
    record_consumed(store, rank=0, world_size=1, shards=sorted(everything), step=9, run_id="0ldrun0ldrun")
    assert delete_consumed(store, run_id="0ldrun0ldrun") == [] and data_shards(store) == everything
    assert not list(store.list(layout.CONSUMED_SHARDS))


def test_status_counts_the_watermarks_that_name_their_run(store_uri):
    """With no run given, every watermark counts (`status`'s `consumed_everywhere`): the named ones
    were left out, so shards every rank had consumed but not yet marked showed as backlog."""
    from layertap.manifests.consumption import consumed_everywhere

    fake_worker.work(store_uri)
    store = open_store(store_uri)
    record_consumed(store, rank=0, world_size=1, shards=[0, 1, 2], step=5, run_id=load_manifest(store).run_id)
    assert consumed_everywhere(store) == {0, 1, 2}


def test_the_delete_consumed_trainer_names_its_run_in_what_it_records(tmp_path):
    from tiny_models import tiny_model_dir

    target = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=fake_worker.HIDDEN)
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    assert cli(["train", "--data", uri, "--model", target, "--out", str(tmp_path / "out"), "--follow",
                "--delete-consumed", "--follow-poll-s", "0.5", "--batch-size", "4", "--shuffle-buffer", "2",
                "--block-size", "4", "--max-anchors", "8"]) == 0
    run_id = load_manifest(store).run_id
    assert watermarks(store)[0]["run_id"] == run_id
    markers = [o.key for o in store.list(layout.CONSUMED_SHARDS)]
    assert markers and all(json.loads(store.get(k)) == {"run_id": run_id} for k in markers)


# -- a follow trainer resumed after a shard it took changed ------------------------------------------


def withdraw(uri: str, shard: int) -> None:
    """A byte of the shard's data flipped, found by `layertap verify`, which withdraws its commit."""
    store = open_store(uri)
    path = os.path.join(uri, decode_commit(store.get(layout.commit_key(shard)), "commit").data_key)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    assert cli(["verify", uri]) == 1 and not store.exists(layout.commit_key(shard))


def redo(uri: str, shard: int, skip: int = 0, other_bytes: bool = False) -> None:
    """An extraction worker redoes `shard`, skipping its first `skip` samples (recorded as skipped);
    `other_bytes`: each sample's first state a step off, as a redo on another GPU may compute it."""
    store = open_store(uri)
    m = load_manifest(store)
    for claim in WorkQueue(store, m, Producer.current(0), ttl_s=60, poll_s=0.2, shards=[shard]):
        with claim:
            meta = ShardMeta(run_id=m.run_id, shard_id=shard, model="synthetic", layers=fake_worker.LAYERS,
                             hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
            with ShardWriter(store.open_writer(claim.data_key), meta) as w:
                for i in range(claim.plan.start + skip, claim.plan.end):
                    sample = fake_worker.make_sample(i)
                    if other_bytes:
                        sample.hidden_states = sample.hidden_states.clone()
                        sample.hidden_states.view(-1)[0] += 1
                    w.write_sample(sample)
                info = w.close()
            skipped = [{"sample_id": f"s{i:05d}", "reason": "too_long"}
                       for i in range(claim.plan.start, claim.plan.start + skip)]
            assert claim.commit(info, skipped=skipped)


def checkpointed(uri: str, samples: int) -> dict:
    """The state of a follow stream that yielded `samples` samples of the (complete) run."""
    stream = ShardStream(uri, config=StreamConfig(**FOLLOW))
    it = iter(stream)
    for _ in range(samples):
        next(it)
    return stream.state_dict()


def resumed(uri: str, state: dict) -> ShardStream:
    stream = ShardStream(uri, config=StreamConfig(**FOLLOW))
    stream.load_state_dict(state)
    return stream


def test_a_follow_epoch_is_not_replayed_over_a_shard_redone_with_other_counts(tmp_path):
    """Shard 2 (6 records) was withdrawn and redone with 5: the replay gave it the new count, so
    every sample's place after it moved: one sample came twice and two never, silently."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    state = checkpointed(uri, 15)
    assert 2 in state["taken"][0]
    withdraw(uri, 2)
    redo(uri, 2, skip=1)
    with pytest.raises(InputError, match=r"shard 2 was redone with 5 records since the checkpoint \(it had 6\): "
                                         r"this follow epoch cannot be resumed exactly"):
        next(iter(resumed(uri, state)))


def _mid_later_epoch(uri: str, samples: int) -> tuple[dict, list[str]]:
    """A follow stream's state `samples` into the epoch after the follow epoch, and the samples the
    uninterrupted epoch yields after it."""
    stream = ShardStream(uri, config=StreamConfig(**FOLLOW))
    list(stream)  # the follow epoch
    it = iter(stream)
    for _ in range(samples):
        next(it)
    state = json.loads(json.dumps(stream.state_dict()))
    return state, [s["sample_id"] for s in it if not s["padding"]]


def test_a_later_epoch_resumes_over_a_shard_withdrawn_and_redone_with_the_same_samples(tmp_path):
    """Past the follow epoch the state held a fingerprint of shard ids and object hashes: a shard
    withdrawn by `verify` and redone (the same samples in other bytes) failed every resume mid-epoch
    for good, with "7 shards, 40 samples then, 7 shards, 40 samples now"."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    state, rest = _mid_later_epoch(uri, 5)
    assert state["epoch"] == 1 and state["settled"] == [[0, 6]]
    withdraw(uri, 2)
    redo(uri, 2)
    assert [s["sample_id"] for s in resumed(uri, state) if not s["padding"]] == rest
    withdraw(uri, 2)
    redo(uri, 2, skip=1)  # other samples: another order, which a resume mid-epoch cannot continue
    with pytest.raises(InputError, match="cannot resume this ShardStream mid-epoch"):
        resumed(uri, state)


def test_a_plain_stream_resumes_mid_epoch_over_a_shard_withdrawn_and_redone_with_the_same_samples(tmp_path):
    """A corrupt shard's error says to run `layertap verify`, which withdraws it for extraction to
    redo: the same samples in other bytes. Outside follow mode the state held only the shards'
    fingerprint (ids and object hashes), and every resume mid-epoch failed for good ("7 shards, 40
    samples then, 7 shards, 40 samples now"): the trainer's checkpoints were lost to the advice."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    config = StreamConfig(seed=3, shuffle_buffer=4)
    stream = ShardStream(uri, config=config)
    it = iter(stream)
    head = [next(it)["sample_id"] for _ in range(5)]
    state = json.loads(json.dumps(stream.state_dict()))
    rest = [s["sample_id"] for s in it]
    older = {k: v for k, v in state.items() if k != "order"}  # as a release before the order was recorded saved it
    resumed = ShardStream(uri, config=config)
    resumed.load_state_dict(older)
    assert [s["sample_id"] for s in resumed] == rest
    # the release before hashed the sample ids themselves into the order (ranks now hold a digest of each
    # shard's): its states resume over the same samples, and are refused over others
    earlier = dict(state, order=order_by_ids(uri))
    assert not state["order"].startswith(earlier["order"][:3]) and earlier["order"] != state["order"]
    resumed = ShardStream(uri, config=config)
    resumed.load_state_dict(earlier)
    assert [s["sample_id"] for s in resumed] == rest
    withdraw(uri, 2)
    redo(uri, 2, other_bytes=True)
    for saved in (state, earlier):
        again = ShardStream(uri, config=config)
        again.load_state_dict(saved)
        assert [s["sample_id"] for s in again] == rest and len(set(head + rest)) == 40
    withdraw(uri, 2)
    redo(uri, 2, skip=1)  # other samples: another order, which a resume mid-epoch cannot continue
    for saved in (state, earlier):
        with pytest.raises(InputError, match="cannot resume this ShardStream mid-epoch"):
            ShardStream(uri, config=config).load_state_dict(saved)


def order_by_ids(uri: str) -> str:
    """The order digest a state of the release before recorded: each committed shard's id, count and
    sample ids, hashed end to end."""
    store = open_store(uri)
    commits = sorted((decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)),
                     key=lambda c: c.shard)
    h = xxhash.xxh3_64()
    for c in commits:
        if c.num_records:
            h.update(f"{c.shard}:{len(c.sample_ids)}:".encode())
            h.update("\0".join(c.sample_ids).encode())
    return h.hexdigest()


def test_a_later_epoch_resumes_over_the_set_it_settled_on_though_a_given_up_shard_came_since(tmp_path):
    """A shard given up ends the follow epoch without it; a second `layertap extract` that redoes
    it changed the committed set, and every resume mid-epoch after the follow epoch failed for good.
    The epoch goes on over the set it began with."""
    from test_follow import give_up

    uri = str(tmp_path / "run")
    fake_worker.work(uri, shards=[0, 1, 2, 3, 4, 5])
    give_up(uri, 6)
    state, rest = _mid_later_epoch(uri, 5)
    assert state["settled"] == [[0, 5]]
    assert fake_worker.work(uri, shards=[6]) == [6]
    again = resumed(uri, state)
    assert [s["sample_id"] for s in again if not s["padding"]] == rest
    assert len(again.shards) == 6


def test_a_follow_trainer_resumed_before_a_withdrawn_shard_is_redone_is_told_to_redo_it(tmp_path):
    """"Start the epoch over" cannot be done where a --delete-consumed trainer deleted what it read."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    state = checkpointed(uri, 4)
    withdraw(uri, 6)
    with pytest.raises(InputError, match=r"shard\(s\) 6 .* no longer committed .*: run `layertap extract` "
                                         r"\(the run's command, unchanged\) to redo them, then resume"):
        next(iter(resumed(uri, state)))
    redo(uri, 6)  # with the same counts, the epoch goes on exactly
    ids = [s["sample_id"] for s in resumed(uri, state) if not s["padding"]]
    assert len(ids) == len(set(ids)) == 40 - 4


# -- the writer's own leftovers, and others' -----------------------------------------------------


def _write_shard(store, m, claim):
    """The claimed shard's object, as fake_worker writes it: its ShardInfo, for the commit."""
    meta = ShardMeta(run_id=m.run_id, shard_id=claim.shard, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    with ShardWriter(store.open_writer(claim.data_key), meta) as w:
        for i in range(claim.plan.start, claim.plan.end):
            w.write_sample(fake_worker.make_sample(i))
        return w.close()


def test_a_commit_whose_create_fails_with_its_outcome_unknown_keeps_its_data(tmp_path, caplog):
    """The commit's create timed out past its retries: the claim's exit found no commit and deleted
    the attempt's data, and a create still queued at the server landed after it: a complete run
    whose commit named a missing object. The data is kept; a late landing finds it."""
    from layertap.manifests.status import run_status
    from layertap.storage.store import TransientStoreError

    store = open_store(str(tmp_path / "run"))
    m = fake_worker.plan(store, 8, shard_bytes=10**9)  # one shard
    real, in_flight = store.put_if_absent, []

    def put_if_absent(key, data):
        if key.startswith(layout.COMMITS) and not in_flight:
            in_flight.append((key, data))  # on its way; the client gave up on it
            raise TransientStoreError(f"create of {key} failed: ReadTimeoutError (tried 8 times)")
        return real(key, data)

    store.put_if_absent = put_if_absent
    claim = next(iter(WorkQueue(store, m, Producer.current(0))))
    with pytest.raises(TransientStoreError), claim:
        info = _write_shard(store, m, claim)
        claim.commit(info)
    assert store.exists(claim.data_key) and "kept, in case it lands late" in caplog.text
    assert real(*in_flight[0])  # it lands
    assert run_status(store)["complete"]
    assert len(list(ShardStream(str(tmp_path / "run")))) == 8  # and the shard reads


def test_a_commit_stored_before_its_create_failed_is_a_commit(tmp_path, caplog):
    """The create landed, then answered an error past its retries (a 503 on the answer): the shard
    was taken for failed (a failure record, "shard 0 failed"), and its tally and feed keys were
    never written. The record it stored names this attempt's data: it is committed."""
    from layertap.manifests.status import run_status
    from layertap.storage.store import TransientStoreError

    store = open_store(str(tmp_path / "run"))
    m = fake_worker.plan(store, 8, shard_bytes=10**9)  # one shard
    real = store.put_if_absent

    def put_if_absent(key, data):
        stored = real(key, data)
        if key.startswith(layout.COMMITS):
            raise TransientStoreError(f"create of {key} failed: 503 Service Unavailable (tried 8 times)")
        return stored

    store.put_if_absent = put_if_absent
    claim = next(iter(WorkQueue(store, m, Producer.current(0))))
    with claim:
        info = _write_shard(store, m, claim)
        assert claim.commit(info) and claim.committed
    assert "the record it stored is there: committed" in caplog.text
    assert not list(store.list(layout.FAILURES)) and list(store.list(layout.TALLY)) and list(store.list(layout.FEED))
    assert run_status(store)["complete"] and len(list(ShardStream(str(tmp_path / "run")))) == 8


def test_the_end_of_run_sweep_leaves_the_writes_of_a_run_nested_below_alone(tmp_path):
    """A run planned inside another's prefix: the outer run's end-of-run sweep took every upload
    under its prefix older than the lease TTL that was not one of its shards for a killed put of
    its own records, and aborted the inner run's shard in progress."""
    import time

    outer_uri = str(tmp_path / "outer")
    fake_worker.plan(open_store(outer_uri), 40)
    fake_worker.plan(open_store(str(tmp_path / "elsewhere")), 40)
    fake_worker.copy_run(str(tmp_path / "elsewhere"), f"{outer_uri}/inner")  # no run is planned inside another
    inner = open_store(f"{outer_uri}/inner")
    writer = inner.open_writer(layout.data_key(0, "a" * 20))
    writer.write(b"x" * 1000)
    (upload,) = inner.list_pending_uploads()
    old = time.time() - 120  # a long shard: older than the outer run's lease TTL
    for path in tmp_path.rglob("*"):
        if path.is_file() and "inner" in path.parts and "shards" in path.parts:
            os.utime(path, (old, old))
    assert fake_worker.work(outer_uri, ttl=60.0)  # the outer run completes, and sweeps
    writer.close()  # failed: "No such file or directory"
    assert inner.exists(layout.data_key(0, "a" * 20))


@pytest.mark.parametrize("waiting, code", [(0, 4), (2, 3)])
def test_failed_shards_beside_workers_waiting_on_the_window_exit_3_not_4(tmp_path, monkeypatch, capsys, waiting, code):
    """Exit 4 says nothing will retry the failed shards (resubmit); workers waiting behind the
    window hold no lease, so they did not count as running, though they take shards as training
    consumes, the failed ones too."""
    import layertap.manifests.status as status

    fake_worker.work(str(tmp_path / "run"))
    monkeypatch.setattr(status, "run_status", lambda store, shards=None: {
        "complete": False, "problem": None, "shards_failed": 1, "shards_running": 0, "workers_waiting": waiting})
    assert cli(["status", str(tmp_path / "run"), "--json"]) == code
