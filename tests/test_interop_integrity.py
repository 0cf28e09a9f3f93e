"""`layertap export` and `layertap import` keep every sample and its labels right, or fail cleanly:
speculators' --layers out of ascending order are refused (its files hold them ascending), a file
whose keys are not tensors is one unreadable sample (not a shard failing forever, nor a traceback),
a failed export leaves no files for a foreign trainer to train on, ModelOpt file names never
overwrite each other, sample ids are unique whatever the shard size, and `status` of an unfinished
import names `layertap import`.

Real files in each layout (layertap's writers, SpecForge's and ModelOpt's dict layouts saved with
torch.save), runs made by the real extractor and the tiny qwen3 target (hidden size 64)."""

from __future__ import annotations

import gzip
import shutil
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.commit_index import read_commits
from layertap.manifests.manifest import load_manifest
from layertap.manifests.records import decode_commit
from layertap.storage.store import open_store
from test_interop_data import extract
from test_interop_import_checks import imported, sample, write_files
from tiny_models import tiny_model_dir


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


@pytest.fixture(scope="module")
def prenorm_run(target, tmp_path_factory) -> str:
    """A run of layers 3,1 (not ascending) with the pre-norm final state, in a few shards."""
    tmp = tmp_path_factory.mktemp("prenorm")
    return extract(target, str(tmp / "run"), tmp, "prenorm")


def shard_files(run: str) -> list[Path]:
    return sorted(Path(run, "shards").iterdir())


# 1. speculators' --layers order

def test_a_speculators_import_refuses_layers_out_of_ascending_order(prenorm_run, target, tmp_path, capsys):
    """Its files hold the capture layers ascending: --layers 4,2 recorded layers [3, 1] while slot 0
    held layer 1's states. Refused before anything is written, with the order to pass, with or
    without the export's note beside the files."""
    dest = tmp_path / "spec"
    assert cli(["export", prenorm_run, "--to", "speculators", str(dest), "--limit", "3"]) == 0
    back = tmp_path / "back"
    for note in (True, False):
        if not note:
            (dest / "layertap-export.json").unlink()
        capsys.readouterr()
        assert cli(["import", str(dest), "--from", "speculators", "--out", str(back), "--layers", "4,2",
                    "--model", target]) == 2
        err = capsys.readouterr().err
        assert "pass --layers 2,4" in err, err
        assert not back.exists()
    assert cli(["import", str(dest), "--from", "speculators", "--out", str(back), "--layers", "2,4",
                "--model", target]) == 0
    assert load_manifest(open_store(str(back))).identity.layers == [1, 3]


# 2. values that are not tensors

def dicts(fmt: str, n: int = 3) -> list[dict]:
    """Sample i as `fmt`'s torch.save dict (DFlash SpecForge, ModelOpt)."""
    out = []
    for i in range(n):
        s = sample(i)
        d = {"input_ids": s.input_ids.long(), "loss_mask": s.loss_mask.long()}
        if fmt == "specforge":
            d["hidden_states"] = s.hidden_states.reshape(1, s.num_tokens, -1)
        else:
            d.update(aux_hidden_states=s.hidden_states.reshape(s.num_tokens, -1), hidden_states=s.final_state,
                     conversation_id=f"s{i}")
        out.append(d)
    return out


NAME = {"specforge": "data_{}.ckpt", "modelopt": "s{}.pt"}


@pytest.mark.parametrize("fmt, key", [("specforge", "input_ids"), ("specforge", "loss_mask"),
                                      ("modelopt", "input_ids"), ("modelopt", "hidden_states")])
def test_a_value_that_is_not_a_tensor_is_one_unreadable_file(target, tmp_path, capsys, fmt, key):
    """weights_only=True unpickles lists: an AttributeError failed the whole shard on every retry
    (its good samples lost), or, in the first file, a traceback. The first file bad, the plan checks
    the next one that reads (it refused the import, every other file sound)."""
    for bad in (1, 0):
        src = tmp_path / f"src{bad}"
        src.mkdir()
        for i, d in enumerate(dicts(fmt)):
            if i == bad:
                d[key] = d[key].tolist()
            torch.save(d, src / NAME[fmt].format(i))
        back = tmp_path / f"back{bad}"
        capsys.readouterr()
        rc = cli(["import", str(src), "--from", fmt, "--out", str(back), "--layers", "1,3", "--model", target])
        where = f"{src}/{NAME[fmt].format(bad)}: {key} is a list, not a tensor"
        assert rc == 0, capsys.readouterr().err[-3000:]
        stored, skipped = imported(str(back))
        good = [i for i in range(3) if i != bad]
        assert sorted(s.sample_id for s in stored) == [NAME[fmt].format(i).split(".")[0] for i in good]
        assert [s["reason"] for s in skipped] == ["unreadable"] and where in skipped[0]["detail"]


# 3. a failed export

@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_failed_export_removes_what_it_wrote(prenorm_run, tmp_path, capsys, where, request):
    """A corrupt second shard left the first shard's rows_0-2000/data_*.ckpt and no export note:
    SpecForge would train on them, and a rerun was refused as "not empty"."""
    run = tmp_path / "run"
    shutil.copytree(prenorm_run, run)
    second = shard_files(str(run))[1]
    data = bytearray(second.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside a record: its hash no longer matches
    second.write_bytes(bytes(data))
    dest = str(tmp_path / "sf") if where == "local" else f"s3://{request.getfixturevalue('s3_bucket')}/sf"
    assert cli(["export", str(run), "--to", "specforge", dest]) == 2
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "file(s) it had written were removed" in err, err
    assert list(open_store(dest).list("")) == []
    if where == "local":  # nor the folders its files were in (rows_0-2000/): DEST is as it was
        assert list(Path(dest).iterdir()) == []
    shutil.rmtree(run)
    shutil.copytree(prenorm_run, run)  # the cause fixed: the same command goes through
    assert cli(["export", str(run), "--to", "specforge", dest]) == 0


def test_an_export_missing_a_shards_data_fails_unless_a_trainer_consumed_it(prenorm_run, tmp_path, capsys, caplog):
    """A committed shard whose data object is gone, and no consumed marker: the export wrote the rest
    with exit 0 and said to export again once the run is complete (it was). Refused, naming the fix;
    a shard a --delete-consumed trainer consumed is left out as before."""
    run = tmp_path / "run"
    shutil.copytree(prenorm_run, run)
    second = shard_files(str(run))[1]
    second.unlink()
    dest = tmp_path / "sf"
    assert cli(["export", str(run), "--to", "specforge", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "data (" in err and "is missing, and no trainer consumed it: run `layertap verify" in err, err
    assert not [p for p in dest.rglob("*") if p.is_file()]
    missing = next(c for c in read_commits(open_store(str(run))).records if c.data_key.endswith(second.name))
    open_store(str(run)).put(layout.consumed_marker_key(missing.shard), b"")
    caplog.clear()
    assert cli(["export", str(run), "--to", "specforge", str(dest)]) == 0
    assert f"shard {missing.shard}'s data" in caplog.text and "1 of the run's 4 shards" in capsys.readouterr().err


def test_an_export_into_a_store_that_stops_answering_exits_5(prenorm_run, tmp_path, capsys, monkeypatch, s3_endpoint,
                                                             s3_bucket):
    """Past its retries the store is out, not the input wrong: exit 5 as every command (it was 2).
    Its delete failing too, the files it wrote are named at once (it asked the failing store about
    each one in turn: minutes of retries before a word)."""
    from faultproxy import FaultProxy

    monkeypatch.setenv("LAYERTAP_S3_MAX_ATTEMPTS", "2")
    methods = Counter()

    def writes(method: str, path: str) -> bool:
        methods[method] += 1
        return method in ("PUT", "POST", "DELETE")

    with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), match=writes) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert cli(["export", prenorm_run, "--to", "specforge", f"s3://{s3_bucket}/sf"]) == 5
    err = capsys.readouterr().err
    assert "SlowDown" in err and "removing what it wrote failed too" not in err and "no file of it is left" in err
    assert methods["HEAD"] == 0  # one listing found nothing there, no look at each file
    # its listing failing too (not the emptiness check's, before any write): every file it wrote is named
    def and_later_lists(method: str, path: str) -> bool:
        methods["list"] += "list-type" in path
        return writes(method, path) or ("list-type" in path and methods["list"] > 1)

    methods.clear()
    with FaultProxy(s3_endpoint, rate=1.0, faults=("503",), match=and_later_lists) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        assert cli(["export", prenorm_run, "--to", "specforge", f"s3://{s3_bucket}/sf2"]) == 5
    err = capsys.readouterr().err
    assert "removing what it wrote failed too" in err and "remove rows_0-2000/data_0.ckpt" in err, err


def test_an_export_meeting_a_damaged_version_field_says_corrupt_not_upgrade(prenorm_run, tmp_path, capsys):
    """A flipped byte in a shard's version field (no frame hash covers the preamble): export said
    "shard format version ... is not supported ... upgrade layertap". Its commit's hash tells."""
    run = tmp_path / "run"
    shutil.copytree(prenorm_run, run)
    second = shard_files(str(run))[1]
    data = bytearray(second.read_bytes())
    data[len(b"LTSHARD\x00") + 2] ^= 0xFF
    second.write_bytes(bytes(data))
    assert cli(["export", str(run), "--to", "specforge", str(tmp_path / "sf")]) == 2
    err = capsys.readouterr().err
    assert "it is corrupt, not newer. Run `layertap verify" in err and "upgrade layertap" in err, err


# 4. ModelOpt file names

def test_modelopt_file_names_never_overwrite_another_sample(target, tmp_path):
    """"a/1" and "a_1" both become a_1.pt, and the second's fallback a_1-2.pt was the first id's
    own name: 3 samples, 2 files."""
    ids = ["a_1-2", "a/1", "a_1"]
    src = write_files(tmp_path / "mo", "modelopt", [replace(sample(i), sample_id=sid) for i, sid in enumerate(ids)])
    files = sorted(p.name for p in Path(src).glob("*.pt"))
    assert len(files) == 3
    assert sorted(torch.load(Path(src, f), weights_only=True)["conversation_id"] for f in files) == sorted(ids)
    back = str(tmp_path / "back")
    assert cli(["import", src, "--from", "modelopt", "--out", back, "--layers", "1,3", "--model", target]) == 0
    stored, skipped = imported(back)
    assert len(stored) == 3 and not skipped


# 5. unique sample ids, whatever the shard size

@pytest.mark.parametrize("shard_bytes", ["1GB", "1KB"])
def test_modelopt_ids_are_unique_and_do_not_depend_on_the_shard_size(target, tmp_path, caplog, shard_bytes):
    """A conversation_id in several files (or a subfolder's file named like another's id) gave two
    samples one id: in one shard, all but the first were skipped as unreadable; across shards,
    the run held the id twice."""
    src = tmp_path / "mo"
    (src / "sub").mkdir(parents=True)
    d = dicts("modelopt", 5)
    for i, (name, cid) in enumerate([("conv0", "same"), ("conv1", "same"), ("sub/x", "sub/x"), ("sub_x", "sub/x"),
                                     ("ok", "ok")]):
        torch.save(dict(d[i], conversation_id=cid), src / f"{name}.pt")
    back = str(tmp_path / "back")
    with caplog.at_level("WARNING"):
        assert cli(["import", str(src), "--from", "modelopt", "--out", back, "--layers", "1,3", "--model", target,
                    "--shard-bytes", shard_bytes]) == 0
    stored, skipped = imported(back)
    assert not skipped and sorted(s.sample_id for s in stored) == ["conv0", "conv1", "ok", "sub/x", "sub_x"]
    assert any("3 sample(s) imported now have their file's name for id" in r.getMessage() for r in caplog.records)


def test_a_specforge_ckpt_gz_beside_its_ckpt_is_imported_once(target, tmp_path, caplog):
    """data_0.ckpt and data_0.ckpt.gz had one id: the second was skipped as unreadable in the same
    shard, kept twice in another. Taken for a compressed copy: the .ckpt alone, with a warning."""
    src = write_files(tmp_path / "sf", "specforge", [sample(i) for i in range(3)])
    first = Path(src, "rows_0-2000", "data_0.ckpt")
    Path(f"{first}.gz").write_bytes(gzip.compress(first.read_bytes()))
    back = str(tmp_path / "back")
    with caplog.at_level("WARNING"):
        assert cli(["import", src, "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target]) == 0
    stored, skipped = imported(back)
    assert not skipped and sorted(s.sample_id for s in stored) == [f"rows_0-2000/data_{i}" for i in range(3)]
    assert load_manifest(open_store(back)).num_samples == 3
    assert any("1 .ckpt.gz file(s)" in r.getMessage() and "only the .ckpt is imported" in r.getMessage()
               for r in caplog.records)


# 6. status of an unfinished import

def test_status_of_an_unfinished_import_names_layertap_import(target, tmp_path, capsys):
    src = write_files(tmp_path / "sf", "specforge", [sample(i) for i in range(4)])
    back = str(tmp_path / "back")
    assert cli(["import", src, "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target,
                "--shard-bytes", "8KB"]) == 0
    store = open_store(back)
    lost = sorted(o.key for o in store.list(layout.COMMITS))[1]  # a shard whose worker died before its commit
    shard = layout.shard_of(lost, layout.COMMITS)
    store.delete(lost)
    for o in list(store.list(f"{layout.TALLY}{shard:06d}.")):
        store.delete(o.key)
    capsys.readouterr()
    assert cli(["status", back]) == 3
    out = capsys.readouterr().out
    assert f"nothing is running: the same `layertap import {src} --from specforge --out {back} ...` command" in out
    assert "layertap extract" not in out
    # a shard verify withdraws is redone by the import, not an extraction (verify said `layertap extract`)
    data = decode_commit(store.get(layout.commit_key(0)), "c").data_key
    damaged = bytearray(store.get(data))
    damaged[len(damaged) // 2] ^= 0xFF
    store.put(data, bytes(damaged))
    assert cli(["verify", back]) == 1
    out = capsys.readouterr().out
    assert "WITHDRAWN shard 0: " in out and "(the next `layertap import` redoes it)" in out, out


# 7. a stop signal during an import's shard

def test_a_stop_signal_during_an_imports_shard_is_taken_before_the_next_file(target, tmp_path, capsys, monkeypatch):
    """The import's stop was raised wherever the main thread was: inside a sample's write (its
    writer's queue and threads), the commit or the lease's release, where an exception raised
    into a `Thread.join` or a `Condition.notify` leaves threads waiting for good (the extraction's
    chaos trials). Now the sample being written completes and the stop is taken before the next
    file: the shard is aborted, its lease released, nothing of it visible, exit 143."""
    import os
    import signal

    from layertap.storage.writer import ShardWriter

    src = write_files(tmp_path / "src", "specforge", [sample(i) for i in range(4)])
    written = []
    real = ShardWriter.write_sample

    def write_then_signal(self, s):
        if not written:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives inside the first sample's write
        real(self, s)
        written.append(s.sample_id)

    monkeypatch.setattr(ShardWriter, "write_sample", write_then_signal)
    back = tmp_path / "back"
    rc = cli(["import", src, "--from", "specforge", "--out", str(back), "--layers", "1,3", "--model", target])
    assert rc == 143, capsys.readouterr().err
    assert len(written) == 1  # the write the signal arrived in completed; no later file was read
    store = open_store(str(back))
    assert not list(store.list(layout.COMMITS)) and not list(store.list(layout.LEASES))
    assert not [o.key for o in store.list(layout.SHARDS)]  # the open shard's object aborted
    failures = [o.key for o in store.list(layout.FAILURES)]
    assert len(failures) == 1 and failures[0].endswith(layout.STOPPED), failures
