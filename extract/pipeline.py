"""One shard's extraction: batches -> forward -> host copy -> encode pool -> streaming writer.

The device thread only runs forwards and hands each batch's states to a pool that encodes
records (zstd and safetensors release the GIL); a writer thread appends the encoded records to
the shard object in order while its parts upload. Queues between the stages are bounded, so a
slow store slows the forward down instead of filling memory. `start_shard` returns when the
forwards are done and leaves the rest to `ShardTail.finish`, so a worker can overlap one shard's
tail with the next shard's forwards (extract.worker); the bounds are then per open shard (two
encode pools, writer queues and upload buffers while one finishes), the pinned buffers shared.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from layertap.extract.inputs import TokenizedSample
from layertap.extract.model import Capture
from layertap.storage.format import ShardMeta
from layertap.storage.records import EncodedRecord, Sample, encode_record
from layertap.storage.store import ObjectWriter
from layertap.storage.writer import ShardInfo, ShardWriter


class LeaseLost(RuntimeError):
    """Another worker took this shard over; stop working on it."""


def make_batches(samples: Sequence[TokenizedSample], batch_tokens: int) -> list[list[TokenizedSample]]:
    """Length-sorted batches whose padded size (rows x longest row) stays within `batch_tokens`.

    Sorting by length keeps padding, which costs compute but is never stored, small.
    """
    batches: list[list[TokenizedSample]] = []
    current: list[TokenizedSample] = []
    for s in sorted(samples, key=len, reverse=True):
        longest = len(current[0]) if current else len(s)
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches


def pad_batch(batch: Sequence[TokenizedSample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and attention mask."""
    t = max(len(s) for s in batch)
    ids = torch.full((len(batch), t), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), t), dtype=torch.long)
    for i, s in enumerate(batch):
        ids[i, : len(s)] = s.input_ids
        mask[i, : len(s)] = 1
    return ids, mask


@dataclass
class PipelineStats:
    """Where the time goes, for logs and bench/gpu_extract.py (seconds, summed per stage), and what
    was stored: the counts (samples, tokens, bytes) are a shard's once its object is complete, not
    of an attempt aborted (a lost lease, a failure: its work is done again, and was counted twice)."""

    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    forward_s: float = 0.0  # the device's own time (CUDA events), not the host's while it launches kernels
    copy_s: float = 0.0  # host time handing states to the copy, incl. waiting for a free pinned buffer
    encode_s: float = 0.0  # summed over encode threads
    write_s: float = 0.0  # writer thread: appends incl. waiting for upload backpressure
    close_s: float = 0.0  # the shard's close: the last parts' uploads and the object's completion
    wall_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: float) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def to_json(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def counts(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("samples", "tokens", "padded_tokens", "stored_bytes")}


class _Writer(threading.Thread):
    """Appends encoded records to the shard in submission order; the first error is kept."""

    def __init__(self, shard: ShardWriter, depth: int, stats: PipelineStats, counts: PipelineStats,
                 on_record: Callable[[EncodedRecord], None]):
        super().__init__(name="shard-writer", daemon=True)
        self.shard, self.stats, self.counts, self.on_record = shard, stats, counts, on_record
        self.q: queue.Queue[Future | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None
        self.cancelled = False  # set by an abort: what is still queued is not uploaded

    def run(self) -> None:
        while (fut := self.q.get()) is not None:
            if self.error is not None or self.cancelled:
                continue  # drain so the producer never blocks on a dead writer (or one being aborted)
            try:
                rec = fut.result()
                t0 = time.perf_counter()
                self.shard.append_encoded(rec)
                self.stats.add(write_s=time.perf_counter() - t0)
                self.counts.add(stored_bytes=rec.size)
                self.on_record(rec)
            except BaseException as e:
                self.error = e

    def wait_and_queue(self, fut: Future, check: Callable[[], None] = lambda: None) -> None:
        """Queue a record being encoded; blocks while `depth` are queued (the encoders' backpressure),
        calling `check` every half second meanwhile, which raises to give up: a store so slow that
        the queue stays full must not keep a stop (or a lost lease) waiting for it."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.q.put(fut, timeout=0.5)
                return
            except queue.Full:
                check()


def extract_shard(capture: Capture, samples: Sequence[TokenizedSample], meta: ShardMeta, out: ObjectWriter, *,
                  batch_tokens: int, pad_id: int, encode_threads: int = 2, stats: PipelineStats | None = None,
                  should_stop: Callable[[], bool] = lambda: False,
                  on_record: Callable[[EncodedRecord], None] = lambda rec: None,
                  staging: HostStaging | None = None) -> ShardInfo:
    """Run `samples` through the model and stream their records into `out`; returns the shard's
    facts for its commit. Any exception aborts the object (nothing becomes visible).
    `start_shard`, then `ShardTail.finish` at once (see there)."""
    stats = stats or PipelineStats()
    t_start = time.perf_counter()
    info = start_shard(capture, samples, meta, out, batch_tokens=batch_tokens, pad_id=pad_id,
                       encode_threads=encode_threads, stats=stats, should_stop=should_stop, on_record=on_record,
                       staging=staging).finish()
    stats.add(wall_s=time.perf_counter() - t_start)
    return info


def start_shard(capture: Capture, samples: Sequence[TokenizedSample], meta: ShardMeta, out: ObjectWriter, *,
                batch_tokens: int, pad_id: int, encode_threads: int = 2, stats: PipelineStats | None = None,
                should_stop: Callable[[], bool] = lambda: False,
                on_record: Callable[[EncodedRecord], None] = lambda rec: None,
                staging: HostStaging | None = None) -> ShardTail:
    """Run the forward passes of `samples` and hand each batch's states to the encoders and the
    writer; return once the last batch is on its way, with the shard still finishing. A worker
    starts the next shard's forward meanwhile and calls `ShardTail.finish` later, so the device
    does not wait for a shard's last encodes, its object's completion or its commit. Any
    exception here aborts the object (nothing becomes visible).

    `should_stop` is asked before each batch (and while the writer's queue stays full): True
    stops with `LeaseLost`; it may raise a stop of its own instead (a worker's stop signal, which
    must not be raised into the queue or a join here: see extract.worker).

    `staging` keeps the pinned host buffers from shard to shard (a worker extracting many shards
    passes one); without it each shard makes its own."""
    stats = stats or PipelineStats()
    device = next(capture.decoder.parameters()).device
    on_cuda = device.type == "cuda"
    staging = staging if staging is not None or not on_cuda else HostStaging()
    shard = ShardWriter(out, meta)  # aborts `out` itself if its header fails
    counts = PipelineStats()  # this shard's, added to `stats` once it is complete
    writer = _Writer(shard, 4 * encode_threads + 8, stats, counts, on_record)
    # An encode thread waits on the copy's event: on CUDA its current device must be this rank's, or
    # the wait opens a context on GPU 0 (a new thread's default) in every rank's process.
    pool = ThreadPoolExecutor(encode_threads, thread_name_prefix="encode",
                              **({"initializer": torch.cuda.set_device, "initargs": (device,)} if on_cuda else {}))
    clock = ForwardClock(on_cuda)
    tail = ShardTail(shard, pool, writer, stats, counts, clock)

    def check() -> None:
        if should_stop():
            raise LeaseLost(f"shard {meta.shard_id}: lease lost to another worker")

    writer.start()
    try:
        for batch in make_batches(samples, batch_tokens):
            check()
            ids, mask = pad_batch(batch, pad_id)
            with clock:
                hidden, final = capture(ids, mask)
                hidden = hidden.to(torch.bfloat16)  # stored as bf16 whatever the forward's dtype
                final = None if final is None else final.to(torch.bfloat16)
            t1 = time.perf_counter()
            if staging is not None:
                hidden_host, final_host, ready, release = staging.wait_and_copy(hidden, final, len(batch))
            else:
                hidden_host, final_host, ready, release = hidden, final, None, None
            stats.add(copy_s=time.perf_counter() - t1)
            counts.add(padded_tokens=ids.numel(), samples=len(batch), tokens=int(mask.sum()))
            submitted = 0
            try:
                for i, s in enumerate(batch):
                    n = len(s)
                    sample = Sample(s.sample_id, s.input_ids, s.loss_mask.to(torch.uint8), hidden_host[i, :n],
                                    None if final_host is None else final_host[i, :n])
                    future = tail.pool.submit(_encode, sample, meta, ready, release, stats)
                    submitted += 1  # its encode releases its share of the pinned buffer, whatever happens
                    writer.wait_and_queue(future, check)
            finally:
                if release is not None:  # the batch's samples never submitted: their shares, or the
                    for _ in range(len(batch) - submitted):  # buffer would never return (staging is shared)
                        release()
    except BaseException:
        tail.abort()
        raise
    return tail


class ShardTail:
    """A shard whose forward passes are done: its last records may still be encoding and
    queued for the writer, and its object is open until `finish` (or `abort`), which any one
    thread calls once."""

    def __init__(self, shard: ShardWriter, pool: ThreadPoolExecutor, writer: _Writer, stats: PipelineStats,
                 counts: PipelineStats, clock: ForwardClock):
        self.shard, self.pool, self.writer, self.stats, self.counts = shard, pool, writer, stats, counts
        self.clock = clock
        self._stopped = False

    def finish(self) -> ShardInfo:
        """Wait for the encoders and the writer, then complete the object; its facts for the commit.
        Any exception aborts the object."""
        try:
            self._drain()
            if self.writer.error is not None:
                raise self.writer.error
            self.stats.add(forward_s=self.clock.seconds())  # its encodes waited for every copy behind a forward
            t_close = time.perf_counter()
            info = self.shard.close()
            self.stats.add(close_s=time.perf_counter() - t_close, raw_bytes=info.raw_bytes, **self.counts.counts())
            return info
        except BaseException:
            self.shard.abort()
            raise

    def abort(self) -> None:
        """Stop the encoders and the writer and drop the object: nothing of it becomes visible."""
        self.writer.cancelled = True
        try:
            self._drain()
            self.stats.add(forward_s=self.clock.seconds(settled=False))  # the time was spent all the same
        finally:
            self.shard.abort()

    def _drain(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            # Not cut short by a stop signal: a worker defers stops around a shard's work
            # (extract.worker). One raised into `wait_and_queue`'s put lost the writer's wake-up,
            # so the writer never took this None and the join below hung for good.
            self.writer.q.put(None)  # the writer takes every queued record (or skips them after an error)
            self.writer.join()
        finally:
            self.pool.shutdown(wait=True)


class ForwardClock:
    """The forwards' time, summed. On CUDA a host clock times only the kernels' launch (they run
    asynchronously): events on the stream time the device's own work instead, and are read once
    the shard finishes, when its encodes have waited for the copies behind every forward, so
    timing never makes the host wait for the device."""

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self._host_s = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start: float | torch.cuda.Event | None = None

    def __enter__(self) -> None:
        if self.on_cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def __exit__(self, exc_type, exc, tb) -> None:
        start, self._start = self._start, None
        if exc_type is not None:
            return  # a failed forward is not timed (on CUDA an event after a device error would fail too)
        if self.on_cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))
        else:
            self._host_s += time.perf_counter() - start

    def seconds(self, settled: bool = True) -> float:
        """The time so far, and resets. `settled`: every forward is known complete (a shard's
        finish); otherwise (an abort) only those the device has finished count, without waiting."""
        total, self._host_s = self._host_s, 0.0
        events, self._events = self._events, []
        for start, end in events:
            if settled:
                end.synchronize()  # complete already: the encodes waited for the copies behind it
            elif not _completed(end):
                continue
            total += start.elapsed_time(end) / 1000
        return total


def _completed(event: torch.cuda.Event) -> bool:
    """Whether the device is past `event`; False after a device error (an abort's cause, not to be
    replaced by the same error raised again here)."""
    try:
        return event.query()
    except RuntimeError:
        return False


class HostStaging:
    """Pinned host buffers, reused batch after batch, filled by copies on a stream of their own.

    The forward of batch n+1 runs while batch n's states travel to the host, and no buffer is
    pinned afresh per batch (pinning ~1 GB costs more than copying it). A buffer goes back to the
    free list once every sample of its batch is encoded; when all `slots` are in use the device
    thread waits for one, so slow encoders slow the forward down instead of filling memory.
    """

    def __init__(self, slots: int = 3):
        self.stream = torch.cuda.Stream()
        self._free: queue.Queue[torch.Tensor | None] = queue.Queue()
        for _ in range(slots):
            self._free.put(None)  # allocated on first use, at the size the batches need

    def wait_and_copy(self, hidden: torch.Tensor, final: torch.Tensor | None, users: int):
        """Start the copy of a batch's states, once a buffer is free (blocks until then); returns
        host views, an event that marks them complete, and the release callback each of the
        batch's `users` calls once done."""
        need = hidden.numel() + (final.numel() if final is not None else 0)
        buf = self._free.get()
        try:
            if buf is None or buf.numel() < need:
                buf = torch.empty(need, dtype=torch.bfloat16, pin_memory=True)
            h = buf[: hidden.numel()].view(hidden.shape)
            f = None if final is None else buf[hidden.numel(): need].view(final.shape)
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                h.copy_(hidden, non_blocking=True)
                hidden.record_stream(self.stream)  # the allocator must not hand its memory out before the copy is done
                if final is not None:
                    f.copy_(final, non_blocking=True)
                    final.record_stream(self.stream)
                ready = torch.cuda.Event(blocking=True)  # waited on by encode threads: they sleep, not spin
                ready.record(self.stream)
        except BaseException:
            # the slot goes back (empty: allocated anew at its next use), or a failed pinning (host
            # memory short) lost it for good, and after `slots` of them the next batch waited for ever
            self._free.put(None)
            raise
        return h, f, ready, _Countdown(users, lambda: self._free.put(buf))


class _Countdown:
    """Calls `done` once `n` users have called it."""

    def __init__(self, n: int, done: Callable[[], None]):
        self._n, self._done, self._lock = n, done, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._done()


def _encode(sample: Sample, meta: ShardMeta, ready, release, stats: PipelineStats) -> EncodedRecord:
    try:
        if ready is not None:
            ready.synchronize()
        t0 = time.perf_counter()
        rec = encode_record(sample, meta)  # every codec copies out of the states: the buffer may go back
        stats.add(encode_s=time.perf_counter() - t0)
        return rec
    finally:
        sample.hidden_states = sample.final_state = None
        if release is not None:
            release()
