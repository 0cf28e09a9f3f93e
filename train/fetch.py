"""Ranged GETs straight into RAM under a byte budget, every record verified before it is handed on.

One `Fetcher` serves one consumer (the stream in-process, or one DataLoader worker). A scheduler
thread walks the consumer's records in ascending input order, shard by shard: it opens shards
ahead (footer index through `ShardReader`: two small GETs), coalesces adjacent records into ranges
of up to `range_bytes`, reserves each range's bytes from the budget, and hands the GET to a thread
pool. A shard no larger than one range that the consumer needs at least half of is fetched whole
in one GET instead (no separate footer reads, and its whole-object hash is checked against the
commit too). Every record's frame hash is checked, and must equal the footer index entry, before
the record is made available; nothing is written anywhere but memory.

Records are not copied out of the bytes a GET brought: each is a view into them, decoded in place.
A range's bytes therefore stay in memory, and counted, until the last of its records is released;
its buffer then goes back to a pool for later GETs (`train.buffers`: a fresh large buffer costs
page faults). The budget counts bytes fetched and not yet released (ranges in flight, ranges
holding verified records that wait for their turn or sit in the shuffle buffer); idle pooled
buffers are kept only within what the budget leaves. A range waits for budget unless
the consumer is blocked on a record only that range can bring (then it goes ahead, so a shuffle
buffer larger than the budget cannot deadlock): buffered bytes stay within the budget plus one
range whenever the ranges holding the shuffle buffer's records fit in the budget.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from layertap.manifests.manifest import header_mismatch
from layertap.storage.format import ShardError, ShardMeta, UnsupportedShard

from layertap.storage.reader import ShardReader, adjacent_runs, record_payload
from layertap.storage.store import ObjectNotFound, ObjectStore
from layertap.train.buffers import BufferPool, size_class

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommittedShard:
    """What a commit record says about one shard; the loader checks the object against it.

    The sample ids are held as their digest (`ids_digest`), not the ids: the object's footer lists
    them, and every rank holds every shard of the run (an 810K-sample run's ids were 57 MiB in each
    rank and DataLoader worker, and 12 MiB of JSON in rank 0's hand-over: bench/work_scale.py)."""

    shard: int
    key: str
    bytes: int
    xxh3_128: str
    records: int
    ids: str


def ids_digest(sample_ids: Sequence[str]) -> str:
    """What `CommittedShard.ids` holds for these sample ids, in order (as JSON: no two lists alike)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(list(sample_ids)).encode())


@dataclass(slots=True)
class _Buffer:
    """The buffer of one GET, counted in the budget until the last record viewing it is released."""

    array: np.ndarray
    records: int


@dataclass(slots=True)
class Record:
    """A verified RECD payload waiting for its turn: a view into the bytes its GET brought."""

    payload: memoryview
    meta: ShardMeta
    sample_id: str
    num_tokens: int  # as the index says
    shard: int  # index into the committed-shard list
    buffer: _Buffer


SKIP = object()  # marks a position whose record or shard failed under on_corrupt="skip"


@dataclass(slots=True)
class _Segment:
    """Consecutive input positions of one consumer that fall in the same shard."""

    shard: int
    positions: list[int]
    records: list[int]


@dataclass(slots=True)
class _Range:
    start: int
    end: int
    items: list[tuple[int, int]]  # (position, record index)
    whole: bool = False


class Metrics:
    """Counters of one consumer; `snapshot()` is what the trainer logs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_fetched = self.get_requests = self.retries = 0
        self.records_verified = self.records_decoded = self.decoded_bytes = 0
        self.samples = self.padding_samples = self.skipped_samples = 0
        self.rereads = 0  # ranges read again after a read that did not verify
        self.corrupt_shards: list[str] = []
        self.wait_s = 0.0
        self.buffered_bytes = self.peak_buffered_bytes = 0
        self.started: float | None = None
        self.finished: float | None = None

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def snapshot(self) -> dict:
        with self._lock:
            end = self.finished if self.finished is not None else time.perf_counter()
            elapsed = end - self.started if self.started is not None else 0.0
            rate = (lambda x: x / elapsed if elapsed > 0 else 0.0)
            return {
                "samples": self.samples, "padding_samples": self.padding_samples,
                "skipped_samples": self.skipped_samples, "corrupt_shards": len(self.corrupt_shards),
                "records_verified": self.records_verified, "records_decoded": self.records_decoded,
                "bytes_fetched": self.bytes_fetched, "get_requests": self.get_requests, "retries": self.retries,
                "rereads": self.rereads,
                "decoded_bytes": self.decoded_bytes, "elapsed_s": elapsed, "wait_s": self.wait_s,
                "samples_per_s": rate(self.samples), "decoded_mb_per_s": rate(self.decoded_bytes) / 1e6,
                "fetched_mb_per_s": rate(self.bytes_fetched) / 1e6,
                "buffered_bytes": self.buffered_bytes, "peak_buffered_bytes": self.peak_buffered_bytes,
            }


def merge_snapshots(snaps: list[dict]) -> dict:
    """Several consumers' counters as one: sums, except elapsed and wait (max) and rates (recomputed).
    `peak_buffered_bytes` is summed too: the sum of the workers' peaks bounds the bytes the worker
    processes may hold at once (their peaks need not coincide, but each can), which the budget
    (split evenly between them) is about; their maximum would understate it by the worker count."""
    if not snaps:
        return Metrics().snapshot()
    out = {k: sum(s[k] for s in snaps) for k in snaps[0]}
    out["elapsed_s"] = max(s["elapsed_s"] for s in snaps)
    out["wait_s"] = max(s["wait_s"] for s in snaps)
    e = out["elapsed_s"]
    out["samples_per_s"] = out["samples"] / e if e > 0 else 0.0
    out["decoded_mb_per_s"] = out["decoded_bytes"] / e / 1e6 if e > 0 else 0.0
    out["fetched_mb_per_s"] = out["bytes_fetched"] / e / 1e6 if e > 0 else 0.0
    return out


class Fetcher:
    """Verified records of one consumer, fetched ahead on threads. Failed GETs are not retried
    here: the store retries its own (`storage.retry`), and `metrics` counts those retries."""

    def __init__(self, store: ObjectStore, shards: list[CommittedShard], run_id: str, *,
                 positions: list[tuple[int, int, int]], budget: int, range_bytes: int, prefetch_shards: int,
                 threads: int, on_corrupt: str, metrics: Metrics, pool: BufferPool | None = None,
                 open_ended: bool = False, config: Mapping[str, Any] | None = None):
        """`positions`: (input position, shard index, record index) of every record to deliver,
        in ascending position order. `pool`: GET buffers to reuse, e.g. the previous epoch's.
        `open_ended` (follow mode): more positions come through `extend` until `seal()`.
        `config`: the manifest's, which every shard's HEAD must agree with (`header_mismatch`)."""
        self.store, self.shards, self.run_id, self.config = store, shards, run_id, config
        self.budget, self.range_bytes, self.prefetch_shards = budget, range_bytes, prefetch_shards
        self.on_corrupt, self.metrics = on_corrupt, metrics
        self._retries_seen = store.retries  # the store's counter is shared by everything that uses it
        self._retries_lock = threading.Lock()
        self._segments: list[_Segment] = []
        self._positions_of: dict[int, list[int]] = defaultdict(list)
        self._add(positions)
        self._sealed = not open_ended
        self._cond = threading.Condition()
        self._ready: dict[int, Record | object] = {}
        self._in_use = 0
        self._pool = pool if pool is not None else BufferPool()
        self._waiting: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._bad: set[int] = set()  # shards whose undelivered records are all SKIP
        self._counted: set[int] = set()  # shards in metrics.corrupt_shards
        self._threads = ThreadPoolExecutor(max(1, threads), thread_name_prefix="layertap-fetch")
        self._thread = threading.Thread(target=self._schedule, name="layertap-fetch-plan", daemon=True)
        self._thread.start()

    def _add(self, positions: list[tuple[int, int, int]]) -> None:
        first = len(self._segments)
        for pos, shard, rec in positions:
            if len(self._segments) == first or self._segments[-1].shard != shard:
                self._segments.append(_Segment(shard, [], []))
            self._segments[-1].positions.append(pos)
            self._segments[-1].records.append(rec)
            self._positions_of[shard].append(pos)

    def extend(self, positions: list[tuple[int, int, int]]) -> None:
        """More records to deliver (open-ended fetcher), at positions after all earlier ones."""
        with self._cond:
            if self._sealed:
                raise RuntimeError("extend() after seal()")
            self._add(positions)
            self._cond.notify_all()

    def seal(self) -> None:
        """No more `extend` calls: the scheduler ends once it has scheduled everything."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    # -- consumer side -------------------------------------------------------------------------

    def wait_for(self, pos: int) -> Record | object:
        """The verified record at `pos` (or SKIP), taken; blocks until it has arrived."""
        with self._cond:
            if pos not in self._ready and self._error is None:
                t0 = time.perf_counter()
                self._waiting = pos
                self._cond.notify_all()  # a range held back by the budget may now go ahead
                while pos not in self._ready and self._error is None:
                    self._cond.wait()
                self._waiting = None
                self.metrics.add(wait_s=time.perf_counter() - t0)
            if pos not in self._ready:
                raise self._error
            return self._ready.pop(pos)

    def take_if_ready(self, pos: int) -> Record | None:
        """The verified record at `pos` if it has arrived (for decoding ahead), else None; never blocks."""
        with self._cond:
            item = self._ready.get(pos)
            if isinstance(item, Record):
                del self._ready[pos]
                return item
            return None

    def release(self, record: Record) -> None:
        """The consumer is done with `record` (decoded, or abandoned)."""
        with self._cond:
            self._drop(record)
            self._cond.notify_all()

    def _drop(self, record: Record) -> None:
        buf = record.buffer
        buf.records -= 1
        if buf.records == 0:
            self._free(buf.array)

    def _free(self, array: np.ndarray) -> None:
        """Un-count a GET's buffer (caller holds the lock) and keep it for reuse if the budget has room."""
        self._in_use -= array.size
        self.metrics.buffered_bytes = self._in_use
        if self._in_use + self._pool.idle_bytes + array.size <= self.budget:
            self._pool.give(array)

    def shard_failed(self, shard: int, error: BaseException) -> ShardError | None:
        """A shard turned out bad (its object, footer or bytes unreadable): the error to raise, or
        None once its undelivered positions are marked SKIP (on_corrupt="skip")."""
        msg = self._describe(shard, error)  # before the lock: a shard gone asks the store who deleted it
        with self._cond:
            err = self._refusal(shard, error, msg)
            if err is not None or shard in self._bad:
                return err
            self._bad.add(shard)
            for pos in self._positions_of[shard]:
                cur = self._ready.get(pos)
                if isinstance(cur, Record):
                    self._drop(cur)
                self._ready[pos] = SKIP
            self._cond.notify_all()
        log.warning("skipping %s (on_corrupt='skip'): its undelivered samples are replaced by padding", msg)
        return None

    def record_failed(self, shard: int, error: BaseException) -> ShardError | None:
        """One record failed its own hash or did not decode: the error to raise, or None, and under
        on_corrupt="skip" that record alone is padding (the caller's). The shard's other records,
        each checked by its own hash, are delivered: which samples a run trains on is a fact of
        the bytes, not of which of the shard's GETs came back first."""
        msg = self._describe(shard, error)
        with self._cond:
            err = self._refusal(shard, error, msg)
            if err is not None:
                return err
        log.warning("skipping a record of %s (on_corrupt='skip'): it is replaced by padding", msg)
        return None

    def object_differs(self, shard: int, error: ShardError) -> None:
        """Under on_corrupt="skip", a shard read whole whose object hash is not its commit's: its
        records still go where each one's own hash holds (as on a ranged read), but the shard is
        counted in `corrupt_shards` and said, so that `verify` is run: a byte no record covers
        (the preamble, the footer's padding) may be all that changed."""
        msg = self._describe(shard, error)
        with self._cond:
            self._refusal(shard, error, msg)
        log.warning("%s (on_corrupt='skip': its records are delivered where each one's own hash holds); run "
                    "`layertap verify %s` to withdraw it so extraction redoes it", msg, self.store.uri)

    def _where(self, shard: int) -> str:
        return f"{self.store.uri.rstrip('/')}/{self.shards[shard].key}"

    def _describe(self, shard: int, error: BaseException) -> str:
        entry = self.shards[shard]
        return (_gone(self.store, entry.shard, self._where(shard)) if isinstance(error, ObjectNotFound)
                else f"shard {entry.shard} ({self._where(shard)}) is corrupt or unreadable: {error}")

    def _refusal(self, shard: int, error: BaseException, msg: str) -> ShardError | None:
        """What a failure of `shard` (`msg`: `_describe`'s) raises under the policy (caller holds the
        lock); None under on_corrupt="skip", the shard then counted in `corrupt_shards` (once)."""
        entry = self.shards[shard]
        if isinstance(error, UnsupportedShard):  # newer, not corrupt: skipping it would lose it silently
            self._error = self._error or UnsupportedShard(
                f"shard {entry.shard}: {error} (if this layertap wrote it, it is corrupt: run `layertap verify {self.store.uri}`)")
            self._cond.notify_all()
            return self._error
        if self.on_corrupt == "raise":
            if self._error is None:
                self._error = ShardError(msg if isinstance(error, ObjectNotFound) else
                                         f"{msg}; run `layertap verify {self.store.uri}` to withdraw bad shards, "
                                         "then `layertap extract` again to redo them (in Python, "
                                         "StreamConfig(on_corrupt='skip') streams the rest without them)")
            self._cond.notify_all()
            return self._error
        if shard not in self._counted:
            self._counted.add(shard)
            self.metrics.corrupt_shards.append(self._where(shard))
        return None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join()
        self._threads.shutdown(wait=True, cancel_futures=True)

    # -- budget ----------------------------------------------------------------------------------

    def _wait_for_budget(self, nbytes: int, first_pos: int) -> np.ndarray | None:
        """A buffer of `nbytes` (a size class), blocking until the budget allows it; None if closed or failed."""
        with self._cond:
            while not self._closed and self._error is None and self._in_use > 0 \
                    and self._in_use + nbytes > self.budget \
                    and not (self._waiting is not None and self._waiting >= first_pos):
                self._cond.wait()
            if self._closed or self._error is not None:
                return None
            array = self._pool.take(nbytes, up_to=self.budget - self._in_use)  # a larger idle one is held anyway
            self._in_use += array.size
            self.metrics.buffered_bytes = self._in_use
            self.metrics.peak_buffered_bytes = max(self.metrics.peak_buffered_bytes, self._in_use)
            self._pool.trim(max(0, self.budget - self._in_use))
            return array

    # -- fetching --------------------------------------------------------------------------------

    def _schedule(self) -> None:
        try:
            opened: list = []  # (segment, future of its reader or None for a whole-object fetch)
            scheduled = 0  # segments taken from self._segments (an open-ended fetcher's list grows)

            def fill() -> None:
                nonlocal scheduled
                while len(opened) < self.prefetch_shards:
                    with self._cond:
                        if scheduled >= len(self._segments):
                            return
                        seg = self._segments[scheduled]
                    scheduled += 1
                    whole = self._whole(seg)
                    opened.append((seg, None if whole else self._threads.submit(self._open_ranged, seg.shard)))

            def more() -> bool:
                """Wait until segments are added or the fetcher is sealed or closed."""
                with self._cond:
                    while scheduled >= len(self._segments) and not (self._sealed or self._closed or self._error):
                        self._cond.wait()
                    return scheduled < len(self._segments) and not self._closed

            while True:
                fill()
                if not opened:
                    if more():
                        continue
                    return
                seg, fut = opened.pop(0)
                fill()
                if self._closed:
                    return
                reader = None
                if fut is not None:
                    try:
                        reader = fut.result()
                    except Exception as e:
                        self._failed(seg.shard, e)
                        continue
                for rng in self._ranges(seg, reader):
                    if seg.shard in self._bad:
                        break
                    array = self._wait_for_budget(size_class(rng.end - rng.start), rng.items[0][0])
                    if array is None:
                        return
                    self._threads.submit(self._fetch, seg.shard, reader, rng, array)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, never lost
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()

    def _whole(self, seg: _Segment) -> bool:
        entry = self.shards[seg.shard]
        return entry.bytes <= self.range_bytes and 2 * len(seg.records) >= entry.records

    def _ranges(self, seg: _Segment, reader: ShardReader | None):
        if reader is None:
            yield _Range(0, self.shards[seg.shard].bytes, list(zip(seg.positions, seg.records)), whole=True)
            return
        entries = [reader.entries[rec] for rec in seg.records]
        for i, j in adjacent_runs(entries, self.range_bytes):
            yield _Range(entries[i].offset, entries[j - 1].offset + entries[j - 1].length,
                         list(zip(seg.positions[i:j], seg.records[i:j])))

    def _read_range(self, key: str, start: int, end: int, out: memoryview | None = None) -> bytes | memoryview:
        """Bytes [start, end) by a ranged GET (read into `out`, of that length, if given): I/O on
        the calling thread, counted in the metrics with the retries the store made meanwhile."""
        if out is None:
            data = self.store.get_range(key, start, end)
            got = len(data)
        else:
            data, got = out, self.store.read_range_into(key, start, out)
        with self._retries_lock:
            retries, self._retries_seen = self.store.retries - self._retries_seen, self.store.retries
        self.metrics.add(get_requests=1, bytes_fetched=got, retries=retries)
        if got != end - start:  # S3 bodies are length-checked: the object is short
            raise ShardError(f"{key}: got {got} bytes of [{start}, {end}); the object is shorter than its commit says")
        return data

    def _open(self, shard: int, data: memoryview | None = None) -> ShardReader:
        entry = self.shards[shard]
        if data is None:
            reader = ShardReader(_Counted(self), entry.key, size=entry.bytes)
        else:
            reader = ShardReader.from_bytes(data, entry.key, uri=self.store.uri)
        if reader.meta.run_id != self.run_id or reader.meta.shard_id != entry.shard:
            raise ShardError(f"the object says run {reader.meta.run_id!r} shard {reader.meta.shard_id}, "
                             f"the commit says run {self.run_id!r} shard {entry.shard}")
        if len(reader.sample_ids) != entry.records or ids_digest(reader.sample_ids) != entry.ids:
            raise ShardError("the footer index lists other samples than the commit record")
        if self.config is not None and (refused := header_mismatch(self.store.uri, entry.shard, entry.key,
                                                                  reader.meta, self.config)):
            raise refused  # the shards are sound and the manifest misdescribes them: nothing to skip
        return reader

    def _fetch(self, shard: int, reader: ShardReader | None, rng: _Range, array: np.ndarray) -> None:
        try:
            entry = self.shards[shard]
            where = f"{self.store.uri.rstrip('/')}/{entry.key}"
            # a range that does not verify is read once more before the shard is refused or its records
            # skipped: a read damaged on its way (a NIC, a proxy) is not the object's fault
            for again in (False, True):
                data = self._read_range(entry.key, rng.start, rng.end, memoryview(array)[: rng.end - rng.start])
                try:
                    differs, records, bad = self._verified(shard, reader, rng, data, array, where, again)
                except ShardError as e:
                    if again:
                        raise
                    self._say_reread(f"{where} bytes [{rng.start}, {rng.end})", e)
                    continue
                if again or (differs is None and not bad):
                    break
                self._say_reread(f"{where} bytes [{rng.start}, {rng.end})", differs or bad[0][1])
            if differs is not None:
                self.object_differs(shard, differs)
            self.metrics.add(records_verified=len(records))
        except (ShardError, ObjectNotFound) as e:
            self._unreserve(array)
            self._failed(shard, e)
            return
        except BaseException as e:  # noqa: BLE001
            self._unreserve(array)
            with self._cond:
                self._error = self._error or e
                self._cond.notify_all()
            return
        for _, err in bad:
            self.record_failed(shard, err)
        with self._cond:
            if not (self._closed or shard in self._bad):
                self._ready.update(records)
                self._ready.update((pos, SKIP) for pos, _ in bad)
                self._cond.notify_all()
                if records:
                    return
        self._unreserve(array)

    def _verified(self, shard: int, reader: ShardReader | None, rng: _Range, data: bytes | memoryview,
                  array: np.ndarray, where: str, last: bool
                  ) -> tuple[ShardError | None, list[tuple[int, Record]], list[tuple[int, ShardError]]]:
        """A shard read whole's object hash refusal (None when it holds; raised but on the `last` read
        under on_corrupt="skip"), the range's records whose hashes hold, and those that fail (under
        "skip"; "raise" raises)."""
        entry, differs = self.shards[shard], None
        if rng.whole:
            digest = xxhash.xxh3_128(data).hexdigest()  # the hasher object releases the GIL
            if digest != entry.xxh3_128:
                differs = ShardError(f"object hash {digest} differs from the committed {entry.xxh3_128}")
                if self.on_corrupt == "raise" or not last:
                    raise differs
            # under "skip", each record's own hash says which are bad, as on a ranged read
            reader = self._open(shard, data)  # a footer that does not read: the whole shard
        buffer = _Buffer(array, len(rng.items))
        records, bad = [], []
        for pos, rec in rng.items:
            e = reader.entries[rec]
            try:
                payload = record_payload(data, rng.start, e, f"{where} record {rec} ({e.sample_id})")
            except ShardError as err:
                if self.on_corrupt == "raise":
                    raise
                bad.append((pos, err))
                continue
            records.append((pos, Record(payload, reader.meta, e.sample_id, e.num_tokens, shard, buffer)))
        buffer.records = len(records)
        return differs, records, bad

    def _open_ranged(self, shard: int) -> ShardReader:
        """`_open` of a shard read by ranges (its HEAD and footer first), twice before it fails."""
        try:
            return self._open(shard)
        except ShardError as e:
            self._say_reread(f"{self._where(shard)} HEAD and footer", e)
            return self._open(shard)

    def _say_reread(self, what: str, error: ShardError) -> None:
        self.metrics.add(rereads=1)
        log.warning("%s did not verify (%s): reading them again before taking the shard for corrupt", what, error)

    def _unreserve(self, array: np.ndarray) -> None:
        with self._cond:
            self._free(array)
            self._cond.notify_all()

    def _failed(self, shard: int, e: BaseException) -> None:
        if isinstance(e, (ShardError, ObjectNotFound)):
            self.shard_failed(shard, e)
            return
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()


def _gone(store: ObjectStore, shard: int, where: str) -> str:
    """Why a committed shard's data is not there: deleted by the run's --delete-consumed trainer
    while this stream read the run (its consumed marker says so), or by hand since it started."""
    from layertap.manifests import layout
    from layertap.manifests.consumption import consumer_of

    try:
        consumed = store.exists(layout.consumed_marker_key(shard))
        trainer = consumer_of(store) if consumed else None
        deleted = not consumed and not store.exists(layout.MANIFEST)
        commit = "" if consumed or deleted else _commit_now(store, shard)  # "": not looked at
    except Exception:  # noqa: BLE001 - only the wording of the error depends on it
        consumed, trainer, deleted, commit = False, None, False, ""
    if deleted:  # `layertap delete` of the run while it was read: nothing to verify or redo
        return (f"shard {shard} ({where}) is gone, and so is the run's manifest: the run at {store.uri} was "
                "deleted while this stream read it (`layertap delete`); extract it again to train on it")
    if commit is None:  # withdrawn, or a delete under way (it removes the manifest last)
        return (f"shard {shard} ({where}) is gone, and so is its commit: `layertap verify` withdrew it while this "
                f"stream read the run, or a `layertap delete` of {store.uri} is under way; `layertap status "
                f"{store.uri}` says which: once `layertap extract` has redone the shard, start the training again")
    if commit and not where.endswith(f"/{commit}"):
        return (f"shard {shard} ({where}) was redone since this stream read the run: its commit now names "
                f"{commit}; start the training again to read the run as it is")
    if consumed:
        return (f"shard {shard} ({where}) was deleted while this stream read the run: consumed by the "
                f"--delete-consumed trainer{f' writing to {trainer}' if trainer else ''}, which deletes what it has "
                "trained on; read such a run only after that trainer has finished (its deleted shards are then "
                "left out), or train it with the same trainer")
    return (f"shard {shard} ({where}) is gone: its commit stands but its data object is not there (deleted by "
            f"hand or by `layertap delete`, or lost); run `layertap verify {store.uri}`, which withdraws the "
            "commit of a shard whose data is missing, then the same `layertap extract` to redo it")


def _commit_now(store: ObjectStore, shard: int) -> str | None:
    """The data object the shard's commit names now; None where no commit is there."""
    from layertap.manifests import layout
    from layertap.manifests.records import decode_commit

    try:
        return decode_commit(store.get(layout.commit_key(shard)), layout.commit_key(shard)).data_key
    except ObjectNotFound:
        return None


class _Counted:
    """The store as `ShardReader` sees it when opening a shard: ranged GETs counted in the metrics."""

    def __init__(self, fetcher: Fetcher):
        self._f = fetcher
        self.uri = fetcher.store.uri

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._f._read_range(key, start, end)
