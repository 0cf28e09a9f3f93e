"""Stored objects whose hashes hold but whose contents lie (a buggy or hostile writer of the
format): an index entry shorter than a frame, a record declaring states far larger than its shard's
HEAD, a tensor of no bytes with dimensions past 2**63, JSON nested 100,000 deep, commit records
of valid JSON and wrong types, a commit that disagrees with its sound object, HEAD and footer
fields of the wrong type, a negative token id. Each is refused, naming the object, by the reader,
the loader (`on_corrupt="skip"` too), `verify` and `inspect`, in bounded memory: they ended in a
raw struct.error, TypeError, RecursionError or a terabyte allocation, or passed `verify`."""

from __future__ import annotations

import json
import re
import struct

import numpy as np
import pytest
import torch
import xxhash
import zstandard

import fake_worker
from layertap.cli import main as cli
from layertap.manifests import layout
from layertap.manifests.manifest import ManifestError
from layertap.manifests.records import decode_commit
from layertap.storage.format import FOOT, FRAME, HEAD, PREAMBLE, RECD, TRAILER, TRAILER_MAGIC, ShardError, ShardMeta
from layertap.storage.reader import ShardReader, verify_shard
from layertap.storage.records import record_metadata, safetensors_parts
from layertap.storage.store import open_store
from layertap.train import ShardStream, StreamConfig

DEEP = "[" * 100_000 + "]" * 100_000


def _frames(data: bytes) -> tuple[bytes, bytes, list[bytes], dict]:
    """(preamble, HEAD payload, RECD payloads, footer) of a shard."""
    pos, head, recs = PREAMBLE.size, b"", []
    while True:
        kind, n, _ = FRAME.unpack_from(data, pos)
        payload = data[pos + FRAME.size: pos + FRAME.size + n]
        pos += FRAME.size + n
        if kind == HEAD:
            head = payload
        elif kind == RECD:
            recs.append(payload)
        else:
            return data[:PREAMBLE.size], head, recs, json.loads(payload)


def _build(pre: bytes, head: bytes, recs: list[bytes], edit_footer=None, footer_raw: bytes | None = None) -> bytes:
    """A shard of these payloads with every hash, the index and the trailer made to agree."""
    out = bytearray(pre)
    out += FRAME.pack(HEAD, len(head), xxhash.xxh3_64_intdigest(head)) + head
    entries = []
    for i, p in enumerate(recs):
        try:
            md = record_metadata(p)
        except ShardError:  # a header no reader parses: the index names it all the same
            md = {"sample_id": f"unparsed{i}", "num_tokens": "1"}
        digest = xxhash.xxh3_64_intdigest(p)
        entries.append({"sample_id": md["sample_id"], "offset": len(out), "length": FRAME.size + len(p),
                        "num_tokens": int(md["num_tokens"]), "xxh3_64": f"{digest:016x}"})
        out += FRAME.pack(RECD, len(p), digest) + p
    footer = {"num_records": len(entries), "num_tokens": sum(e["num_tokens"] for e in entries), "raw_bytes": 0,
              "records": entries, "content_xxh3_128": xxhash.xxh3_128_hexdigest(bytes(out)), "relative_error": None}
    if edit_footer is not None:
        edit_footer(footer)
    raw = footer_raw if footer_raw is not None else json.dumps(footer).encode()
    offset = len(out)
    out += FRAME.pack(FOOT, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw + TRAILER.pack(offset, TRAILER_MAGIC)
    return bytes(out)


def _record(meta_json: dict, tensors: dict[str, torch.Tensor], sample_id: str = "x", **md: str) -> bytes:
    metadata = {"sample_id": sample_id, "num_tokens": str(len(tensors["input_ids"])), "codec": meta_json["codec"], **md}
    return b"".join(bytes(p) for p in safetensors_parts(tensors, metadata))


def _header(payload: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack_from("<Q", payload, 0)
    return json.loads(payload[8: 8 + n]), payload[8 + n:]


def _with_header(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.fixture
def run(tmp_path):
    """A committed run of 12 samples on a local folder; shard 0's object and commit to replace."""
    uri = str(tmp_path / "run")
    fake_worker.work(uri, samples=12)
    return uri


def _shard0(uri: str) -> tuple[str, bytes]:
    store = open_store(uri)
    key = decode_commit(store.get(layout.commit_key(0)), "commit").data_key
    return key, store.get(key)


def _replace(uri: str, data: bytes, **commit_fields) -> str:
    """Shard 0's object replaced by `data`, its commit made to agree (size, hash, samples), and then
    `commit_fields` set over it."""
    store = open_store(uri)
    key = decode_commit(store.get(layout.commit_key(0)), "commit").data_key
    store.put(key, data)
    commit = json.loads(store.get(layout.commit_key(0)))
    commit.update(bytes=len(data), xxh3_128=xxhash.xxh3_128_hexdigest(data))
    try:
        entries = _frames(data)[3]["records"]
        commit.update(sample_ids=[e["sample_id"] for e in entries], num_records=len(entries),
                      num_tokens=sum(e["num_tokens"] for e in entries))
    except (ValueError, RecursionError, KeyError, TypeError):
        pass
    commit.update(commit_fields)
    store.put(layout.commit_key(0), json.dumps(commit).encode())
    return key


def _refused_everywhere(uri: str, key: str, capsys, match: str) -> None:
    """The reader raises ShardError, the loader raises it (or skips the shard, counted), `verify`
    withdraws the shard and `inspect` says CORRUPT, each naming `match`; no other exception."""
    store = open_store(uri)
    with pytest.raises(ShardError, match=match):
        list(ShardReader(store, key))
    for range_bytes in (1 << 30, 1000):  # one GET, and ranges
        with pytest.raises(ShardError):
            list(ShardStream(uri, config=StreamConfig(range_bytes=range_bytes)))
        stream = ShardStream(uri, config=StreamConfig(on_corrupt="skip", range_bytes=range_bytes))
        got = list(stream)
        assert stream.metrics()["corrupt_shards"] == 1 and len(got) == 12
    capsys.readouterr()
    assert cli(["inspect", f"{uri}/{key}"]) == 1
    out = capsys.readouterr().out
    assert "CORRUPT" in out and key in out, out
    assert cli(["verify", uri]) == 1
    assert "1 bad" in capsys.readouterr().out
    assert not store.exists(layout.commit_key(0))  # withdrawn: the next extraction redoes it


def test_an_index_entry_shorter_than_a_frame_header_is_corruption(run, capsys):
    """Entry 1 of length 0, entry 2 stretched over records 1 and 2: back to back, totals right."""
    key, data = _shard0(run)
    pre, head, recs, _ = _frames(data)

    def squeeze(footer):
        r = footer["records"]
        r[2]["length"] += r[1]["length"]
        r[2]["offset"] = r[1]["offset"]
        r[1]["length"] = 0

    _replace(run, _build(pre, head, recs, squeeze))
    _refused_everywhere(run, key, capsys, "shorter than a frame's 20-byte header")


def test_a_tensor_of_no_bytes_with_dimensions_past_2_63_is_corruption(run, capsys):
    key, data = _shard0(run)
    pre, head, recs, _ = _frames(data)
    header, body = _header(recs[0])
    header["zz_extra"] = {"dtype": "I32", "shape": [0, 2**63], "data_offsets": [len(body), len(body)]}
    _replace(run, _build(pre, head, [_with_header(header, body), *recs[1:]]))
    _refused_everywhere(run, key, capsys, "bad shape")


@pytest.mark.parametrize("where", ["head", "record", "footer"])
def test_json_nested_100_000_deep_is_corruption(run, capsys, where):
    key, data = _shard0(run)
    pre, head, recs, _ = _frames(data)
    if where == "head":
        obj = json.loads(head)
        head = json.dumps(dict(obj, extra={"x": 1})).encode().replace(b'{"x": 1}', DEEP.encode())
        data = _build(pre, head, recs)
    elif where == "record":
        header, body = _header(recs[0])
        raw = json.dumps(header).encode().replace(b'"__metadata__"', f'"zz": {DEEP}, "__metadata__"'.encode(), 1)
        raw += b" " * (-len(raw) % 8)
        data = _build(pre, head, [struct.pack("<Q", len(raw)) + raw + body, *recs[1:]])
    else:
        data = _build(pre, head, recs, footer_raw=DEEP.encode())
    _replace(run, data)
    _refused_everywhere(run, key, capsys, "recursion|nested too deeply")


def test_a_record_declaring_states_far_past_its_head_is_refused_before_they_are_allocated(tmp_path):
    """An fp8 record declaring hidden 2**36 with a frame of a few bytes: its codec allocated the
    declared shape (1.4 TB) before it checked anything (a 34 KB shard held 3.4 GB before its refusal)."""
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0, 1], hidden_size=32, codec="fp8")
    head = json.dumps(meta.to_json()).encode()
    tensors = {"input_ids": torch.arange(5, dtype=torch.int32), "loss_mask": torch.ones(5, dtype=torch.uint8),
               "hidden_states.fp8.zst": torch.from_numpy(np.frombuffer(zstandard.compress(b"\0" * 10), np.uint8).copy()),
               "hidden_states.scale": torch.ones(5, 2, dtype=torch.float32)}
    payload = _record(meta.to_json(), tensors, **{"hidden_states.shape": f"5,2,{2**36}"})
    pre = PREAMBLE.pack(b"LTSHARD\x00", 1, 0)
    store = open_store(str(tmp_path))
    store.put("s.lts", _build(pre, head, [payload]))
    with pytest.raises(ShardError, match=r"does not fit its shard's HEAD .* declares hidden_states \[5,2,68719476736\]"):
        list(ShardReader(store, "s.lts"))
    report = verify_shard(store, "s.lts", decode=True)
    assert not report.ok and "does not fit its shard's HEAD" in report.error


def test_a_negative_token_id_is_corruption(tmp_path):
    """The writer refuses them and FORMAT.md says [0, 2^31): a reader passed one on to the
    drafter's embedding (an IndexError, or a CUDA device assert)."""
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0], hidden_size=4, codec="bf16")
    tensors = {"input_ids": torch.tensor([0, 1, -5], dtype=torch.int32), "loss_mask": torch.ones(3, dtype=torch.uint8),
               "hidden_states.raw": torch.zeros(3, 1, 4, dtype=torch.bfloat16)}
    payload = _record(meta.to_json(), tensors, **{"hidden_states.shape": "3,1,4"})
    store = open_store(str(tmp_path))
    store.put("s.lts", _build(PREAMBLE.pack(b"LTSHARD\x00", 1, 0), json.dumps(meta.to_json()).encode(), [payload]))
    with pytest.raises(ShardError, match=r"record 'x' holds a negative token id \(-5\)"):
        list(ShardReader(store, "s.lts"))


@pytest.mark.parametrize("field,value", [("bytes", "7915"), ("bytes", -1), ("bytes", 7915.0), ("num_records", "6"),
                                         ("skipped", 3), ("skipped", ["x"]), ("truncated", None),
                                         ("sample_ids", [1, 2]), ("producer", "me"), ("deep", None)])
def test_a_commit_record_of_wrong_types_is_corrupt_to_every_reader(run, capsys, field, value):
    store = open_store(run)
    commit = json.loads(store.get(layout.commit_key(0)))
    if field == "deep":
        raw = json.dumps(commit).encode().replace(b'"skipped"', f'"zz": {DEEP}, "skipped"'.encode(), 1)
    else:
        raw = json.dumps(dict(commit, **{field: value})).encode()
    store.put(layout.commit_key(0), raw)
    with pytest.raises(ManifestError, match="corrupt commit record"):
        decode_commit(raw, layout.commit_key(0))
    with pytest.raises(ManifestError, match="corrupt commit record"):
        list(ShardStream(run, config=StreamConfig(on_corrupt="skip")))
    capsys.readouterr()
    assert cli(["status", run]) in (0, 1, 3, 4)  # it reports; it does not crash
    assert cli(["verify", run]) == 1
    assert "unreadable commit record" in capsys.readouterr().out
    assert not store.exists(layout.commit_key(0))


@pytest.mark.parametrize("field", ["bytes", "sample_ids", "fewer sample_ids"])
def test_verify_withdraws_a_commit_that_disagrees_with_its_sound_object(run, capsys, field):
    """The loader compares a commit's size and samples with its object and, where they differ,
    refused the shard and said to run `verify`, which compared neither and passed it: for good."""
    key, data = _shard0(run)
    store = open_store(run)
    commit = json.loads(store.get(layout.commit_key(0)))
    wrong = {"bytes": {"bytes": commit["bytes"] - 1}, "sample_ids": {"sample_ids": commit["sample_ids"][:-1] + ["zzz"]},
             "fewer sample_ids": {"sample_ids": commit["sample_ids"][:-1]}}[field]
    store.put(layout.commit_key(0), json.dumps(dict(commit, **wrong)).encode())
    with pytest.raises(ShardError, match="run `layertap verify "):
        list(ShardStream(run, config=StreamConfig()))
    capsys.readouterr()
    assert cli(["verify", run]) == 1
    out = capsys.readouterr().out
    said = {"bytes": "bytes, commit says", "sample_ids": "commit says 'zzz'",
            "fewer sample_ids": f"the object lists {len(commit['sample_ids'])} sample ids, commit "
                                f"{len(commit['sample_ids']) - 1}"}[field]
    assert said in out, out
    assert not store.exists(layout.commit_key(0))


@pytest.mark.parametrize("damage", ["model_revision", "relative_error", "no relative_error", "format_version",
                                    "layer_convention"])
def test_inspect_on_head_or_footer_fields_of_the_wrong_type(run, capsys, damage):
    """format_version and layer_convention: FORMAT.md says the HEAD's equal the preamble's version
    and "decoder_output"; a HEAD saying otherwise (hashes intact) read as a sound shard."""
    key, data = _shard0(run)
    pre, head, recs, _ = _frames(data)
    if damage == "model_revision":
        head = json.dumps(dict(json.loads(head), model_revision=5)).encode()
        data = _build(pre, head, recs)
    elif damage in ("format_version", "layer_convention"):
        wrong = {"format_version": 2, "layer_convention": "decoder_outpuX"}[damage]
        data = _build(pre, json.dumps(dict(json.loads(head), **{damage: wrong})).encode(), recs)
    elif damage == "relative_error":
        data = _build(pre, head, recs, lambda f: f.update(relative_error="big"))
    else:
        data = _build(pre, head, recs, lambda f: f.pop("relative_error"))
    store = open_store(run)
    store.put(key, data)
    capsys.readouterr()
    code = cli(["inspect", f"{run}/{key}"])
    out = capsys.readouterr().out
    if damage == "no relative_error":  # a footer key a writer may leave out: no error to show ...
        assert code == 1 and "differs from the committed" in out  # ... but not the object its commit names
        store.put(key.replace(".lts", "-other.lts"), data)  # an object no commit names: judged on its own
        assert cli(["inspect", f"{run}/{key.replace('.lts', '-other.lts')}"]) == 0
        out = capsys.readouterr().out
        assert "OK (every hash verified)" in out and "relative error" not in out
    else:
        assert code == 1 and "CORRUPT" in out and damage in out, out


@pytest.mark.parametrize("edit", [{"layers": [fake_worker.LAYERS[0]]}, {"codec": "bf16"}, {"final_state": "prenorm"},
                                  {"hidden_size": 2 * fake_worker.HIDDEN}])
def test_a_manifest_edited_to_misdescribe_its_shards_is_refused_and_nothing_withdrawn(run, capsys, edit, tmp_path,
                                                                                     monkeypatch):
    """Capture layers edited in manifest.json: `status` and `verify` passed the run and `train` ended in a
    torch shape error; every shard's HEAD says what its states are, and the loader and verify compared
    only the run id. Sound shards are not withdrawn for it (nor skipped under on_corrupt="skip").
    `verify` refuses at the HEAD, before decoding a record (it decoded every one first: the codecs
    allocate the shapes a HEAD declares, however large)."""
    import layertap.storage.reader as reader

    decoded, decode = [], reader.decode_named
    monkeypatch.setattr(reader, "decode_named", lambda *a: decoded.append(a[2]) or decode(*a))
    store = open_store(run)
    manifest = json.loads(store.get(layout.MANIFEST))
    [(field, value)] = edit.items()
    store.put(layout.MANIFEST, json.dumps(dict(manifest, config=dict(manifest["config"], **edit))).encode())
    commits = sorted(o.key for o in store.list("commits/"))
    said = f"{field} {manifest['config'].get(field, fake_worker.HIDDEN)!r} in the shard, {value!r} in the manifest"
    for policy in ("raise", "skip"):
        with pytest.raises(ManifestError, match=rf"manifest.json disagrees with committed shard \d+'s header \(shards/.*\): "
                                                rf"{re.escape(said)}; the manifest was edited or replaced"):
            list(ShardStream(run, config=StreamConfig(on_corrupt=policy)))
    capsys.readouterr()
    assert cli(["verify", run]) == 2
    err = capsys.readouterr().err
    assert "disagrees with committed shard" in err and said in err and "Nothing was withdrawn" in err
    assert sorted(o.key for o in store.list("commits/")) == commits and decoded == []
    # export labels its files (and its note) by the manifest: it wrote mislabelled ones with exit 0
    dest = tmp_path / "exported"
    assert cli(["export", run, "--to", "specforge", str(dest)]) == 2
    err = capsys.readouterr().err
    assert "disagrees with committed shard" in err and said in err, err
    assert not [p for p in dest.rglob("*") if p.is_file()]  # nothing partial left


def test_only_what_a_manifest_records_is_compared_with_a_shards_header():
    """A run made through the Python API may leave final_state or hidden_size out of its config: read
    as the defaults, they "disagreed" with shards written with a final state."""
    from layertap.storage.identity import header_disagreement

    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0, 2], hidden_size=8, codec="bf16",
                     final_state="prenorm")
    assert header_disagreement(meta, {"model": "m", "layers": [0, 2], "codec": "bf16"}) is None
    assert header_disagreement(meta, {"layers": [0, 2], "codec": "bf16", "final_state": "none", "hidden_size": 8}) \
        == "final_state 'prenorm' in the shard, 'none' in the manifest"
