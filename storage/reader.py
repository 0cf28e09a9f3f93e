"""Reading a shard: random access through the footer (`ShardReader`), a front-to-back parse as the
bytes arrive (`iter_frames`), and `verify_shard`, which re-reads and checks every hash."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import xxhash

from layertap.storage.format import (FOOT, FRAME, HEAD, PREAMBLE, RECD, TRAILER, TRAILER_MAGIC, RecordEntry, ShardError,
                            ShardMeta, UnsupportedShard, check_preamble, parse_footer, parse_frame,
                            parse_head)
from layertap.storage.records import Sample, decode_record, record_metadata
from layertap.storage.store import ObjectStore, StoreError


def record_payload(buf: bytes | memoryview, base: int, entry: RecordEntry, where: str) -> memoryview:
    """The payload of the RECD frame that `entry` indexes, as a view into `buf` (object bytes from
    offset `base` on), once its xxh3-64 equals both the frame header's and the index entry's."""
    pos = entry.offset - base
    if pos < 0 or len(buf) - pos < max(entry.length, FRAME.size):
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


def check_index(entries: list[RecordEntry], footer: dict, records_start: int, footer_offset: int, where: str) -> None:
    """The footer index describes the records as the format lays them out: back to back from the
    end of the HEAD frame to the footer, each sample once, its counts the footer's totals. Reading
    through the index alone, a writer's index that dropped or repeated an entry served the
    samples it lists and silently lost the rest; a commit record made from the same list agrees
    with it, so nothing downstream would notice."""
    pos, seen = records_start, set()
    for i, e in enumerate(entries):
        if e.offset != pos:
            raise ShardError(f"{where}: footer index entry {i} ({e.sample_id}) starts at byte {e.offset}, where "
                             f"byte {pos} was expected (records lie back to back); the shard is corrupt")
        if e.length < FRAME.size:
            raise ShardError(f"{where}: footer index entry {i} ({e.sample_id}) is {e.length} bytes long, shorter than a "
                             f"frame's {FRAME.size}-byte header; the shard is corrupt")
        if e.sample_id in seen:
            raise ShardError(f"{where}: footer index entry {i} repeats sample {e.sample_id!r}; the shard is corrupt")
        seen.add(e.sample_id)
        pos += e.length
    if pos != footer_offset:
        raise ShardError(f"{where}: the footer index's {len(entries)} records end at byte {pos}, the footer starts at "
                         f"byte {footer_offset}: records are missing from the index; the shard is corrupt")
    tokens = sum(e.num_tokens for e in entries)
    if footer.get("num_records") != len(entries) or footer.get("num_tokens") != tokens:
        raise ShardError(f"{where}: the footer's totals ({footer.get('num_records')} records, "
                         f"{footer.get('num_tokens')} tokens) are not its index's ({len(entries)}, {tokens}); "
                         "the shard is corrupt")


def check_sample(sample: Sample, sample_id: str, num_tokens: int, where: str) -> Sample:
    """`sample`, decoded from a record, once it is the one its index entry names, at its length."""
    if sample.sample_id != sample_id:
        raise ShardError(f"{where}: holds sample {sample.sample_id!r}, the index says {sample_id!r}")
    if sample.num_tokens != num_tokens:
        raise ShardError(f"{where}: holds {sample.num_tokens} tokens, the index says {num_tokens}")
    return sample


def decode_named(payload: memoryview | bytes, meta: ShardMeta, where: str) -> Sample:
    """`decode_record`, its errors naming the object and record they are about."""
    try:
        return decode_record(payload, meta)
    except ShardError as e:
        if type(e) is not ShardError:  # UnsupportedShard: its type tells the caller more than a name
            raise
        raise ShardError(f"{where}: {e}") from None


def read_record(store: ObjectStore, key: str, where: str, meta: ShardMeta, index: int, e: RecordEntry,
                buf: bytes | memoryview | None = None, base: int = 0) -> Sample:
    """Record `index` of the shard `key` (`where`: its location, for errors), whose index entry is
    `e`: one ranged GET (none when `buf`, the object's bytes from offset `base` on, holds it), its
    hashes checked, decoded, and checked to be the sample `e` names."""
    where = f"{where} record {index} ({e.sample_id})"
    if buf is None:
        buf, base = store.get_range(key, e.offset, e.offset + e.length), e.offset
    return check_sample(decode_named(record_payload(buf, base, e, where), meta, where), e.sample_id,
                        e.num_tokens, where)


def adjacent_runs(entries: Sequence[RecordEntry], limit: int) -> Iterator[tuple[int, int]]:
    """[i, j) spans of `entries` (in the order given) that lie back to back in their object, each
    within `limit` bytes (a larger entry alone): one ranged GET reads each span."""
    i = 0
    while i < len(entries):
        base, j = entries[i].offset, i + 1
        while (j < len(entries) and entries[j].offset == entries[j - 1].offset + entries[j - 1].length
               and entries[j].offset + entries[j].length - base <= limit):
            j += 1
        yield i, j
        i = j


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
        check_preamble(head, self.where)
        n = FRAME.unpack_from(head, PREAMBLE.size)[1] if len(head) >= PREAMBLE.size + FRAME.size else 0
        if PREAMBLE.size + FRAME.size + n > self.size:  # a corrupt length is not a size to fetch
            raise ShardError(f"{self.where}: the HEAD frame claims {n} bytes, past the object's end "
                             f"({self.size} bytes); the shard is truncated or corrupt")
        if len(head) < PREAMBLE.size + FRAME.size + n:
            head = store.get_range(key, 0, PREAMBLE.size + FRAME.size + n)
        kind, payload, self.records_start = parse_frame(head, PREAMBLE.size, self.where)
        if kind != HEAD:
            raise ShardError(f"{self.where}: first frame is {kind!r}, expected HEAD")
        self.meta = parse_head(payload, self.where)
        self.footer = self._read_footer()
        self.entries = [RecordEntry(**e) for e in self.footer["records"]]
        check_index(self.entries, self.footer, self.records_start, self.footer_offset, self.where)

    def _read_footer(self) -> dict:
        tail_start = max(0, self.size - self.TAIL_GUESS)
        tail = self.store.get_range(self.key, tail_start, self.size)
        if len(tail) != self.size - tail_start:  # `size` may be its commit record's: truncated since, or replaced
            raise ShardError(f"{self.where}: holds {tail_start + len(tail):,} bytes, not the {self.size:,} expected "
                             "(its commit record's size, or the size read before): the object is truncated or "
                             "was replaced")
        footer_offset, magic = TRAILER.unpack_from(tail, len(tail) - TRAILER.size)
        if magic != TRAILER_MAGIC or not (self.records_start <= footer_offset < self.size - TRAILER.size):
            raise ShardError(f"{self.where}: no valid trailer; the shard is truncated or corrupt")
        if footer_offset < tail_start:
            tail_start, tail = footer_offset, self.store.get_range(self.key, footer_offset, self.size)
        kind, payload, end = parse_frame(tail, footer_offset - tail_start, self.where)
        if kind != FOOT or end != len(tail) - TRAILER.size:
            raise ShardError(f"{self.where}: trailer does not point at the footer; the shard is corrupt")
        self.footer_offset = footer_offset
        return parse_footer(payload, self.where)

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
        return read_record(self.store, self.key, self.where, self.meta, index, self.entries[index])

    RUN_BYTES = 64 << 20  # `__iter__` reads adjacent records in GETs of up to this (one larger record alone)

    def __iter__(self) -> Iterator[Sample]:
        """Every record in order, adjacent ones fetched together (records lie back to back,
        `check_index`): a GET per RUN_BYTES, not one per record (export read a run's 900,000
        samples in as many GETs), with as much in memory."""
        for i, j in adjacent_runs(self.entries, self.RUN_BYTES):
            base, last = self.entries[i].offset, self.entries[j - 1]
            buf = self.store.get_range(self.key, base, last.offset + last.length)
            for k in range(i, j):
                yield read_record(self.store, self.key, self.where, self.meta, k, self.entries[k], buf, base)


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
    sample_ids: tuple[str, ...] = ()  # in the footer index's order, when the shard verified


def iter_frames(stream: BinaryIO, where: str, verify: bool = True,
                content_hash=None, size: int | None = None) -> Iterator[tuple[bytes, int, bytes]]:
    """Parse a shard front to back without its footer, as bytes arrive: (kind, offset, payload).

    Raises ShardError on a bad hash or a truncated object (the stream ends before the footer).
    `content_hash`, an xxh3 hasher, is fed every byte before the footer frame. `size`, the
    object's, when known: a frame longer than what is left of it is refused before it is read,
    so a flipped bit in a length is a corrupt shard, not a read of terabytes.
    """
    feed = content_hash.update if content_hash is not None else (lambda b: None)
    pre = stream.read(PREAMBLE.size)
    check_preamble(pre, where)
    feed(pre)
    pos = PREAMBLE.size
    while True:
        head = stream.read(FRAME.size)
        if len(head) < FRAME.size:
            raise ShardError(f"{where}: truncated at byte {pos + len(head)} before the footer")
        kind, n, digest = FRAME.unpack(head)
        if kind not in (HEAD, RECD, FOOT):
            raise ShardError(f"{where}: unknown frame kind {kind!r} at byte {pos}; the object is corrupt")
        if size is not None and n > size - pos - FRAME.size:
            raise ShardError(f"{where}: the {kind.decode()} frame at byte {pos} claims {n} bytes, past the "
                             f"object's end ({size} bytes); the object is truncated or corrupt")
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
                 decode: bool = False, check_head: Callable[[ShardMeta], None] | None = None) -> VerifyReport:
    """Re-read the whole object and check every hash: each frame, the footer's content hash, the
    trailer, the whole-object hash (against `expected_xxh3_128`, e.g. from a commit record) and,
    with `decode`, that every record decodes. A report of "bad" gets the shard withdrawn and
    deleted, so it is made only for a malformed object: one of a newer format version or codec
    raises `UnsupportedShard` (if its hash matches), a failing store its `StoreError`, a lack of
    memory its MemoryError. `check_head` sees the HEAD (its frame hash checked) before any record
    is decoded, and raises what refuses it: the codecs allocate the shapes a HEAD declares."""
    where = f"{store.uri.rstrip('/')}/{key}"
    whole, content = xxhash.xxh3_128(), xxhash.xxh3_128()
    records = size = 0
    try:
        size = store.size(key)
        with store.open_stream(key, size=size) as raw:  # one HEAD a shard, not two
            stream = _HashingStream(raw, whole)
            meta, footer, footer_offset = None, None, -1
            found: list[dict] = []
            for kind, pos, payload in iter_frames(stream, where, content_hash=content, size=size):
                if kind == HEAD:
                    if meta is not None or pos != PREAMBLE.size:
                        raise ShardError(f"{where}: unexpected HEAD frame at byte {pos}; the object is corrupt")
                    meta = parse_head(memoryview(payload), where)
                    records_start = pos + FRAME.size + len(payload)
                    if check_head is not None:
                        check_head(meta)
                elif meta is None:
                    raise ShardError(f"{where}: the first frame is not HEAD; the object is corrupt")
                elif kind == RECD:
                    records += 1
                    try:
                        md = record_metadata(payload)
                    except ShardError as e:
                        raise ShardError(f"{where} record {records - 1} (at byte {pos}): {e}") from None
                    found.append({"sample_id": md.get("sample_id"), "offset": pos, "length": FRAME.size + len(payload),
                                  "num_tokens": int(md.get("num_tokens", -1)),
                                  "xxh3_64": f"{xxhash.xxh3_64_intdigest(payload):016x}"})
                    if decode:
                        decode_named(payload, meta, f"{where} record {records - 1} ({md.get('sample_id')})")
                else:
                    footer, footer_offset = parse_footer(payload, where), pos
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
            check_index([RecordEntry(**r) for r in found], footer, records_start, footer_offset, where)
        digest = whole.hexdigest()
        if expected_xxh3_128 is not None and digest != expected_xxh3_128:
            raise ShardError(f"{where}: object hash {digest} differs from the committed {expected_xxh3_128}")
        return VerifyReport(key, True, records, footer["num_tokens"], size, digest, meta=meta,
                            sample_ids=tuple(r["sample_id"] for r in found))
    except UnsupportedShard as e:
        # Newer than this reader, or a corrupted version or codec field: the object's hash tells.
        if expected_xxh3_128 is None or object_xxh3_128(store, key) == expected_xxh3_128:
            raise
        return VerifyReport(key, False, records, 0, size, "", f"{e}; but the object's hash differs from its "
                            "commit's: it is corrupt, not newer")
    except StoreError:
        raise  # the store failed (a bad key is also a ValueError), not the object
    except (ShardError, ValueError, KeyError) as e:
        msg = str(e) if isinstance(e, ShardError) else f"{where}: undecodable content ({type(e).__name__}: {e})"
        return VerifyReport(key, False, records, 0, size, whole.hexdigest(), msg)


def object_xxh3_128(store: ObjectStore, key: str) -> str:
    """The whole object's hash, as a commit records it: what tells a damaged version or codec field
    from a newer layertap's shard (`UnsupportedShard`)."""
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
