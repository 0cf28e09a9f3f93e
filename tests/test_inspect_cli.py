"""`layertap inspect URI [--json]`: good, corrupted, truncated and missing shards, local and on S3.

Most tests call `layertap.cli.main` in-process; a few run the installed `layertap` console
script in a subprocess (on S3 it reaches the moto server through AWS_ENDPOINT_URL, which the
conftest's autouse fixture exports).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
import torch

from layertap.cli import main
from layertap.storage.format import ShardMeta
from layertap.storage.reader import ShardReader
from layertap.storage.records import Sample
from layertap.storage.writer import write_shard
from layertap.storage.store import open_store

KEY = "shards/00007.lts"
LAYERS, HIDDEN = [1, 3, 5], 64


def make_meta(codec: str) -> ShardMeta:
    return ShardMeta(run_id="run-cli", shard_id=7, model="org/model", model_revision="rev1", layers=LAYERS,
                     hidden_size=HIDDEN, codec=codec, final_state="postnorm", tokenizer="org/tok")


def make_samples(n: int = 5) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    return [Sample(sample_id=f"conv-{i}", input_ids=torch.randint(0, 50_000, (3 + 7 * i,), generator=g),
                   loss_mask=torch.ones(3 + 7 * i, dtype=torch.uint8),
                   hidden_states=torch.randn(3 + 7 * i, len(LAYERS), HIDDEN, generator=g).to(torch.bfloat16),
                   final_state=torch.randn(3 + 7 * i, HIDDEN, generator=g).to(torch.bfloat16))
            for i in range(n)]


def inspect(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["inspect", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def uri(store_uri: str, key: str = KEY) -> str:
    return f"{store_uri.rstrip('/')}/{key}"


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x40
    return bytes(b)


@pytest.fixture
def layertap_script() -> str:
    path = shutil.which("layertap")
    assert path, "the layertap console script is not installed (pip install -e .)"
    return path


# -- a good shard -------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["bf16-zstd", "fp8"])
def test_good_shard_text(store, store_uri, capsys, codec):
    info = write_shard(store, KEY, make_meta(codec), make_samples())
    rc, out, err = inspect(capsys, uri(store_uri))
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == f"{uri(store_uri)}  OK (every hash verified)"
    assert "run run-cli  shard 7  model org/model@rev1  tokenizer org/tok" in out
    assert f"layers {LAYERS} (decoder_output)  final_state postnorm  hidden {HIDDEN}  bfloat16" in out
    assert f"codec {codec}  ratio {info.raw_bytes / info.bytes:.3f}x" in out
    assert ("relative error" in out) == (codec == "fp8")
    if codec == "fp8":
        assert f"relative error {info.relative_error:.4%}" in out
    assert f"5 records  {info.num_tokens:,} tokens  {info.bytes:,} bytes  xxh3-128 {info.xxh3_128}" in out
    for i, e in enumerate(ShardReader(store, KEY).entries):
        assert re.search(rf"\[\s*{i}\] {e.sample_id}\s+tokens\s+{e.num_tokens:,}\s+bytes\s+{e.length:,}"
                         rf"\s+@ {e.offset:,}$",
                         out, re.M), out
    assert "more (--records -1 lists all)" not in out


def test_records_limit(store, store_uri, capsys):
    write_shard(store, KEY, make_meta("bf16"), make_samples())
    rc, out, _ = inspect(capsys, uri(store_uri), "--records", "2")
    assert rc == 0
    assert "conv-1" in out and "conv-2" not in out
    assert "... 3 more (--records -1 lists all)" in out
    rc, out, _ = inspect(capsys, uri(store_uri), "--records", "-1")
    assert rc == 0 and all(f"conv-{i}" in out for i in range(5)) and "more" not in out
    rc, out, err = inspect(capsys, uri(store_uri), "--records", "-2")  # listed them all, as -1 does
    assert rc == 2 and "--records must be a count of records, or -1 for all of them; got -2" in err and not out


def test_good_shard_json(store, store_uri, capsys):
    meta = make_meta("fp8")
    info = write_shard(store, KEY, meta, make_samples())
    rc, out, err = inspect(capsys, uri(store_uri), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["uri"] == uri(store_uri) and doc["ok"] is True and doc["error"] is None
    assert doc["bytes"] == info.bytes and doc["xxh3_128"] == info.xxh3_128
    assert doc["meta"] == meta.to_json()
    assert doc["num_records"] == 5 and doc["num_tokens"] == info.num_tokens and doc["raw_bytes"] == info.raw_bytes
    assert doc["relative_error"] == info.relative_error
    assert [r["sample_id"] for r in doc["records"]] == info.sample_ids
    reader = ShardReader(store, KEY)
    assert [(r["offset"], r["length"], r["xxh3_64"]) for r in doc["records"]] == [
        (e.offset, e.length, e.xxh3_64) for e in reader.entries]


def test_empty_shard(store, store_uri, capsys):
    info = write_shard(store, KEY, make_meta("bf16-zstd"), [])
    rc, out, _ = inspect(capsys, uri(store_uri))
    assert rc == 0 and f"0 records  0 tokens  {info.bytes:,} bytes" in out


# -- damaged and missing objects ----------------------------------------------------------------


@pytest.mark.parametrize("where", ["record", "footer", "header"])
def test_corrupted_shard(store, store_uri, capsys, where):
    write_shard(store, KEY, make_meta("bf16-zstd"), make_samples())
    data = store.get(KEY)
    reader = ShardReader(store, KEY)
    pos = {"record": reader.entries[2].offset + 100, "footer": reader.footer_offset + 30,
           "header": reader.records_start - 10}[where]
    store.put(KEY, _flip(data, pos))

    rc, out, err = inspect(capsys, uri(store_uri))
    assert rc == 1
    assert out.startswith(f"CORRUPT {uri(store_uri)}\n")
    assert "checksum mismatch" in out and uri(store_uri) in out.splitlines()[1]  # the error names the object
    frame = {"record": reader.entries[2].offset, "footer": reader.footer_offset, "header": 16}[where]
    assert f"frame at byte {frame}" in out

    rc, out, _ = inspect(capsys, uri(store_uri), "--json")
    doc = json.loads(out)
    assert rc == 1 and doc["ok"] is False and uri(store_uri) in doc["error"] and "meta" not in doc


@pytest.mark.parametrize("cut", [0.5, 0.99, -16, 20])
def test_truncated_shard(store, store_uri, capsys, cut):
    write_shard(store, KEY, make_meta("bf16-zstd"), make_samples())
    data = store.get(KEY)
    n = int(len(data) * cut) if isinstance(cut, float) else (len(data) + cut if cut < 0 else cut)
    store.put(KEY, data[:n])
    rc, out, _ = inspect(capsys, uri(store_uri))
    assert rc == 1 and out.startswith(f"CORRUPT {uri(store_uri)}\n")
    assert re.search(r"truncated|too short", out) and uri(store_uri) in out.splitlines()[1]
    rc, out, _ = inspect(capsys, uri(store_uri), "--json")
    assert rc == 1 and json.loads(out)["ok"] is False


def test_not_a_shard(store, store_uri, capsys):
    store.put(KEY, b'{"hello": "world"}' * 10)  # a shard's name: damaged (exit 1)
    rc, out, _ = inspect(capsys, uri(store_uri))
    assert rc == 1 and "not a layertap shard" in out and uri(store_uri) in out


def test_a_runs_other_file_is_a_usage_error_not_a_corrupt_shard(store, store_uri, capsys):
    """`inspect RUN/manifest.json` said CORRUPT (exit 1, the code of damaged data): a user's mistake."""
    store.put("manifest.json", b'{"format": "layertap-run"}')
    rc, out, err = inspect(capsys, uri(store_uri, "manifest.json"))
    assert rc == 2 and out == "" and "is not a layertap shard (it starts with b'{\"format'" in err
    assert "`layertap status RUN --shards` lists a run's shard objects" in err


def test_missing_object(store, store_uri, capsys):
    store.put("shards/00001.lts", b"x")  # the folder / prefix exists, the object does not
    rc, out, err = inspect(capsys, uri(store_uri, "shards/00009.lts"))
    assert rc == 2 and out == ""
    assert err.startswith("error: ") and "no object" in err and "00009.lts" in err
    assert "Traceback" not in err
    rc, out, err = inspect(capsys, uri(store_uri, "shards/00009.lts"), "--json")
    assert rc == 2 and "no object" in err


def test_missing_local_folder(tmp_path, capsys):
    rc, _, err = inspect(capsys, str(tmp_path / "nowhere" / "00001.lts"))
    assert rc == 2 and "no object '00001.lts'" in err and str(tmp_path / "nowhere") in err


def test_missing_bucket(s3_bucket, capsys):
    rc, _, err = inspect(capsys, f"s3://{s3_bucket}-missing/runs/x/00001.lts")
    assert rc == 2 and err.startswith("error: ") and f"{s3_bucket}-missing" in err


def test_unsupported_scheme(capsys):
    rc, _, err = inspect(capsys, "gs://bucket/x.lts")
    assert rc == 2 and "unsupported store URI" in err


# -- the installed console script ---------------------------------------------------------------


def test_console_script(store, store_uri, layertap_script):
    info = write_shard(store, KEY, make_meta("fp8"), make_samples())
    assert os.environ.get("AWS_ENDPOINT_URL")  # the child reaches moto through it
    p = subprocess.run([layertap_script, "inspect", uri(store_uri), "--json"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] and doc["xxh3_128"] == info.xxh3_128 and doc["num_records"] == 5

    store.put(KEY, _flip(store.get(KEY), ShardReader(store, KEY).entries[1].offset + 50))
    p = subprocess.run([layertap_script, "inspect", uri(store_uri)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and p.stdout.startswith(f"CORRUPT {uri(store_uri)}")

    p = subprocess.run([layertap_script, "inspect", uri(store_uri, "nope.lts")], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.splitlines()[-1] == f"error: no object {'at ' + uri(store_uri, 'nope.lts') if store_uri.startswith('s3://') else repr('nope.lts') + ' in ' + store.uri}"


def test_piped_into_head(tmp_path, layertap_script):
    """A reader that stops early (`| head`) must not produce a BrokenPipeError traceback."""
    store = open_store(str(tmp_path))
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0], hidden_size=2, codec="bf16")
    samples = [Sample(f"s{i}", torch.arange(2), torch.ones(2, dtype=torch.uint8),
                      torch.zeros(2, 1, 2, dtype=torch.bfloat16)) for i in range(3000)]  # ~250 KB of listing
    write_shard(store, "big.lts", meta, samples)
    for extra in ([], ["--json"]):
        p = subprocess.Popen([layertap_script, "inspect", str(tmp_path / "big.lts"), "--records", "-1", *extra],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = p.stdout.read(200)
        p.stdout.close()  # like `head -c 200`
        err = p.stderr.read().decode()
        rc = p.wait(timeout=120)
        assert first and rc == 0 and "Traceback" not in err and "BrokenPipe" not in err, (rc, err)


# -- usability: clean errors for URIs that name no object, and a quiet stderr


def test_bucket_only_uri_is_a_clean_error(capsys):
    rc, _, err = inspect(capsys, "s3://some-bucket")
    assert rc == 2 and err.startswith("error: ")


def test_folder_uri_is_a_clean_error(tmp_path, capsys):
    (tmp_path / "shards").mkdir()
    rc, _, err = inspect(capsys, str(tmp_path / "shards"))
    assert rc == 2 and err.startswith("error: ")


def test_s3_stderr_has_only_the_error(s3_bucket, layertap_script):
    p = subprocess.run([layertap_script, "inspect", f"s3://{s3_bucket}/runs/nope.lts"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == f"error: no object at s3://{s3_bucket}/runs/nope.lts\n"


# -- listing fewer records, statistics per layer, and what the help shows -------------------------


def test_records_limit_applies_to_json(store, store_uri, capsys):
    write_shard(store, KEY, make_meta("bf16"), make_samples())
    rc, out, _ = inspect(capsys, uri(store_uri), "--json", "--records", "2")
    doc = json.loads(out)
    assert rc == 0 and [r["sample_id"] for r in doc["records"]] == ["conv-0", "conv-1"] and doc["num_records"] == 5
    rc, out, _ = inspect(capsys, uri(store_uri), "--json", "--records", "-1")
    assert len(json.loads(out)["records"]) == 5


@pytest.mark.parametrize("codec", ["bf16", "fp8"])
def test_stats_per_capture_layer(store, store_uri, capsys, codec):
    samples = make_samples()
    if codec == "bf16":  # fp8 refuses non-finite values when writing
        samples[1].hidden_states[2, 1, 5] = float("inf")  # one non-finite value in layer 3
    write_shard(store, KEY, make_meta(codec), samples)
    stored = list(ShardReader(store, KEY))  # what the shard holds (fp8 is lossy): the reference
    rc, out, err = inspect(capsys, uri(store_uri), "--json", "--stats")
    assert rc == 0, err
    stats = json.loads(out)["stats"]
    assert stats["tokens"] == sum(s.num_tokens for s in samples)
    for j, (layer, row) in enumerate(zip(LAYERS, stats["layers"])):
        x = torch.cat([s.hidden_states[:, j].double().flatten() for s in stored])
        finite = x[torch.isfinite(x)]
        assert row["layer"] == layer and row["nonfinite"] == int((~torch.isfinite(x)).sum())
        assert row["mean"] == pytest.approx(finite.mean().item(), rel=1e-9, abs=1e-12)
        assert row["std"] == pytest.approx(finite.std(unbiased=False).item(), rel=1e-9)
        assert row["max_abs"] == finite.abs().max().item()
    assert [r["nonfinite"] for r in stats["layers"]] == ([0, 1, 0] if codec == "bf16" else [0, 0, 0])
    f = torch.cat([s.final_state.double().flatten() for s in stored])
    assert stats["final_state"]["mean"] == pytest.approx(f.mean().item(), rel=1e-9, abs=1e-12)
    rc, out, _ = inspect(capsys, uri(store_uri), "--stats", "--records", "0")
    assert rc == 0 and "statistics over 5 records" in out and "[    0]" not in out
    bad = "1" if codec == "bf16" else "0"
    assert re.search(rf"^\s+3\s+\S+\s+\S+\s+\S+\s+{bad}$", out, re.M), out  # layer 3's non-finite count
    assert "final (postnorm)" in out


def test_help_example_is_a_real_shard_name(capsys):
    from layertap.manifests import layout

    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    names = re.findall(r"shards/(\S+?\.lts)", " ".join(capsys.readouterr().out.split()))
    assert names and all(layout.is_data_key(f"shards/{n}", int(n.split("-")[0])) for n in names)


def test_a_run_prefix_is_pointed_at_status_shards(store, store_uri, capsys):
    store.put("manifest.json", b"{}")
    rc, out, err = inspect(capsys, store_uri)
    assert rc == 2 and out == ""
    assert f"{store_uri} is a run, not a shard object: `layertap status {store_uri} --shards`" in err


def test_version(layertap_script):
    from importlib.metadata import version

    p = subprocess.run([layertap_script, "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout == f"layertap {version('layertap')}\n"


def test_a_committed_shard_whose_version_field_is_damaged_is_corrupt_not_newer(tmp_path, capsys, monkeypatch):
    """A flipped byte in the preamble's version field (no frame hash covers it): `inspect` said "shard
    format version 16711681 is not supported ... upgrade layertap" (exit 2). Under a run, the commit's
    object hash tells a damaged shard from a newer layertap's, as `verify` tells them."""
    import sys
    from pathlib import Path

    from layertap.manifests import layout
    from layertap.manifests.records import decode_commit

    sys.path.insert(0, str(Path(__file__).parent))
    import fake_worker

    run = str(tmp_path / "run")
    fake_worker.work(run, shards=[0])
    store = open_store(run)
    key = decode_commit(store.get(layout.commit_key(0)), "c").data_key
    data = bytearray(store.get(key))
    data[len(b"LTSHARD\x00") + 2] ^= 0xFF  # the version's third byte
    store.put(key, bytes(data))
    capsys.readouterr()
    assert main(["inspect", f"{run}/{key}"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "it is corrupt, not newer" in out, out
    monkeypatch.chdir(run)  # the shard named from inside its run: its commit is found all the same
    assert main(["inspect", key]) == 1
    assert "it is corrupt, not newer" in capsys.readouterr().out
    store.put("loose.lts", bytes(data))  # no commit names it: a newer layertap's, or corrupt, cannot be told
    assert main(["inspect", f"{run}/loose.lts"]) == 2
    assert "upgrade layertap to read it" in capsys.readouterr().err
