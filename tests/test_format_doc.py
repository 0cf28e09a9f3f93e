"""docs/FORMAT.md is enough to read a shard: an independent reader, written from the document alone.

The reader below (everything above the tests) uses only struct, json, xxhash, zstandard and
numpy, as another team would in another language; it never imports the storage package (the
reference format modules and codecs). The tests write shards with the reference writer on both
backends and check that this reader gets exactly the same tensors (bit for bit for the lossless
codecs; bit for bit against the reference reader for fp8) and verifies every hash the document
defines.
"""

from __future__ import annotations

import io
import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np
import pytest
import torch
import xxhash
import zstandard

DOC = Path(__file__).resolve().parents[1] / "docs" / "FORMAT.md"

# ---------------------------------------------------------------------------------------------
# The reader, from docs/FORMAT.md
# ---------------------------------------------------------------------------------------------

MAGIC = b"LTSHARD\x00"  # §2.1
TRAILER_MAGIC = b"LTSEND\x00\x00"  # §2.3
VERSION = 1
KINDS = (b"HEAD", b"RECD", b"FOOT")  # §2.2
FRAME_HEADER = 20
ST_DTYPES = {"I32": "<i4", "U8": "u1", "F32": "<f4", "BF16": "<u2"}  # §4; bf16 kept as bit patterns
HEAD_KEYS = {"format", "format_version", "run_id", "shard_id", "model", "model_revision", "layers",
             "layer_convention", "final_state", "hidden_size", "dtype", "codec", "tokenizer", "extra",
             "created_at"}
ENTRY_KEYS = {"sample_id", "offset", "length", "num_tokens", "xxh3_64"}


class FormatError(Exception):
    pass


class UnsupportedVersion(FormatError):
    pass


def check_preamble(b: bytes) -> None:
    if len(b) < 16:
        raise FormatError("truncated preamble")
    magic, version, _flags = struct.unpack_from("<8sII", b, 0)  # flags: ignored by v1 readers (§9)
    if magic != MAGIC:
        raise FormatError(f"bad magic {magic!r}")
    if version != VERSION:
        raise UnsupportedVersion(f"format version {version}")


def parse_frame_header(b: bytes) -> tuple[bytes, int, int]:
    kind, n, digest = struct.unpack("<4sQQ", b)
    if kind not in KINDS:
        raise FormatError(f"unknown frame kind {kind!r}")
    return kind, n, digest


def check_payload(kind: bytes, payload: bytes, digest: int) -> None:
    if xxhash.xxh3_64_intdigest(payload) != digest:  # §7: frame hash covers the payload only
        raise FormatError(f"{kind.decode()} payload hash mismatch")


def parse_head(payload: bytes) -> dict:
    head = json.loads(payload)
    if head.get("format") != "layertap-shard":
        raise FormatError(f"format {head.get('format')!r}")
    if head.get("format_version") != VERSION:
        raise UnsupportedVersion(f"HEAD format_version {head.get('format_version')}")
    if head["final_state"] not in ("none", "prenorm", "postnorm"):
        raise FormatError(f"final_state {head['final_state']!r}")
    if head["codec"] not in ("bf16", "bf16-zstd", "fp8") or head["dtype"] != "bfloat16":
        raise FormatError(f"codec {head['codec']!r} / dtype {head['dtype']!r}")
    if head["layer_convention"] != "decoder_output":
        raise FormatError(f"layer_convention {head['layer_convention']!r}")
    return head


def parse_safetensors(blob: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """§4: u64 N | N bytes JSON | data section; offsets relative to the data section."""
    (n,) = struct.unpack_from("<Q", blob, 0)
    header = json.loads(blob[8 : 8 + n])
    metadata = header.pop("__metadata__", {})
    data = blob[8 + n :]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        dtype = np.dtype(ST_DTYPES[t["dtype"]])
        shape = tuple(t["shape"])
        if end - begin != math.prod(shape) * dtype.itemsize or end > len(data):
            raise FormatError(f"tensor {name}: bad data_offsets")
        # copy: the payload sits at an arbitrary offset in the object, so nothing is aligned
        tensors[name] = np.frombuffer(bytes(data[begin:end]), dtype=dtype).reshape(shape)
    return tensors, metadata


def unzstd(frame: np.ndarray, n: int) -> np.ndarray:
    """§5: one zstd frame whose header states the content size, which must be n."""
    data = frame.tobytes()
    if zstandard.frame_content_size(data) != n:
        raise FormatError("zstd frame content size mismatch")
    out = zstandard.ZstdDecompressor().decompress(data, max_output_size=n)
    if len(out) != n:
        raise FormatError("zstd frame decompressed to the wrong size")
    return np.frombuffer(out, dtype=np.uint8)


def e4m3fn_table() -> np.ndarray:
    """§5.3: the float32 value of every float8 e4m3fn code."""
    table = np.empty(256, dtype=np.float32)
    for q in range(256):
        s, e, m = q >> 7, (q >> 3) & 15, q & 7
        if e == 15 and m == 7:
            v = math.nan
        elif e == 0:
            v = (m / 8) * 2.0**-6
        else:
            v = (1 + m / 8) * 2.0 ** (e - 7)
        table[q] = -v if s else v
    return table


E4M3 = e4m3fn_table()


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """§5.3: round to nearest even, for finite float32 values."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def parse_shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s.split(","))


def decode_codec(codec: str, name: str, tensors: dict[str, np.ndarray], md: dict[str, str]) -> np.ndarray:
    """§5: the bf16 bit patterns (uint16) of tensor `name`."""
    shape = parse_shape(md[f"{name}.shape"])
    n = math.prod(shape)
    if codec == "bf16":
        raw = tensors[f"{name}.raw"]
        assert raw.dtype == np.uint16 and raw.shape == shape
        return raw
    if codec == "bf16-zstd":
        lo = tensors[f"{name}.lo"]
        hi = unzstd(tensors[f"{name}.hi.zst"], n)
        assert lo.dtype == np.uint8 and lo.shape == (n,)
        if len(shape) >= 3:  # the high plane is layer-major: [L, S, ...]
            hi = hi.reshape((shape[1], shape[0], *shape[2:])).swapaxes(0, 1).reshape(-1)
        return (lo.astype(np.uint16) | (hi.astype(np.uint16) << 8)).reshape(shape)
    if codec == "fp8":
        scale = tensors[f"{name}.scale"]
        assert scale.dtype == np.float32 and scale.shape == shape[:-1]
        q = unzstd(tensors[f"{name}.fp8.zst"], n).reshape(shape)
        return f32_to_bf16_bits(E4M3[q] * scale[..., None])  # one float32 multiply, then RNE
    raise FormatError(f"unknown codec {codec!r}")


@dataclass
class Record:
    sample_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    hidden_states: np.ndarray  # uint16 bf16 bits [S, L, H]
    final_state: np.ndarray | None  # uint16 bf16 bits [S, H]
    metadata: dict[str, str]
    tensors: dict[str, np.ndarray]


def decode_record(payload: bytes, head: dict) -> Record:
    tensors, md = parse_safetensors(payload)
    s, n_layers, h = int(md["num_tokens"]), len(head["layers"]), head["hidden_size"]
    codec = md["codec"]
    if codec != head["codec"]:
        raise FormatError(f"record codec {codec!r} != HEAD codec {head['codec']!r}")
    ids, mask = tensors["input_ids"], tensors["loss_mask"]
    assert ids.dtype == np.int32 and ids.shape == (s,) and mask.dtype == np.uint8 and mask.shape == (s,)
    hs = decode_codec(codec, "hidden_states", tensors, md)
    assert hs.shape == (s, n_layers, h)
    has_final = any(k.startswith("final_state.") for k in tensors)
    if has_final != (head["final_state"] != "none"):
        raise FormatError("final_state presence disagrees with the HEAD")
    fs = decode_codec(codec, "final_state", tensors, md) if has_final else None
    assert fs is None or fs.shape == (s, h)
    return Record(md["sample_id"], ids, mask, hs, fs, md, tensors)


@dataclass
class Parsed:
    head: dict
    footer: dict
    records: list[Record]
    frames: list[tuple[bytes, int, int, int]] = field(default_factory=list)  # kind, offset, length, xxh3-64
    content_xxh3_128: str = ""
    object_xxh3_128: str = ""


def _read_exact(stream: BinaryIO, n: int, what: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = stream.read(n - len(out))
        if not chunk:
            raise FormatError(f"truncated in {what}")
        out += chunk
    return bytes(out)


def read_front_to_back(stream: BinaryIO) -> Parsed:
    """§8, front to back: every frame hash, the content hash, the trailer, the object hash."""
    whole, content = xxhash.xxh3_128(), xxhash.xxh3_128()

    def take(n: int, what: str, before_footer: bool) -> bytes:
        b = _read_exact(stream, n, what)
        whole.update(b)
        if before_footer:
            content.update(b)
        return b

    check_preamble(take(16, "preamble", True))
    pos, head, footer, frames, payloads = 16, None, None, [], []
    while footer is None:
        raw = _read_exact(stream, FRAME_HEADER, "frame header")
        kind, n, digest = parse_frame_header(raw)
        whole.update(raw)
        if kind != b"FOOT":
            content.update(raw)
        payload = take(n, f"{kind.decode()} payload", kind != b"FOOT")
        check_payload(kind, payload, digest)
        if (kind == b"HEAD") != (pos == 16):
            raise FormatError("HEAD must be the first frame, and only the first")
        if kind == b"HEAD":
            head = parse_head(payload)
        elif kind == b"RECD":
            payloads.append(payload)
        else:
            footer = json.loads(payload)
            footer_offset = pos
            if footer["content_xxh3_128"] != content.hexdigest():
                raise FormatError("content hash mismatch")
        frames.append((kind, pos, FRAME_HEADER + n, digest))
        pos += FRAME_HEADER + n
    trailer = take(16, "trailer", False)
    offset, magic = struct.unpack("<Q8s", trailer)
    if magic != TRAILER_MAGIC or offset != footer_offset:
        raise FormatError("bad trailer")
    if stream.read(1):
        raise FormatError("bytes after the trailer")
    records = [decode_record(p, head) for p in payloads]
    check_footer(footer, head, frames, records)
    return Parsed(head, footer, records, frames, content.hexdigest(), whole.hexdigest())


def check_footer(footer: dict, head: dict, frames: list, records: list[Record]) -> None:
    """§6: the index against the frames seen, and the totals against the records."""
    recd = [f for f in frames if f[0] == b"RECD"]
    if footer["num_records"] != len(recd) or len(footer["records"]) != len(recd):
        raise FormatError("footer record count mismatch")
    for entry, (_, offset, length, digest), rec in zip(footer["records"], recd, records):
        assert set(entry) == ENTRY_KEYS
        if (entry["offset"], entry["length"], entry["xxh3_64"]) != (offset, length, f"{digest:016x}"):
            raise FormatError(f"index entry {entry} does not match the frame")
        if entry["sample_id"] != rec.sample_id or entry["num_tokens"] != rec.input_ids.shape[0]:
            raise FormatError(f"index entry {entry} does not match the record")
    if footer["num_tokens"] != sum(r.input_ids.shape[0] for r in records):
        raise FormatError("num_tokens mismatch")
    raw = sum(2 * (r.hidden_states.size + (r.final_state.size if r.final_state is not None else 0)) for r in records)
    if footer["raw_bytes"] != raw:
        raise FormatError("raw_bytes mismatch")
    if len({r.sample_id for r in records}) != len(records):
        raise FormatError("duplicate sample ids")


class RandomAccessReader:
    """§8, random access: preamble + HEAD from the front, trailer + footer from the tail, then
    one ranged read per record."""

    def __init__(self, get_range: Callable[[int, int], bytes], size: int, tail_guess: int = 256 << 10):
        self.get_range, self.size, self.gets = get_range, size, 0
        if size < 32:
            raise FormatError("too short")
        front = self._get(0, min(size, 64 << 10))
        check_preamble(front)
        kind, n, digest = parse_frame_header(front[16:36])
        if kind != b"HEAD":
            raise FormatError("first frame is not HEAD")
        if len(front) < 36 + n:
            front = self._get(0, 36 + n)
        check_payload(kind, front[36 : 36 + n], digest)
        self.head = parse_head(front[36 : 36 + n])
        self.records_start = 36 + n

        tail_start = max(0, size - tail_guess)
        tail = self._get(tail_start, size)
        footer_offset, magic = struct.unpack("<Q8s", tail[-16:])
        if magic != TRAILER_MAGIC or not (self.records_start <= footer_offset < size - 16):
            raise FormatError("no valid trailer")
        if footer_offset < tail_start:
            tail_start, tail = footer_offset, self._get(footer_offset, size)
        kind, n, digest = parse_frame_header(tail[footer_offset - tail_start :][:FRAME_HEADER])
        start = footer_offset - tail_start + FRAME_HEADER
        if kind != b"FOOT" or footer_offset + FRAME_HEADER + n != size - 16:
            raise FormatError("trailer does not point at a footer that ends at the trailer")
        payload = tail[start : start + n]
        check_payload(kind, payload, digest)
        self.footer = json.loads(payload)
        self.footer_offset = footer_offset

    def _get(self, start: int, end: int) -> bytes:
        self.gets += 1
        b = self.get_range(start, end)
        if len(b) != end - start:
            raise FormatError("short read")
        return b

    def __len__(self) -> int:
        return len(self.footer["records"])

    def read(self, i: int) -> Record:
        e = self.footer["records"][i]
        buf = self._get(e["offset"], e["offset"] + e["length"])
        kind, n, digest = parse_frame_header(buf[:FRAME_HEADER])
        if kind != b"RECD" or n != e["length"] - FRAME_HEADER or f"{digest:016x}" != e["xxh3_64"]:
            raise FormatError(f"record {i}: frame does not match its index entry")
        payload = buf[FRAME_HEADER:]
        check_payload(kind, payload, digest)
        rec = decode_record(payload, self.head)
        if rec.sample_id != e["sample_id"]:
            raise FormatError(f"record {i}: sample id mismatch")
        return rec


class Trickle(io.RawIOBase):
    """A stream that hands out at most `k` bytes per read, like a socket mid-upload."""

    def __init__(self, data: bytes, k: int = 997):
        self._buf, self._k = io.BytesIO(data), k

    def read(self, n: int = -1) -> bytes:
        return self._buf.read(self._k if n is None or n < 0 else min(n, self._k))


# ---------------------------------------------------------------------------------------------
# Tests: shards from the reference writer, read with the reader above
# ---------------------------------------------------------------------------------------------

from layertap.storage.format import ShardMeta  # noqa: E402  (writer side)
from layertap.storage.reader import ShardReader, verify_shard  # noqa: E402
from layertap.storage.records import Sample  # noqa: E402
from layertap.storage.writer import write_shard  # noqa: E402

LAYERS, HIDDEN = [0, 4, 11], 48
KEY = "shards/00003.lts"


def make_samples(final: bool, lossy: bool, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, s in enumerate([5, 0, 1, 23, 9]):  # includes a zero-token sample
        hs = torch.randn(s, len(LAYERS), HIDDEN, generator=g).mul(30).to(torch.bfloat16)
        if s:
            hs[0] *= 500  # token 0 is huge in real models
        if s > 3:
            hs[1, 1] = 0  # an all-zero row: fp8 scale 1.0
            hs[2, 0, :3] = torch.tensor([1e-40, -1e-39, -0.0]).to(torch.bfloat16)  # subnormals, -0
            hs[4, 2] = 2.0 ** -torch.arange(HIDDEN)  # a wide row: fp8 normal, subnormal and zero codes
            if not lossy:  # fp8 refuses non-finite values (and its error stats overflow past ~1e19)
                hs[3, 2, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 3e38]).to(torch.bfloat16)
        fs = torch.randn(s, HIDDEN, generator=g).to(torch.bfloat16) if final else None
        out.append(Sample(sample_id=f"sample/{i}-é", input_ids=torch.randint(0, 2**31 - 1, (s,), generator=g),
                          loss_mask=(torch.rand(s, generator=g) > 0.3).to(torch.uint8),
                          hidden_states=hs, final_state=fs))
    return out


def make_meta(codec: str, final_state: str) -> ShardMeta:
    return ShardMeta(run_id="run-doc", shard_id=3, model="org/model", model_revision="abc123", layers=LAYERS,
                     hidden_size=HIDDEN, codec=codec, final_state=final_state, tokenizer="org/tok",
                     extra={"note": "ünïcode"})


def bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def expected_relative_error(records: list[Record]) -> float:
    """§6, summed in record order as the writer does."""
    err = norm = 0.0
    for r in records:
        e = n = 0.0
        for name in ("hidden_states", "final_state"):
            e += float(r.metadata.get(f"{name}.sq_err", 0.0))
            n += float(r.metadata.get(f"{name}.sq_norm", 0.0))
        err, norm = err + e, norm + n
    return math.sqrt(err / norm) if norm > 0 else 0.0


@pytest.mark.parametrize("codec", ["bf16", "bf16-zstd", "fp8"])
@pytest.mark.parametrize("final_state", ["none", "prenorm", "postnorm"])
def test_doc_reader_reads_what_the_writer_wrote(store, codec, final_state):
    lossy = codec == "fp8"
    meta = make_meta(codec, final_state)
    samples = make_samples(final_state != "none", lossy)
    info = write_shard(store, KEY, meta, samples)
    data = store.get(KEY)

    # front to back, a few hundred bytes at a time: every frame hash, content hash, trailer
    parsed = read_front_to_back(Trickle(data))
    assert parsed.object_xxh3_128 == info.xxh3_128 == xxhash.xxh3_128_hexdigest(data)
    assert parsed.content_xxh3_128 == xxhash.xxh3_128_hexdigest(data[: parsed.frames[-1][1]])
    assert [f[0] for f in parsed.frames] == [b"HEAD"] + [b"RECD"] * len(samples) + [b"FOOT"]
    assert parsed.frames[-1][1] + parsed.frames[-1][2] + 16 == len(data) == info.bytes

    # HEAD: every key the document lists, nothing else, with the writer's values
    head = parsed.head
    assert set(head) == HEAD_KEYS
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", head["created_at"])
    assert {k: v for k, v in head.items() if k != "created_at"} == meta.to_json()
    assert head["format_version"] == struct.unpack_from("<I", data, 8)[0] == 1

    # FOOT totals and relative error
    footer = parsed.footer
    assert footer["num_records"] == info.num_records == len(samples)
    assert footer["num_tokens"] == info.num_tokens == sum(s.num_tokens for s in samples)
    assert footer["raw_bytes"] == info.raw_bytes
    if lossy:
        assert footer["relative_error"] == pytest.approx(expected_relative_error(parsed.records), rel=1e-12)
        assert footer["relative_error"] == info.relative_error and 0 < info.relative_error < 0.04
    else:
        assert footer["relative_error"] is None and info.relative_error is None

    # random access through the store: a tail GET that holds the footer, and one that does not
    size = store.size(KEY)
    readers = [RandomAccessReader(lambda a, b: store.get_range(KEY, a, b), size, tail_guess=t) for t in (256 << 10, 40)]
    assert readers[0].gets == 2 and readers[1].gets == 3
    ref = ShardReader(store, KEY)
    for ra in readers:
        assert ra.footer == footer and ra.head == head and ra.footer_offset == parsed.frames[-1][1]
        for i in (3, 0, 4, 1, 2):
            got, streamed, want = ra.read(i), parsed.records[i], samples[i]
            assert got.sample_id == streamed.sample_id == want.sample_id
            assert np.array_equal(got.input_ids, want.input_ids.numpy()) and got.input_ids.dtype == np.int32
            assert np.array_equal(got.loss_mask, want.loss_mask.numpy())
            assert got.metadata == streamed.metadata and got.metadata["num_tokens"] == str(want.num_tokens)
            for name in ("hidden_states", "final_state"):
                mine, orig = getattr(got, name), getattr(want, name)
                assert np.array_equal(mine, getattr(streamed, name))
                if orig is None:
                    assert mine is None
                    continue
                if lossy:  # bit-exact against the reference reader, and close to the original
                    assert np.array_equal(mine, bits(getattr(ref.read(i), name)))
                    if orig.numel():
                        y = torch.from_numpy(mine.view(np.int16).copy()).view(torch.bfloat16).float()
                        assert (y - orig.float()).norm() / orig.float().norm() < 0.04
                else:
                    assert np.array_equal(mine, bits(orig))


def test_safetensors_parsing_agrees_with_the_library(store):
    """The hand-written safetensors parser (§4) sees the same tensors as the library."""
    from safetensors.torch import load as st_load

    write_shard(store, KEY, make_meta("fp8", "postnorm"), make_samples(True, True))
    ra = RandomAccessReader(lambda a, b: store.get_range(KEY, a, b), store.size(KEY))
    for e in ra.footer["records"]:
        payload = store.get_range(KEY, e["offset"] + FRAME_HEADER, e["offset"] + e["length"])
        mine, md = parse_safetensors(payload)
        lib = st_load(payload)
        assert set(mine) == set(lib) == {"input_ids", "loss_mask", "hidden_states.fp8.zst", "hidden_states.scale",
                                          "final_state.fp8.zst", "final_state.scale"}
        for k, v in lib.items():
            assert mine[k].tobytes() == v.contiguous().view(torch.uint8).numpy().tobytes()
        assert set(md) == {"sample_id", "num_tokens", "codec"} | {
            f"{n}.{k}" for n in ("hidden_states", "final_state") for k in ("shape", "sq_err", "sq_norm")}


def test_e4m3fn_table_matches_torch():
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    assert np.array_equal(np.isnan(codes), np.isnan(E4M3)) and np.isnan(E4M3).sum() == 2
    assert np.array_equal(codes[~np.isnan(codes)], E4M3[~np.isnan(E4M3)])
    assert E4M3[0x7E] == 448.0 and E4M3[0x01] == 2.0**-9


def test_bf16_rounding_matches_torch():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.randn(100_000, generator=g) * 10.0 ** torch.randint(-40, 38, (100_000,), generator=g),
                   torch.tensor([0.0, -0.0, 3.3e38, -3.3e38, 1e-45])])
    assert np.array_equal(f32_to_bf16_bits(x.numpy()), bits(x.to(torch.bfloat16)))


def test_empty_shard(store):
    info = write_shard(store, KEY, make_meta("bf16-zstd", "none"), [])
    parsed = read_front_to_back(Trickle(store.get(KEY)))
    assert parsed.records == [] and parsed.footer["records"] == [] and parsed.object_xxh3_128 == info.xxh3_128
    ra = RandomAccessReader(lambda a, b: store.get_range(KEY, a, b), store.size(KEY))
    assert len(ra) == 0 and ra.footer_offset == ra.records_start


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x10
    return bytes(b)


def test_doc_reader_detects_damage(store):
    write_shard(store, KEY, make_meta("bf16-zstd", "prenorm"), make_samples(True, False))
    data = store.get(KEY)
    good = read_front_to_back(io.BytesIO(data))
    e = good.footer["records"][3]
    foot = good.frames[-1][1]

    # a flag bit: no frame hash covers the preamble, only the content hash (and the object hash)
    bad = _flip(data, 12)
    with pytest.raises(FormatError, match="content hash"):
        read_front_to_back(io.BytesIO(bad))
    RandomAccessReader(lambda a, b: bad[a:b], len(bad))  # random access ignores flags (§9)
    store.put("flags.lts", bad)
    assert not verify_shard(store, "flags.lts").ok  # the reference agrees

    damaged = {
        "record payload": (e["offset"] + e["length"] - 7, "RECD payload hash"),
        "record hash field": (e["offset"] + 15, "RECD payload hash"),
        "record kind": (e["offset"] + 1, "unknown frame kind"),
        "footer payload": (foot + FRAME_HEADER + 5, "FOOT payload hash"),
        "trailer magic": (len(data) - 2, "trailer"),
        "trailer offset": (len(data) - 16, "trailer"),
    }
    for what, (pos, msg) in damaged.items():
        bad = _flip(data, pos)
        with pytest.raises(FormatError, match=msg):
            read_front_to_back(io.BytesIO(bad))
        with pytest.raises(FormatError):
            ra = RandomAccessReader(lambda a, b: bad[a:b], len(bad))
            ra.read(3)
            pytest.fail(f"{what}: random access did not notice")

    for cut in (10, 100, e["offset"] + 30, foot + 3, len(data) - 1):
        with pytest.raises(FormatError, match="truncated|trailer|too short"):
            read_front_to_back(io.BytesIO(data[:cut]))
        if cut >= 32:
            with pytest.raises(FormatError):
                RandomAccessReader(lambda a, b: data[:cut][a:b], cut)


def test_unknown_version_is_refused_by_both_readers(store):
    from layertap.storage.format import UnsupportedShardVersion

    write_shard(store, KEY, make_meta("bf16", "none"), make_samples(False, False)[:1])
    data = bytearray(store.get(KEY))
    struct.pack_into("<I", data, 8, 2)
    with pytest.raises(UnsupportedVersion):
        read_front_to_back(io.BytesIO(bytes(data)))
    with pytest.raises(UnsupportedVersion):
        RandomAccessReader(lambda a, b: bytes(data[a:b]), len(data))
    store.put("v2.lts", bytes(data))
    with pytest.raises(UnsupportedShardVersion, match="version 2"):
        ShardReader(store, "v2.lts")


# -- the worked example of §10 ----------------------------------------------------------------


def _doc_example() -> bytes:
    text = DOC.read_text()
    block = text.split("<!-- example-hexdump", 1)[1].split("```", 2)[1]
    out = bytearray()
    for line in block.splitlines():
        m = re.match(r"^([0-9a-f]{8})  ((?:[0-9a-f]{2} ?)+?)\s+\|", line)
        if m:
            assert int(m.group(1), 16) == len(out), line
            out += bytes.fromhex(m.group(2))
    return bytes(out)


def test_worked_example_in_the_doc_is_a_valid_shard(store):
    text = DOC.read_text()
    data = _doc_example()
    assert len(data) == 1022
    assert data[:16].hex(" ") == "4c 54 53 48 41 52 44 00 01 00 00 00 00 00 00 00"
    assert data[:16].hex(" ") in text

    parsed = read_front_to_back(io.BytesIO(data))
    # the hashes the doc states are the ones of the bytes it shows
    assert f"`{parsed.content_xxh3_128}`" in text and f"`{parsed.object_xxh3_128}`" in text
    assert parsed.frames[-1][1] == 762 and parsed.footer["records"][0]["offset"] == 396
    assert parsed.head["layers"] == [1, 15] and parsed.head["codec"] == "bf16"
    (rec,) = parsed.records
    assert rec.sample_id == "s0" and rec.input_ids.tolist() == [1, 2] and rec.loss_mask.tolist() == [0, 1]
    values = torch.from_numpy(rec.hidden_states.view(np.int16).copy()).view(torch.bfloat16).float()
    assert values.tolist() == [[[1, -2, 0.5, 0], [3, 0.25, -1, 1.5]], [[2, 4, 8, -0.125], [0, 1, 2, 3]]]

    # and the reference implementation accepts it too
    store.put("example.lts", data)
    report = verify_shard(store, "example.lts", expected_xxh3_128=parsed.object_xxh3_128, decode=True)
    assert report.ok, report.error
    ref = ShardReader(store, "example.lts").read(0)
    assert np.array_equal(bits(ref.hidden_states), rec.hidden_states)


def test_hash_test_vectors_in_the_doc():
    text = DOC.read_text()
    assert xxhash.xxh3_64_hexdigest(b"") in text and xxhash.xxh3_128_hexdigest(b"") in text
    # canonical 128-bit form: high 64 bits first
    h = xxhash.xxh3_128_intdigest(b"layertap")
    assert xxhash.xxh3_128_hexdigest(b"layertap") == f"{h >> 64:016x}{h & (2**64 - 1):016x}"
