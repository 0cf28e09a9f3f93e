"""The shard format: round trips, random access, streaming parse, and detection of damage."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from layertap.storage.codecs import CODEC_NAMES
from layertap.storage.format import (FOOT, HEAD, PREAMBLE, RECD, TRAILER, ShardError, ShardMeta,
                                     UnsupportedShardVersion, parse_head)
from layertap.storage.identity import RunConfig, RunIdentity
from layertap.storage.reader import ShardReader, iter_frames, verify_shard
from layertap.storage.records import Sample
from layertap.storage.s3 import MiB
from layertap.storage.local import LocalStore
from layertap.storage.store import InvalidKey, open_store
from layertap.storage.writer import ShardWriter, write_shard

LAYERS, HIDDEN = [1, 3, 5], 64


def make_meta(codec="bf16-zstd", final_state="none", **kw) -> ShardMeta:
    return ShardMeta(run_id="run-test", shard_id=7, model="tiny", layers=LAYERS, hidden_size=HIDDEN,
                     codec=codec, final_state=final_state, tokenizer="tiny-tok", **kw)


def make_samples(n=5, final=False, seed=0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        s = 3 + 11 * i
        hs = torch.randn(s, len(LAYERS), HIDDEN, generator=g).mul(40).to(torch.bfloat16)
        hs[0] *= 500  # token 0 carries huge activations in real models
        out.append(Sample(
            sample_id=f"conv-{i}",
            input_ids=torch.randint(0, 50_000, (s,), generator=g),
            loss_mask=(torch.arange(s) % 3 != 0).to(torch.uint8),
            hidden_states=hs,
            final_state=torch.randn(s, HIDDEN, generator=g).to(torch.bfloat16) if final else None,
        ))
    return out


def assert_same(a: Sample, b: Sample, exact: bool) -> None:
    assert a.sample_id == b.sample_id
    assert torch.equal(a.input_ids.long(), b.input_ids.long())
    assert torch.equal(a.loss_mask.to(torch.uint8), b.loss_mask.to(torch.uint8))
    for x, y in ((a.hidden_states, b.hidden_states), (a.final_state, b.final_state)):
        if x is None:
            assert y is None
            continue
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        if exact:
            assert torch.equal(x.view(torch.int16), y.view(torch.int16))
        else:
            # e4m3 keeps 3 mantissa bits: ~2.7% on Gaussian data; heavy-tailed real activations
            # stay under 1% (tests/test_codecs.py checks that on SmolLM2).
            err = (x.float() - y.float()).norm() / x.float().norm()
            assert err < 0.04


@pytest.mark.parametrize("codec", CODEC_NAMES)
@pytest.mark.parametrize("final", [False, True])
def test_round_trip_random_access_and_streaming(store, codec, final):
    meta = make_meta(codec, "prenorm" if final else "none")
    samples = make_samples(final=final)
    info = write_shard(store, "shards/00007.lts", meta, samples)
    exact = codec != "fp8"

    assert info.num_records == 5 and info.sample_ids == [s.sample_id for s in samples]
    assert info.num_tokens == sum(s.num_tokens for s in samples)
    assert info.bytes == store.size("shards/00007.lts")
    assert (info.relative_error is None) == exact

    reader = ShardReader(store, "shards/00007.lts")
    assert reader.meta == meta
    assert reader.sample_ids == info.sample_ids
    for i in (3, 0, 4):  # random access, any order
        assert_same(samples[i], reader.read(i), exact)

    frames = list(iter_frames(io.BytesIO(store.get("shards/00007.lts")), "mem"))
    assert [k for k, _, _ in frames] == [HEAD] + [RECD] * 5 + [FOOT]

    report = verify_shard(store, "shards/00007.lts", expected_xxh3_128=info.xxh3_128, decode=True)
    assert report.ok, report.error
    assert report.num_records == 5 and report.xxh3_128 == info.xxh3_128


def test_fp8_error_is_measured_and_recorded(store):
    samples = make_samples(n=4)
    info = write_shard(store, "s.lts", make_meta("fp8"), samples)
    reader = ShardReader(store, "s.lts")
    num = den = 0.0
    for i, s in enumerate(samples):
        x, y = s.hidden_states.float(), reader.read(i).hidden_states.float()
        num += (x - y).pow(2).sum().item()
        den += x.pow(2).sum().item()
    measured = (num / den) ** 0.5
    assert 0 < info.relative_error < 0.04
    assert info.relative_error == pytest.approx(measured, rel=1e-3)
    assert reader.footer["relative_error"] == info.relative_error


def test_empty_shard_is_valid(store):
    info = write_shard(store, "empty.lts", make_meta(), [])
    assert info.num_records == 0
    assert len(ShardReader(store, "empty.lts")) == 0
    assert verify_shard(store, "empty.lts", info.xxh3_128).ok


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x40
    return bytes(b)


def test_every_flipped_byte_region_is_detected(store):
    info = write_shard(store, "good.lts", make_meta(), make_samples())
    data = store.get("good.lts")
    reader = ShardReader(store, "good.lts")
    e = reader.entries[2]
    positions = {
        "preamble version": 9,
        "header": reader.records_start - 5,
        "record payload": e.offset + e.length - 10,
        "record frame length": e.offset + 5,
        "footer": reader.footer_offset + 30,
        "trailer": len(data) - 3,
    }
    for what, pos in positions.items():
        store.put("bad.lts", _flip(data, pos))
        report = verify_shard(store, "bad.lts", info.xxh3_128)
        assert not report.ok, what
        assert "bad.lts" in report.error, what


def test_flipped_record_byte_is_caught_on_random_access(store):
    write_shard(store, "s.lts", make_meta(), make_samples())
    reader = ShardReader(store, "s.lts")
    e = reader.entries[1]
    store.put("s.lts", _flip(store.get("s.lts"), e.offset + e.length - 1))
    reader = ShardReader(store, "s.lts")
    assert reader.read(0).sample_id == "conv-0"  # the other records still read
    with pytest.raises(ShardError, match=r"checksum mismatch.*record 1 \(conv-1\)|record 1 \(conv-1\).*checksum mismatch"):
        reader.read(1)


@pytest.mark.parametrize("cut", [0.3, 0.9, 0.999])
def test_truncated_object_is_detected(store, cut):
    info = write_shard(store, "s.lts", make_meta(), make_samples())
    data = store.get("s.lts")
    store.put("t.lts", data[: int(len(data) * cut)])
    report = verify_shard(store, "t.lts", info.xxh3_128)
    assert not report.ok and "truncated" in report.error
    with pytest.raises(ShardError, match="truncated|trailer"):
        ShardReader(store, "t.lts")
    with pytest.raises(ShardError, match="truncated"):
        list(iter_frames(io.BytesIO(data[: int(len(data) * cut)]), "t.lts"))


@pytest.mark.parametrize("frame", ["HEAD", "RECD"])
def test_a_frame_length_past_the_objects_end_is_corruption_not_a_read_of_it(store, frame):
    """A flipped high bit in a frame's u64 length is refused before anything is read: a read of
    n bytes allocates them, so it was a MemoryError out of `verify`, not a corrupt shard. (The
    object outgrows the 8 MiB a stream buffers: a read within them is served from the buffer.)"""
    s = 24_000  # 9.2 MB of raw bf16
    big = Sample("big", torch.zeros(s, dtype=torch.long), torch.ones(s, dtype=torch.uint8),
                 torch.zeros(s, len(LAYERS), HIDDEN, dtype=torch.bfloat16))
    info = write_shard(store, "s.lts", make_meta("bf16"), [big, *make_samples(n=1)])
    pos = PREAMBLE.size if frame == "HEAD" else ShardReader(store, "s.lts").entries[0].offset
    store.put("s.lts", _flip(store.get("s.lts"), pos + 4 + 5))  # bit 46 of the length: 64 TiB
    report = verify_shard(store, "s.lts", info.xxh3_128)
    assert not report.ok and "past the object's end" in report.error
    if frame == "HEAD":  # records are read at the footer's lengths, which its hash covers
        with pytest.raises(ShardError, match="past the object's end"):
            ShardReader(store, "s.lts")


def test_running_out_of_memory_in_verify_is_raised_never_reported_as_corruption(tmp_path):
    """`verify` withdraws and deletes what it reports bad, so a MemoryError while a record decodes
    must come out as itself. A child process verifies an intact shard under address-space limits
    from tight to enough: each try raises MemoryError or succeeds. (A fixed mmap threshold keeps
    glibc from serving big allocations out of freed heap, which the limit would not see.)"""
    code = textwrap.dedent(f"""
        import json, resource, torch
        from layertap.storage.format import ShardMeta
        from layertap.storage.local import LocalStore
        from layertap.storage.reader import verify_shard
        from layertap.storage.records import Sample
        from layertap.storage.writer import write_shard
        store = LocalStore({str(tmp_path)!r})
        meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0, 1, 2, 3], hidden_size=1 << 16,
                         codec="bf16-zstd")
        x = torch.randn(32, 4, 1 << 16).bfloat16()  # 16 MiB decoded
        info = write_shard(store, "s.lts", meta, [Sample("s0", torch.arange(32), torch.ones(32, dtype=torch.uint8), x)])
        del x
        seen = []
        for mib in range(0, 200, 2):
            vm = next(int(line.split()[1]) << 10 for line in open("/proc/self/status") if line.startswith("VmSize"))
            resource.setrlimit(resource.RLIMIT_AS, (vm + (mib << 20), resource.RLIM_INFINITY))
            try:
                report = verify_shard(store, "s.lts", info.xxh3_128, decode=True)
                seen.append("ok" if report.ok else "bad: " + report.error)
            except MemoryError:
                seen.append("MemoryError")
            finally:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            if seen[-1] == "ok":
                break
        print(json.dumps(seen))
    """)
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072"))
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout)
    assert [s for s in seen if s.startswith("bad")] == []
    assert "MemoryError" in seen and seen[-1] == "ok"


@pytest.mark.parametrize("payload", [b"\x01\x02", struct.pack("<Q", 3) + b"[1]", struct.pack("<Q", 21) + b'{"__metadata__": [1]}'])
def test_a_record_whose_hash_holds_but_whose_header_is_malformed_is_reported_bad(tmp_path, payload):
    """Only a writer bug makes one, but verify stopped on it with a struct or attribute error
    instead of reporting the shard (and going on with the others)."""
    import xxhash

    from layertap.storage.records import EncodedRecord

    store = LocalStore(str(tmp_path))
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[0], hidden_size=4, codec="bf16")
    with ShardWriter(store.open_writer("s.lts"), meta) as w:
        w.append_encoded(EncodedRecord("s0", 1, (payload,), len(payload), xxhash.xxh3_64_intdigest(payload), 0))
        info = w.close()
    report = verify_shard(store, "s.lts", info.xxh3_128)
    assert not report.ok and "record header" in report.error


def test_a_store_failure_in_verify_is_raised_not_reported(store):
    """A bad key is the caller's mistake (InvalidKey is also a ValueError), not a corrupt object."""
    with pytest.raises(InvalidKey):
        verify_shard(store, "../s.lts")


def test_committed_hash_mismatch_is_reported(store):
    write_shard(store, "s.lts", make_meta(), make_samples())
    report = verify_shard(store, "s.lts", expected_xxh3_128="0" * 32)
    assert not report.ok and "differs from the committed" in report.error


def test_unknown_format_version_is_refused(store):
    write_shard(store, "s.lts", make_meta(), make_samples(n=1))
    data = bytearray(store.get("s.lts"))
    data[8] = 99
    store.put("v.lts", bytes(data))
    with pytest.raises(UnsupportedShardVersion, match="format version 99 .* upgrade layertap"):
        ShardReader(store, "v.lts")


def test_not_a_shard(store):
    store.put("x.json", json.dumps({"hello": "world"}).encode() * 10)
    with pytest.raises(ShardError, match="not a layertap shard"):
        ShardReader(store, "x.json")


def test_samples_are_validated_against_the_metadata(store):
    meta = make_meta()
    good = make_samples(n=1)[0]
    bad_shape = Sample("a", good.input_ids, good.loss_mask, good.hidden_states[:, :2])
    with pytest.raises(ValueError, match="hidden_states shape"):
        write_shard(store, "s.lts", meta, [bad_shape])
    unexpected_final = Sample("b", good.input_ids, good.loss_mask, good.hidden_states,
                              torch.zeros(good.num_tokens, HIDDEN, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="final_state is present"):
        write_shard(store, "s.lts", meta, [unexpected_final])
    with pytest.raises(ValueError, match="already in shard"):
        write_shard(store, "s.lts", meta, [good, good])
    negative = Sample("c", -good.input_ids - 1, good.loss_mask, good.hidden_states)
    with pytest.raises(ValueError, match="token ids"):
        write_shard(store, "s.lts", meta, [negative])
    assert list(store.list()) == [] and store.list_pending_uploads() == []


def test_metadata_is_validated():
    with pytest.raises(ValueError, match="codec"):
        make_meta(codec="gzip")
    with pytest.raises(ValueError, match="final_state"):
        make_meta(final_state="sometimes")
    with pytest.raises(ValueError, match="layers"):
        ShardMeta(run_id="r", shard_id=0, model="m", layers=[], hidden_size=8, codec="bf16")


# A HEAD exactly as `layertap extract` has always written it (created_at aside).
EXTRACTED_HEAD = {"codec": "fp8", "dtype": "bfloat16", "extra": {"forward_dtype": "bfloat16", "gguf_file": None,
                                                                 "max_length": 4096},
                  "final_state": "prenorm", "format": "layertap-shard", "format_version": 1, "hidden_size": 4096,
                  "layer_convention": "decoder_output", "layers": [1, 9, 17], "model": "/models/Qwen3-8B",
                  "model_revision": None, "run_id": "0123456789ab", "shard_id": 3, "tokenizer": "/models/Qwen3-8B"}


def test_a_head_round_trips_and_shares_the_manifest_identity():
    meta = ShardMeta.from_json(dict(EXTRACTED_HEAD, created_at="2025-01-01T00:00:00Z"))
    assert json.dumps(meta.to_json(), sort_keys=True) == json.dumps(EXTRACTED_HEAD, sort_keys=True)
    run = RunConfig(model="/models/Qwen3-8B", tokenizer="/models/Qwen3-8B", layers=[1, 9, 17],
                    final_state="prenorm", hidden_size=4096, codec="fp8", gguf_file=None, dtype="auto", max_length=4096)
    assert ShardMeta.of(run, run_id="0123456789ab", shard_id=3, extra=EXTRACTED_HEAD["extra"]) == meta
    assert RunIdentity.from_json(meta.to_json()) == RunIdentity.from_json(run.to_json())  # the same facts
    with pytest.raises(ShardError, match="unreadable shard header"):  # a HEAD must carry its width
        parse_head(json.dumps({k: v for k, v in EXTRACTED_HEAD.items() if k != "hidden_size"}).encode(), "s.lts")


def test_writer_memory_stays_within_k_parts(s3_bucket):
    """A 30 MB shard through 5 MiB parts with K=2: peak buffered bytes never exceed K x P."""
    store = open_store(f"s3://{s3_bucket}/run", part_size=5 * MiB, max_parts_in_memory=2)
    g = torch.Generator().manual_seed(1)
    samples = [Sample(f"s{i}", torch.arange(2000), torch.ones(2000, dtype=torch.uint8),
                      torch.randn(2000, len(LAYERS), HIDDEN * 4, generator=g).to(torch.bfloat16))
               for i in range(10)]
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=LAYERS, hidden_size=HIDDEN * 4, codec="bf16")
    writer = store.open_writer("big.lts")
    with ShardWriter(writer, meta) as w:
        for s in samples:
            w.write_sample(s)
        info = w.close()
    assert info.bytes > 5 * 5 * MiB  # six parts
    assert 0 < writer.peak_buffered_bytes <= 2 * 5 * MiB
    assert verify_shard(store, "big.lts", info.xxh3_128).ok
    assert store.list_pending_uploads() == []


def test_reader_from_bytes_decodes_in_place_and_names_the_object(tmp_path):
    samples = make_samples(final=True)
    store = open_store(str(tmp_path))
    write_shard(store, "s.lts", make_meta(final_state="prenorm"), samples)
    data = store.get("s.lts")
    reader = ShardReader.from_bytes(data, "shards/00007.lts", uri="s3://bucket/run")
    assert reader.meta.shard_id == 7 and reader.sample_ids == [s.sample_id for s in samples]
    for want, got in zip(samples, reader):
        assert_same(want, got, exact=True)
    got = reader.read(2)
    # The decoded tensors own their memory: nothing keeps the object's bytes alive or aliases them.
    for t in (got.input_ids, got.loss_mask, got.hidden_states, got.final_state):
        assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()

    e = reader.entries[1]
    bad = ShardReader.from_bytes(_flip(data, e.offset + e.length - 1), "shards/00007.lts", uri="s3://bucket/run")
    with pytest.raises(ShardError, match=r"s3://bucket/run/shards/00007\.lts record 1 \(conv-1\): checksum mismatch"):
        bad.read(1)


def _blob(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize("damage", ["hole", "overlap", "size", "dtype", "shape", "past the end", "header length",
                                    "metadata", "not an object"])
def test_malformed_safetensors_in_a_record_is_refused(damage):
    """Records are parsed in place, without the safetensors library: its checks are ours to keep."""
    from layertap.storage.records import decode_record

    ok = {"__metadata__": {"sample_id": "s", "num_tokens": "2", "codec": "bf16", "hidden_states.shape": "2,1,2"},
          "input_ids": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]},
          "hidden_states.raw": {"dtype": "BF16", "shape": [2, 1, 2], "data_offsets": [8, 16]},
          "loss_mask": {"dtype": "U8", "shape": [2], "data_offsets": [16, 18]}}
    data = bytes(range(8)) + torch.ones(4, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes() + b"\x01\x00"
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[1], hidden_size=2, codec="bf16")
    s = decode_record(_blob(ok, data), meta)
    assert s.input_ids.tolist() == [0x03020100, 0x07060504] and s.loss_mask.tolist() == [1, 0]
    assert s.hidden_states.tolist() == [[[1.0, 1.0]], [[1.0, 1.0]]]

    bad, blob = json.loads(json.dumps(ok)), None
    if damage == "hole":
        bad["loss_mask"]["data_offsets"] = [17, 19]
        bad["loss_mask"]["shape"] = [2]
        data += b"\x00"
    elif damage == "overlap":
        bad["loss_mask"]["data_offsets"] = [14, 16]
    elif damage == "size":
        bad["input_ids"]["shape"] = [3]
    elif damage == "dtype":
        bad["input_ids"]["dtype"] = "X9"
    elif damage == "shape":
        bad["input_ids"]["shape"] = [-2]
    elif damage == "past the end":
        bad["loss_mask"]["data_offsets"] = [16, 20]
        bad["loss_mask"]["shape"] = [4]
    elif damage == "header length":
        blob = (10**6).to_bytes(8, "little") + _blob(ok, data)[8:]
    elif damage == "metadata":
        bad["__metadata__"]["num_tokens"] = 2
    else:
        blob = len(b"[1, 2]").to_bytes(8, "little") + b"[1, 2]" + data
    with pytest.raises(ShardError, match="does not decode"):
        decode_record(blob if blob is not None else _blob(bad, data), meta)


@pytest.mark.parametrize("damage", ["ids bf16", "ids i64", "mask f32", "mask of 7"])
def test_a_record_of_other_dtypes_or_mask_values_than_its_format_is_refused(damage):
    """A record that parses and fits its HEAD, but whose ids are not int32 or whose mask is not
    0-or-1 uint8 (FORMAT.md section 4; a writer other than ours): bf16 ids decoded rounded to other
    tokens, and a mask of 7 weighed its token 7 times in the loss. `verify --decode` passed them."""
    from layertap.storage.records import decode_record

    ids, mask = ("I32", struct.pack("<2i", 5, 70001)), ("U8", b"\x01\x00")
    if damage == "ids bf16":
        ids = ("BF16", torch.tensor([5, 70001], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    elif damage == "ids i64":
        ids = ("I64", struct.pack("<2q", 5, 70001))
    elif damage == "mask f32":
        mask = ("F32", struct.pack("<2f", 1.0, 0.0))
    else:
        mask = ("U8", b"\x07\x00")
    states = torch.ones(4, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    header = {"__metadata__": {"sample_id": "s", "num_tokens": "2", "codec": "bf16", "hidden_states.shape": "2,1,2"},
              "input_ids": {"dtype": ids[0], "shape": [2], "data_offsets": [0, len(ids[1])]},
              "hidden_states.raw": {"dtype": "BF16", "shape": [2, 1, 2],
                                    "data_offsets": [len(ids[1]), len(ids[1]) + 8]},
              "loss_mask": {"dtype": mask[0], "shape": [2],
                            "data_offsets": [len(ids[1]) + 8, len(ids[1]) + 8 + len(mask[1])]}}
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[1], hidden_size=2, codec="bf16")
    want = "its format says 0 or 1" if damage == "mask of 7" else "its format says int32 and uint8"
    with pytest.raises(ShardError, match=f"record 's' holds .*{want}"):
        decode_record(_blob(header, ids[1] + states + mask[1]), meta)
    if damage == "mask of 7":  # nor does the writer write one (a library caller's mask of weights)
        from layertap.storage.records import Sample, encode_record

        with pytest.raises(ValueError, match="loss_mask values must be 0 or 1"):
            encode_record(Sample("s", torch.tensor([5, 1]), torch.tensor([7, 0]), torch.ones(2, 1, 2,
                                                                                     dtype=torch.bfloat16)), meta)


@pytest.mark.parametrize("codec", CODEC_NAMES)
def test_record_blobs_agree_with_the_safetensors_library(tmp_path, codec):
    """The hand-written blob writer and parser against the library both ways: the library reads
    our record (tensors and metadata), and our parser decodes the library's blob of the same
    tensors (its own order and alignment) to the same sample."""
    from safetensors import safe_open
    from safetensors.torch import save

    from layertap.storage.records import decode_record, encode_record, read_safetensors, record_metadata

    meta = make_meta(codec, final_state="prenorm")
    sample = make_samples(3, final=True)[2]
    rec = encode_record(sample, meta)
    (tmp_path / "r.safetensors").write_bytes(rec.payload)
    md, ours = read_safetensors(rec.payload)
    with safe_open(str(tmp_path / "r.safetensors"), "pt") as f:
        assert f.metadata() == md == record_metadata(rec.payload)
        assert sorted(f.keys()) == sorted(ours)
        lib = {k: f.get_tensor(k) for k in f.keys()}
    for k, t in ours.items():
        t = torch.from_numpy(t.copy()) if not isinstance(t, torch.Tensor) else t
        assert t.dtype == lib[k].dtype and torch.equal(t.view(torch.uint8), lib[k].view(torch.uint8)), k

    theirs = save(dict(reversed(lib.items())), metadata=md)
    assert theirs != rec.payload
    assert_same(decode_record(rec.payload, meta), decode_record(theirs, meta), exact=True)
    assert_same(sample, decode_record(theirs, meta), exact=codec != "fp8")


def test_a_state_the_codec_refuses_names_its_sample_and_tensor():
    """fp8 refuses NaN/inf: the shard failed with "fp8 codec needs finite values", retried, given
    up, and the sample holding the NaN was never named."""
    from layertap.storage.records import encode_record

    sample = make_samples(3, final=True)[1]
    sample.final_state[0, 0] = float("nan")
    with pytest.raises(ValueError, match=rf"sample {sample.sample_id}: final_state: fp8 codec needs finite values"):
        encode_record(sample, make_meta("fp8", final_state="prenorm"))


def test_bytes_after_the_trailer_fail_verify_even_against_the_committed_hash(store):
    """A stray tail (a multipart part too many) leaves the shard readable up to its trailer; the
    committed hash alone would not see it, since it covers only the bytes verify reads."""
    write_shard(store, "s.lts", make_meta(), make_samples(n=2))
    data = store.get("s.lts")
    committed = verify_shard(store, "s.lts").xxh3_128
    store.put("t.lts", data + b"x")
    for expected in (None, committed):
        report = verify_shard(store, "t.lts", expected_xxh3_128=expected)
        assert not report.ok and "unexpected bytes after the trailer" in report.error


def test_bytes_between_the_footer_and_the_trailer_are_refused_on_random_access(store):
    write_shard(store, "s.lts", make_meta(), make_samples(n=2))
    data = store.get("s.lts")
    trailer = len(data) - TRAILER.size  # the footer's offset and the magic
    store.put("g.lts", data[:trailer] + b"junk" + data[trailer:])
    with pytest.raises(ShardError, match="trailer does not point at the footer"):
        ShardReader(store, "g.lts")
    assert not verify_shard(store, "g.lts").ok
