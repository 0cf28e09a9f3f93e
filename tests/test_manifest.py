"""The run manifest: planning, resume, leases, the commit protocol, status and verify."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from itertools import islice
from dataclasses import replace
from pathlib import Path

import pytest

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout, liveness
from layertap.manifests.manifest import (ConfigMismatch, Manifest, ManifestError, UnsupportedVersion, create_or_resume,
                                        load_manifest, plan_shards)
from layertap.storage.units import parse_size
from layertap.manifests.records import Producer, decode_commit, decode_failure
from layertap.manifests.status import run_status, verify_run
from layertap.manifests.state import scan, scan_shard
from layertap.manifests.work import Claim, WorkQueue
from layertap.slurm.work import remaining_work
from layertap.storage.format import ShardMeta
from layertap.storage.identity import RunConfig
from layertap.storage.reader import ShardReader, verify_shard
from layertap.storage.writer import ShardWriter
from layertap.storage.store import StoreError, open_store
from layertap.train import ShardStream, StreamConfig

WORKER = [sys.executable, str(Path(__file__).with_name("fake_worker.py"))]


def child_env() -> dict[str, str]:
    """The test's environment (S3 endpoint and keys included) with the repo and tests importable."""
    here = Path(__file__).parent
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]))


def spawn(prefix: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(WORKER + [prefix, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=child_env())


def all_sample_ids(store) -> Counter:
    ids = Counter()
    for o in store.list(layout.COMMITS):
        c = decode_commit(store.get(o.key), o.key)
        reader = ShardReader(store, c.data_key)
        assert reader.sample_ids == c.sample_ids
        assert verify_shard(store, c.data_key, c.xxh3_128).ok
        ids.update(c.sample_ids)
    return ids


def test_parse_size():
    assert parse_size("64MB") == 64_000_000
    assert parse_size("1GiB") == 2**30
    assert parse_size("1.5g") == 1_500_000_000
    assert parse_size(4096) == 4096
    for bad in ("lots", "-1MB", "0", "12XB", 0, -1, True):  # numbers as a --config file gives them too
        with pytest.raises(ValueError, match="invalid size"):
            parse_size(bad)
    # a unit forgotten: `--shard-bytes 32` made a shard per sample, for good (the plan is kept)
    assert parse_size("32B") == 32 and parse_size("2000000") == 2_000_000
    assert parse_size(500_000.0) == 500_000  # a number a Python caller gives is bytes, as before
    with pytest.raises(ValueError, match=r"size '32' has no unit, so it is 32 bytes: write the unit, e.g. 32MB"):
        parse_size("32")


def test_plan_sizes_shards_by_estimated_bytes():
    counts = [800] * 1000 + [8000] * 100  # long samples at the end
    shards = plan_shards(counts, bytes_per_token=100.0, shard_bytes=8_000_000)
    assert shards[0].start == 0 and shards[-1].end == len(counts)
    assert all(a.end == b.start for a, b in zip(shards, shards[1:]))
    assert sum(s.est_tokens for s in shards) == sum(counts)
    full = [s.est_tokens * 100 for s in shards[:-1]]
    assert all(8_000_000 <= b < 8_000_000 + 8000 * 100 for b in full)  # each just past the target
    assert shards[0].num_samples == 100 and shards[-2].num_samples == 10  # same bytes, fewer samples
    # the largest shard, which window warnings size by: the plan's, not --shard-bytes, for a run below one
    plan = Manifest(run_id="r", created_at="t", config={}, dataset={}, shard_bytes=8_000_000, bytes_per_token=100.0,
                    shards=shards)
    assert plan.largest_shard_bytes == max(s.est_tokens for s in shards) * 100
    small = Manifest(run_id="r", created_at="t", config={}, dataset={}, shard_bytes=10**9, bytes_per_token=100.0,
                     shards=plan_shards([40] * 10, 100.0, 10**9))
    assert small.largest_shard_bytes == 40_000


def test_rows_the_extraction_skips_at_the_end_join_the_last_shard_not_one_of_their_own():
    """Prompt-only rows (0 tokens) after the last full shard made a shard of 0 tokens: extracted as an
    empty shard object, counted by estimate, not by the loader."""
    shards = plan_shards([64, 64, 0, 0], bytes_per_token=16.0, shard_bytes=1000)  # the last full shard, then 0s
    assert [(s.start, s.end, s.est_tokens) for s in shards] == [(0, 1, 64), (1, 4, 64)]
    shards = plan_shards([64, 64, 49, 0, 0], bytes_per_token=16.0, shard_bytes=1000)
    assert [(s.start, s.end, s.est_tokens) for s in shards] == [(0, 1, 64), (1, 2, 64), (2, 5, 49)]
    assert [(s.start, s.end) for s in plan_shards([0, 0], 16.0, 1000)] == [(0, 2)]  # a plan has a shard
    assert [(s.start, s.end) for s in plan_shards([0, 64, 0, 70], 16.0, 1000)] == [(0, 2), (2, 4)]


def test_the_plan_counts_the_rows_each_shard_skips_and_keeps_them_in_the_manifest(store):
    """A follow trainer sized its epoch by every planned row, skipped ones too: at --max-length 256,
    83 of 300 ShareGPT rows have no answer, and 41 of its 150 steps were padding alone under a
    stretched lr schedule. The plan knows them (token count 0) and now says how many per shard."""
    shards = plan_shards([64, 0, 64, 0, 0, 64, 49, 0, 0], bytes_per_token=16.0, shard_bytes=1000)
    assert [(s.start, s.end, s.skips, s.planned_records) for s in shards] == [(0, 1, 0, 1), (1, 3, 1, 1),
                                                                              (3, 6, 2, 1), (6, 9, 2, 1)]
    m, _ = create_or_resume(store, config={"model": "a", "layers": [1], "codec": "bf16"}, dataset={"fingerprint": "f"},
                            token_counts=[64, 0, 64, 0, 0, 64, 49, 0, 0], bytes_per_token=16.0, shard_bytes=1000)
    again = load_manifest(store)
    assert [s.skips for s in again.shards] == [0, 1, 2, 2] and again.shards == m.shards
    assert again.planned_records == 4 and again.num_samples == 9
    raw = json.loads(store.get(layout.MANIFEST))
    assert all(len(e) == 3 for e in raw["shards"])  # the entries older readers unpack keep their shape
    del raw["planned_skips"]  # a run planned before plans counted skips: every row counts
    store.put(layout.MANIFEST, json.dumps(raw).encode())
    assert load_manifest(store).planned_records == 9
    for bad, said in (([0, 1], "one count per shard (4)"), ([0, 3, 0, 0], "shard 1 plans 3 skipped rows of its 2"),
                      ([0, -1, 0, 0], "shard 1 plans -1"), ("0,1", "one count per shard"),
                      ([0, True, 0, 0], "holds True, not a count of rows"), ([0, 1.9, 0, 0], "holds 1.9")):
        store.put(layout.MANIFEST, json.dumps(dict(raw, planned_skips=bad)).encode())
        with pytest.raises(ManifestError, match="is corrupt") as e:
            load_manifest(store)
        assert said in str(e.value)


def test_a_commit_of_more_samples_than_the_plan_counts_is_refused(store_uri):
    """The plan counts which rows yield no sample, and a follow trainer sizes its epoch by that: a
    worker that stores one of them (tokenizing otherwise than the planner) would push a consumer
    past the count every rank pads to. Refused, not committed; one that skips more is fine."""
    store = open_store(store_uri)
    counts = fake_worker.token_counts(40)
    counts[1] = counts[3] = 0  # the planner found rows 1 and 3 yield no sample
    manifest = create_or_resume(store, config=fake_worker.CONFIG, dataset=fake_worker.DATASET, token_counts=counts,
                                bytes_per_token=len(fake_worker.LAYERS) * fake_worker.HIDDEN * 2 / 1.3,
                                shard_bytes=4000)[0]
    first = manifest.shards[0]
    assert first.skips == 2 and first.end > 4
    claim = next(iter(WorkQueue(store, manifest, Producer.current(), poll_s=0.2)))
    assert claim.shard == 0

    def write(ids):
        meta = ShardMeta(run_id=manifest.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                         hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
        with ShardWriter(store.open_writer(claim.data_key), meta) as w:
            for i in ids:
                w.write_sample(fake_worker.make_sample(i))
            return w.close()

    with pytest.raises(ManifestError) as e, claim:
        claim.commit(write([i for i in range(first.start, first.end) if i != 3]), skipped=[{"sample_id": "s00003"}])
    assert (f"shard 0: its object holds {first.num_samples - 1} sample(s), but the planner found 2 of its "
            f"{first.num_samples} rows yield none ({first.planned_records} at most)") in str(e.value)
    assert "not committed" in str(e.value) and not store.exists(layout.commit_key(0))
    claim = next(iter(WorkQueue(store, manifest, Producer.current(), poll_s=0.2)))
    with claim:  # skipping a row the plan kept (the row's own failure) stays allowed
        skipped = [{"sample_id": f"s{i:05d}"} for i in (1, 2, 3)]
        assert claim.commit(write([i for i in range(first.start, first.end) if i not in (1, 2, 3)]), skipped=skipped)


def test_plan_913k_samples_is_fast_enough_to_be_routine():
    counts = [800] * 913_786
    shards = plan_shards(counts, bytes_per_token=51_200 / 1.45, shard_bytes=1_000_000_000)
    assert sum(s.num_samples for s in shards) == 913_786
    assert 24_000 < len(shards) < 26_000  # 35 TB raw / 1.45 / 1 GB


def test_resume_and_config_mismatch(store, caplog):
    m1, created = create_or_resume(store, config={"model": "a", "layers": [1, 2], "codec": "bf16"},
                                   dataset={"fingerprint": "f1"}, token_counts=[10] * 50,
                                   bytes_per_token=10, shard_bytes=1000)
    assert created and len(m1.shards) == 5
    m2, created = create_or_resume(store, config={"model": "a", "layers": [1, 2], "codec": "bf16"},
                                   dataset={"fingerprint": "f1"}, token_counts=None, bytes_per_token=10)
    assert not created and m2.run_id == m1.run_id and m2.shards == m1.shards
    assert "keeps its plan" not in caplog.text  # no size asked for: the default's is no request to tell of
    create_or_resume(store, config={"model": "a", "layers": [1, 2], "codec": "bf16"}, dataset={"fingerprint": "f1"},
                     token_counts=None, bytes_per_token=10, shard_bytes=2000)
    assert "keeps its plan of 5 shards cut at 1,000 bytes" in caplog.text  # another size asked for: said
    caplog.clear()
    m3, _ = create_or_resume(store, config={"model": "a", "layers": [1, 2], "codec": "bf16"},
                             dataset={"fingerprint": "f1"}, token_counts=None, bytes_per_token=10, shard_bytes=1000)
    assert m3.shards == m1.shards and "keeps its plan" not in caplog.text
    with pytest.raises(ConfigMismatch) as e:
        create_or_resume(store, config={"model": "b", "layers": [1, 3], "codec": "bf16"},
                         dataset={"fingerprint": "f2"}, token_counts=[10] * 50, bytes_per_token=10)
    msg = str(e.value)
    assert "model: run has 'a', now 'b'" in msg and "layers: run has [1, 2], now [1, 3]" in msg
    assert "dataset fingerprint" in msg and "codec" not in msg
    assert load_manifest(store).to_json() == m1.to_json()  # untouched


# A manifest's config exactly as `layertap extract` has always written it.
EXTRACTED_CONFIG = {"model": "/models/Qwen3-8B", "gguf_file": None, "model_revision": "0" * 40, "model_type": "qwen3",
                    "tokenizer": "/models/Qwen3-8B", "layers": [1, 9, 17, 25, 33], "layer_convention": "decoder_output",
                    "final_state": "postnorm", "hidden_size": 4096, "codec": "bf16-zstd", "dtype": "auto",
                    "max_length": 4096}


def test_a_manifest_config_round_trips_through_its_type(store):
    identity = RunConfig.from_json(EXTRACTED_CONFIG)
    assert json.dumps(identity.to_json()) == json.dumps(EXTRACTED_CONFIG)  # same keys, same order, same values
    assert (identity.layers, identity.hidden_size, identity.final_state) == ([1, 9, 17, 25, 33], 4096, "postnorm")
    m, _ = create_or_resume(store, config=identity, dataset={"fingerprint": "f"}, token_counts=[10] * 5,
                            bytes_per_token=10)
    stored = json.loads(store.get("manifest.json"))["config"]
    assert json.dumps(stored) == json.dumps(EXTRACTED_CONFIG) and load_manifest(store).identity == identity
    with pytest.raises(ConfigMismatch, match="hidden_size: run has 4096, now 2048"):  # names the field
        create_or_resume(store, config=replace(identity, hidden_size=2048), dataset={"fingerprint": "f"},
                         token_counts=None, bytes_per_token=10)


def test_a_manifest_config_missing_a_fact_or_naming_an_unknown_codec_is_refused(store):
    create_or_resume(store, config={"model": "m", "codec": "bf16"}, dataset={"fingerprint": "f"},
                     token_counts=[10], bytes_per_token=10)
    with pytest.raises(ManifestError, match="layers"):
        load_manifest(store).identity
    obj = json.loads(store.get("manifest.json"))
    store.put("manifest.json", json.dumps(dict(obj, config=dict(EXTRACTED_CONFIG, codec="zf16"))).encode())
    with pytest.raises(UnsupportedVersion, match="codec 'zf16'.*upgrade layertap"):
        load_manifest(store).identity


def test_corrupt_or_foreign_manifest_is_a_clear_error(store):
    with pytest.raises(ManifestError, match="no run at .*manifest.json is missing"):
        load_manifest(store)
    store.put("manifest.json", b"{not json")
    with pytest.raises(ManifestError, match="manifest.json is corrupt"):
        load_manifest(store)
    store.put("manifest.json", json.dumps({"format": "layertap-manifest", "format_version": 99}).encode())
    with pytest.raises(ManifestError, match="manifest version 99"):
        load_manifest(store)
    store.put("manifest.json", json.dumps({"format": "layertap-manifest", "format_version": 1}).encode())
    with pytest.raises(ManifestError, match="corrupt"):
        load_manifest(store)


@pytest.mark.moto_only
def test_single_worker_completes_run_and_rerun_does_nothing(store_uri):
    done = fake_worker.work(store_uri)
    store = open_store(store_uri)
    manifest = load_manifest(store)
    assert sorted(done) == list(range(len(manifest.shards))) and len(done) >= 5
    assert all_sample_ids(store) == Counter(f"s{i:05d}" for i in range(40))
    s = run_status(store)
    assert (s["shards_done"], s["shards_failed"], s["shards_pending"], s["shards_running"]) == (len(done), 0, 0, 0)
    assert s["samples_done"] == 40 and s["tokens_done"] == sum(fake_worker.token_counts(40))
    assert s["complete"] and s["compression_ratio"] == round(s["bytes_raw"] / s["bytes_stored"], 4)
    assert fake_worker.work(store_uri) == []  # a rerun finds nothing to do
    assert len(list(store.list(layout.SHARDS))) == len(done)


@pytest.mark.moto_only
def test_a_worker_lists_the_run_once_per_pass_not_once_per_claim(store_uri, monkeypatch):
    """Each claim checks its own shard afresh (a HEAD and two small listings); the listings of
    the run's records come once per pass, and those of every commit record (`CommitView`'s full
    scans) for a lone worker once to start and once to find the run done, however many shards it
    claims in between: the passes between list the feed keys written since."""
    from layertap import manifests
    import layertap.manifests.work  # noqa: F401

    scans = []
    real_scan = manifests.work.scan
    monkeypatch.setattr(manifests.work, "scan", lambda *a, **kw: scans.append(kw.get("with_commits", True))
                        or real_scan(*a, **kw))
    done = fake_worker.work(store_uri)
    assert len(done) >= 5 and scans.count(True) == 2 and len(scans) <= 4, scans
    assert all_sample_ids(open_store(store_uri)) == Counter(f"s{i:05d}" for i in range(40))


class Stop(BaseException):
    """What a worker's SIGTERM handler raises (extract's Preempted), at any bytecode."""


def test_a_stop_signal_mid_claim_or_mid_release_leaves_no_lease(tmp_path, monkeypatch):
    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.2)

    def stop(*a, **kw):
        raise Stop()

    # Between the lease's creation and the claim reaching its holder.
    with monkeypatch.context() as m:
        m.setattr(store, "exists", stop)
        with pytest.raises(Stop):
            next(iter(queue))
    assert list(store.list(layout.LEASES)) == []

    # In the release, while the heartbeat thread is joined.
    claim = next(iter(queue))
    with claim:
        assert len(list(store.list(layout.LEASES))) == 1
        # one stop, as a signal handler that ignores further signals gives; the `with` then
        # releases again with the real join (the heartbeat may still be alive under load)
        with monkeypatch.context() as m:
            m.setattr(claim._heartbeat, "join", stop)
            with pytest.raises(Stop):
                claim.release()
    assert list(store.list(layout.LEASES)) == []


def test_a_stop_signal_inside_the_leases_put_leaves_no_lease_of_ours_and_keeps_anothers(store_uri, monkeypatch):
    """A signal during the lease's PUT, after the server stored it (the CI failure of
    test_sigterm_stops_cleanly_and_a_rerun_completes[s3]: `status` counted the shard running), or
    after another worker won the same key: the queue deletes our lease on the way out, and only ours."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.2, shards=[0])
    real_put = store.put_if_absent

    def put_then_stop(key, data):
        real_put(key, data)  # the server has it; the reply never reaches the caller
        raise Stop()

    with monkeypatch.context() as m:
        m.setattr(store, "put_if_absent", put_then_stop)
        with pytest.raises(Stop):
            next(iter(queue))
    assert list(store.list(layout.LEASES)) == []  # the CI run's status saw it left running

    other = WorkQueue(store, manifest, Producer.current(), poll_s=0.2, shards=[0])

    def lose_then_stop(key, data):
        # another worker's PUT of the same key landed first
        real_put(key, other.lease_payload(1, layout.data_key(0, other.producer.token)))
        raise Stop()

    with monkeypatch.context() as m:
        m.setattr(store, "put_if_absent", lose_then_stop)
        with pytest.raises(Stop):
            next(iter(queue))
    [lease] = list(store.list(layout.LEASES))  # the other worker's lease stays
    assert json.loads(store.get(lease.key))["holder"]["token"] == other.producer.token


def test_a_stop_between_close_and_commit_leaves_no_data_and_one_inside_the_commit_keeps_it(store_uri):
    """The data object is complete once the writer closes. A stop before the commit deletes it
    (no orphan); a stop that lands after the commit record was created keeps it (the commit names
    it), though the claim never learnt that its commit succeeded."""
    store = open_store(store_uri)
    manifest = fake_worker.plan(store)
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.2)

    def write(claim):
        meta = ShardMeta(run_id=manifest.run_id, shard_id=claim.shard, model="synthetic",
                         layers=fake_worker.LAYERS, hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
        with ShardWriter(store.open_writer(claim.data_key), meta) as w:
            for i in range(claim.plan.start, claim.plan.end):
                w.write_sample(fake_worker.make_sample(i))
            return w.close()

    claims = iter(queue)
    first = next(claims)
    with pytest.raises(Stop), first:
        write(first)
        raise Stop()
    assert list(store.list(layout.SHARDS)) == [] and not store.exists(layout.commit_key(first.shard))
    assert [decode_failure(store.get(o.key), o.key).preempted for o in store.list(layout.FAILURES)] == [True]

    second = next(claims)
    real = store.put_if_absent

    def create_then_stop(key, data):
        real(key, data)
        if key.startswith(layout.COMMITS):
            raise Stop()
        return True

    with pytest.raises(Stop), second:
        info = write(second)
        store.put_if_absent = create_then_stop
        second.commit(info)
    store.put_if_absent = real
    assert [o.key for o in store.list(layout.SHARDS)] == [second.data_key]
    assert verify_run(store).bad == [] and list(store.list(layout.LEASES)) == []


def test_concurrent_processes_store_every_sample_exactly_once(store_uri):
    procs = [spawn(store_uri, "--rank", str(r), "--world", "3", "--slow", "0.01") for r in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    committed = [int(x) for out, _ in outs for x in out.split()[1:]]
    store = open_store(store_uri)
    assert sorted(committed) == list(range(len(load_manifest(store).shards)))  # each shard by one worker
    assert len({tuple(o[0].split()[1:]) for o in outs}) > 1 or len(procs) == 1
    assert all_sample_ids(store) == Counter(f"s{i:05d}" for i in range(40))


def test_racing_commits_of_one_shard_yield_exactly_one(store_uri):
    """Several real processes finish the same shard at once (a takeover of a slow worker), each
    holding a lease generation: exactly one commit wins, each loser finishes its object and has
    its commit refused (the winner's sweep leaves a live attempt's upload alone: before, a loser
    still writing lost its upload under it, and failed), the losers' data objects are deleted,
    the winner's verifies."""
    code = f"""
import sys, fake_worker
from layertap.manifests.records import Producer
from layertap.manifests.work import Claim, WorkQueue
from layertap.storage.format import ShardMeta
from layertap.storage.writer import ShardWriter
from layertap.storage.store import open_store
store = open_store({store_uri!r})
m = fake_worker.plan(store)
q = WorkQueue(store, m, Producer.current(int(sys.argv[1])))
claim = Claim(q, m.shards[0], generation=int(sys.argv[1]) + 1, attempt=q.producer.token)
store.put(claim.lease_key, claim.lease_payload())
meta = ShardMeta(run_id=m.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                 hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
with ShardWriter(store.open_writer(claim.data_key), meta) as w:
    for i in range(m.shards[0].start, m.shards[0].end):
        w.write_sample(fake_worker.make_sample(i))
    info = w.close()
print(claim.commit(info))
"""
    fake_worker.plan(open_store(store_uri))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i)], stdout=subprocess.PIPE, text=True,
                              env=child_env())
             for i in range(4)]
    results = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert sorted(results) == ["False"] * 3 + ["True"]
    store = open_store(store_uri)
    commit = decode_commit(store.get(layout.commit_key(0)), "c")
    assert [o.key for o in store.list(layout.SHARDS)] == [commit.data_key]
    assert verify_shard(store, commit.data_key, commit.xxh3_128).ok


# Leases age by the store's clock (`ObjectStore.now`), read on S3 from the Date header in whole seconds
# and behind by the latency of the request that read it, and from LastModified counted at the end of its
# whole second: a lease may look up to two seconds and that latency (a busy CI machine's: tenths of a
# second) younger than it is, never older: waits for one to go stale add this.
STORE_CLOCK_SLACK = 2.6


def test_a_commit_removes_a_dead_attempts_upload_and_spares_a_live_ones(store_uri):
    """The winner's sweep (and a rerun's): an attempt whose lease went stale (killed) leaves an open upload,
    which is aborted; one whose lease is alive is still writing: its upload survives, it
    completes its object, its commit is refused and it deletes the object itself. Nothing of
    either is left. (Removing the live upload too fails this: its close errors.)"""
    store = open_store(store_uri, **({"part_size": 5 * 2**20} if store_uri.startswith("s3://") else {}))
    m = fake_worker.plan(store)
    meta = ShardMeta(run_id=m.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    claims = []
    for gen, ttl in ((1, 0.5), (2, 60.0), (3, 60.0)):  # dead (its lease soon stale), live, winner
        q = WorkQueue(store, m, Producer.current(gen), ttl_s=ttl)
        claims.append(Claim(q, m.shards[0], generation=gen, attempt=q.producer.token))
        store.put(claims[-1].lease_key, claims[-1].lease_payload())
    dead, live, winner = claims
    opened = {}
    for c in (dead, live):  # past one part: a real multipart upload on S3, a temp file on a folder
        opened[c] = store.open_writer(c.data_key)
        opened[c].write(os.urandom(6 * 2**20))
    assert {u.key for u in store.list_pending_uploads(layout.SHARDS)} == {dead.data_key, live.data_key}
    time.sleep(0.5 + STORE_CLOCK_SLACK)  # the dead attempt's lease goes stale
    with ShardWriter(store.open_writer(winner.data_key), meta) as w:
        for i in range(m.shards[0].start, m.shards[0].end):
            w.write_sample(fake_worker.make_sample(i))
        info = w.close()
    assert winner.commit(info)
    assert [u.key for u in store.list_pending_uploads(layout.SHARDS)] == [live.data_key]
    assert WorkQueue(store, m, Producer.current(4), shards=[0]).finished()  # a rerun's sweep spares it too
    assert [u.key for u in store.list_pending_uploads(layout.SHARDS)] == [live.data_key]
    opened[live].write(b"the rest")
    opened[live].close()  # raised before: its upload was aborted under it
    assert not live.commit(replace(info, key=live.data_key))
    assert [o.key for o in store.list(layout.SHARDS)] == [winner.data_key]
    assert store.list_pending_uploads(layout.SHARDS) == []
    opened[dead].abort()


def test_an_attempt_whose_upload_a_winner_swept_leaves_no_failure_record(store_uri):
    """A slow attempt taken over (its lease gone): the winner's sweep aborts its upload, so its close
    fails. The shard is committed, so that error is not recorded as a failure of the shard, and
    nothing of the attempt is left. (Recording it fails this: status would list a done shard's failure.)"""
    store = open_store(store_uri, **({"part_size": 5 * 2**20} if store_uri.startswith("s3://") else {}))
    m = fake_worker.plan(store)
    meta = ShardMeta(run_id=m.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    slow, winner = (Claim(q, m.shards[0], generation=gen, attempt=q.producer.token)
                    for gen, q in ((1, WorkQueue(store, m, Producer.current(1))),
                                   (2, WorkQueue(store, m, Producer.current(2)))))
    store.put(winner.lease_key, winner.lease_payload())  # the slow one's lease was deleted by the takeover
    writer = store.open_writer(slow.data_key)
    writer.write(os.urandom(6 * 2**20))
    with ShardWriter(store.open_writer(winner.data_key), meta) as w:
        for i in range(m.shards[0].start, m.shards[0].end):
            w.write_sample(fake_worker.make_sample(i))
        info = w.close()
    assert winner.commit(info)
    assert store.list_pending_uploads(layout.SHARDS) == []  # the slow attempt's upload, swept
    with pytest.raises(Exception) as raised:
        with slow:
            writer.write(b"the rest")
            writer.close()
    assert not isinstance(raised.value, AssertionError)
    assert list(store.list(layout.FAILURES)) == []
    assert slow.superseded and not slow.committed
    s = run_status(store)
    assert s["shards_done"] == 1 and s["shards_failed"] == 0 and not s["failed"]
    assert [o.key for o in store.list(layout.SHARDS)] == [winner.data_key]
    assert store.list_pending_uploads(layout.SHARDS) == []


def test_an_attempt_failing_before_any_commit_is_recorded(store_uri):
    """The other side of the above: with no commit of the shard, the error is the shard's failure."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    q = WorkQueue(store, m, Producer.current(1))
    claim = Claim(q, m.shards[0], generation=1, attempt=q.producer.token)
    with pytest.raises(RuntimeError):
        with claim:
            raise RuntimeError("boom")
    assert not claim.superseded
    assert [decode_failure(store.get(o.key), o.key).error for o in store.list(layout.FAILURES)] == ["boom"]


def test_two_attempts_of_one_worker_write_objects_of_their_own(store_uri):
    """One process claims a shard again after its own stalled attempt's lease went stale (a
    finishing shard's heartbeat stuck past the TTL). Both attempts finish: the first commits, the
    second loses and deletes its object, which must not be the committed one."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    me = Producer.current(0)  # one worker process: one token
    first = next(iter(WorkQueue(store, m, me, ttl_s=0.3, shards=[0])))  # its heartbeat stalls: never started
    time.sleep(0.3 + STORE_CLOCK_SLACK)
    second = next(iter(WorkQueue(store, m, me, ttl_s=60, shards=[0])))
    assert second.generation == first.generation + 1 and second.data_key != first.data_key
    meta = ShardMeta(run_id=m.run_id, shard_id=0, model="synthetic", layers=fake_worker.LAYERS,
                     hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    infos = []
    for claim in (first, second):
        with ShardWriter(store.open_writer(claim.data_key), meta) as w:
            for i in range(m.shards[0].start, m.shards[0].end):
                w.write_sample(fake_worker.make_sample(i))
            infos.append(w.close())
    assert first.commit(infos[0]) and not second.commit(infos[1])
    second.release()
    committed = decode_commit(store.get(layout.commit_key(0)), layout.commit_key(0))
    assert committed.data_key == first.data_key
    assert verify_shard(store, first.data_key, expected_xxh3_128=committed.xxh3_128).ok


def test_claims_with_different_lease_ttls_never_share_a_generation(store_uri):
    """The TTL is part of a lease's key, so a resubmission with another --lease-ttl creates the
    same generation under another key: both creates succeed, and the later claimant must back off."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    queues = [WorkQueue(store, m, Producer.current(r), ttl_s=ttl) for r, ttl in ((0, 60.0), (1, 30.0))]
    st = scan_shard(store, m, 0)  # both saw the shard free
    first, second = (q._try_claim(0, st) for q in queues)
    assert first is not None and second is None
    assert [o.key for o in store.list(layout.lease_prefix(0))] == [first.lease_key]


def test_a_lease_taken_anew_at_its_generation_is_neither_renewed_nor_released_by_the_old_holder(store_uri):
    """Generations restart at 1 once every lease of a shard is gone: a holder whose heartbeat
    stalled may find its lease key claimed by a new attempt. It must notice (and abandon), and
    neither rewrite nor delete the new attempt's lease. A lease of its own that vanished is not
    created again (only a takeover, or the sweep of a committed shard, deletes another's lease:
    creating it again made two holders beside a claim under another --lease-ttl): it abandons."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    q = WorkQueue(store, m, Producer.current(0), ttl_s=0.4)  # a heartbeat every 0.1 s
    gone = next(iter(q))
    with gone:
        store.delete(gone.lease_key)  # deleted by a takeover that then ended
        assert gone.lost.wait(10) and not store.exists(gone.lease_key)
    old = next(iter(q))
    with old:
        other = WorkQueue(store, m, Producer.current(1), ttl_s=0.4)
        new = Claim(other, m.shards[0], generation=old.generation, attempt=other.producer.token)
        store.put(new.lease_key, new.lease_payload())  # a new attempt holds the key now
        assert old.lost.wait(10)
        time.sleep(0.3)  # heartbeats that would have rewritten it
        assert json.loads(store.get(new.lease_key))["data_key"] == new.data_key
    assert json.loads(store.get(new.lease_key))["data_key"] == new.data_key  # the old holder's exit left it


def clock_ahead(monkeypatch, seconds: float) -> None:
    """This process's clock `seconds` ahead of the store's (moto's, or the kernel's file stamps):
    every LastModified looks `seconds` older than by our clock. Stores opened after this measure
    the offset (`ObjectStore.now`)."""
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + seconds)


def test_a_worker_whose_clock_runs_ahead_of_the_stores_leaves_a_fresh_lease_alone(store_uri, monkeypatch):
    """Leases age by the store's clock (LastModified). A worker 50 s ahead of it, with a 30 s TTL,
    took a lease renewed a moment ago for a stale one and took the shard over; it must wait for
    the holder instead, and claim the shard once the holder lets it go."""
    m = fake_worker.plan(open_store(store_uri))
    holder = next(iter(WorkQueue(open_store(store_uri), m, Producer.current(0), ttl_s=30, shards=[0])))
    clock_ahead(monkeypatch, 50)
    store = open_store(store_uri)
    ahead = WorkQueue(store, m, Producer.current(1), ttl_s=30, shards=[0], poll_s=0.1)
    claimed = []
    waiter = threading.Thread(target=lambda: claimed.append(next(iter(ahead))), daemon=True)
    waiter.start()
    waiter.join(1.5)
    assert waiter.is_alive() and not claimed  # it waits on the live lease
    assert json.loads(store.get(holder.lease_key))["data_key"] == holder.data_key
    holder.release()
    waiter.join(30)
    assert claimed and claimed[0].shard == 0 and claimed[0].data_key != holder.data_key
    claimed[0].release()


def test_no_object_looks_older_than_it_is(store_uri):
    """S3 lists LastModified in whole seconds, rounded down: counted as written at that stamp, an
    object written 0.1 s ago looked up to 1.1 s old, so a lease of a 1 s TTL (`--lease-ttl 1`),
    renewed 4 times a second, went stale for part of every second and its live shard was taken
    over. Its age by the store's clock is at most the time since the write began, at every
    fraction of a second."""
    store = open_store(store_uri)
    store.put("probe", b"x")
    while time.time() % 1 > 0.05:
        time.sleep(0.005)
    store.now()  # the clock's offset, measured once, early in a second: the writes below land later in theirs
    for i in range(10):
        time.sleep(0.09)
        began = time.time()
        store.put("probe", b"x")
        [info] = [o for o in store.list("probe")]
        assert store.now() - info.modified <= time.time() - began + 0.01, i


def test_status_and_delete_on_a_machine_whose_clock_runs_ahead_see_a_live_lease(store_uri, monkeypatch):
    """`status`, `submit` and `delete` run on a login node, whose clock may run ahead of the
    store's: a shard under a lease renewed a moment ago must still count as running there (not
    pending, to be resubmitted), and `delete` must still refuse the run."""
    from layertap.manifests.delete import Refused, describe

    m = fake_worker.plan(open_store(store_uri))
    holder = next(iter(WorkQueue(open_store(store_uri), m, Producer.current(0), ttl_s=30, shards=[0])))
    clock_ahead(monkeypatch, 50)
    store = open_store(store_uri)
    assert abs(store.now() - (time.time() - 50)) < 3  # the store's clock, measured
    assert run_status(store)["shards_running"] == 1
    assert 0 not in remaining_work(store).todo
    with pytest.raises(Refused, match="live leases"):
        describe(store, force=False)
    holder.release()


def test_stopped_and_taken_over_attempts_do_not_use_up_a_shards_retries(store_uri):
    """A worker gives a shard up after `retries + 1` failures of its own; preemptions and
    takeovers say nothing of the shard, so they are recorded apart and not counted."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    q = WorkQueue(store, m, Producer.current(0), retries=1, shards=[0])
    for gen in (1, 2, 3):
        stopped = Claim(q, m.shards[0], generation=gen, attempt=f"x{gen}")
        if gen == 3:
            stopped.lost.set()  # a takeover; it then stops with LeaseLost
        stopped.fail(RuntimeError("lease lost") if gen == 3 else KeyboardInterrupt(), preempted=gen < 3)
    assert all(o.key.endswith(layout.STOPPED) for o in store.list(layout.failure_prefix(0)))
    claim = next(iter(q))
    assert claim.shard == 0
    claim.release()
    for gen in (4, 5):
        Claim(q, m.shards[0], generation=gen, attempt=f"x{gen}").fail(RuntimeError("bad input"))
    assert list(q) == [] and q.given_up == {0}  # its own failures still count


@pytest.mark.parametrize("ttl", ["2", "600"])
def test_sigkilled_lease_holder_is_taken_over(store_uri, ttl):
    """A SIGKILLed worker's lease: taken over once it expires (2 s); or, by a worker on the same
    machine, at once (600 s: it waited the whole TTL, silently, before the holder's exit was seen
    here: same host and PID namespace, PID gone)."""
    hung = spawn(store_uri, "--hang-shard", "0", "--ttl", ttl)
    assert hung.stdout.readline().startswith("hanging in shard 0")
    store = open_store(store_uri)
    assert run_status(store)["shards_running"] == 1
    hung.send_signal(signal.SIGKILL)
    hung.wait()
    t0 = time.time()
    helper = spawn(store_uri, "--ttl", ttl)
    out, err = helper.communicate(timeout=120)
    assert helper.returncode == 0, err[-2000:]
    assert "0" in out.split()[1:]  # the survivor did shard 0 too
    s = run_status(store)
    assert s["complete"] and s["shards_running"] == 0
    assert all_sample_ids(store) == Counter(f"s{i:05d}" for i in range(40))
    assert time.time() - t0 < 60  # with 600: not the TTL
    store.abort_pending_uploads()  # the killed writer's parts (S3) or temp file (local)
    assert store.list_pending_uploads() == []


def test_a_live_lease_of_another_machine_is_not_taken_over(store_uri):
    """A holder named by another host (or without a PID namespace: a lease of an older layertap)
    is waited on, whatever its PID."""
    store = open_store(store_uri)
    fake_worker.plan(store)
    for shard, holder in ((0, {"host": "another-node", "pid": 1 << 22, "pid_ns": liveness.pid_namespace()}),
                          (1, {"host": socket.gethostname(), "pid": 1 << 22})):
        store.put(layout.lease_key(shard, 1, 600), json.dumps({"holder": {**holder, "token": "t"}}).encode())
    queue = WorkQueue(store, load_manifest(store), Producer.current(), ttl_s=600, shards=[0, 1])
    st = scan(store, queue.manifest)
    assert not queue._dead_here([st.live_lease(0), st.live_lease(1)])
    assert len(list(store.list(layout.LEASES))) == 2


def test_idle_worker_waits_for_a_live_lease_instead_of_exiting(store_uri):
    """One slow worker holds the only shard; a second worker must not exit before it commits."""
    store = open_store(store_uri)
    fake_worker.plan(store)
    slow = spawn(store_uri, "--slow", "0.25", "--ttl", "3")  # several seconds per shard
    deadline = time.time() + 30
    while not list(store.list(layout.LEASES)) and time.time() < deadline:
        time.sleep(0.05)
    waiter = spawn(store_uri, "--ttl", "3")
    waiter.communicate(timeout=180)
    slow.communicate(timeout=180)
    assert waiter.returncode == 0 and slow.returncode == 0
    assert run_status(store)["complete"]  # the waiter exited only when nothing was left


@pytest.mark.moto_only
def test_failure_is_recorded_shown_and_resumed(store_uri, capsys):
    done = fake_worker.work(store_uri, fail_shard=2)
    store = open_store(store_uri)
    assert 2 not in done
    s = run_status(store)
    assert s["shards_failed"] == 1 and s["failed"][0]["shard"] == 2
    assert "RuntimeError: injected failure in shard 2" in s["failed"][0]["error"]
    assert s["failed"][0]["attempts"] == 2  # tried twice (retries=1), then left failed
    assert not s["complete"]
    assert not list(store.list(f"{layout.SHARDS}000002-")), "a failed attempt leaves no data object"

    assert cli(["status", store_uri]) == 4  # failed shards: exit 4, for scripts
    out = capsys.readouterr().out
    assert "1 failed" in out and "FAILED shard 2" in out and "injected failure" in out
    assert "nothing is running" in out and "ETA" not in out
    assert cli(["status", store_uri, "--json"]) == 4
    js = json.loads(capsys.readouterr().out)
    for key in ("shards_total", "shards_done", "shards_failed", "shards_pending", "shards_running",
                "samples_done", "tokens_done", "bytes_stored", "failed"):
        assert key in js
    assert js["failed"][0]["shard"] == 2 and "injected" in js["failed"][0]["error"]

    # its retry under way: running, not failed (the earlier attempt's record stays beside the live lease)
    retry = next(iter(WorkQueue(store, fake_worker.plan(store), Producer.current(0), ttl_s=60, shards=[2],
                                poll_s=0.2)))
    s = run_status(store)
    assert retry.shard == 2 and (s["shards_running"], s["shards_failed"]) == (1, 0)
    retry.release()
    assert run_status(store)["shards_failed"] == 1

    assert fake_worker.work(store_uri) == [2]  # the rerun does only the failed shard
    assert run_status(store)["complete"]
    assert all_sample_ids(store) == Counter(f"s{i:05d}" for i in range(40))

    # a second tally marker (a `verify` killed while it withdrew an earlier commit): its numbers are not
    # trusted, the commit's are
    before = run_status(store)
    store.put(layout.tally_key(2, 999, 99999, 1, 1, 0, 0), b"")
    after = run_status(store)
    assert after["samples_done"] == before["samples_done"] == 40 and after["tokens_done"] == before["tokens_done"]


@pytest.mark.moto_only
def test_verify_withdraws_a_corrupted_shard_and_rerun_redoes_it(store_uri, capsys):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    assert cli(["verify", store_uri]) == 0
    commit = decode_commit(store.get(layout.commit_key(3)), "c")
    data = bytearray(store.get(commit.data_key))
    data[len(data) // 2] ^= 0xFF
    store.put(commit.data_key, bytes(data))
    capsys.readouterr()

    assert cli(["verify", store_uri, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["withdrawn"] == 1 and report["bad"][0]["shard"] == 3
    assert "checksum mismatch" in report["bad"][0]["error"] or "hash" in report["bad"][0]["error"]
    feed = [layout.parse_feed(o.key)[1] for o in store.list(layout.FEED)]
    assert 3 not in feed and sorted(feed) == [s for s in range(len(feed) + 1) if s != 3]  # only its key went
    s = run_status(store)
    assert s["shards_failed"] == 1 and "VerifyFailed" in s["failed"][0]["error"]
    assert fake_worker.work(store_uri) == [3]
    assert cli(["verify", store_uri]) == 0
    assert all_sample_ids(store) == Counter(f"s{i:05d}" for i in range(40))


def _flip(store, shard: int) -> None:
    commit = decode_commit(store.get(layout.commit_key(shard)), "c")
    data = bytearray(store.get(commit.data_key))
    data[len(data) // 2] ^= 0xFF
    store.put(commit.data_key, bytes(data))


def test_verify_of_a_run_it_cannot_write_says_the_shards_are_bad_and_why_they_stay(tmp_path, capsys, monkeypatch):
    """A run this user may read but not write: verify logged "withdrawing its commit", then failed with
    "cannot write .../failures/...: permission denied; choose a writable output folder" (verify has none),
    and named the first bad shard alone. Every bad shard is reported, and --dry-run writes nothing."""
    import errno

    from layertap.storage import local

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    _flip(store, 3)
    _flip(store, 5)
    denied = local._os_error(PermissionError(errno.EACCES, "Permission denied"), str(tmp_path / "run" / "failures"))
    monkeypatch.setattr(local.LocalStore, "put", lambda self, key, body: (_ for _ in ()).throw(denied))
    monkeypatch.setattr(local.LocalStore, "delete", lambda self, key: (_ for _ in ()).throw(denied))
    capsys.readouterr()
    assert cli(["verify", uri]) == 2
    out, err = capsys.readouterr()
    assert "BAD shard 3: " in out and "BAD shard 5: " in out and "WITHDRAWN" not in out, out
    assert "bad shard(s) 3, 5 of " in err and "could not be withdrawn: cannot write" in err, err
    assert "run `layertap verify` where it is writable (`layertap verify --dry-run` reports without writing)" in err
    assert "choose a writable output folder" not in err
    assert cli(["verify", uri, "--dry-run"]) == 1
    out, err = capsys.readouterr()
    assert "BAD shard 3: " in out and "BAD shard 5: " in out and "without --dry-run withdraws it" in out and not err
    assert store.exists(layout.commit_key(3)) and store.exists(layout.commit_key(5))


@pytest.mark.parametrize("outage", ["one object", "the whole store"])
def test_verify_reports_what_it_checked_before_the_store_stopped_answering(tmp_path, capsys, monkeypatch, outage):
    """A store failing past its retries on one shard's data (or on everything from then on): verify
    raised at once, and shards found bad before it were neither reported nor withdrawn; each shard
    after it waited out the same retries. Those checked are reported, the rest named as not checked,
    exit 5; a bad one is withdrawn while the store still answers, and nothing more is asked of it
    once it does not (each look would wait out the retries again, and lose the report)."""
    from layertap.storage import local
    from layertap.storage.store import TransientStoreError

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    _flip(store, 0)
    stuck = decode_commit(store.get(layout.commit_key(2)), "c").data_key
    down = []

    def failing(method):
        real = getattr(local.LocalStore, method)

        def call(self, key="", *a, **kw):
            if key == stuck:
                down.append(key)
            if down and (outage == "the whole store" or key == stuck):
                raise TransientStoreError(f"{method} of {key} failed: SlowDown (tried 8 times)")
            return real(self, key, *a, **kw)
        return call

    for method in ("open_stream", "get", "put", "delete", "exists", "list", "size"):
        monkeypatch.setattr(local.LocalStore, method, failing(method))
    capsys.readouterr()
    assert cli(["verify", uri, "--threads", "1"]) == 5
    out, err = capsys.readouterr()
    assert "verified 2 committed shards: 1 ok, 1 bad" in out, out + err
    assert "SlowDown (tried 8 times); 5 committed shard(s) were not checked (2-6)" in err, err
    monkeypatch.undo()
    if outage == "one object":
        assert "WITHDRAWN shard 0: " in out and not store.exists(layout.commit_key(0))
        assert ": run `layertap verify" in err
    else:
        assert "BAD shard 0: " in out and "(not withdrawn)" in out and store.exists(layout.commit_key(0))
        assert ", and bad shard(s) 0 were not withdrawn: run `layertap verify" in err
    assert store.exists(layout.commit_key(2))


def test_verify_stops_on_a_store_failure_instead_of_withdrawing(store_uri, monkeypatch):
    """A commit record the store fails to return (after its retries) is not a bad shard: verify
    stops with the store's error and withdraws nothing."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    real_get = store.get

    def get(key):
        if key == layout.commit_key(2):
            raise StoreError("injected: the store keeps failing")
        return real_get(key)

    monkeypatch.setattr(store, "get", get)
    with pytest.raises(StoreError):
        verify_run(store)
    monkeypatch.undo()
    assert len(list(store.list(layout.COMMITS))) == 7 and list(store.list(layout.FAILURES)) == []


@pytest.mark.moto_only
def test_corrupt_commit_record_is_a_clear_error_and_withdrawn(store_uri, capsys):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    store.put(layout.commit_key(1), b"{garbage")
    with pytest.raises(ManifestError, match="corrupt commit record"):
        decode_commit(store.get(layout.commit_key(1)), layout.commit_key(1))
    assert cli(["verify", store_uri]) == 1
    out = capsys.readouterr().out
    assert "unreadable commit record" in out and "to withdraw it" not in out  # what verify did, not what to do
    assert cli(["status", store_uri]) == 4
    out = capsys.readouterr().out
    assert "withdrawn by `layertap verify`: unreadable commit record" in out and "to withdraw it" not in out
    assert fake_worker.work(store_uri) == [1]


def test_a_replaced_manifest_is_refused_not_resumed(store_uri, capsys):
    """Commits made under a manifest that was then deleted and planned again follow another plan:
    extraction, status, Slurm resubmission and the loader stop and say so instead of counting
    those shards as done."""
    from layertap.storage.errors import ConfigError

    assert fake_worker.work(store_uri, shards=[0, 1]) == [0, 1]
    store = open_store(store_uri)
    store.delete(layout.MANIFEST)
    time.sleep(1.1)  # S3 stamps objects to the second
    with pytest.raises(ConfigError, match="holds no run"):  # planned over the commits: refused
        fake_worker.plan(store, shard_bytes=8000)
    other = open_store(store_uri.rstrip("/") + "-plan")
    fake_worker.plan(other, shard_bytes=8000)  # other shard boundaries, put in place by hand (or a race)
    store.put(layout.MANIFEST, other.get(layout.MANIFEST))
    with pytest.raises(ManifestError, match=r"2 commit record\(s\) .* another plan than its manifest.json's \(shards 0, 1\)"):
        fake_worker.work(store_uri)
    assert list(store.list(layout.LEASES)) == [], "nothing was claimed"
    s = run_status(store)
    assert s["stale_commits"] == [0, 1] and not s["complete"] and "manifest was replaced" in s["problem"]
    assert cli(["status", store_uri]) == 1
    assert "manifest was replaced" in capsys.readouterr().err
    with pytest.raises(ManifestError, match="manifest was replaced"):
        ShardStream(store_uri)
    with pytest.raises(ManifestError, match="manifest was replaced"):
        remaining_work(store)


def test_a_copied_run_is_not_taken_for_a_replaced_manifest(store_uri):
    """Copying a run (`aws s3 sync`, `cp -r`) stamps its objects anew in any order: commit records
    older than the manifest are then read and found to fit its plan, and the copy is used as is."""
    fake_worker.work(store_uri)
    src = open_store(store_uri)
    dst = open_store(store_uri.rstrip("/") + "-copy")
    keys = sorted(o.key for o in src.list() if o.key != layout.MANIFEST)
    for key in keys:
        dst.put(key, src.get(key))
    time.sleep(1.1)  # S3 stamps objects to the second
    dst.put(layout.MANIFEST, src.get(layout.MANIFEST))  # last, as a sync in key order does it
    s = run_status(dst)
    assert s["problem"] is None and s["complete"] and s["samples_done"] == 40
    assert fake_worker.work(dst.uri) == []  # nothing to redo
    assert sum(1 for _ in ShardStream(dst.uri, config=StreamConfig(shuffle=False))) == 40


def test_static_assignment_works_only_its_shards(store_uri):
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    mine = [s.id for s in m.shards if s.id % 2 == 0]
    assert sorted(fake_worker.work(store_uri, shards=mine)) == mine
    s = run_status(store)
    assert s["shards_done"] == len(mine) and s["shards_pending"] == len(m.shards) - len(mine)
    with pytest.raises(ValueError, match=r"--shards names 7, which the run does not have"):
        WorkQueue(store, m, Producer.current(), shards=[len(m.shards)])


@pytest.mark.moto_only
def test_status_survives_a_missing_tally(store_uri):
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    before = run_status(store)
    for o in list(store.list(layout.TALLY))[:2]:
        store.delete(o.key)
    listing = [(o.key, o.version) for o in store.list()]
    after = run_status(store)
    assert {k: after[k] for k in ("samples_done", "tokens_done", "bytes_stored")} == \
           {k: before[k] for k in ("samples_done", "tokens_done", "bytes_stored")}
    assert [(o.key, o.version) for o in store.list()] == listing  # status read the commits, wrote nothing
    assert verify_run(store).bad == []  # verify is the command that repairs: the markers are back
    assert len(list(store.list(layout.TALLY))) == len(list(store.list(layout.COMMITS)))


def test_status_of_a_missing_run_is_a_clear_error(store_uri, capsys):
    assert cli(["status", store_uri]) == 2
    assert "no run at" in capsys.readouterr().err


def test_a_lost_claim_race_is_waited_on_not_taken_for_the_end(store_uri):
    """Between a worker's listing and its claim another worker may lease the shard: the queue
    must wait for that lease (here it goes stale), not end with the shard unfinished."""
    store = open_store(store_uri)
    m = fake_worker.plan(store)
    queue = WorkQueue(store, m, Producer.current(), ttl_s=1.0, shards=[0], poll_s=0.2)
    real_try_claim = queue._try_claim

    def competitor_first(shard, st, redo=False):
        if not getattr(competitor_first, "done", False):
            competitor_first.done = True  # a rival creates this very generation just before us
            store.put_if_absent(layout.lease_key(shard, st.next_generation(shard), 1.0), b'{"rival": true}')
        return real_try_claim(shard, st, redo)

    queue._try_claim = competitor_first
    claim = next(iter(queue), None)  # the rival never renews: its lease goes stale, then it is ours
    assert claim is not None and claim.shard == 0 and claim.generation == 2


# -- deleting a run ------------------------------------------------------------------------------


def sibling(store_uri: str) -> str:
    """A prefix that starts like `store_uri` (runs/test-2 beside runs/test): must survive its delete."""
    return store_uri + "-2"


def test_delete_removes_every_object_of_the_run_and_nothing_else(store_uri, capsys):
    fake_worker.work(store_uri, fail_shard=1)
    fake_worker.work(sibling(store_uri))
    store, other = open_store(store_uri), open_store(sibling(store_uri))
    kept = [(o.key, o.version) for o in other.list()]
    n = len(list(store.list()))
    # Without a terminal and without --yes: refused, nothing deleted.
    assert cli(["delete", store_uri]) == 2
    assert "standard input is not a terminal; pass --yes" in capsys.readouterr().err
    assert len(list(store.list())) == n
    assert cli(["delete", store_uri, "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"run {load_manifest(other).run_id}" not in out and f"{n:,} object(s)" in out
    assert list(store.list()) == [] and not store.exists(layout.MANIFEST)
    assert [(o.key, o.version) for o in other.list()] == kept
    if not store_uri.startswith("s3://"):
        assert not os.path.exists(store_uri)  # no empty folders left
    assert cli(["delete", store_uri, "--yes"]) == 0 and "nothing to delete" in capsys.readouterr().out
    assert cli(["status", store_uri]) == 2


def test_a_delete_cut_short_leaves_no_commit_without_its_data(tmp_path):
    """Commits and data went in one parallel wave: a delete interrupted midway could leave commits
    of deleted data, which status counts done and a trainer fails on. The commit records (and what
    is made of them: tallies, feed keys, the commit index) go first, the manifest last."""
    from layertap.manifests.delete import delete_all

    from layertap.manifests.consumption import delete_consumed, record_consumed

    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    record_consumed(store, rank=0, world_size=1, shards=[0], step=1)
    delete_consumed(store)  # shard 0 consumed: its marker stays, its data is gone
    order: list[list[str]] = []
    deleting = store.delete_many
    store.delete_many = lambda keys: (order.append(list(keys)), deleting(keys))[1]
    keys = [o.key for o in store.list()]
    assert delete_all(store, keys, threads=4) == len(keys)
    flat = [k for batch in order for k in batch]
    first_data = min(i for i, k in enumerate(flat) if k.startswith(layout.SHARDS))
    assert all(i < first_data for i, k in enumerate(flat) if k.startswith((layout.COMMITS, layout.TALLY)))
    # consumption markers too: a run redone in place after a cut-short delete took them for its fresh shards'
    batch_of = lambda key: next(i for i, batch in enumerate(order) if key in batch)  # noqa: E731
    assert batch_of(layout.consumed_marker_key(0)) < min(batch_of(k) for k in keys if k.startswith(layout.SHARDS))
    assert flat[-1] == layout.MANIFEST and sorted(flat) == sorted(keys) and list(store.list()) == []


def test_delete_refuses_what_is_not_a_run_and_a_run_being_written(store_uri, capsys):
    store = open_store(store_uri)
    store.put("notes/readme.txt", b"not a run")
    assert cli(["delete", store_uri, "--yes"]) == 2
    assert "holds no run (no manifest.json) and no training output" in capsys.readouterr().err
    assert store.exists("notes/readme.txt")
    assert cli(["delete", store_uri, "--yes", "--force"]) == 0 and not store.exists("notes/readme.txt")

    fake_worker.work(store_uri, shards=[0])
    store.put(layout.lease_key(1, 1, 600), b"{}")  # a live worker holds shard 1
    assert cli(["delete", store_uri, "--yes"]) == 2
    assert "shard(s) 1 of run" in capsys.readouterr().err and store.exists(layout.MANIFEST)
    manifest = store.get(layout.MANIFEST)  # a newer layertap's: which shards are leased cannot be told
    store.put(layout.MANIFEST, manifest.replace(b'"format_version":1', b'"format_version":99'))
    assert cli(["delete", store_uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert "is not readable here" in err and "Make sure none do, then pass --force" in err
    store.put(layout.MANIFEST, manifest)
    store.delete(layout.lease_key(1, 1, 600))
    store.put(layout.CONSUMER, b"not json")  # nor whether its --delete-consumed trainer runs
    assert cli(["delete", store_uri, "--yes"]) == 2
    assert "cannot tell whether the --delete-consumed trainer of run" in capsys.readouterr().err
    store.put(layout.lease_key(1, 1, 600), b"{}")
    assert cli(["delete", store_uri, "--yes", "--force"]) == 0 and list(store.list()) == []

    store.put("metrics.jsonl", b'{"step": 1}\n')  # a training output is deleted like a run
    store.put("checkpoints/step-00000001/state.json", b"{}")
    assert cli(["delete", store_uri, "--yes"]) == 0
    assert f"training output at {store.uri}" in capsys.readouterr().out and list(store.list()) == []

    from layertap.manifests.output_lease import OutputLease

    store.put("metrics.jsonl", b'{"step": 1}\n')
    with OutputLease(store):  # a trainer at work there
        assert cli(["delete", store_uri, "--yes"]) == 2
        assert f"a trainer is writing to {store.uri} (pid {os.getpid()}" in capsys.readouterr().err
        assert store.exists("metrics.jsonl")
    # a trainer killed here: its lease outlives it, and `status` says it exited; delete said "stop it first"
    killed = ("import os, sys; from layertap.storage.store import open_store; "
              "from layertap.manifests.output_lease import OutputLease; "
              "OutputLease(open_store(sys.argv[1])).acquire(); os._exit(0)")
    subprocess.run([sys.executable, "-c", killed, store_uri], check=True, env=child_env())
    assert cli(["delete", store_uri, "--yes"]) == 0 and list(store.list()) == []


def test_delete_asks_on_a_terminal(tmp_path):
    """The prompt, answered on a real pseudo-terminal: anything but `yes` keeps the run."""
    import pty

    prefix = str(tmp_path / "run")
    fake_worker.work(prefix)

    def answer(text: str) -> tuple[int, str]:
        master, slave = pty.openpty()
        proc = subprocess.Popen([sys.executable, "-m", "layertap", "delete", prefix], stdin=slave, stdout=slave,
                                stderr=slave, env=child_env(), close_fds=True)
        os.close(slave)
        seen = b""
        while b"type yes to confirm" not in seen:
            seen += os.read(master, 4096)
        os.write(master, text.encode() + b"\n")
        rc = proc.wait(timeout=60)
        try:
            while chunk := os.read(master, 4096):
                seen += chunk
        except OSError:  # the terminal closed with the process
            pass
        os.close(master)
        return rc, seen.decode()

    rc, shown = answer("no")
    assert rc == 1 and "not deleted" in shown and os.path.exists(os.path.join(prefix, layout.MANIFEST))
    assert f"delete everything under {prefix}?" in shown
    rc, shown = answer("yes")
    assert rc == 0 and "deleted" in shown and not os.path.exists(prefix)


def _write_and_commit(claim: Claim) -> None:
    meta = ShardMeta(run_id=claim.queue.manifest.run_id, shard_id=claim.shard, model="synthetic",
                     layers=fake_worker.LAYERS, hidden_size=fake_worker.HIDDEN, codec="bf16-zstd")
    with ShardWriter(claim.queue.store.open_writer(claim.data_key), meta) as w:
        for i in range(claim.plan.start, claim.plan.end):
            w.write_sample(fake_worker.make_sample(i))
        info = w.close()
    assert claim.commit(info)


def test_an_idle_worker_scans_less_and_less_while_every_shard_left_runs_elsewhere(tmp_path):
    """Near a run's end ~1,000 idle workers took a full scan (~50 listings at 25,000 shards) every
    ~7.5 s, ~7,000 listings/s, though a lease kept fresh by its heartbeat cannot be claimed. The
    idle wait now doubles up to 4 polls and the scan leaves out tally/; a lease that goes stale is
    still taken over within its TTL, and the worker still ends once every shard is committed."""
    # heartbeats every 0.75 s: never stale, unless a busy machine stalls them 2 s; the bounds below leave
    # a second or two for such stalls too
    prefix, ttl, poll, watch = str(tmp_path / "run"), 3.0, 0.25, 6.0
    manifest = fake_worker.plan(open_store(prefix))
    holder = WorkQueue(open_store(prefix), manifest, Producer.current(1), ttl_s=ttl)
    held = [c.__enter__() for c in islice(holder, len(manifest.shards))]  # each lease renewed by its heartbeat
    assert len(held) == len(manifest.shards) >= 3
    store, listed = open_store(prefix), Counter()
    real_list = store.list
    store.list = lambda p="", *a, **kw: listed.update([p.split("/")[0] + "/"]) or real_list(p, *a, **kw)
    idle = WorkQueue(store, manifest, Producer.current(2), ttl_s=ttl, poll_s=poll)
    claims: list[tuple[float, Claim]] = []
    ended = threading.Event()

    def work() -> None:
        for claim in idle:
            claims.append((time.monotonic(), claim))
            with claim:
                _write_and_commit(claim)
        ended.set()

    threading.Thread(target=work, daemon=True).start()
    try:
        time.sleep(watch)
        scans = listed[layout.LEASES]  # every pass lists the leases
        # before: a scan every ~poll (waits of poll..1.25 poll), >= 19 in 6 s; now ~8 (12 at most)
        assert 2 <= scans <= watch / poll / 2, listed
        # every commit record is listed once, at the start: the passes since list the feed (`CommitView`)
        assert listed[layout.COMMITS] == 1 and listed[layout.FEED] == scans - 1, listed
        assert listed[layout.TALLY] == 0 and not claims, listed
        quitter = held.pop()
        quitter._stop.set()  # its worker died: the lease goes stale within ttl_s
        quitter._heartbeat.join()
        stopped = time.monotonic()
        while not claims and time.monotonic() < stopped + 3 * ttl:
            time.sleep(0.05)
        assert claims and claims[0][1].shard == quitter.shard
        assert claims[0][0] - stopped <= ttl + poll / 4 + 1.5  # taken over as promptly as before
    finally:
        for claim in held:
            _write_and_commit(claim)
            claim.__exit__(None, None, None)
    done = time.monotonic()
    assert ended.wait(4 * poll * 1.25 + 2.0)  # ends at its next scan, at most one longest wait away
    assert time.monotonic() - done <= 4 * poll * 1.25 + 2.0
    assert listed[layout.TALLY] == 0
    assert len(list(store.list(layout.COMMITS))) == len(manifest.shards)


def test_ranks_of_different_array_tasks_start_at_different_shards(tmp_path):
    """Each Slurm array task runs its own accelerate world (ranks 0..7): the ranks of one task
    spread evenly over the shards, and each task turns that spread by its job's own offset, the
    same on all its ranks. Before, every task's rank r started at the same shard: 125 tasks x 8
    ranks walked the list from 8 places, each claim passing what the others had just taken."""
    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store, samples=400)
    n = len(manifest.shards)
    assert n >= 64

    def first(job: str | None, rank: int) -> int:
        producer = Producer("h", 1, rank, job, "t")
        return WorkQueue(store, manifest, producer, world_size=8)._order(list(range(n)))[0]

    one_job = [first("7_3", r) for r in range(8)]
    steps = {(b - a) % n for a, b in zip(one_job, one_job[1:] + one_job[:1])}
    assert steps <= {n // 8, n // 8 + 1}  # evenly spread within the job
    assert [first("7_3", r) for r in range(8)] == one_job  # the same offset on every rank of it
    tasks = [first(f"7_{t}", 0) for t in range(16)]
    assert len(set(tasks)) >= 12  # array tasks start apart (16 tasks shared one start before)
    assert [first(None, r) for r in range(8)] == [r * n // 8 for r in range(8)]  # no job: as before


def test_an_idle_worker_waits_on_leases_it_scanned_without_looking_at_each(tmp_path, monkeypatch):
    """Near a run's end every shard left is running elsewhere: a pass of an idle worker is one
    scan, not a fresh look (a HEAD and two listings) at each running shard, and it waits on them
    rather than ending. ~3 requests a running shard a poll, from each of ~1,000 idle workers."""
    from layertap.manifests import work

    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    other = WorkQueue(store, manifest, Producer.current(), ttl_s=0.6)
    for s in range(len(manifest.shards)):
        store.put(layout.lease_key(s, 1, 0.6), other.lease_payload(1, layout.data_key(s, other.producer.token)))
    looks = []
    real = work.scan_shard
    monkeypatch.setattr(work, "scan_shard", lambda *a: looks.append(a[2]) or real(*a))
    queue = WorkQueue(store, manifest, Producer.current(), poll_s=0.2)
    claim = next(iter(queue))  # waits until the leases go stale, then takes one
    with claim:
        pass
    assert len(looks) <= 2 * len(manifest.shards) // 3, looks  # a look only for shards found free
    assert claim.shard in looks


def test_status_says_which_running_shards_are_held_by_processes_that_exited_here(store_uri, capsys):
    """A worker killed with SIGKILL: status said its shard was running until the lease's TTL (60 s
    by default), while a rerun here takes it over at once. Holders on other machines, or alive,
    are running as before."""
    store = open_store(store_uri)
    fake_worker.plan(store)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = {"host": socket.gethostname(), "pid_ns": liveness.pid_namespace(), "token": "t"}
    for shard, holder in ((0, {**here, "pid": dead.pid}), (1, {**here, "pid": os.getpid()}),
                          (2, {**here, "host": "another-node", "pid": dead.pid})):
        store.put(layout.lease_key(shard, 1, 600), json.dumps({"holder": holder}).encode())
    s = run_status(store)
    assert s["shards_running"] == 3 and s["shards_running_exited_here"] == 1
    assert cli(["status", store_uri]) == 3
    assert "3 running (1 of them held by processes on this machine that have exited: the next" in \
        capsys.readouterr().out
    # only a dead holder's shard: it said "ETA ..." and not "nothing is running", status knowing it was so
    fake_worker.work(store_uri, shards=[4, 5])  # a recent rate, for an ETA to come from
    for shard in (1, 2):
        store.delete(layout.lease_key(shard, 1, 600))
    s = run_status(store)
    assert s["shards_running"] == s["shards_running_exited_here"] == 1 and s["eta_s"] is None
    assert cli(["status", store_uri]) == 3
    out = capsys.readouterr().out
    assert "ETA" not in out and "nothing is running: the same `layertap extract` (or `layertap submit extract`) " \
        "command finishes the pending shards (and takes over at once those held by the processes that exited)" in out
    # nor does `delete` tell to stop workers that status knows are gone ("being written under live leases")
    assert cli(["delete", store_uri, "--yes"]) == 0
    assert not list(store.list())


def test_delete_looks_for_writers_again_once_the_question_is_answered(tmp_path, monkeypatch, capsys):
    """The live writers were looked for before the question only: a worker that started while it
    waited (seconds, or minutes of a terminal left open) had its run deleted under it."""
    from layertap.manifests import delete

    prefix = str(tmp_path / "run")
    fake_worker.work(prefix)
    store = open_store(prefix)

    def a_worker_starts_meanwhile(uri: str) -> bool:
        store.put(layout.lease_key(2, 9, 600), b"{}")
        return True

    monkeypatch.setattr(delete, "_confirmed", a_worker_starts_meanwhile)
    assert cli(["delete", prefix]) == 2
    assert "shard" in capsys.readouterr().err and store.exists(layout.MANIFEST)
