"""`layertap export` / `layertap import`: runs made by the real extractor (local folder and moto S3)
written in speculators', SpecForge's and ModelOpt's layouts, read back by speculators' and
SpecForge's own readers (the real packages; a reader written from ModelOpt's documented layout
for ModelOpt, whose package is not installed), and imported back into runs that hold the same
input_ids, loss masks and states, bit for bit."""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.manifest import load_manifest
from layertap.manifests.records import decode_commit
from layertap.storage.reader import ShardReader
from layertap.storage.store import open_store
from test_extract import write_chats
from tiny_models import tiny_model_dir

# Not skipped when missing: CI installs them (tests/run.sh), and a missing package is a failure here.
from speculators.train.data import ArrowDataset  # noqa: E402
from specforge.algorithms.common.dflash_family_data import normalize_offline_sample  # noqa: E402
from specforge.runtime.data_plane.feature_store import load_feature_file  # noqa: E402
from specforge.runtime.data_plane.offline_reader import OfflineManifestReader, list_feature_files  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3")


def extract(target: str, out: str, tmp: Path, final_state: str, layers: str = "3,1", shard_bytes: str = "40KB") -> str:
    assert cli(["extract", "--model", target, "--dataset", write_chats(tmp / "chats.jsonl", 12), "--out", out,
                "--layers", layers, "--max-length", "64", "--final-state", final_state, "--shard-bytes", shard_bytes,
                "--log-dir", str(tmp / "logs")]) == 0
    return out


@pytest.fixture(scope="module")
def prenorm_run(target, tmp_path_factory) -> str:
    """Layers stored as 3,1 (not ascending), with the pre-norm final state."""
    tmp = tmp_path_factory.mktemp("prenorm")
    return extract(target, str(tmp / "run"), tmp, "prenorm")


@pytest.fixture(scope="module")
def s3_postnorm_run(target, tmp_path_factory, s3_endpoint) -> str:
    import boto3

    bucket = f"interop-{os.getpid()}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    tmp = tmp_path_factory.mktemp("postnorm")
    return extract(target, f"s3://{bucket}/runs/post", tmp, "postnorm", layers="1,3")


def samples(uri: str) -> dict:
    store = open_store(uri)
    out = {}
    for o in store.list(layout.COMMITS):
        for s in ShardReader(store, decode_commit(store.get(o.key), o.key).data_key):
            out[s.sample_id] = s
    return out


def in_order(uri: str) -> list:
    """A run's samples in shard order (what export writes)."""
    store = open_store(uri)
    commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
    return [s for c in sorted(commits, key=lambda c: c.shard) for s in ShardReader(store, c.data_key)]


def ascending(s):
    """A sample of the runs stored as layers 3,1, with its layers as speculators' files hold them: 1,3."""
    return replace(s, hidden_states=s.hidden_states[:, [1, 0]])


def assert_same(a, b, final: bool = True) -> None:
    assert torch.equal(a.input_ids.long(), b.input_ids.long())
    assert torch.equal(a.loss_mask.bool(), b.loss_mask.bool())
    assert torch.equal(a.hidden_states.view(torch.int16), b.hidden_states.view(torch.int16))
    if final:
        assert torch.equal(a.final_state.view(torch.int16), b.final_state.view(torch.int16))


def test_speculators_reads_the_export_and_import_gives_the_run_back(prenorm_run, target, tmp_path, capsys):
    dest, back = str(tmp_path / "spec"), str(tmp_path / "back")
    assert cli(["export", prenorm_run, "--to", "speculators", dest]) == 0
    assert "layers [1, 3] (layertap's ids) are speculators' [2, 4]" in capsys.readouterr().out
    ours = in_order(prenorm_run)
    # speculators' own dataset class: Arrow rows + hs_{i}.safetensors, nothing generated
    ds = ArrowDataset(max_len=64, datapath=dest, on_missing="raise")
    assert len(ds) == len(ours)
    for i, s in enumerate(ours):
        item = ds[i]
        assert torch.equal(item["input_ids"], s.input_ids.long())
        assert torch.equal(item["loss_mask"].bool(), s.loss_mask.bool())
        assert torch.equal(item["hidden_states"], ascending(s).hidden_states.flatten(1))
        assert torch.equal(item["verifier_last_hidden_states"], s.final_state)
    note = json.loads(Path(dest, "layertap-export.json").read_text())
    assert note["speculators_layer_ids"] == [2, 4] and note["samples"] == len(ours)

    capsys.readouterr()
    assert cli(["import", dest, "--from", "speculators", "--out", back, "--layers", "2,4", "--model", target,
                "--shard-bytes", "30KB"]) == 0
    assert "COMPLETE" in capsys.readouterr().out
    run = load_manifest(open_store(back)).identity
    assert run.layers == [1, 3] and run.final_state == "prenorm" and run.model == target
    got = samples(back)
    assert len(got) == len(ours)
    for i, s in enumerate(ours):
        assert_same(got[str(i)], ascending(s))
    # an ordinary run: verify re-reads it, and train takes the target its manifest records
    assert cli(["verify", back]) == 0
    assert cli(["train", "--data", back, "--out", str(tmp_path / "drafter"), "--steps", "2", "--batch-size", "4",
                "--block-size", "4", "--max-anchors", "8", "--mask-token-id", "3"]) == 0


def test_a_byte_flipped_on_its_way_from_the_store_is_read_again_not_imported(prenorm_run, target, tmp_path, s3_endpoint,
                                                                             s3_bucket, monkeypatch):
    """safetensors files carry no hash, and radosgw 16 (as moto here, with checksum validation off)
    sends no checksum header for a plain PUT: a byte flipped in transit was imported as it arrived,
    and the run's own hashes then covered it (`verify` passed). A whole-object GET is checked against
    the object's ETag, its MD5, and read again."""
    from faultproxy import FaultProxy

    monkeypatch.setenv("LAYERTAP_S3_CHECKSUM_MODE", "when_required")  # files PUT with no checksum: none kept
    dest = f"s3://{s3_bucket}/spec-flip"
    assert cli(["export", prenorm_run, "--to", "speculators", dest]) == 0
    states = lambda method, path: method == "GET" and "/hidden_states/hs_" in path  # noqa: E731
    with FaultProxy(s3_endpoint, rate=1.0, faults=("flip",), match=states, limit=3) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        back = str(tmp_path / "back")
        assert cli(["import", dest, "--from", "speculators", "--out", back, "--layers", "2,4", "--model", target]) == 0
        assert proxy.counts["flip"] == 3
    got, ours = samples(back), in_order(prenorm_run)
    assert len(got) == len(ours)
    for i, s in enumerate(ours):
        assert_same(got[str(i)], ascending(s))


def test_specforge_reads_the_export_and_import_gives_the_run_back(prenorm_run, target, tmp_path):
    dest, back = str(tmp_path / "sf"), str(tmp_path / "back")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "7"]) == 0
    ours = in_order(prenorm_run)[:7]
    paths = list_feature_files(dest)
    assert len(paths) == 7 and all("/rows_0-2000/data_" in p for p in paths)
    refs = OfflineManifestReader(dest, feature_keys=("input_ids", "loss_mask", "hidden_states"),
                                 strategy="dflash", validate_files=True).read()
    assert sorted(r.num_tokens for r in refs) == sorted(s.num_tokens for s in ours)
    by_name = {os.path.basename(p): p for p in paths}
    for i, s in enumerate(ours):
        raw = load_feature_file(by_name[f"data_{i}.ckpt"])  # SpecForge's own loader
        item = normalize_offline_sample(raw, max_len=64)  # and its DFlash normalizer
        assert torch.equal(item["input_ids"][0], s.input_ids.long())
        assert torch.equal(item["loss_mask"][0].bool(), s.loss_mask.bool())
        # layers ascending, as SGLang gathers them (SpecForge's capture): the run's 3,1 written as 1,3
        assert torch.equal(item["hidden_states"][0], ascending(s).hidden_states.flatten(1))
    assert cli(["import", dest, "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target]) == 0
    run = load_manifest(open_store(back)).identity
    assert run.layers == [1, 3] and run.final_state == "none"
    got = samples(back)
    for i, s in enumerate(ours):
        assert_same(got[f"rows_0-2000/data_{i}"], ascending(s), final=False)


def test_import_of_a_layertap_export_takes_the_target_and_layers_its_note_records(prenorm_run, target, tmp_path,
                                                                                   capsys):
    """--model and --layers were required even where `layertap export` had recorded both beside the
    files (a Quickstart user had to dig the packaged SmolLM2's folder out); foreign files, with no
    note, still need them, and are told so."""
    dest, back = str(tmp_path / "sf"), str(tmp_path / "back")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "3"]) == 0
    assert cli(["import", dest, "--from", "specforge", "--out", back]) == 0
    run = load_manifest(open_store(back)).identity
    assert run.layers == [1, 3] and run.model == load_manifest(open_store(prenorm_run)).identity.model
    assert len(samples(back)) == 3
    capsys.readouterr()  # the wrong --from, and a SRC that is not there, were "give --model and --layers"
    assert cli(["import", dest, "--from", "modelopt", "--out", str(tmp_path / "other")]) == 2
    assert "holds 'specforge' files, as its layertap-export.json records" in capsys.readouterr().err
    assert cli(["import", dest + "-typo", "--from", "specforge", "--out", str(tmp_path / "other")]) == 2
    assert f"{dest}-typo does not exist, or holds nothing" in capsys.readouterr().err
    note = json.loads(open_store(dest).get("layertap-export.json"))
    open_store(dest).put("layertap-export.json", json.dumps({k: v for k, v in note.items()
                                                            if k != "specforge_layer_ids"}).encode())
    capsys.readouterr()  # a note without the layers: a KeyError traceback
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "other")]) == 2
    assert "give --layers: the layertap-export.json beside" in capsys.readouterr().err
    open_store(dest).delete("layertap-export.json")
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "other"), "--model", target]) == 2
    assert "give --layers: " in capsys.readouterr().err


def test_an_import_that_would_store_nothing_fails_and_says_why(prenorm_run, target, tmp_path, capsys):
    """Files of another model's vocabulary (every sample skipped as bad_token_id), or with no
    supervised token anywhere, made a run of 0 samples: "COMPLETE", exit 0 and "train a drafter
    on it". The first is refused before anything is written, naming --model; the second exits 1."""
    import glob
    import shutil

    dest = str(tmp_path / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "4"]) == 0
    small = Path(tmp_path / "small-vocab")
    shutil.copytree(target, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 10}))
    capsys.readouterr()
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "a"), "--model", str(small)]) == 2
    assert "is outside the target's vocabulary [0, 10)" in capsys.readouterr().err and not (tmp_path / "a").exists()
    for path in glob.glob(f"{dest}/rows_*/*.ckpt"):  # SpecForge's own files: torch pickles, as it writes them
        d = torch.load(path, weights_only=True)
        torch.save({**d, "loss_mask": torch.zeros_like(d["loss_mask"])}, path)
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "b")]) == 1
    captured = capsys.readouterr()
    assert "no sample of" in captured.err and "was stored" in captured.err and "train a drafter" not in captured.out


def test_an_export_of_no_sample_fails_and_leaves_dest_empty(tmp_path, capsys):
    """Every committed shard's data gone (consumed, or withdrawn): the export wrote 0 samples and
    exited 0, leaving a speculators dataset `datasets` cannot load (an IndexError) or a SpecForge
    folder holding only the note."""
    import fake_worker

    run = str(tmp_path / "run")
    fake_worker.work(run)
    store = open_store(run)
    store.delete_many([o.key for o in store.list(layout.SHARDS)])
    for shard in range(7):  # consumed by a --delete-consumed trainer (data gone without a marker: refused as lost)
        store.put(layout.consumed_marker_key(shard), b"")
    dest = tmp_path / "specforge"  # the layout fake_worker's runs (no final state) export to
    assert cli(["export", run, "--to", "specforge", str(dest)]) == 2
    assert "has no sample to export: the data of every committed shard is gone" in capsys.readouterr().err
    assert not dest.exists() or not any(p.is_file() for p in dest.rglob("*"))


def test_modelopt_on_s3_round_trip(s3_postnorm_run, target, s3_bucket, capsys):
    dest, back = f"s3://{s3_bucket}/modelopt", f"s3://{s3_bucket}/back"
    assert cli(["export", s3_postnorm_run, "--to", "modelopt", dest, "--limit", "5"]) == 0
    ours = in_order(s3_postnorm_run)[:5]
    store = open_store(dest)
    files = sorted(o.key for o in store.list("") if o.key.endswith(".pt"))
    assert len(files) == 5
    for s in ours:  # ModelOpt's documented layout, read with the safe unpickler
        d = torch.load(io.BytesIO(store.get(f"{s.sample_id}.pt")), weights_only=True)
        assert d["conversation_id"] == s.sample_id
        assert torch.equal(d["input_ids"], s.input_ids.long())
        assert torch.equal(d["aux_hidden_states"], s.hidden_states.flatten(1))
        assert torch.equal(d["hidden_states"], s.final_state) and d["hidden_states"].shape == (s.num_tokens, 64)
        assert torch.equal(d["loss_mask"].bool(), s.loss_mask.bool())
    assert cli(["import", dest, "--from", "modelopt", "--out", back, "--layers", "1,3", "--model", target]) == 0
    run = load_manifest(open_store(back)).identity
    assert run.layers == [1, 3] and run.final_state == "postnorm"
    got = samples(back)
    assert sorted(got) == sorted(s.sample_id for s in ours)
    for s in ours:
        assert_same(got[s.sample_id], s)


def test_import_resumes_and_refuses_other_arguments(prenorm_run, target, tmp_path, capsys):
    dest, back = str(tmp_path / "sf"), str(tmp_path / "back")
    assert cli(["export", prenorm_run, "--to", "specforge", dest]) == 0
    args = ["import", dest, "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target,
            "--shard-bytes", "20KB"]
    assert cli(args) == 0
    store = open_store(back)
    commits = {o.key: store.get(o.key) for o in store.list(layout.COMMITS)}
    assert len(commits) >= 3
    lost = sorted(commits)[1]  # a shard whose worker died before its commit
    shard = layout.shard_of(lost, layout.COMMITS)
    store.delete(lost)
    for o in list(store.list(f"{layout.TALLY}{shard:06d}.")):
        store.delete(o.key)
    assert cli(args) == 0
    again = {o.key: store.get(o.key) for o in store.list(layout.COMMITS)}
    assert sorted(again) == sorted(commits)
    assert all(again[k] == v for k, v in commits.items() if k != lost)  # the others were not redone
    assert again[lost] != commits[lost]
    capsys.readouterr()
    other = [a if a != "1,3" else "0,3" for a in args]
    assert cli(other) == 2  # the export's note names the layers the files hold
    assert "records that the files hold specforge's layer ids [1, 3]" in capsys.readouterr().err
    os.remove(os.path.join(dest, "layertap-export.json"))
    assert cli(other) == 2  # without it: other layers, another run
    assert "different configuration" in capsys.readouterr().err


def test_export_refuses_a_run_without_the_final_state_the_format_holds(s3_postnorm_run, tmp_path, capsys):
    assert cli(["export", s3_postnorm_run, "--to", "speculators", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--final-state prenorm" in err and "final_state='postnorm'" in err


def test_import_refuses_wrong_layer_counts_and_unsafe_pickles(prenorm_run, target, tmp_path, capsys):
    dest = str(tmp_path / "spec")
    assert cli(["export", prenorm_run, "--to", "speculators", dest, "--limit", "2"]) == 0
    capsys.readouterr()
    assert cli(["import", dest, "--from", "speculators", "--out", str(tmp_path / "a"), "--layers", "2",
                "--model", target]) == 2
    assert "--layers" in capsys.readouterr().err
    assert cli(["import", dest, "--from", "speculators", "--out", str(tmp_path / "a"), "--layers", "0,2",
                "--model", target]) == 2
    assert "counts layers from 1" in capsys.readouterr().err

    evil = tmp_path / "evil"
    evil.mkdir()
    torch.save({"input_ids": torch.arange(4), "payload": Path("/etc/passwd")}, evil / "data_0.ckpt")
    assert cli(["import", str(evil), "--from", "specforge", "--out", str(tmp_path / "b"), "--layers", "1",
                "--model", target]) == 2
    assert "not a torch.save file of tensors" in capsys.readouterr().err


def test_an_export_refuses_a_destination_that_holds_files(prenorm_run, tmp_path, capsys):
    """SpecForge's and ModelOpt's trainers read every sample file under the folder: a second,
    smaller export into it would leave the first one's files to be trained on."""
    dest = str(tmp_path / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", dest]) == 0
    before = sorted(p.name for p in Path(dest).rglob("*"))
    capsys.readouterr()
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "3"]) == 2
    err = capsys.readouterr().err
    assert "is not empty (it holds an earlier export: layertap-export.json" in err
    assert f"or empty this one first (`layertap delete {Path(dest).resolve()}`)" in err or \
        f"or empty this one first (`layertap delete {dest}`)" in err
    assert sorted(p.name for p in Path(dest).rglob("*")) == before
    # the command it names deletes it, an output of layertap's own ("holds no run ... Check the prefix, or --force")
    assert cli(["delete", "--yes", dest]) == 0 and not Path(dest).exists()
    assert "`layertap export` output at" in capsys.readouterr().out
    # the run itself given as DEST: "empty this one first" would have had the user delete the run
    assert cli(["export", prenorm_run, "--to", "specforge", prenorm_run]) == 2
    err = capsys.readouterr().err
    assert f"the export destination {prenorm_run} is a layertap run (it holds manifest.json)" in err
    assert "empty this one" not in err


def test_an_import_into_an_extracted_runs_prefix_says_so(prenorm_run, target, tmp_path, capsys):
    """It listed nine "run has X, now None" differences and advised "use the run's settings to resume it",
    which no import can."""
    dest = str(tmp_path / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "2"]) == 0
    capsys.readouterr()
    assert cli(["import", dest, "--from", "specforge", "--out", prenorm_run, "--model", target]) == 2
    err = capsys.readouterr().err
    assert f"the run at {prenorm_run} was extracted (`layertap extract`); this is an import of specforge files, " \
        "which cannot resume it: write the new run to another prefix" in err, err
    assert "now None" not in err


def test_an_import_with_another_model_than_the_export_records_warns(prenorm_run, target, tmp_path, caplog):
    """Only the width was compared: a model of the same width imported without a word, and the
    drafter trained on the run would borrow its embeddings and head."""
    dest = str(tmp_path / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "2"]) == 0
    other = tiny_model_dir(tmp_path / "other", "qwen3", seed=1)  # the same width and layers, another model
    caplog.set_level("WARNING", logger="layertap.extract.interop")
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "a"), "--model", other]) == 0
    said = [r.getMessage() for r in caplog.records if "records that these states are of" in r.getMessage()]
    assert len(said) == 1 and f"but --model is {os.path.realpath(other)}" in said[0], said
    caplog.clear()
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "b"), "--model", target]) == 0
    assert not [r for r in caplog.records if "records that these states are of" in r.getMessage()]


def test_an_import_skips_truncated_files_with_their_reason(prenorm_run, target, tmp_path, capsys):
    """A file cut short (a .ckpt.gz, an hs_{i}.safetensors) is one bad sample, skipped and named in
    its shard's commit, not a failure of the whole shard on every rerun; the import's end says that
    files were left out (it said COMPLETE alone, as of a whole import)."""
    import gzip

    sf, spec = tmp_path / "sf", tmp_path / "spec"
    assert cli(["export", prenorm_run, "--to", "specforge", str(sf), "--limit", "4"]) == 0
    cut = sorted(sf.rglob("data_*.ckpt"))[1]
    cut.with_suffix(".ckpt.gz").write_bytes(gzip.compress(cut.read_bytes())[:300])
    cut.unlink()
    assert cli(["export", prenorm_run, "--to", "speculators", str(spec), "--limit", "4"]) == 0
    hs = spec / "hidden_states" / "hs_2.safetensors"
    hs.write_bytes(hs.read_bytes()[:200])
    for src, fmt, layers in ((sf, "specforge", "1,3"), (spec, "speculators", "2,4")):
        back = str(tmp_path / f"back-{fmt}")
        assert cli(["import", str(src), "--from", fmt, "--out", back, "--layers", layers, "--model", target]) == 0
        store = open_store(back)
        commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
        skipped = [s for c in commits for s in c.skipped]
        assert sum(c.num_records for c in commits) == 3 and len(skipped) == 1
        assert skipped[0]["reason"] == "unreadable" and "cut short" in skipped[0]["detail"]
        assert f"warning: 1 file of {src} could not be read and is left out of the run" in capsys.readouterr().err


def test_a_file_deleted_after_the_plan_is_a_skipped_sample_not_a_failed_shard(prenorm_run, target, tmp_path,
                                                                               monkeypatch, capsys):
    """A SpecForge file removed while the import ran failed its whole shard on every retry ("ObjectNotFound"),
    and the same command was then refused (the files' fingerprint had changed): a run left at 596/600."""
    from layertap.extract import interop

    sf = tmp_path / "sf"
    assert cli(["export", prenorm_run, "--to", "specforge", str(sf), "--limit", "4"]) == 0
    gone = sorted(sf.rglob("data_*.ckpt"))[2]
    planned = interop.plan_import

    def then_deleted(*args, **kwargs):
        result = planned(*args, **kwargs)
        gone.unlink()
        return result

    monkeypatch.setattr(interop, "plan_import", then_deleted)
    back = str(tmp_path / "back")
    assert cli(["import", str(sf), "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target]) == 0
    out = capsys.readouterr().out
    assert "COMPLETE" in out and "3/4 stored, 1 skipped: unreadable 1" in out, out
    store = open_store(back)
    [skip] = [s for o in store.list(layout.COMMITS) for s in decode_commit(store.get(o.key), o.key).skipped]
    assert skip["reason"] == "unreadable" and "is missing: deleted since the import was planned" in skip["detail"]


def test_an_import_with_too_many_layers_for_the_targets_width_is_refused(prenorm_run, target, tmp_path, capsys):
    """SpecForge's DFlash files concatenate the layers: 4 ids for 2 stored layers split each state in
    halves of another width than the target's, which only training would notice."""
    sf = str(tmp_path / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", sf, "--limit", "2"]) == 0
    capsys.readouterr()
    assert cli(["import", sf, "--from", "specforge", "--out", str(tmp_path / "back"), "--layers", "1,3,5,7",
                "--model", target]) == 2
    err = capsys.readouterr().err
    assert "hidden size 64" in err and "--layers" in err and not (tmp_path / "back").exists()


def gguf_target(target: str, folder: Path) -> str:
    """`folder` holding only a GGUF of the tiny target: hidden size, depth, heads, embedding and head."""
    import gguf
    from safetensors.torch import load_file

    weights = load_file(os.path.join(target, "model.safetensors"))
    folder.mkdir()
    w = gguf.GGUFWriter(str(folder / "tiny.gguf"), "qwen3")
    w.add_embedding_length(64)
    w.add_block_count(6)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"].float().numpy())
    w.add_tensor("output.weight", weights["lm_head.weight"].float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(folder)


@pytest.fixture(scope="module")
def specforge_export(prenorm_run, tmp_path_factory) -> str:
    """Two samples of the prenorm run (layers 3,1: 2 x 64 values per token) in SpecForge's layout."""
    dest = str(tmp_path_factory.mktemp("sf-export") / "sf")
    assert cli(["export", prenorm_run, "--to", "specforge", dest, "--limit", "2"]) == 0
    return dest


@pytest.mark.parametrize("layers", ["3", "1,2,3", "1,2,3,4"])
def test_a_specforge_import_with_a_wrong_layer_count_is_refused_before_writing(specforge_export, target, tmp_path,
                                                                               capsys, layers):
    """The files concatenate the layers: 128 values per token read as 1 layer (or 3, or 4) would be
    imported as states 128 (or 42, or 32) wide. The target's hidden size says they hold 2; the
    walkthrough's case is a --model folder holding only a GGUF, which the old check never read."""
    for model in ([target], [gguf_target(target, tmp_path / "gguf"), "--gguf-file", "tiny.gguf"]):
        capsys.readouterr()
        back = tmp_path / "back"
        assert cli(["import", specforge_export, "--from", "specforge", "--out", str(back), "--layers", layers,
                    "--model", *model]) == 2
        err = capsys.readouterr().err
        if layers == "1,2,3":  # 128 values are no whole number of 3 layers: refused as before, with the numbers
            assert "holds 128 values per token" in err
        else:
            assert ("data_0.ckpt holds 128 values per token" in err and "hidden size 64" in err
                    and f"2 capture layer(s), but --layers {layers} names {len(layers.split(','))}" in err
                    and "records specforge's layer ids [1, 3]" in err), err
        assert not back.exists()


def test_a_modelopt_import_with_a_wrong_layer_count_is_refused_before_writing(prenorm_run, target, tmp_path, capsys):
    """ModelOpt files without layertap's export note: the target's hidden size alone counts the layers."""
    from layertap.storage.foreign_modelopt import ModelOptWriter

    src = tmp_path / "mo"
    out = ModelOptWriter(open_store(str(src)))
    for i, s in enumerate(in_order(prenorm_run)[:2]):
        out.write(i, replace(s, final_state=s.hidden_states[:, 0]))
    back = tmp_path / "back"
    assert cli(["import", str(src), "--from", "modelopt", "--out", str(back), "--layers", "1,2,3,4",
                "--model", target]) == 2
    err = capsys.readouterr().err
    assert "holds 128 values per token" in err and "2 capture layer(s), but --layers 1,2,3,4 names 4" in err
    assert "layertap-export.json" not in err and not back.exists()
    # 4 names a whole number of states (32 wide): a wrong --model reads so too, and is named
    assert "or, if --layers is right, they are states 32 wide: another model's than --model's" in err
    assert cli(["import", str(src), "--from", "modelopt", "--out", str(back), "--layers", "1,3",
                "--model", target]) == 0


def test_a_speculators_import_names_the_layer_counts(prenorm_run, target, tmp_path, capsys):
    """speculators' files say their layer count ([T, k+1, H]); the error gives it, with the target's
    width, and a file of another width than --model's hidden size is refused too."""
    dest = str(tmp_path / "spec")
    assert cli(["export", prenorm_run, "--to", "speculators", dest, "--limit", "2"]) == 0
    capsys.readouterr()
    back = tmp_path / "back"
    assert cli(["import", dest, "--from", "speculators", "--out", str(back), "--layers", "2,4,6", "--model",
                target]) == 2
    err = capsys.readouterr().err
    assert "hs_0.safetensors holds 128 values per token" in err and "names 3" in err and "[2, 4]" in err
    wide = tiny_model_dir(tmp_path / "models", "qwen3", hidden_size=128)
    assert cli(["import", dest, "--from", "speculators", "--out", str(back), "--layers", "2,4", "--model",
                wide]) == 2
    err = capsys.readouterr().err
    assert "are 64 wide" in err and "hidden size is 128" in err and not back.exists()
    # narrower: 128 values are 4 states 32 wide, so "not a whole number of states of hidden size 32" was false
    narrow = tiny_model_dir(tmp_path / "narrow", "qwen3", hidden_size=32)
    (Path(dest) / "layertap-export.json").unlink()  # files of another tool: no note to compare widths with
    assert cli(["import", dest, "--from", "speculators", "--out", str(back), "--layers", "2,4", "--model",
                narrow]) == 2
    err = capsys.readouterr().err
    assert "(2 layer(s) of 64): states 64 wide, where the target's hidden size is 32" in err, err
    assert "whole number" not in err and not back.exists()


def test_an_import_checks_the_target_and_records_its_gguf_file(specforge_export, target, tmp_path, capsys):
    """--model must be a folder `layertap train` can read the target from (the manifest records it
    and import prints that train command as the next step); a GGUF target is named with --gguf-file
    and recorded, so the printed train command finds it."""
    back = tmp_path / "back"
    base = ["import", specforge_export, "--from", "specforge", "--out", str(back), "--layers", "1,3"]
    folder = gguf_target(target, tmp_path / "gguf")
    for model, says in (([str(tmp_path / "nope")], "is not a folder on this machine"),
                        ([folder], "has no config.json, which `layertap train` needs with the target's safetensors "
                                   "weights; it holds tiny.gguf: pass --gguf-file tiny.gguf"),
                        ([folder, "--gguf-file", "other.gguf"], "'other.gguf' (--gguf-file) not found in"),
                        ([f"{folder}/tiny.gguf"], f"is a GGUF file: pass the folder that holds it as --model and the "
                                                  f"file's name as --gguf-file (--model {folder} --gguf-file tiny.gguf)")):
        capsys.readouterr()
        assert cli(base + ["--model", *model]) == 2
        err = capsys.readouterr().err
        assert says in err and not back.exists(), err
    # extract and train say the same of the file given as --model (each said its folder was missing)
    from layertap.extract.model import load_target
    from layertap.storage.errors import MissingInput
    from layertap.train.target_head import load_target_head

    for load in (load_target, load_target_head):
        with pytest.raises(MissingInput, match="is a GGUF file: pass the folder"):
            load(f"{folder}/tiny.gguf")
    empty = tmp_path / "config-only"
    empty.mkdir()
    (empty / "config.json").write_text(Path(target, "config.json").read_text())
    assert cli(base + ["--model", str(empty)]) == 2
    assert "neither model.safetensors nor model.safetensors.index.json" in capsys.readouterr().err

    assert cli(base + ["--model", folder, "--gguf-file", "tiny.gguf"]) == 0
    assert f"layertap train --data {back} --out" in capsys.readouterr().out
    run = load_manifest(open_store(str(back))).identity
    assert (run.model, run.gguf_file, run.hidden_size) == (folder, "tiny.gguf", 64)
    assert cli(["train", "--data", str(back), "--out", str(tmp_path / "drafter"), "--steps", "1", "--batch-size", "2",
                "--block-size", "4", "--max-anchors", "4", "--mask-token-id", "3"]) == 0


def test_speculators_layout_on_s3_round_trip(prenorm_run, target, s3_bucket):
    """The Arrow dataset passes through a temporary folder on both sides; the states never do."""
    dest, back = f"s3://{s3_bucket}/spec", f"s3://{s3_bucket}/back"
    assert cli(["export", prenorm_run, "--to", "speculators", dest, "--limit", "3"]) == 0
    keys = {o.key for o in open_store(dest).list("")}
    assert {"state.json", "dataset_info.json", "hidden_states/hs_2.safetensors"} <= keys
    assert cli(["import", dest, "--from", "speculators", "--out", back, "--layers", "2,4", "--model", target]) == 0
    got = samples(back)
    for i, s in enumerate(in_order(prenorm_run)[:3]):
        assert_same(got[str(i)], ascending(s))


def test_speculators_trains_from_the_run_itself_through_the_layertap_transfer(prenorm_run, target, tmp_path, capsys):
    """`--rows-only` writes the Arrow dataset alone; speculators' ArrowDataset then reads each row's
    states from the run's shards through LayertapTransfer, equal to the full export's files."""
    from layertap.extract.speculators_transfer import LayertapTransfer

    full, rows = str(tmp_path / "full"), str(tmp_path / "rows")
    assert cli(["export", prenorm_run, "--to", "speculators", full]) == 0
    assert cli(["export", prenorm_run, "--to", "speculators", rows, "--rows-only"]) == 0
    assert not (tmp_path / "rows" / "hidden_states").exists()
    # the rows alone are not an import's source: it said hs_0.safetensors was missing
    capsys.readouterr()
    assert cli(["import", rows, "--from", "speculators", "--out", str(tmp_path / "back"), "--layers", "2,4",
                "--model", target]) == 2
    assert f"{rows} is a `layertap export --rows-only` of the run at {prenorm_run}: it holds the rows alone" \
        in capsys.readouterr().err
    assert not (tmp_path / "back").exists()
    files = ArrowDataset(max_len=64, datapath=full, on_missing="raise")
    streamed = ArrowDataset(max_len=64, datapath=rows, on_missing="raise", transfer=LayertapTransfer(rows))
    assert len(files) == len(streamed) == len(in_order(prenorm_run))
    for i in range(len(files)):
        a, b = files[i], streamed[i]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert LayertapTransfer(rows).get_cached(len(files)) is None
    import pickle  # what speculators' spawned DataLoader workers are sent: a transfer read from first failed it

    used = LayertapTransfer(rows)
    first = used.get_cached(0)
    again = pickle.loads(pickle.dumps(used)).get_cached(0)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)


def test_rows_keep_their_samples_when_the_run_changes_after_the_export(target, tmp_path, capsys):
    """Rows map to samples through the export's record of the shards it read: a shard committed
    after the export (a run still extracting) must not shift later rows onto other samples, and a
    shard whose data is gone (consumed, withdrawn) makes its rows missing, not another's."""
    from layertap.extract.speculators_transfer import LayertapTransfer

    tmp = tmp_path / "x"
    tmp.mkdir()
    run = extract(target, str(tmp_path / "run"), tmp, "prenorm")
    store = open_store(run)
    commits = sorted((decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)),
                     key=lambda c: c.shard)
    assert len(commits) >= 3
    held_back = store.get(layout.commit_key(commits[0].shard))  # as if shard 0 were still extracting at export time
    store.delete(layout.commit_key(commits[0].shard))
    full, rows = str(tmp_path / "full"), str(tmp_path / "rows")
    assert cli(["export", run, "--to", "speculators", full]) == 0
    assert cli(["export", run, "--to", "speculators", rows, "--rows-only"]) == 0
    # a partial export says so as it ends (it only warned of the count as it began), and records it
    assert f"warning: 1 of the run's {len(commits)} shards are not in it" in capsys.readouterr().err
    note = json.loads(Path(full, "layertap-export.json").read_text())
    assert (note["shards_missing"], note["shards_planned"]) == (1, len(commits))
    store.put(layout.commit_key(commits[0].shard), held_back)  # it commits afterwards
    gone = commits[1]
    store.delete(gone.data_key)  # a --delete-consumed trainer took it
    from safetensors.torch import load_file

    exported = sorted(Path(full, "hidden_states").iterdir(), key=lambda p: int(p.stem.split("_")[1]))
    transfer = LayertapTransfer(rows)
    missing = [i for i in range(len(exported)) if transfer.get_cached(i) is None]
    assert missing == list(range(gone.num_records))  # the first exported shard's rows, and only those
    for i in range(gone.num_records, len(exported)):
        ours, theirs = load_file(exported[i]), transfer.get_cached(i)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_complete_export_warns_of_no_missing_shard(prenorm_run, tmp_path, capsys):
    assert cli(["export", prenorm_run, "--to", "specforge", str(tmp_path / "sf")]) == 0
    assert "are not in it" not in capsys.readouterr().err
    assert json.loads((tmp_path / "sf" / "layertap-export.json").read_text())["shards_missing"] == 0


def test_rows_of_a_run_whose_manifest_was_edited_since_are_refused_not_mislabelled(prenorm_run, tmp_path):
    """`LayertapTransfer` labels the states it reads by the run's manifest, as export does: one
    edited after the export (here its codec) is refused where its first shard is read, naming the
    disagreement, rather than decoding the shard's bytes as other states."""
    import shutil

    from layertap.extract.speculators_transfer import LayertapTransfer
    from layertap.manifests.manifest import ManifestError

    run, rows = str(tmp_path / "run"), str(tmp_path / "rows")
    shutil.copytree(prenorm_run, run)
    assert cli(["export", run, "--to", "speculators", rows, "--rows-only"]) == 0
    assert LayertapTransfer(rows).get_cached(0) is not None
    store = open_store(run)
    manifest = json.loads(store.get(layout.MANIFEST))
    store.put(layout.MANIFEST, json.dumps(dict(manifest, config=dict(manifest["config"], codec="bf16"))).encode())
    with pytest.raises(ManifestError, match=r"manifest.json disagrees with committed shard \d+'s header .*: codec "
                                            r"'bf16-zstd' in the shard, 'bf16' in the manifest; the manifest was edited"):
        LayertapTransfer(rows).get_cached(0)


def test_a_modelopt_files_flag_says_which_final_state_it_holds(s3_postnorm_run, target, tmp_path, capsys, caplog):
    """ModelOpt's vLLM dumper stores the last layer's state before the final norm (its reader norms
    it where the file says `hidden_states_prenorm`); every ModelOpt import was recorded postnorm,
    and the state trained unnormed. The flag decides, --final-state for files without one, and a
    mix is refused file by file; an export says what it wrote."""
    dest = str(tmp_path / "mo")
    assert cli(["export", s3_postnorm_run, "--to", "modelopt", dest, "--limit", "3"]) == 0
    files = sorted(Path(dest).glob("*.pt"))
    assert all(torch.load(f, weights_only=True)["hidden_states_prenorm"] is False for f in files)

    def imported(flags: list, *extra: str) -> str:
        for f, flag in zip(files, flags):
            d = torch.load(f, weights_only=True)
            d.pop("hidden_states_prenorm", None)
            torch.save(d if flag is None else {**d, "hidden_states_prenorm": flag}, f)
        back = str(tmp_path / f"back-{len(os.listdir(tmp_path))}")
        assert cli(["import", dest, "--from", "modelopt", "--out", back, "--layers", "1,3", "--model", target,
                    *extra]) == 0
        return back

    assert load_manifest(open_store(imported([False] * 3))).identity.final_state == "postnorm"
    assert load_manifest(open_store(imported([True] * 3))).identity.final_state == "prenorm"
    assert load_manifest(open_store(imported([None] * 3, "--final-state", "prenorm"))).identity.final_state == \
        "prenorm"
    assert load_manifest(open_store(imported([None] * 3))).identity.final_state == "postnorm"
    assert "applies only to files that do not say" not in caplog.text
    # --final-state beside files that say otherwise: the files decide, and the flag's loss is said
    assert load_manifest(open_store(imported([False] * 3, "--final-state", "prenorm"))).identity.final_state == \
        "postnorm"
    assert "says it holds a postnorm final state (hidden_states_prenorm False): imported as one; --final-state " \
        "prenorm applies only to files that do not say" in caplog.text
    mixed = imported([True, True, False])  # the third file is not imported, and says why
    store = open_store(mixed)
    skipped = [s for o in store.list(layout.COMMITS) for s in decode_commit(store.get(o.key), o.key).skipped]
    assert len(skipped) == 1 and "holds a postnorm final state (hidden_states_prenorm False), the first file a " \
        "prenorm one" in skipped[0]["detail"]
    capsys.readouterr()
    assert cli(["import", dest, "--from", "specforge", "--out", str(tmp_path / "x"), "--layers", "1,3", "--model",
                target, "--final-state", "prenorm"]) == 2
    assert "--final-state is for --from modelopt" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["specforge", "modelopt"])
def test_every_format_takes_its_layers_ascending(s3_postnorm_run, target, tmp_path, capsys, fmt):
    """SGLang gathers aux states in layer order (SpecForge's capture), ModelOpt's dumpers sort the
    aux ids: --layers 3,1 stored each layer's states under the other's id. Refused, as speculators'
    was, naming the order to pass."""
    dest = str(tmp_path / fmt)
    assert cli(["export", s3_postnorm_run, "--to", fmt, dest, "--limit", "2"]) == 0
    capsys.readouterr()
    assert cli(["import", dest, "--from", fmt, "--out", str(tmp_path / "back"), "--layers", "3,1", "--model",
                target]) == 2
    assert f"{fmt}'s files hold the capture layers in ascending order" in capsys.readouterr().err
    assert not (tmp_path / "back").exists()


def test_broken_speculators_files_are_named_not_tracebacks_or_failed_shards(prenorm_run, target, tmp_path, capsys):
    """FP8 scales of the wrong shape failed the whole shard on every rerun with a broadcasting
    RuntimeError; an Arrow file `datasets` cannot load was a traceback naming no file."""
    from safetensors.torch import load_file, save_file

    dest = tmp_path / "spec"
    assert cli(["export", prenorm_run, "--to", "speculators", str(dest), "--limit", "4"]) == 0
    hs = dest / "hidden_states" / "hs_2.safetensors"
    d = load_file(hs)
    t = d["hidden_states"].shape[0]
    save_file({**d, "hidden_states": d["hidden_states"].to(torch.float8_e4m3fn),
               "hidden_states_scales": torch.ones(t + 1, 1, 1)}, hs)
    back = str(tmp_path / "back")
    assert cli(["import", str(dest), "--from", "speculators", "--out", back, "--layers", "2,4", "--model",
                target]) == 0
    store = open_store(back)
    skipped = [s for o in store.list(layout.COMMITS) for s in decode_commit(store.get(o.key), o.key).skipped]
    assert len(skipped) == 1 and f"hidden_states_scales has shape ({t + 1}, 1, 1), not [{t}, 1, 1]" in \
        skipped[0]["detail"]
    arrow = next(dest.glob("data-*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])
    capsys.readouterr()
    assert cli(["import", str(dest), "--from", "speculators", "--out", str(tmp_path / "b2"), "--layers", "2,4",
                "--model", target]) == 2
    err = capsys.readouterr().err
    assert f"the speculators dataset at {open_store(str(dest)).uri}" in err and "does not load" in err
    assert "Traceback" not in err


def test_states_past_a_files_tokens_or_a_batch_of_several_are_refused_not_dropped(s3_postnorm_run, target,
                                                                                   tmp_path):
    """SpecForge states were cut to input_ids' length whatever lay past it, and a ModelOpt final
    state saved as a batch of several gave its first: data dropped without a word. Zero padding
    past the tokens is still cut; anything else skips the file, named."""
    sf, mo = tmp_path / "sf", tmp_path / "mo"
    assert cli(["export", s3_postnorm_run, "--to", "specforge", str(sf), "--limit", "3"]) == 0
    assert cli(["export", s3_postnorm_run, "--to", "modelopt", str(mo), "--limit", "2"]) == 0
    padded, longer, _ = sorted(sf.rglob("data_*.ckpt"))
    for path, tail in ((padded, torch.zeros), (longer, torch.ones)):
        d = torch.load(path, weights_only=True)
        h = d["hidden_states"]
        d["hidden_states"] = torch.cat([h, tail(1, 3, h.shape[-1], dtype=h.dtype)], dim=1)
        torch.save(d, path)
    batched = sorted(mo.glob("*.pt"))[1]
    d = torch.load(batched, weights_only=True)
    torch.save({**d, "hidden_states": torch.stack([d["hidden_states"]] * 2)}, batched)
    for src, fmt, says in ((sf, "specforge", "its values past them are not zero padding"),
                           (mo, "modelopt", "a batch of 2: one sample a file")):
        back = str(tmp_path / f"back-{fmt}")
        assert cli(["import", str(src), "--from", fmt, "--out", back, "--layers", "1,3", "--model", target]) == 0
        store = open_store(back)
        commits = [decode_commit(store.get(o.key), o.key) for o in store.list(layout.COMMITS)]
        skipped = [s for c in commits for s in c.skipped]
        assert len(skipped) == 1 and says in skipped[0]["detail"], skipped
        assert sum(c.num_records for c in commits) == (2 if fmt == "specforge" else 1)


def test_the_layertap_transfer_reads_each_row_with_one_get_in_any_order(target, tmp_path, monkeypatch):
    """speculators' sampler shuffles rows; the transfer kept 4 shard readers, so nearly every row
    over a run of more shards opened its shard again: 3 GETs a row (HEAD, footer, record)."""
    import random

    from layertap.extract.speculators_transfer import LayertapTransfer
    from layertap.storage.local import LocalStore

    run = extract(target, str(tmp_path / "run"), tmp_path, "prenorm", shard_bytes="12KB")
    rows = str(tmp_path / "rows")
    assert cli(["export", run, "--to", "speculators", rows, "--rows-only"]) == 0
    shards = len(list(open_store(run).list(layout.COMMITS)))
    transfer = LayertapTransfer(rows)
    transfer.setup()
    order = list(range(transfer._starts[-1]))
    assert shards > 4 and len(order) > shards
    gets = []
    real = LocalStore.get_range
    monkeypatch.setattr(LocalStore, "get_range", lambda self, key, a, b: gets.append(key) or real(self, key, a, b))
    for _ in range(2):
        random.Random(len(gets)).shuffle(order)
        gets.clear()
        first = [transfer.get_cached(i) for i in order]
        assert all(first)
    assert len(gets) == len(order)  # the second pass: one ranged GET a row, every index read already


def test_a_file_on_s3_that_does_not_read_is_read_again_before_it_is_skipped():
    """A .ckpt read with a byte flipped on its way fails its zip CRC (a multipart object, which no
    ETag's MD5 checks): it was skipped as unreadable, and the committed shard kept it out for good.
    On S3 a file is read twice before it is skipped; a local file, and a sample that reads but cannot
    be trained on, once."""
    from layertap.extract.interop import BadSample, _read
    from layertap.storage.errors import InputError
    from layertap.storage.foreign import ForeignFile

    class Reader:
        def __init__(self, fails: int, error=InputError("bad CRC-32 for file 'data_0/data.pkl'")):
            self.fails, self.reads, self.error = fails, 0, error

        def read(self, f):
            self.reads += 1
            if self.reads <= self.fails:
                raise self.error
            return "sample"

    f = ForeignFile("0", "rows_0-2000/data_0.ckpt", 100)
    once = Reader(1)
    assert _read(once, f, "s3://b/x", again=True) == "sample" and once.reads == 2
    for reader, again in ((Reader(9), True), (Reader(1), False), (Reader(1, BadSample("non_finite", "NaN")), True)):
        with pytest.raises(InputError):
            _read(reader, f, "x", again=again)
        assert reader.reads == (2 if again and reader.fails == 9 else 1)


def test_an_import_of_many_bad_files_warns_of_a_few_and_counts_the_rest(prenorm_run, target, tmp_path, caplog):
    """A source of bad files logged a warning each (39 lines for 40 files): the first few of a reason,
    then how many more, where `status` counts them."""
    import logging

    sf = tmp_path / "sf"
    assert cli(["export", prenorm_run, "--to", "specforge", str(sf), "--limit", "8"]) == 0
    for f in sorted(sf.rglob("data_*.ckpt"))[1:]:  # the first one is read to plan
        f.write_bytes(f.read_bytes()[:100])
    back = str(tmp_path / "back")
    with caplog.at_level(logging.INFO, logger="layertap"):
        assert cli(["import", str(sf), "--from", "specforge", "--out", back, "--layers", "1,3", "--model", target]) == 0
    shown = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("skipped ")]
    assert len(shown) == 5, [r.getMessage() for r in shown]
    assert f"2 more file(s) skipped than shown above (5 a reason at most): `layertap status {back}` counts them" \
        in caplog.text


@pytest.mark.parametrize("fmt", ["specforge", "speculators", "modelopt"])
def test_a_first_file_that_does_not_read_is_skipped_not_the_whole_import(prenorm_run, s3_postnorm_run, target,
                                                                         tmp_path, capsys, caplog, fmt):
    """The plan checked the arguments against the first file alone: one cut short refused the whole
    import, every other file sound. It checks the first that reads, and the import skips the rest."""
    src = tmp_path / fmt
    run = s3_postnorm_run if fmt == "modelopt" else prenorm_run
    assert cli(["export", run, "--to", fmt, str(src), "--limit", "4"]) == 0
    pattern = "hs_*.safetensors" if fmt == "speculators" else "*.ckpt" if fmt == "specforge" else "*.pt"
    files = sorted(src.rglob(pattern),
                   key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", p.name)])
    files[0].write_bytes(files[0].read_bytes()[:100])
    back = str(tmp_path / "back")
    layers = "2,4" if fmt == "speculators" else "1,3"
    assert cli(["import", str(src), "--from", fmt, "--out", back, "--layers", layers, "--model", target]) == 0, \
        capsys.readouterr().err[-3000:]
    assert "3/4 stored, 1 skipped: unreadable 1" in capsys.readouterr().out
    assert "the plan checks the arguments against" in caplog.text
    # the plan's tokens per byte are the file it read's (the first file's size beside them planned ~100x)
    assert cli(["status", back, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["tokens_total_est"] < 3 * s["tokens_done"], s
