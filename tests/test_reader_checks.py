"""The shard reader's checks against a buggy *writer*, proved on hand-built shard bytes.

tests/test_shard.py damages shards the way storage does (a flipped byte, a cut): the frame and
content hashes catch that. A writer bug is different: it writes bytes that are wrong yet hash
correctly, because the writer hashed what it wrote. Each test here writes a good shard with the
real writer, then rewrites its footer or one record with the format's own encoders (recomputing
the FOOT frame hash, and the content hash where a record changes) so that exactly one
inconsistency is left, the one only the check under test can see. Each is then read every way
the reader offers: one record by position (`ShardReader.read`), front to back through the footer
(`iter(ShardReader)`, from the store and from bytes in memory) and `verify_shard` as
`layertap verify` calls it (against the object hash a commit would hold, so that hash cannot be
what catches it, and decoding every record).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
import xxhash

from layertap.storage.format import (FOOT, FRAME, PREAMBLE, RECD, TRAILER, TRAILER_MAGIC, ShardError, ShardMeta,
                                     frame_header, parse_frame)
from layertap.storage.local import LocalStore
from layertap.storage.reader import ShardReader, verify_shard
from layertap.storage.records import Sample, decode_record, encode_record
from layertap.storage.writer import ShardWriter, write_shard
from test_shard import make_meta, make_samples

KEY = "shards/000007-bad.lts"


@pytest.fixture
def store(tmp_path):
    return LocalStore(str(tmp_path))


def good_shard(store) -> bytes:
    """The bytes of an intact 5-record bf16-zstd shard (samples conv-0 .. conv-4, of 3 to 47 tokens)."""
    write_shard(store, "good.lts", make_meta(), make_samples())
    return store.get("good.lts")


def footer_of(data: bytes) -> tuple[int, dict]:
    """(offset, JSON) of the FOOT frame the trailer points at."""
    footer_offset, _ = TRAILER.unpack_from(data, len(data) - TRAILER.size)
    _, payload, _ = parse_frame(data, footer_offset, "test")
    return footer_offset, json.loads(bytes(payload))


def with_footer(data: bytes, footer: dict, *, rehash_content: bool = False) -> bytes:
    """`data` with its FOOT frame replaced by `footer`, encoded and framed as the writer does it;
    `rehash_content` also recomputes `content_xxh3_128` over the bytes before the footer."""
    footer_offset, _ = footer_of(data)
    before = data[:footer_offset]
    if rehash_content:
        footer = dict(footer, content_xxh3_128=xxhash.xxh3_128_hexdigest(before))
    body = json.dumps(footer, separators=(",", ":")).encode()
    return before + frame_header(FOOT, body) + body + TRAILER.pack(footer_offset, TRAILER_MAGIC)


def edit_entry(data: bytes, index: int, **changes) -> bytes:
    """`data` with footer index entry `index` changed: nothing else differs, every hash still holds."""
    _, footer = footer_of(data)
    footer["records"][index].update(changes)
    return with_footer(data, footer)


def assert_refused(store, data: bytes, rec: int, message: str) -> None:
    """Store `data` and check every read path refuses record `rec` with `message` (a regex),
    naming the object and the record (position and the index's sample id); verify reports it."""
    store.put(KEY, data)
    reader = ShardReader(store, KEY)  # opens: the footer and trailer are well formed
    where = re.escape(f"{reader.where} record {rec} ({reader.entries[rec].sample_id}): ")
    assert reader.read(rec + 1 if rec == 0 else 0) is not None  # the other records read
    with pytest.raises(ShardError, match=where + message):
        reader.read(rec)
    with pytest.raises(ShardError, match=where + message):
        list(reader)
    with pytest.raises(ShardError, match=re.escape(f"s3://b/run/{KEY} record {rec} (") + ".*: " + message):
        list(ShardReader.from_bytes(data, KEY, uri="s3://b/run"))
    report = verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(data), decode=True)
    assert not report.ok
    assert report.error.startswith(f"{reader.where}: the footer index does not match the records found")


def test_the_footer_rewrite_alone_changes_no_byte(store):
    """The helpers re-encode a footer exactly as the writer does, so the edits below change only
    what they name."""
    data = good_shard(store)
    assert with_footer(data, footer_of(data)[1]) == data
    assert with_footer(data, footer_of(data)[1], rehash_content=True) == data
    store.put(KEY, data)
    assert [s.sample_id for s in ShardReader(store, KEY)] == [f"conv-{i}" for i in range(5)]
    assert verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(data), decode=True).ok


def test_an_index_hash_that_disagrees_with_its_intact_record_is_refused(store):
    """Writer bug: the index entry carries a stale hash (the previous record's) while the record
    and its frame header are intact. Guards reader.py record_payload's index-hash comparison."""
    data = good_shard(store)
    _, footer = footer_of(data)
    bad = edit_entry(data, 2, xxh3_64=footer["records"][1]["xxh3_64"])
    e = footer["records"][2]
    assert_refused(store, bad, 2, re.escape(f"the frame at byte {e['offset']} does not match the footer index"))


@pytest.mark.parametrize("bug", ["offset after the frame header", "offset of the next frame",
                                 "length without the frame header", "the HEAD frame"])
def test_an_index_offset_or_length_that_misses_its_record_is_refused(store, bug):
    """Writer bug: the index entry's offset or length is not its record's frame: the offset taken
    after writing the frame header, or after the whole frame (the next record's); the payload's
    length without the 20-byte header; or the entry describing the HEAD frame, the frame written
    before the record (its offset, length and hash: only the frame kind tells). Guards
    reader.py record_payload's frame kind and length check."""
    data = good_shard(store)
    reader = ShardReader.from_bytes(data, KEY)
    e, nxt = reader.entries[2], reader.entries[3]
    rec, changes = 2, {
        "offset after the frame header": {"offset": e.offset + FRAME.size},
        "offset of the next frame": {"offset": nxt.offset},
        "length without the frame header": {"length": e.length - FRAME.size},
    }.get(bug, {})
    if bug == "the HEAD frame":
        head = data[PREAMBLE.size + FRAME.size : reader.records_start]
        rec, changes = 0, {"offset": PREAMBLE.size, "length": reader.records_start - PREAMBLE.size,
                           "xxh3_64": f"{xxhash.xxh3_64_intdigest(head):016x}"}
    bad = edit_entry(data, rec, **changes)
    # the index no longer lays the records back to back (from the HEAD frame's end to the footer):
    # refused at open, before any record is read by it
    if bug == "length without the frame header":
        message = f"footer index entry 3 (conv-3) starts at byte {nxt.offset}, where byte {nxt.offset - FRAME.size}"
    else:
        message = f"footer index entry {rec} ({reader.entries[rec].sample_id}) starts at byte {changes['offset']}"
    assert_refused_at_open(store, bad, re.escape(message))


def assert_refused_at_open(store, data: bytes, message: str, verify_message: str = "the footer index does not match "
                           "the records found") -> None:
    """Store `data` and check that opening it (from the store and from memory) is refused with
    `message` (a regex) naming the object, and that verify reports it with `verify_message`."""
    store.put(KEY, data)
    where = re.escape(f"{store.uri.rstrip('/')}/{KEY}: ")
    with pytest.raises(ShardError, match=where + message):
        ShardReader(store, KEY)
    with pytest.raises(ShardError, match=re.escape(f"s3://b/run/{KEY}: ") + message):
        ShardReader.from_bytes(data, KEY, uri="s3://b/run")
    report = verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(data), decode=True)
    assert not report.ok
    assert report.error.startswith(f"{store.uri.rstrip('/')}/{KEY}: {verify_message}"), report.error


def without_entry(data: bytes, index: int) -> bytes:
    """`data` with footer index entry `index` left out, the footer's totals made to agree."""
    _, footer = footer_of(data)
    gone = footer["records"].pop(index)
    footer.update(num_records=footer["num_records"] - 1, num_tokens=footer["num_tokens"] - gone["num_tokens"])
    return with_footer(data, footer)


@pytest.mark.parametrize("index", [2, 4])
def test_an_index_that_leaves_out_a_record_is_refused(store, index):
    """Writer bug: an index entry dropped (a record written, its entry lost), the footer's totals
    counting the rest. Read through the index, the shard served 4 samples of 5, and a commit
    record made from the same list agreed: the sample was lost without a word."""
    data = good_shard(store)
    entries = ShardReader.from_bytes(data, KEY).entries
    if index == 4:  # the last: every listed record in place, the bytes before the footer unlisted
        message = f"the footer index's 4 records end at byte {entries[4].offset}, the footer starts at byte"
    else:
        message = f"footer index entry 2 (conv-3) starts at byte {entries[3].offset}, where byte {entries[2].offset}"
    assert_refused_at_open(store, without_entry(data, index), re.escape(message))


def test_an_index_that_lists_a_sample_twice_is_refused(store):
    """Writer bug: one sample written twice (a retried encode appended again), each copy indexed:
    the records lie back to back, every hash holds, and the sample would be trained on twice."""
    meta, samples = make_meta(), make_samples()
    recs = [encode_record(s, meta) for s in (samples[0], samples[1], samples[1], samples[3])]
    recs[2] = dataclasses.replace(recs[2], sample_id="other")  # past the writer's own check of ids
    with ShardWriter(store.open_writer("twice.lts"), meta) as w:
        for r in recs:
            w.append_encoded(r)
        w.close()
    data = edit_entry(store.get("twice.lts"), 2, sample_id="conv-1")  # the index as the buggy writer made it
    store.put(KEY, data)
    with pytest.raises(ShardError, match=re.escape("footer index entry 2 repeats sample 'conv-1'")):
        ShardReader(store, KEY)
    report = verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(data), decode=True)
    assert not report.ok and "footer index entry 2 repeats sample 'conv-1'" in report.error


def test_an_index_token_count_other_than_the_records_is_refused(store):
    """Writer bug: an entry's token count not its record's (the footer's total made to agree): the
    record reads, as another length than the index (and a commit built from it) promised."""
    data = good_shard(store)
    offset, footer = footer_of(data)
    footer["records"][2]["num_tokens"] += 1
    footer["num_tokens"] += 1
    bad = with_footer(data, footer)
    n = footer["records"][2]["num_tokens"]
    store.put(KEY, bad)
    reader = ShardReader(store, KEY)
    with pytest.raises(ShardError, match=re.escape(f"{reader.where} record 2 (conv-2): holds {n - 1} tokens, "
                                                   f"the index says {n}")):
        reader.read(2)
    assert reader.read(3).sample_id == "conv-3"
    report = verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(bad), decode=True)
    assert not report.ok and "the footer index does not match the records found" in report.error


def test_footer_totals_other_than_the_index_are_refused(store):
    """Writer bug: the footer's totals not its records' (status and the planner read them)."""
    data = good_shard(store)
    _, footer = footer_of(data)
    total = footer["num_tokens"]
    bad = with_footer(data, dict(footer, num_tokens=1))
    message = f"the footer's totals (5 records, 1 tokens) are not its index's (5, {total})"
    assert_refused_at_open(store, bad, re.escape(message), message)


def test_a_record_that_does_not_decode_is_named(store):
    """A record framed and hashed correctly that does not decode (a writer's garbage payload) is
    refused naming the object and the record, on every path."""
    data = good_shard(store)
    e = footer_of(data)[1]["records"][2]
    junk = bytes(range(256)) * (e["length"] // 256 + 1)
    payload = b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + junk[:e["length"] - FRAME.size - 18]
    off = e["offset"]
    bad = data[:off] + frame_header(RECD, payload) + payload + data[off + e["length"]:]
    bad = edit_entry(bad, 2, xxh3_64=f"{xxhash.xxh3_64_intdigest(payload):016x}")
    bad = with_footer(bad, footer_of(bad)[1], rehash_content=True)
    store.put(KEY, bad)
    reader = ShardReader(store, KEY)
    with pytest.raises(ShardError, match=re.escape(f"{reader.where} record 2 (conv-2): record does not decode")):
        reader.read(2)
    report = verify_shard(store, KEY, expected_xxh3_128=xxhash.xxh3_128_hexdigest(bad), decode=True)
    assert not report.ok and report.error.startswith(f"{reader.where} record 2 (at byte {off}): record header does "
                                                     "not parse"), report.error


def test_a_record_that_holds_another_sample_than_its_index_entry_is_refused(store):
    """Writer bug: records labelled with the wrong sample id (encode threads finishing out of
    order, their results matched to the plan by position): records 1 and 2 are each indexed under
    the other's id. Every hash holds; only the id inside the record tells. Built with the real
    writer. Guards reader.py ShardReader.read's sample-id comparison."""
    meta, samples = make_meta(), make_samples()
    recs = [encode_record(s, meta) for s in samples]
    recs[1], recs[2] = (dataclasses.replace(recs[2], sample_id="conv-1"),
                        dataclasses.replace(recs[1], sample_id="conv-2"))
    with ShardWriter(store.open_writer("mislabelled.lts"), meta) as w:
        for r in recs:
            w.append_encoded(r)
        w.close()
    data = store.get("mislabelled.lts")
    assert_refused(store, data, 1, re.escape("holds sample 'conv-2', the index says 'conv-1'"))


def test_a_validly_framed_record_other_than_the_indexed_one_is_refused(store):
    """Writer bug: a record re-encoded and re-framed after its index entry was made (its frame
    header and the content hash recomputed, the index entry not): a valid, decodable record of the
    same sample and size whose activations differ in their low mantissa bits. Guards reader.py
    record_payload's index-hash comparison (verify: the index against the records found)."""
    meta, samples = make_meta(), make_samples()
    data = good_shard(store)
    e = footer_of(data)[1]["records"][2]
    s = samples[2]
    other = Sample(s.sample_id, s.input_ids, s.loss_mask, (s.hidden_states.view(torch.int16) ^ 1).view(torch.bfloat16))
    payload = encode_record(other, meta).payload
    assert FRAME.size + len(payload) == e["length"]  # same size: only the hash can tell
    decoded = decode_record(payload, meta)  # a valid record the reader would serve as conv-2
    assert decoded.sample_id == "conv-2" and not torch.equal(decoded.hidden_states, s.hidden_states)
    off = e["offset"]
    bad = data[:off] + frame_header(RECD, payload) + payload + data[off + e["length"]:]
    bad = with_footer(bad, footer_of(bad)[1], rehash_content=True)
    assert_refused(store, bad, 2, re.escape(f"the frame at byte {off} does not match the footer index"))


def test_the_training_stream_checks_each_record_against_its_index_entry(store):
    """The loader decodes records on its own threads (train/stream.py), not through
    `ShardReader.read`: the same checks of sample id and length apply there."""
    from layertap.storage.reader import record_payload
    from layertap.train.fetch import Record
    from layertap.train.stream import _decode

    data = good_shard(store)
    reader = ShardReader.from_bytes(data, KEY)
    e = reader.entries[2]
    payload = record_payload(data, 0, e, KEY)
    with pytest.raises(ShardError, match=re.escape(f"holds {e.num_tokens} tokens, the index says {e.num_tokens + 1}")):
        _decode(Record(payload, reader.meta, e.sample_id, e.num_tokens + 1, 0, None), None)
    with pytest.raises(ShardError, match=re.escape("holds sample 'conv-2', the index says 'conv-3'")):
        _decode(Record(payload, reader.meta, "conv-3", e.num_tokens, 0, None), None)


def _framed(store, meta, tensors: dict, md: dict) -> None:
    """One record of `tensors` and `md`, with correct hashes, as another writer might frame it."""
    from layertap.storage.records import EncodedRecord, safetensors_parts

    parts = safetensors_parts(tensors, md)
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    rec = EncodedRecord(md["sample_id"], int(md["num_tokens"]), tuple(parts), sum(len(p) for p in parts),
                        h.intdigest(), 0)
    with ShardWriter(store.open_writer("x.lts"), meta) as w:
        w.append_encoded(rec)
        w.close()


@pytest.mark.parametrize("case", ["mask_short", "states_short", "layers", "width", "final_missing", "codec"])
def test_a_record_whose_tensors_disagree_with_each_other_or_the_head_is_corrupt(store, case):
    """Hashes prove the bytes are the writer's, not that the writer was right: a record of 4 ids,
    a 3-entry mask and states of 2 tokens x 3 layers x 6 wide under a HEAD of 2 layers x 8 passed
    verify and was handed to training misaligned."""
    final = "prenorm" if case == "final_missing" else "none"
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[1, 5], hidden_size=8, codec="bf16", final_state=final)
    tokens, mask_n, shape = 4, 4, [4, 2, 8]
    if case == "mask_short":
        mask_n = 3
    elif case == "states_short":
        shape[0] = 2
    elif case == "layers":
        shape[1] = 3
    elif case == "width":
        shape[2] = 6
    md = {"sample_id": "s0", "num_tokens": str(tokens), "codec": "fp8" if case == "codec" else "bf16",
          "hidden_states.shape": ",".join(map(str, shape))}
    tensors = {"input_ids": torch.arange(tokens, dtype=torch.int32), "loss_mask": torch.ones(mask_n, dtype=torch.uint8),
               "hidden_states.raw": torch.randn(*shape).bfloat16()}
    _framed(store, meta, tensors, md)
    report = verify_shard(store, "x.lts", decode=True)
    assert not report.ok and "s0" in report.error
    with pytest.raises(ShardError, match="s0"):
        ShardReader(store, "x.lts").read(0)


def test_a_record_that_fits_its_head_still_reads(store):
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[1, 5], hidden_size=8, codec="bf16")
    _framed(store, meta, {"input_ids": torch.arange(4, dtype=torch.int32), "loss_mask": torch.ones(4, dtype=torch.uint8),
                          "hidden_states.raw": torch.randn(4, 2, 8).bfloat16()},
            {"sample_id": "s0", "num_tokens": "4", "codec": "bf16", "hidden_states.shape": "4,2,8"})
    assert verify_shard(store, "x.lts", decode=True).ok
    assert tuple(ShardReader(store, "x.lts").read(0).hidden_states.shape) == (4, 2, 8)


def _hand_built(head: bytes, foot: bytes) -> bytes:
    """A shard of no records from a HEAD and a FOOT payload, with a correct content hash ("HASH")."""
    from layertap.storage.format import HEAD, MAGIC

    b = PREAMBLE.pack(MAGIC, 1, 0) + frame_header(HEAD, head) + head
    off = len(b)
    foot = foot.replace(b"HASH", xxhash.xxh3_128_hexdigest(b).encode())
    return b + frame_header(FOOT, foot) + foot + TRAILER.pack(off, TRAILER_MAGIC)


_HEAD = (b'{"codec":"bf16","format":"layertap-shard","format_version":1,"run_id":"r","shard_id":0,"model":"m",'
         b'"layers":[1],"hidden_size":8,"extra":{}}')
_FOOT = b'{"num_records":0,"num_tokens":0,"raw_bytes":0,"records":[],"content_xxh3_128":"HASH","relative_error":null}'


@pytest.mark.parametrize("head, foot", [(b'["layertap-shard"]', _FOOT), (_HEAD.replace(b'"extra":{}', b'"extra":"x"'), _FOOT),
                                        (_HEAD, b'["HASH"]'), (_HEAD, _FOOT.replace(b'"records":[]', b'"records":[7]'))],
                         ids=["head_list", "extra_text", "foot_list", "entry_int"])
def test_a_head_or_footer_of_valid_hashes_and_another_shape_is_a_corrupt_shard(tmp_path, capsys, head, foot):
    """They were AttributeError and TypeError tracebacks out of `verify` and `inspect`."""
    from layertap.cli import main as cli

    store = LocalStore(str(tmp_path))
    (tmp_path / "x.lts").write_bytes(_hand_built(head, foot))
    report = verify_shard(store, "x.lts")
    assert not report.ok and "corrupt" in report.error
    with pytest.raises(ShardError):
        ShardReader(store, "x.lts")
    assert cli(["inspect", str(tmp_path / "x.lts")]) == 1
    assert "the shard is corrupt" in capsys.readouterr().out


def test_inspect_shows_a_free_form_produced_by_it_does_not_know_without_failing(tmp_path, capsys):
    """HEAD `extra` is free-form (FORMAT.md §3): a string `produced_by` failed inspect."""
    from layertap.cli import main as cli

    (tmp_path / "x.lts").write_bytes(_hand_built(_HEAD.replace(b'"extra":{}', b'"extra":{"produced_by":"gpu"}'), _FOOT))
    assert cli(["inspect", str(tmp_path / "x.lts")]) == 0
    assert "OK (every hash verified)" in capsys.readouterr().out


@pytest.mark.parametrize("value,hidden", [(3e37, 8), (1e20, 8), (1e-36, 8), (4e17, 5120)])
def test_fp8_error_of_values_far_from_one_is_finite_and_strict_json(tmp_path, value, hidden):
    """Squares in float32 overflowed (NaN written into the footer, which is not JSON) or underflowed
    (a false 0.0) for values past ~1e18 or below ~1e-18: decoding was fine, the stats were not. A
    row sum of 5,120 squares overflows from ~2.6e17 on: its norm was inf, its error a false 0.0."""
    store = LocalStore(str(tmp_path))
    x = torch.full((2, 1, hidden), value, dtype=torch.bfloat16)
    x[:, :, ::2] = -value * 0.37
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[3], hidden_size=hidden, codec="fp8")
    info = write_shard(store, "s.lts", meta, [Sample("a", torch.tensor([1, 2]), torch.tensor([1, 1]), x)])
    assert 0.001 < info.relative_error < 0.05
    y = ShardReader(store, "s.lts").read(0).hidden_states.double()
    real = float(((y - x.double()).norm() / x.double().norm()))
    assert info.relative_error == pytest.approx(real, rel=1e-3)

    def refuse(constant: str):
        raise ValueError(constant)

    footer = ShardReader(store, "s.lts").footer
    assert json.loads(json.dumps(footer), parse_constant=refuse)["relative_error"] == info.relative_error


def test_a_shard_shorter_than_its_commit_says_is_called_truncated(tmp_path):
    """The loader opens a shard at its commit record's size: a truncated object was reported as
    having "changed size while reading"."""
    store = LocalStore(str(tmp_path))
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[3], hidden_size=8, codec="bf16")
    x = torch.ones((2, 1, 8), dtype=torch.bfloat16)
    write_shard(store, "s.lts", meta, [Sample("a", torch.tensor([1, 2]), torch.tensor([1, 1]), x)])
    size = store.size("s.lts")
    (tmp_path / "s.lts").write_bytes((tmp_path / "s.lts").read_bytes()[:-100])
    with pytest.raises(ShardError, match=rf"holds {size - 100:,} bytes, not the {size:,} expected .* truncated"):
        ShardReader(store, "s.lts", size=size)


def test_reading_a_shard_through_fetches_adjacent_records_together(tmp_path, monkeypatch):
    """Iterating a shard (export, inspect --stats) made a GET per record: a run's 900,000 samples
    exported in 900,000 GETs. Adjacent records come in GETs of up to RUN_BYTES, each still checked."""
    store = LocalStore(str(tmp_path))
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[3], hidden_size=8, codec="bf16")
    samples = [Sample(f"s{i}", torch.arange(4 + i), torch.ones(4 + i, dtype=torch.uint8),
                      torch.full((4 + i, 1, 8), float(i), dtype=torch.bfloat16)) for i in range(10)]
    write_shard(store, "s.lts", meta, samples)
    reader = ShardReader(store, "s.lts")
    gets = []
    real = LocalStore.get_range
    monkeypatch.setattr(LocalStore, "get_range", lambda self, k, a, b: gets.append(b - a) or real(self, k, a, b))
    assert [s.sample_id for s in reader] == [f"s{i}" for i in range(10)] and len(gets) == 1
    gets.clear()
    run = reader.entries[9].offset + reader.entries[9].length - reader.entries[8].offset  # the 2 largest records
    monkeypatch.setattr(ShardReader, "RUN_BYTES", run)
    got = list(reader)
    assert 5 <= len(gets) < 10 and max(gets) <= run
    assert all(torch.equal(a.hidden_states, b.hidden_states) for a, b in zip(got, samples))
    data = bytearray((tmp_path / "s.lts").read_bytes())
    data[reader.entries[7].offset + 40] ^= 0xFF  # record 7's payload
    (tmp_path / "s.lts").write_bytes(bytes(data))
    with pytest.raises(ShardError, match=r"record 7 \(s7\): checksum mismatch"):
        list(reader)


def test_verify_reads_a_shards_size_once(tmp_path, monkeypatch):
    """verify_shard asked the size, then its stream asked again: two HEADs a shard, 50,000 on a run
    of 25,000 shards."""

    store = LocalStore(str(tmp_path))
    meta = ShardMeta(run_id="r", shard_id=0, model="m", layers=[3], hidden_size=8, codec="bf16")
    write_shard(store, "s.lts", meta, [Sample("a", torch.tensor([1, 2]), torch.tensor([1, 1]),
                                              torch.ones((2, 1, 8), dtype=torch.bfloat16))])
    sizes = []
    real = LocalStore.size
    monkeypatch.setattr(LocalStore, "size", lambda self, key: sizes.append(key) or real(self, key))
    assert verify_shard(store, "s.lts").ok and sizes == ["s.lts"]
