"""A run's prefix holds that run alone. `layertap delete` of a run made at a bucket's root took
a complete run stored below it: it refuses now, naming each run or output below and how to delete
it, and a new run is not planned over a prefix that holds one. A local input file leaves no Arrow
copy in the HF cache, and a worker's start reads the (compact) manifest once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import fake_worker
from layertap.cli import main as cli
from layertap.extract.config import ExtractConfig
from layertap.extract.run import resume_run, write_plan
from layertap.manifests import delete, layout
from layertap.manifests.manifest import NoRun, create_or_resume, load_manifest
from layertap.storage.errors import ConfigError
from layertap.manifests.regeneration import RECIPE
from layertap.manifests.train_output import LATEST, METRICS
from layertap.storage.identity import RunConfig
from layertap.storage.store import open_store

REPO = Path(__file__).resolve().parents[1]


def keys(store) -> list[str]:
    return sorted(o.key for o in store.list())


# -- layertap delete ------------------------------------------------------------------------------


def test_delete_refuses_a_run_with_another_run_below_it(store_uri, capsys):
    """The finding: a run at the prefix, a complete run at prefix/keepme; deleting the first
    deleted both. Refused with the way to delete each; once the one below is gone, it goes."""
    fake_worker.work(store_uri)
    fake_worker.work(f"{store_uri}-keepme")
    fake_worker.copy_run(f"{store_uri}-keepme", f"{store_uri}/keepme")  # layertap plans no run inside another
    store, kept = open_store(store_uri), open_store(f"{store_uri}/keepme")
    before = keys(store)
    assert cli(["delete", store_uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert f"{store.uri.rstrip('/')}/keepme (run)" in err
    assert f"`layertap delete {store.uri.rstrip('/')}/keepme`" in err and "--force" in err
    assert keys(store) == before and load_manifest(kept).run_id

    assert cli(["delete", f"{store_uri}/keepme", "--yes"]) == 0
    assert cli(["delete", store_uri, "--yes"]) == 0
    assert keys(store) == []


def test_delete_of_a_folder_inside_a_run_names_the_run(store_uri, capsys):
    """`delete RUN/shards` (a user hunt): refused as no run, but not told that it is part of one,
    and with --force the run was left counting data that was gone, without a word."""
    fake_worker.work(store_uri)
    run = open_store(store_uri).uri.rstrip("/")
    assert cli(["delete", f"{store_uri}/shards", "--yes"]) == 2
    assert f"It is inside the run at {run}: deleting part of it leaves that run incomplete" in capsys.readouterr().err
    assert cli(["delete", f"{store_uri}/shards", "--yes", "--force"]) == 0
    assert f"(--force: not a run; inside the run at {run})" in capsys.readouterr().out
    assert cli(["delete", f"{store_uri}/nothing/here", "--yes"]) == 0  # nothing under it: nothing to name


def test_delete_refuses_a_bucket_root_run_with_a_run_below(s3_bucket, tmp_path, capsys):
    """The repro exactly: runs at s3://bucket and s3://bucket/keepme."""
    fake_worker.work(f"s3://{s3_bucket}")
    fake_worker.work(str(tmp_path / "keepme"))
    fake_worker.copy_run(str(tmp_path / "keepme"), f"s3://{s3_bucket}/keepme")  # none is planned inside another
    kept = open_store(f"s3://{s3_bucket}/keepme")
    before = keys(kept)
    assert cli(["delete", f"s3://{s3_bucket}", "--yes"]) == 2
    assert f"s3://{s3_bucket}/keepme (run)" in capsys.readouterr().err
    assert keys(kept) == before


def test_delete_names_outputs_below_deepest_first_and_force_takes_them(tmp_path, capsys):
    """A training output and a regeneration output count as much as a run, at any depth; --force
    deletes them with the prefix, and says so before it does."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri)
    store = open_store(uri)
    store.put(f"drafter/{LATEST}", b'{"step": 1, "prefix": "checkpoints/step-1"}')
    store.put(f"drafter/{METRICS}", b"{}\n")
    store.put(f"a/b/{RECIPE}", b"{}")
    assert cli(["delete", uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 other run(s) or output(s) below it" in err
    assert err.index(f"{uri}/a/b (regeneration output)") < err.index(f"{uri}/drafter (training output)")

    assert cli(["delete", uri, "--yes", "--force"]) == 0
    assert "with the 2 run(s) or output(s) below it (--force)" in capsys.readouterr().out
    assert keys(store) == []


def test_delete_markers_are_the_ones_runs_and_outputs_are_known_by():
    """delete.py names the marker keys itself (a light import); they must be the real ones."""
    assert {m for m, _ in delete.MARKERS} == {layout.MANIFEST, LATEST, METRICS, RECIPE}


# -- a new run over runs below -----------------------------------------------------------------


def test_a_new_run_is_not_planned_over_a_run_below_it(store_uri):
    """Resuming the run at the prefix is normal; creating one above another is refused."""
    fake_worker.plan(open_store(f"{store_uri}/keepme"))
    fake_worker.plan(open_store(f"{store_uri}/team/deeper"))  # not looked for below team/: said so
    store = open_store(store_uri)
    with pytest.raises(ConfigError) as e:
        fake_worker.plan(store)
    assert f"{store.uri.rstrip('/')}/keepme (run); and 1 other folder(s) (team/), not looked into" in str(e.value)
    assert "a prefix of its own" in str(e.value)
    assert not store.exists(layout.MANIFEST)


def test_a_bucket_root_is_a_run_prefix_while_it_holds_nothing_else(s3_bucket):
    """A bare bucket is a prefix like any other. Folders of other data are no nested run, but a
    run made among them would be deleted with them (`layertap delete` of the run): refused, naming
    them, not taken for runs below."""
    store = open_store(f"s3://{s3_bucket}")
    store.put("data/chats.jsonl", b"{}\n")
    with pytest.raises(ConfigError, match=rf"s3://{s3_bucket} is not empty: it holds objects that are not a "
                                          rf"layertap run \(s3://{s3_bucket}/data/chats.jsonl\)") as e:
        fake_worker.plan(store)
    assert "other runs or outputs below it" not in str(e.value)
    store.delete("data/chats.jsonl")
    manifest = fake_worker.plan(store)
    assert load_manifest(store).run_id == manifest.run_id


def _extract_without_a_model(tmp_path: Path, data: Path, out: Path, capsys) -> str:
    """`layertap extract` of a one-chat `data` into `out` with no model there: it must exit 2 before
    loading one; its stderr."""
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    args = ["extract", "--model", str(tmp_path / "no-model"), "--dataset", str(data), "--out", str(out),
            "--log-dir", str(tmp_path / "logs")]
    assert cli(args) == 2
    return capsys.readouterr().err


def test_a_new_run_is_not_planned_inside_a_run_or_output_nor_at_an_objects_key(store_uri, tmp_path, capsys):
    """`--out run1/sub`, `run1/shards/inner`, even `s3://b/run1/manifest.json` made a run inside
    the complete run1 (whose `delete` then refused). Refused, naming the run above, before the
    model loads; a folder above holding some other tool's manifest.json is no run."""
    fake_worker.plan(open_store(store_uri))
    for inner in ("sub", "shards/inner", "a/b/c"):
        with pytest.raises(ConfigError, match=rf"{open_store(store_uri).uri} is a run: a run at .*{inner} would be "
                                              "inside it .*give the run a prefix of its own beside it"):
            fake_worker.plan(open_store(f"{store_uri}/{inner}"))
    assert keys(open_store(store_uri)) == [layout.MANIFEST]
    if store_uri.startswith("s3://"):  # a key that is an object (a local folder's file is refused as a root)
        with pytest.raises(ConfigError, match=r"manifest.json is an object, not a prefix"):
            fake_worker.plan(open_store(f"{store_uri}/{layout.MANIFEST}"))
    trained = open_store(f"{store_uri}-drafter")
    trained.put(LATEST, json.dumps({"step": 4, "prefix": "checkpoints/step-000004"}).encode())
    with pytest.raises(ConfigError, match=r"-drafter is a training output: a run at"):
        fake_worker.plan(open_store(f"{store_uri}-drafter/run"))
    # the command line says so before it loads a model
    err = _extract_without_a_model(tmp_path, tmp_path / "chats.jsonl", tmp_path / "r1" / "sub", capsys) \
        if fake_worker.plan(open_store(str(tmp_path / "r1"))) else ""
    assert f"{tmp_path / 'r1'} is a run: a run at {tmp_path / 'r1' / 'sub'} would be inside it" in err
    assert "could not load" not in err
    other = tmp_path / "webapp"  # some other tool's manifest.json and checkpoints in a folder above
    (other / "checkpoints").mkdir(parents=True)
    (other / layout.MANIFEST).write_text(json.dumps({"name": "webapp", "version": 3}))
    (other / LATEST).write_text(json.dumps({"step": 1}))
    assert fake_worker.plan(open_store(str(other / "run"))).shards
    # a layertap run of another manifest version above is a run all the same
    older = tmp_path / "older"
    older.mkdir()
    (older / layout.MANIFEST).write_text(json.dumps({"format": "layertap-manifest", "format_version": 0}))
    with pytest.raises(ConfigError, match="older is a run: a run at"):
        fake_worker.plan(open_store(str(older / "run")))


def test_a_folder_above_these_credentials_cannot_read_does_not_refuse_a_new_run(store_uri, monkeypatch):
    """Credentials that reach only below a prefix (a bucket shared by prefix): a read a level up is
    denied. The look for a run above cannot tell, and refused every new run on that error."""
    from layertap.storage.local import LocalStore
    from layertap.storage.s3 import S3Store

    store = open_store(f"{store_uri}/mine")
    for cls in (LocalStore, S3Store):
        for name in ("get", "size"):
            real = getattr(cls, name)
            monkeypatch.setattr(cls, name, lambda self, key, *a, _real=real, **kw: _real(self, key, *a, **kw)
                                if self.uri == store.uri else _deny(self, key))
    assert fake_worker.plan(store).shards


def _deny(store, key: str):
    from layertap.storage.store import StoreError

    raise StoreError(f"access denied to {store.uri}/{key} (403 AccessDenied)")


def test_extract_refuses_an_out_holding_a_run_below_before_the_model_loads(tmp_path, capsys):
    """`layertap extract` says so at once: no model is there to load (the check comes first)."""
    out = tmp_path / "runs"
    fake_worker.plan(open_store(str(out / "keepme")))
    err = _extract_without_a_model(tmp_path, tmp_path / "chats.jsonl", out, capsys)
    assert f"{out}/keepme (run)" in err and "could not load" not in err
    assert not (out / layout.MANIFEST).exists()


# -- a worker's start: the manifest, once and compact ------------------------------------------


def _identity() -> RunConfig:
    return RunConfig(model="synthetic", layers=[1, 3], hidden_size=8, codec="bf16-zstd", dtype="float32",
                     max_length=32)


def test_a_rerun_reads_the_manifest_once(store_uri):
    """resume_run (each worker's start) read manifest.json twice: megabytes at 150k shards,
    times 1,000 workers."""
    cfg = ExtractConfig(out=store_uri, max_length=32, dtype="float32", shard_bytes=2000)
    store = open_store(store_uri)
    write_plan(store, cfg, _identity(), "fp", [20] * 300)
    gets = []
    real = store.get
    store.get = lambda key: gets.append(key) or real(key)
    manifest, _ = resume_run(store, cfg, _identity(), "fp")
    assert len(manifest.shards) > 10 and gets.count(layout.MANIFEST) == 1


def test_the_manifest_is_written_compact_and_an_indented_one_resumes(store_uri):
    store = open_store(store_uri)
    manifest = fake_worker.plan(store, samples=200, shard_bytes=400)
    raw = store.get(layout.MANIFEST)
    assert raw == json.dumps(json.loads(raw), separators=(",", ":")).encode()

    old = open_store(f"{store_uri}-old")  # as an earlier layertap wrote it
    old.put(layout.MANIFEST, json.dumps(manifest.to_json(), indent=1).encode())
    resumed, created = create_or_resume(old, config=fake_worker.CONFIG, dataset=fake_worker.DATASET,
                                        token_counts=None, bytes_per_token=1.0, shard_bytes=400)
    assert not created and resumed.shards == manifest.shards and resumed.run_id == manifest.run_id


def test_create_or_resume_takes_the_manifest_already_read(tmp_path):
    store = open_store(str(tmp_path / "run"))
    manifest = fake_worker.plan(store)
    store.get = lambda key: pytest.fail(f"read {key} again")
    assert create_or_resume(store, config=fake_worker.CONFIG, dataset=fake_worker.DATASET, token_counts=None,
                            bytes_per_token=1.0, shard_bytes=4000, existing=manifest) == (manifest, False)
    with pytest.raises(NoRun):
        create_or_resume(open_store(str(tmp_path / "none")), config=fake_worker.CONFIG, dataset=fake_worker.DATASET,
                         token_counts=None, bytes_per_token=1.0)


def test_extract_into_a_folder_holding_files_of_ones_own_is_refused_before_the_model_loads(tmp_path, capsys):
    """`--out data/` where the dataset itself lies: the run was made among the files, and
    `layertap delete` of it then deleted the dataset with the run."""
    out = tmp_path / "notempty"
    out.mkdir()
    data = out / "chats.jsonl"
    err = _extract_without_a_model(tmp_path, data, out, capsys)
    assert f"{out} is not empty: it holds objects that are not a layertap run ({data})" in err, err
    assert "could not load" not in err and sorted(p.name for p in out.iterdir()) == ["chats.jsonl"]


def test_delete_of_a_run_holding_files_of_ones_own_leaves_them_unless_forced(store_uri, capsys):
    """A file put into a run's prefix after the run was made was counted as one of the run's
    objects and deleted with it."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    store.put("notes/readme.txt", b"mine")
    assert cli(["delete", store_uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert f"holds 1 object(s) that are not the run's: {store_uri.rstrip('/')}/notes/readme.txt" in err, err
    assert store.get("notes/readme.txt") == b"mine" and store.exists(layout.MANIFEST)
    assert cli(["delete", store_uri, "--yes", "--force"]) == 0
    assert list(store.list()) == []


def test_a_file_of_ones_own_inside_one_of_the_runs_folders_is_not_the_runs(store_uri, capsys):
    """A run's key was any key under one of its folders: shards/README.txt or index/notes.txt went
    with `delete --yes`, unasked."""
    fake_worker.work(store_uri)
    store = open_store(store_uri)
    store.put("shards/README.txt", b"mine")
    store.put("index/notes.txt", b"mine")
    assert cli(["delete", store_uri, "--yes"]) == 2
    err = capsys.readouterr().err
    assert "holds 2 object(s) that are not the run's" in err and "shards/README.txt" in err, err
    assert store.get("shards/README.txt") == b"mine" and store.exists(layout.MANIFEST)


def test_every_key_a_run_writes_is_the_runs():
    """The other side of the strict names: each family of keys layertap writes counts as the run's."""
    keys = [layout.MANIFEST, layout.data_key(3, "a1b2"), layout.commit_key(3),
            layout.tally_key(3, 4, 100, 2000, 8000, 1, 0), layout.lease_key(3, 2, 60.5),
            layout.beat_key(layout.lease_key(3, 2, 60.5), "tok-1"), layout.failure_key(3, 1, "tok", 2, stopped=True),
            layout.failure_key(3, 1, "tok", by_store=True), layout.withdrawal_key(3, 1, "tok"),
            layout.given_up_key(3, 1, "tok"), layout.redo_key(3), layout.waiting_key("tok-9"),
            layout.feed_key(1, 3, 4, 1), layout.COMMIT_INDEX, layout.consumed_rank_key(2),
            layout.consumed_marker_key(3), layout.CONSUMED_WINDOW, layout.CONSUMER,
            "sweeps/0123456789abcdef/000001", "sweeps/0123456789abcdef/000001.done", "logs/extract-rank0.log"]
    assert [k for k in keys if not layout.is_run_key(k)] == []


def test_an_upload_in_progress_to_a_file_of_ones_own_is_not_aborted_unasked(s3_bucket, capsys):
    """Only finished objects were judged: an unfinished upload to a key not the run's was aborted
    (destroyed) by `delete --yes` where the same file, finished, was refused."""
    uri = f"s3://{s3_bucket}/run"
    fake_worker.work(uri)
    s3 = open_store(uri).client
    s3.create_multipart_upload(Bucket=s3_bucket, Key="run/backup/mine.bin")
    assert cli(["delete", uri, "--yes"]) == 2
    assert "run/backup/mine.bin" in capsys.readouterr().err
    assert [u["Key"] for u in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])] == ["run/backup/mine.bin"]
