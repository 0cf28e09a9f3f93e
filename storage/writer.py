"""Writing a shard: records stream into an `ObjectWriter` as they come, the footer goes last."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import xxhash

from layertap.storage.codecs import get_codec
from layertap.storage.format import (FOOT, FORMAT_VERSION, FRAME, HEAD, MAGIC, PREAMBLE, RECD, TRAILER, TRAILER_MAGIC,
                            RecordEntry, ShardMeta, frame_header)
from layertap.storage.records import EncodedRecord, Sample, encode_record
from layertap.storage.store import ObjectStore, ObjectWriter


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


class ShardWriter:
    """Streams a shard into an `ObjectWriter`: records go out as they are appended.

    `write_sample` encodes on the calling thread; `append_encoded` takes a record already encoded
    elsewhere (the extractor's encode threads) and only writes it. Use as a context manager; an
    exception inside the block aborts the object so nothing half-written becomes visible.
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
        try:  # the caller's `with` has not begun: a header that fails (e.g. unencodable `extra`) aborts here
            header = dict(meta.to_json(), created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            head = json.dumps(header, sort_keys=True).encode()
            self._emit(PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0))
            self._emit(frame_header(HEAD, head), head)
        except BaseException:
            writer.abort()
            raise

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

    def write_sample(self, sample: Sample) -> RecordEntry:
        """Encode `sample` with the shard's codec and append it."""
        return self.append_encoded(encode_record(sample, self.meta))

    def append_encoded(self, rec: EncodedRecord) -> RecordEntry:
        """Append a record encoded by `encode_record` for this shard's metadata: no encoding, no copy."""
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
        if rel_err is not None and not math.isfinite(rel_err):  # another encoder's stats: the footer is strict JSON
            rel_err = None
        footer = {
            "num_records": len(self._entries),
            "num_tokens": self._tokens,
            "raw_bytes": self._raw,
            "records": [asdict(e) for e in self._entries],
            "content_xxh3_128": self._hash.hexdigest(),
            "relative_error": rel_err,
        }
        body = json.dumps(footer, separators=(",", ":")).encode()
        self._emit(frame_header(FOOT, body), body, TRAILER.pack(footer_offset, TRAILER_MAGIC))
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
            w.write_sample(s)
        return w.close()
