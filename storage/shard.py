"""The shard format: many samples' activations in one self-describing, checksummed object.

Layout (docs/FORMAT.md is the normative description)::

    preamble   16 B   magic "LTSHARD\\0", u32 format version, u32 flags (0)
    frame      HEAD   JSON: run, shard, model, layers and their convention, codec, ...
    frame*     RECD   one sample: a safetensors blob (codec-encoded tensors + string metadata)
    frame      FOOT   JSON: index of records (offset, length, hash, sample id, tokens), totals,
                      the xxh3-128 of every byte before this frame
    trailer    16 B   u64 offset of the FOOT frame, magic "LTSEND\\0\\0"

Every frame is `kind (4 B) | payload length (u64) | xxh3-64 of payload (u64) | payload`, all
little-endian. The frames make the object parseable front to back while it is still being
uploaded; the trailer and footer give random access to any record with one ranged GET.
"""

from __future__ import annotations

import json
import math
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, BinaryIO, Literal

import numpy as np
import torch
import xxhash

from storage.codecs import CODEC_NAMES, get_codec
from storage.store import ObjectStore, ObjectWriter

FORMAT_NAME = "layertap-shard"
FORMAT_VERSION = 1
MAGIC = b"LTSHARD\x00"
TRAILER_MAGIC = b"LTSEND\x00\x00"
PREAMBLE = struct.Struct("<8sII")
FRAME = struct.Struct("<4sQQ")
TRAILER = struct.Struct("<Q8s")
HEAD, RECD, FOOT = b"HEAD", b"RECD", b"FOOT"
LAYER_CONVENTION = "decoder_output"  # layer k = output of decoder layer k = HF hidden_states[k + 1]
FINAL_STATES = ("none", "prenorm", "postnorm")


class ShardError(Exception):
    """A shard is corrupt, truncated or not understood; the message names the object."""


class UnsupportedShard(ShardError):
    """Written by a layertap this one does not understand (a newer format version or codec): not
    corrupt, so never withdrawn or skipped as if it were; upgrade layertap to read it."""


class UnsupportedShardVersion(UnsupportedShard):
    pass


@dataclass(kw_only=True)
class ShardMeta:
    """What a reader needs to interpret the records, written once in the HEAD frame."""

    run_id: str
    shard_id: int
    model: str
    model_revision: str | None = None
    layers: list[int]
    layer_convention: str = LAYER_CONVENTION
    final_state: Literal["none", "prenorm", "postnorm"] = "none"
    hidden_size: int
    dtype: str = "bfloat16"
    codec: str
    tokenizer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_codec(self.codec)  # unknown codec -> ValueError naming it
        if not self.layers or any(not isinstance(k, int) or k < 0 for k in self.layers):
            raise ValueError(f"layers must be a non-empty list of non-negative ints, got {self.layers!r}")
        if self.final_state not in FINAL_STATES:
            raise ValueError(f"final_state must be one of {FINAL_STATES}, got {self.final_state!r}")
        if self.hidden_size <= 0:
            raise ValueError(f"hidden_size must be positive, got {self.hidden_size}")
        if self.dtype != "bfloat16":
            raise ValueError(f"only bfloat16 activations are supported, got {self.dtype!r}")

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShardMeta:
        fields = {k: v for k, v in obj.items() if k not in ("format", "format_version", "created_at")}
        return cls(**fields)


@dataclass(slots=True)
class Sample:
    """One sample's tokens and activations, unpadded."""

    sample_id: str
    input_ids: torch.Tensor  # int [S]
    loss_mask: torch.Tensor  # 0/1 [S]
    hidden_states: torch.Tensor  # bf16 [S, len(layers), hidden]
    final_state: torch.Tensor | None = None  # bf16 [S, hidden]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class EncodedRecord:
    """A sample turned into its RECD payload, ready to append (encoding runs in worker threads).

    The payload is kept as the list of buffers that make it up (safetensors header, then each
    tensor's bytes), hashed where it was built: appending it copies nothing and hashes nothing.
    """

    sample_id: str
    num_tokens: int
    parts: tuple[bytes | memoryview, ...]
    size: int
    xxh3_64: int
    raw_bytes: int  # activation bytes before the codec
    sq_err: float = 0.0  # codec reconstruction error, summed (lossy codecs)
    sq_norm: float = 0.0

    @property
    def payload(self) -> bytes:
        return b"".join(self.parts)


@dataclass(frozen=True, slots=True)
class RecordEntry:
    """One line of the footer index."""

    sample_id: str
    offset: int  # of the frame, from the start of the object
    length: int  # of the whole frame
    num_tokens: int
    xxh3_64: str


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What the writer reports once the object is complete: the facts a commit record needs."""

    key: str
    bytes: int
    xxh3_128: str  # of the whole object
    num_records: int
    num_tokens: int
    raw_bytes: int
    sample_ids: list[str]
    relative_error: float | None


def _frame(kind: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(payload), xxhash.xxh3_64_intdigest(payload))


_ST_DTYPES = {torch.uint8: "U8", torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16",
              torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
_ST_TORCH = {code: dtype for dtype, code in _ST_DTYPES.items()}


def _safetensors_parts(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> list[bytes | memoryview]:
    """A safetensors blob as [header, tensor bytes...], without copying the tensors.

    Byte-compatible with `safetensors.torch.save` readers: a u64 header length, the JSON header
    (offsets of contiguous tensors, no holes) padded with spaces to 8 bytes, then the data.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    parts: list[bytes | memoryview] = [b""]
    offset = 0
    for name, t in tensors.items():
        t = t.contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        parts.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    parts[0] = struct.pack("<Q", len(head)) + head
    return parts


def encode_record(sample: Sample, meta: ShardMeta) -> EncodedRecord:
    """Validate a sample against the shard's metadata and encode it with the shard's codec."""
    sid = sample.sample_id
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"sample_id must be a non-empty string, got {sid!r}")
    s = sample.input_ids.shape[0] if sample.input_ids.dim() == 1 else -1
    if s < 0:
        raise ValueError(f"sample {sid}: input_ids must be 1-D, got shape {tuple(sample.input_ids.shape)}")
    if tuple(sample.loss_mask.shape) != (s,):
        raise ValueError(f"sample {sid}: loss_mask shape {tuple(sample.loss_mask.shape)} != ({s},)")
    want = (s, len(meta.layers), meta.hidden_size)
    if tuple(sample.hidden_states.shape) != want:
        raise ValueError(f"sample {sid}: hidden_states shape {tuple(sample.hidden_states.shape)} != {want}")
    has_final = sample.final_state is not None
    if has_final != (meta.final_state != "none"):
        raise ValueError(f"sample {sid}: final_state is {'present' if has_final else 'missing'} "
                         f"but the shard says final_state={meta.final_state!r}")
    if has_final and tuple(sample.final_state.shape) != (s, meta.hidden_size):
        raise ValueError(f"sample {sid}: final_state shape {tuple(sample.final_state.shape)} != {(s, meta.hidden_size)}")
    ids = sample.input_ids
    if s and (int(ids.min()) < 0 or int(ids.max()) >= 2**31):
        raise ValueError(f"sample {sid}: token ids must lie in [0, 2^31)")

    codec = get_codec(meta.codec)
    tensors: dict[str, torch.Tensor] = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "loss_mask": sample.loss_mask.to(torch.uint8).contiguous(),
    }
    md = {"sample_id": sid, "num_tokens": str(s), "codec": meta.codec}
    raw, sq_err, sq_norm = 0, 0.0, 0.0
    for name in ("hidden_states", "final_state"):
        x = getattr(sample, name)
        if x is None:
            continue
        enc, enc_meta = codec.encode(x.contiguous())
        raw += x.numel() * x.element_size()
        tensors.update({f"{name}.{k}": v for k, v in enc.items()})
        md.update({f"{name}.{k}": v for k, v in enc_meta.items()})
        sq_err += float(enc_meta.get("sq_err", 0.0))
        sq_norm += float(enc_meta.get("sq_norm", 0.0))
    parts = _safetensors_parts(tensors, md)
    h = xxhash.xxh3_64()
    for p in parts:
        h.update(p)
    return EncodedRecord(sid, s, tuple(parts), sum(len(p) for p in parts), h.intdigest(), raw, sq_err, sq_norm)


def decode_record(payload: bytes | memoryview, meta: ShardMeta) -> Sample:
    """The inverse of `encode_record` (payload hash already checked by the caller).

    Reads the payload in place: the codecs decompress and reassemble straight from it into the
    output tensors, which share no memory with it (the payload can be freed once this returns).
    """
    md: dict[str, str] = {}
    try:
        md, tensors = _read_safetensors(payload)
        codec = get_codec(md.get("codec", meta.codec))
        decoded = {}
        for name in ("hidden_states", "final_state"):
            parts = {k[len(name) + 1 :]: v for k, v in tensors.items() if k.startswith(name + ".")}
            if parts:
                sub_meta = {k[len(name) + 1 :]: v for k, v in md.items() if k.startswith(name + ".")}
                decoded[name] = codec.decode(parts, sub_meta)
        ids, mask = tensors.get("input_ids"), tensors.get("loss_mask")
        if isinstance(mask, np.ndarray):  # a view into the payload: the sample gets its own copy
            mask = torch.from_numpy(mask.copy())
        if isinstance(ids, np.ndarray):
            ids = torch.from_numpy(ids.copy())
    except Exception as e:  # safetensors, zstd and codec errors all mean the same: bad record
        raise ShardError(f"record does not decode: {type(e).__name__}: {e}") from None
    if "hidden_states" not in decoded or ids is None or mask is None:
        raise ShardError(f"record {md.get('sample_id')!r} lacks input_ids, loss_mask or hidden_states")
    return Sample(
        sample_id=md["sample_id"],
        input_ids=ids.to(torch.int64),
        loss_mask=mask,
        hidden_states=decoded["hidden_states"],
        final_state=decoded.get("final_state"),
    )


_ST_ITEMSIZE = {"U8": 1, "I32": 4, "I64": 8, "BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1}


def _read_safetensors(payload: bytes | memoryview) -> tuple[dict[str, str], dict[str, np.ndarray | torch.Tensor]]:
    """(metadata, tensors) of a safetensors blob, checked as strictly as the library checks it.

    Nothing large is copied: U8 tensors (the codecs' byte planes and zstd frames) come back as
    read-only numpy views into `payload`. The others (small ones, or raw bf16 that the caller would
    copy anyway) are copied into torch tensors: in a shard they are unaligned. ValueError if the
    blob is malformed.
    """
    buf = memoryview(payload)
    if len(buf) < 8:
        raise ValueError(f"a safetensors blob needs at least 8 bytes, got {len(buf)}")
    (n,) = struct.unpack_from("<Q", buf, 0)
    if n > len(buf) - 8:
        raise ValueError(f"header length {n} exceeds the {len(buf)}-byte blob")
    header = json.loads(bytes(buf[8 : 8 + n]))
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a JSON object")
    md = header.pop("__metadata__", None) or {}
    if not isinstance(md, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise ValueError("__metadata__ must map strings to strings")
    data = buf[8 + n :]
    tensors: dict[str, np.ndarray | torch.Tensor] = {}
    spans = []
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"tensor {name!r}: malformed header entry {info!r}") from None
        if dtype not in _ST_ITEMSIZE:
            raise ValueError(f"tensor {name!r}: unsupported dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: bad shape {shape!r}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= len(data)):
            raise ValueError(f"tensor {name!r}: data_offsets {[begin, end]} outside the {len(data)}-byte data")
        if end - begin != math.prod(shape) * _ST_ITEMSIZE[dtype]:
            raise ValueError(f"tensor {name!r}: {end - begin} bytes cannot hold {dtype} {shape}")
        spans.append((begin, end))
        view = data[begin:end]
        if dtype == "U8":
            tensors[name] = np.frombuffer(view, dtype=np.uint8).reshape(shape)
        elif begin == end:
            tensors[name] = torch.empty(shape, dtype=_ST_TORCH[dtype])
        else:
            tensors[name] = torch.frombuffer(bytearray(view), dtype=_ST_TORCH[dtype]).reshape(shape)
    pos = 0
    for begin, end in sorted(spans):
        if begin != pos:
            raise ValueError(f"tensor data overlaps or leaves a hole at byte {pos} of the data section")
        pos = end
    if pos != len(data):
        raise ValueError(f"the tensors cover {pos} of the {len(data)} data bytes")
    return md, tensors


def _safetensors_metadata(payload: bytes | memoryview) -> dict[str, str]:
    (n,) = struct.unpack_from("<Q", payload, 0)
    return json.loads(bytes(payload[8 : 8 + n])).get("__metadata__", {})


class ShardWriter:
    """Streams a shard into an `ObjectWriter`: records go out as they are appended.

    Use as a context manager; an exception inside the block aborts the object so nothing
    half-written becomes visible.
    """

    def __init__(self, writer: ObjectWriter, meta: ShardMeta):
        self.meta = meta
        self._out = writer
        self._hash = xxhash.xxh3_128()
        self._offset = 0
        self._entries: list[RecordEntry] = []
        self._ids: set[str] = set()
        self._tokens = self._raw = 0
        self._sq_err = self._sq_norm = 0.0
        header = dict(meta.to_json(), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        head = json.dumps(header, sort_keys=True).encode()
        self._emit(PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0))
        self._emit(_frame(HEAD, head), head)

    def _emit(self, *chunks: bytes) -> None:
        for c in chunks:
            self._hash.update(c)
            self._out.write(c)
            self._offset += len(c)

    @property
    def bytes_written(self) -> int:
        return self._offset

    @property
    def num_records(self) -> int:
        return len(self._entries)

    def add(self, sample: Sample) -> RecordEntry:
        return self.append(encode_record(sample, self.meta))

    def append(self, rec: EncodedRecord) -> RecordEntry:
        if rec.sample_id in self._ids:
            raise ValueError(f"sample {rec.sample_id!r} is already in shard {self.meta.shard_id}")
        header = FRAME.pack(RECD, rec.size, rec.xxh3_64)
        entry = RecordEntry(rec.sample_id, self._offset, FRAME.size + rec.size, rec.num_tokens, f"{rec.xxh3_64:016x}")
        self._emit(header, *rec.parts)
        self._entries.append(entry)
        self._ids.add(rec.sample_id)
        self._tokens += rec.num_tokens
        self._raw += rec.raw_bytes
        self._sq_err += rec.sq_err
        self._sq_norm += rec.sq_norm
        return entry

    def close(self) -> ShardInfo:
        footer_offset = self._offset
        rel_err = (self._sq_err / self._sq_norm) ** 0.5 if self._sq_norm > 0 else (None if not self._lossy() else 0.0)
        footer = {
            "num_records": len(self._entries),
            "num_tokens": self._tokens,
            "raw_bytes": self._raw,
            "records": [asdict(e) for e in self._entries],
            "content_xxh3_128": self._hash.hexdigest(),
            "relative_error": rel_err,
        }
        body = json.dumps(footer, separators=(",", ":")).encode()
        self._emit(_frame(FOOT, body), body, TRAILER.pack(footer_offset, TRAILER_MAGIC))
        self._out.close()
        return ShardInfo(
            key=self._out.key, bytes=self._offset, xxh3_128=self._hash.hexdigest(),
            num_records=len(self._entries), num_tokens=self._tokens, raw_bytes=self._raw,
            sample_ids=[e.sample_id for e in self._entries], relative_error=rel_err,
        )

    def _lossy(self) -> bool:
        return not get_codec(self.meta.codec).lossless

    def abort(self) -> None:
        self._out.abort()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def write_shard(store: ObjectStore, key: str, meta: ShardMeta, samples: Sequence[Sample]) -> ShardInfo:
    """Convenience: write a whole shard from samples already in memory."""
    with ShardWriter(store.open_writer(key), meta) as w:
        for s in samples:
            w.add(s)
        return w.close()


# -- reading ----------------------------------------------------------------------------------


def parse_frame(buf: bytes | memoryview, pos: int, where: str, verify: bool = True) -> tuple[bytes, memoryview, int]:
    """(kind, payload, next position) of the frame at `pos` of `buf`, hash checked."""
    if len(buf) - pos < FRAME.size:
        raise ShardError(f"{where}: truncated frame header at byte {pos}")
    kind, n, digest = FRAME.unpack_from(buf, pos)
    start = pos + FRAME.size
    if kind not in (HEAD, RECD, FOOT):
        raise ShardError(f"{where}: unknown frame kind {kind!r} at byte {pos}; the object is corrupt")
    if len(buf) - start < n:
        raise ShardError(f"{where}: truncated {kind.decode()} frame at byte {pos} "
                         f"(needs {n} payload bytes, {len(buf) - start} present)")
    payload = memoryview(buf)[start : start + n]
    if verify and xxhash.xxh3_64_intdigest(payload) != digest:
        raise ShardError(f"{where}: checksum mismatch in {kind.decode()} frame at byte {pos}; the object is corrupt")
    return kind, payload, start + n


def _check_preamble(buf: bytes, where: str) -> None:
    if len(buf) < PREAMBLE.size:
        raise ShardError(f"{where}: too short to be a layertap shard ({len(buf)} bytes)")
    magic, version, _ = PREAMBLE.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ShardError(f"{where}: not a layertap shard (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise UnsupportedShardVersion(
            f"{where}: shard format version {version} is not supported by this layertap "
            f"(it reads version {FORMAT_VERSION}); upgrade layertap to read it"
        )


def _parse_head(payload: memoryview, where: str) -> ShardMeta:
    try:
        obj = json.loads(bytes(payload))
        if obj.get("format") != FORMAT_NAME:
            raise ShardError(f"{where}: header format is {obj.get('format')!r}, expected {FORMAT_NAME!r}")
        if obj.get("codec") not in CODEC_NAMES:
            raise UnsupportedShard(f"{where}: codec {obj.get('codec')!r} is not known to this layertap (it reads "
                                   f"{', '.join(CODEC_NAMES)}); upgrade layertap to read it")
        return ShardMeta.from_json(obj)
    except (ValueError, TypeError) as e:
        raise ShardError(f"{where}: unreadable shard header: {e}") from None


def record_payload(buf: bytes | memoryview, base: int, entry: RecordEntry, where: str) -> memoryview:
    """The payload of the RECD frame that `entry` indexes, as a view into `buf` (object bytes from
    offset `base` on), once its xxh3-64 equals both the frame header's and the index entry's."""
    pos = entry.offset - base
    if pos < 0 or len(buf) - pos < entry.length:
        raise ShardError(f"{where}: the frame at byte {entry.offset} lies outside the bytes read")
    kind, n, digest = FRAME.unpack_from(buf, pos)
    if kind != RECD or FRAME.size + n != entry.length:
        raise ShardError(f"{where}: the frame at byte {entry.offset} does not match the footer index; the shard is corrupt")
    payload = memoryview(buf)[pos + FRAME.size : pos + entry.length]
    actual = xxhash.xxh3_64(payload).intdigest()  # the hasher object releases the GIL; the one-shot call does not
    if actual != digest:
        raise ShardError(f"{where}: checksum mismatch in RECD frame at byte {entry.offset}; the object is corrupt")
    if f"{actual:016x}" != entry.xxh3_64:
        raise ShardError(f"{where}: the frame at byte {entry.offset} does not match the footer index; the shard is corrupt")
    return payload


class _InMemory:
    """A whole object held in memory, served as the store `ShardReader` reads it through."""

    def __init__(self, uri: str, data: bytes | memoryview):
        self.uri, self._view = uri, memoryview(data)

    def get_range(self, key: str, start: int, end: int) -> memoryview:
        return self._view[start:end]


class ShardReader:
    """Random access to one shard through its footer: a few small ranged GETs to open it, then one
    ranged GET per record (or per run of adjacent records)."""

    TAIL_GUESS = 256 << 10  # one GET usually brings trailer and footer together

    def __init__(self, store: ObjectStore, key: str, size: int | None = None):
        self.store, self.key = store, key
        self.where = f"{store.uri.rstrip('/')}/{key}"
        self.size = store.size(key) if size is None else size
        if self.size < PREAMBLE.size + TRAILER.size:
            raise ShardError(f"{self.where}: too short to be a layertap shard ({self.size} bytes)")
        head = store.get_range(key, 0, min(self.size, 64 << 10))
        _check_preamble(head, self.where)
        n = FRAME.unpack_from(head, PREAMBLE.size)[1] if len(head) >= PREAMBLE.size + FRAME.size else 0
        if len(head) < PREAMBLE.size + FRAME.size + n:
            head = store.get_range(key, 0, PREAMBLE.size + FRAME.size + n)
        kind, payload, self.records_start = parse_frame(head, PREAMBLE.size, self.where)
        if kind != HEAD:
            raise ShardError(f"{self.where}: first frame is {kind!r}, expected HEAD")
        self.meta = _parse_head(payload, self.where)
        self.footer = self._read_footer()
        self.entries = [RecordEntry(**e) for e in self.footer["records"]]

    def _read_footer(self) -> dict:
        tail_start = max(0, self.size - self.TAIL_GUESS)
        tail = self.store.get_range(self.key, tail_start, self.size)
        if len(tail) != self.size - tail_start:
            raise ShardError(f"{self.where}: object changed size while reading")
        footer_offset, magic = TRAILER.unpack_from(tail, len(tail) - TRAILER.size)
        if magic != TRAILER_MAGIC or not (self.records_start <= footer_offset < self.size - TRAILER.size):
            raise ShardError(f"{self.where}: no valid trailer; the shard is truncated or corrupt")
        if footer_offset < tail_start:
            tail_start, tail = footer_offset, self.store.get_range(self.key, footer_offset, self.size)
        kind, payload, end = parse_frame(tail, footer_offset - tail_start, self.where)
        if kind != FOOT or end != len(tail) - TRAILER.size:
            raise ShardError(f"{self.where}: trailer does not point at the footer; the shard is corrupt")
        self.footer_offset = footer_offset
        return json.loads(bytes(payload))

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def sample_ids(self) -> list[str]:
        return [e.sample_id for e in self.entries]

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, key: str, *, uri: str = "memory:") -> ShardReader:
        """A reader over a whole object already in memory (one GET): no further reads, and
        `read` decodes records in place. `uri` and `key` name the object in error messages."""
        return cls(_InMemory(uri, data), key, size=len(data))

    def read(self, index: int) -> Sample:
        e = self.entries[index]
        where = f"{self.where} record {index} ({e.sample_id})"
        buf = self.store.get_range(self.key, e.offset, e.offset + e.length)
        sample = decode_record(record_payload(buf, e.offset, e, where), self.meta)
        if sample.sample_id != e.sample_id:
            raise ShardError(f"{where}: holds sample {sample.sample_id!r}, the index says {e.sample_id!r}")
        return sample

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self.entries)):
            yield self.read(i)


@dataclass
class VerifyReport:
    key: str
    ok: bool
    num_records: int
    num_tokens: int
    bytes: int
    xxh3_128: str
    error: str | None = None
    meta: ShardMeta | None = None  # the HEAD metadata, when it could be read


def iter_frames(stream: BinaryIO, where: str, verify: bool = True,
                content_hash=None) -> Iterator[tuple[bytes, int, bytes]]:
    """Parse a shard front to back without its footer, as bytes arrive: (kind, offset, payload).

    Raises ShardError on a bad hash or a truncated object (the stream ends before the footer).
    `content_hash`, an xxh3 hasher, is fed every byte before the footer frame.
    """
    feed = content_hash.update if content_hash is not None else (lambda b: None)
    pre = stream.read(PREAMBLE.size)
    _check_preamble(pre, where)
    feed(pre)
    pos = PREAMBLE.size
    while True:
        head = stream.read(FRAME.size)
        if len(head) < FRAME.size:
            raise ShardError(f"{where}: truncated at byte {pos + len(head)} before the footer")
        kind, n, digest = FRAME.unpack(head)
        if kind not in (HEAD, RECD, FOOT):
            raise ShardError(f"{where}: unknown frame kind {kind!r} at byte {pos}; the object is corrupt")
        payload = stream.read(n)
        if len(payload) < n:
            raise ShardError(f"{where}: truncated inside the {kind.decode()} frame at byte {pos}")
        if verify and xxhash.xxh3_64_intdigest(payload) != digest:
            raise ShardError(f"{where}: checksum mismatch in {kind.decode()} frame at byte {pos}; the object is corrupt")
        if kind != FOOT:
            feed(head)
            feed(payload)
        yield kind, pos, payload
        pos += FRAME.size + n
        if kind == FOOT:
            return


def verify_shard(store: ObjectStore, key: str, expected_xxh3_128: str | None = None,
                 decode: bool = False) -> VerifyReport:
    """Re-read the whole object and check every hash: each frame, the footer's content hash, the
    trailer, the whole-object hash (against `expected_xxh3_128`, e.g. from a commit record) and,
    with `decode`, that every record decodes. Raises `UnsupportedShard` for an intact object of a
    newer format version or codec, which a report of "bad" would get withdrawn and deleted."""
    where = f"{store.uri.rstrip('/')}/{key}"
    whole, content = xxhash.xxh3_128(), xxhash.xxh3_128()
    records = size = 0
    try:
        size = store.size(key)
        with store.open_stream(key) as raw:
            stream = _HashingStream(raw, whole)
            meta, footer, footer_offset = None, None, -1
            found: list[dict] = []
            for kind, pos, payload in iter_frames(stream, where, content_hash=content):
                if kind == HEAD:
                    if meta is not None or pos != PREAMBLE.size:
                        raise ShardError(f"{where}: unexpected HEAD frame at byte {pos}; the object is corrupt")
                    meta = _parse_head(memoryview(payload), where)
                elif meta is None:
                    raise ShardError(f"{where}: the first frame is not HEAD; the object is corrupt")
                elif kind == RECD:
                    records += 1
                    md = _safetensors_metadata(payload)
                    found.append({"sample_id": md.get("sample_id"), "offset": pos, "length": FRAME.size + len(payload),
                                  "num_tokens": int(md.get("num_tokens", -1)),
                                  "xxh3_64": f"{xxhash.xxh3_64_intdigest(payload):016x}"})
                    if decode:
                        decode_record(payload, meta)
                else:
                    footer, footer_offset = json.loads(payload), pos
            if footer["content_xxh3_128"] != content.hexdigest():
                raise ShardError(f"{where}: content hash mismatch; the object is corrupt")
            trailer = stream.read(TRAILER.size)
            if len(trailer) != TRAILER.size or TRAILER.unpack(trailer) != (footer_offset, TRAILER_MAGIC):
                raise ShardError(f"{where}: bad or missing trailer; the shard is truncated or corrupt")
            if stream.read(1):
                raise ShardError(f"{where}: unexpected bytes after the trailer")
            if footer["num_records"] != records or footer["records"] != found:
                raise ShardError(f"{where}: the footer index does not match the records found "
                                 f"({footer['num_records']} listed, {records} found); the object is corrupt")
        digest = whole.hexdigest()
        if expected_xxh3_128 is not None and digest != expected_xxh3_128:
            raise ShardError(f"{where}: object hash {digest} differs from the committed {expected_xxh3_128}")
        return VerifyReport(key, True, records, footer["num_tokens"], size, digest, meta=meta)
    except UnsupportedShard as e:
        # Newer than this reader, or a corrupted version or codec field: the object's hash tells.
        if expected_xxh3_128 is None or _object_xxh3_128(store, key) == expected_xxh3_128:
            raise
        return VerifyReport(key, False, records, 0, size, "", f"{e}; but the object's hash differs from its "
                            "commit's: it is corrupt, not newer")
    except (ShardError, ValueError, KeyError) as e:
        msg = str(e) if isinstance(e, ShardError) else f"{where}: undecodable content ({type(e).__name__}: {e})"
        return VerifyReport(key, False, records, 0, size, whole.hexdigest(), msg)


def _object_xxh3_128(store: ObjectStore, key: str) -> str:
    h = xxhash.xxh3_128()
    with store.open_stream(key) as raw:
        while chunk := raw.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


class _HashingStream:
    def __init__(self, raw: BinaryIO, hasher):
        self._raw, self._h = raw, hasher

    def read(self, n: int = -1) -> bytes:
        b = self._raw.read(n)
        self._h.update(b)
        return b
