"""The shard format's framing: constants, the HEAD metadata, the footer index line, frame parsing.

Layout (docs/FORMAT.md is the normative description)::

    preamble   16 B   magic "LTSHARD\\0", u32 format version, u32 flags (0)
    frame      HEAD   JSON: run, shard, model, layers and their convention, codec, ...
    frame*     RECD   one sample: a safetensors blob (codec-encoded tensors + string metadata),
                      see storage/records.py
    frame      FOOT   JSON: index of records (offset, length, hash, sample id, tokens), totals,
                      the xxh3-128 of every byte before this frame
    trailer    16 B   u64 offset of the FOOT frame, magic "LTSEND\\0\\0"

Every frame is `kind (4 B) | payload length (u64) | xxh3-64 of payload (u64) | payload`, all
little-endian. The frames make the object parseable front to back while it is still being
uploaded; the trailer and footer give random access to any record with one ranged GET.
The writer is storage/writer.py, the readers and verify storage/reader.py.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import xxhash

from layertap.storage.codec_names import CODEC_NAMES
from layertap.storage.errors import UserError
from layertap.storage.identity import LAYER_CONVENTION, RunIdentity

FORMAT_NAME = "layertap-shard"
FORMAT_VERSION = 1
MAGIC = b"LTSHARD\x00"
TRAILER_MAGIC = b"LTSEND\x00\x00"
PREAMBLE = struct.Struct("<8sII")
FRAME = struct.Struct("<4sQQ")
TRAILER = struct.Struct("<Q8s")
HEAD, RECD, FOOT = b"HEAD", b"RECD", b"FOOT"


class ShardError(UserError):
    """A shard is corrupt, truncated or not understood; the message names the object."""


class UnsupportedShard(ShardError):
    """Written by a layertap this one does not understand (a newer format version or codec): not
    corrupt, so never withdrawn or skipped as if it were; upgrade layertap to read it."""


class UnsupportedShardVersion(UnsupportedShard):
    pass


@dataclass(frozen=True, kw_only=True)
class ShardMeta(RunIdentity):
    """What a reader needs to interpret the records, written once in the HEAD frame: the run's
    identity, under the same keys as in its manifest, plus the shard's own fields."""

    run_id: str
    shard_id: int
    hidden_size: int  # required here, unlike in a manifest
    dtype: str = "bfloat16"  # of the decoded activations (the manifest's `dtype` is the forward's)
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden_size is None:
            raise ValueError("hidden_size is required in a shard header")
        if self.dtype != "bfloat16":
            raise ValueError(f"only bfloat16 activations are supported, got {self.dtype!r}")

    @classmethod
    def of(cls, identity: RunIdentity, *, run_id: str, shard_id: int, extra: Mapping[str, Any]) -> ShardMeta:
        """The HEAD of one of a run's shards: the run's identity (a manifest's `RunConfig` keeps
        only these facts), the shard's ids and the writer's `extra`."""
        facts = {f.name: getattr(identity, f.name) for f in fields(RunIdentity)}
        return cls(run_id=run_id, shard_id=shard_id, extra=dict(extra), **facts)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShardMeta:
        fields = {k: v for k, v in obj.items() if k not in ("format", "format_version", "created_at")}
        return cls(**fields)


@dataclass(frozen=True, slots=True)
class RecordEntry:
    """One line of the footer index."""

    sample_id: str
    offset: int  # of the frame, from the start of the object
    length: int  # of the whole frame
    num_tokens: int
    xxh3_64: str


_FOOTER_FIELDS = {"num_records": int, "num_tokens": int, "raw_bytes": int, "records": list, "content_xxh3_128": str}
_ENTRY_FIELDS = {"sample_id": str, "offset": int, "length": int, "num_tokens": int, "xxh3_64": str}


def parse_footer(payload: bytes | memoryview, where: str) -> dict[str, Any]:
    """The footer of a FOOT payload, its fields of the types FORMAT.md gives (a footer of valid
    hashes and another shape was a TypeError out of `verify` and `inspect`)."""
    try:
        footer = json.loads(bytes(payload))
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested thousands deep
        raise ShardError(f"{where}: unreadable footer: {e}") from None

    def fits(obj: Any, want: dict[str, type]) -> bool:
        return isinstance(obj, dict) and all(type(obj.get(k)) is t for k, t in want.items())

    if not fits(footer, _FOOTER_FIELDS) or not all(fits(e, _ENTRY_FIELDS) and len(e) == len(_ENTRY_FIELDS)
                                                   for e in footer["records"]):
        raise ShardError(f"{where}: the footer is not the index FORMAT.md describes ({', '.join(_FOOTER_FIELDS)}; "
                         f"records of {', '.join(_ENTRY_FIELDS)}); the shard is corrupt")
    if type(footer.get("relative_error")) not in (type(None), int, float):
        raise ShardError(f"{where}: the footer's relative_error is {footer['relative_error']!r:.80}, not a number or "
                         "null; the shard is corrupt")
    return footer


def frame_header(kind: bytes, payload: bytes) -> bytes:
    """The 20-byte header of a frame holding `payload`."""
    return FRAME.pack(kind, len(payload), xxhash.xxh3_64_intdigest(payload))


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


def check_preamble(buf: bytes | memoryview, where: str) -> None:
    """ShardError unless `buf` starts with a layertap preamble of the version this code reads."""
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


def parse_head(payload: bytes | memoryview, where: str) -> ShardMeta:
    """The metadata of a HEAD payload; `UnsupportedShard` for a codec this layertap lacks."""
    try:
        obj = json.loads(bytes(payload))
        if not isinstance(obj, dict) or not isinstance(obj.get("extra", {}), dict):
            raise ShardError(f"{where}: the shard header is not a JSON object with an object 'extra'; the shard is "
                             "corrupt")
        if obj.get("format") != FORMAT_NAME:
            raise ShardError(f"{where}: header format is {obj.get('format')!r}, expected {FORMAT_NAME!r}")
        if obj.get("codec") not in CODEC_NAMES:
            raise UnsupportedShard(f"{where}: codec {obj.get('codec')!r} is not known to this layertap (it reads "
                                   f"{', '.join(CODEC_NAMES)}); upgrade layertap to read it")
        # FORMAT.md's invariants of the HEAD: a shard whose HEAD says otherwise was not written as specified
        if (v := obj.get("format_version", FORMAT_VERSION)) != FORMAT_VERSION or type(v) is not int:  # not true
            raise ShardError(f"{where}: header format_version {obj.get('format_version')!r:.40} is not the preamble's "
                             f"{FORMAT_VERSION}; the shard is corrupt")
        if obj.get("layer_convention", LAYER_CONVENTION) != LAYER_CONVENTION:
            raise ShardError(f"{where}: header layer_convention {obj.get('layer_convention')!r:.40} is not "
                             f"{LAYER_CONVENTION!r}, the format's only one; the shard is corrupt")
        return ShardMeta.from_json(obj)
    except (ValueError, TypeError, RecursionError) as e:
        raise ShardError(f"{where}: unreadable shard header: {e}") from None
