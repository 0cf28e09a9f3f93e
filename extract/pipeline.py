"""One shard's extraction: batches -> forward -> host copy -> encode pool -> streaming writer.

The device thread only runs forwards and hands each batch's states to a pool that encodes
records (zstd and safetensors release the GIL); a writer thread appends the encoded records to
the shard object in order while its parts upload. Queues between the stages are bounded, so a
slow store slows the forward down instead of filling memory.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from extract.inputs import TokenizedSample
from extract.model import Capture
from storage.shard import EncodedRecord, Sample, ShardInfo, ShardMeta, ShardWriter, encode_record
from storage.store import ObjectWriter


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
    """Where the time goes, for logs and bench/gpu_extract.py (seconds, summed per stage)."""

    samples: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    raw_bytes: int = 0
    stored_bytes: int = 0
    forward_s: float = 0.0
    copy_s: float = 0.0
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


class _Writer(threading.Thread):
    """Appends encoded records to the shard in submission order; the first error is kept."""

    def __init__(self, shard: ShardWriter, depth: int, stats: PipelineStats, on_record: Callable[[EncodedRecord], None]):
        super().__init__(name="shard-writer", daemon=True)
        self.shard, self.stats, self.on_record = shard, stats, on_record
        self.q: queue.Queue[Future | None] = queue.Queue(maxsize=depth)
        self.error: BaseException | None = None

    def run(self) -> None:
        while (fut := self.q.get()) is not None:
            if self.error is not None:
                continue  # drain so the producer never blocks on a dead writer
            try:
                rec = fut.result()
                t0 = time.perf_counter()
                self.shard.append(rec)
                self.stats.add(write_s=time.perf_counter() - t0, stored_bytes=rec.size)
                self.on_record(rec)
            except BaseException as e:
                self.error = e

    def put(self, fut: Future) -> None:
        if self.error is not None:
            raise self.error
        self.q.put(fut)


def extract_shard(capture: Capture, samples: Sequence[TokenizedSample], meta: ShardMeta, out: ObjectWriter, *,
                  batch_tokens: int, pad_id: int, encode_threads: int = 2, stats: PipelineStats | None = None,
                  should_stop: Callable[[], bool] = lambda: False,
                  on_record: Callable[[EncodedRecord], None] = lambda rec: None) -> ShardInfo:
    """Run `samples` through the model and stream their records into `out`; returns the shard's
    facts for its commit. Any exception aborts the object (nothing becomes visible)."""
    stats = stats or PipelineStats()
    t_start = time.perf_counter()
    on_cuda = next(capture.decoder.parameters()).device.type == "cuda"
    depth = 4 * encode_threads + 8
    try:
        shard = ShardWriter(out, meta)
    except BaseException:
        out.abort()
        raise
    with shard, ThreadPoolExecutor(encode_threads, thread_name_prefix="encode") as pool:
        writer = _Writer(shard, depth, stats, on_record)
        writer.start()
        try:
            for batch in make_batches(samples, batch_tokens):
                if should_stop():
                    raise LeaseLost(f"shard {meta.shard_id}: lease lost to another worker")
                ids, mask = pad_batch(batch, pad_id)
                t0 = time.perf_counter()
                hidden, final = capture(ids, mask)
                hidden = hidden.to(torch.bfloat16)  # stored as bf16 whatever the forward's dtype
                final = None if final is None else final.to(torch.bfloat16)
                t1 = time.perf_counter()
                hidden_host, final_host, ready = _to_host(hidden, final, on_cuda)
                stats.add(forward_s=t1 - t0, copy_s=time.perf_counter() - t1,
                          padded_tokens=ids.numel(), samples=len(batch), tokens=int(mask.sum()))
                for i, s in enumerate(batch):
                    n = len(s)
                    sample = Sample(s.sample_id, s.input_ids, s.loss_mask.to(torch.uint8), hidden_host[i, :n],
                                    None if final_host is None else final_host[i, :n])
                    writer.put(pool.submit(_encode, sample, meta, ready, stats))
        finally:
            writer.q.put(None)
            writer.join()
        if writer.error is not None:
            raise writer.error
        t_close = time.perf_counter()
        info = shard.close()
        stats.add(close_s=time.perf_counter() - t_close)
    stats.add(wall_s=time.perf_counter() - t_start, raw_bytes=info.raw_bytes)
    return info


def _to_host(hidden: torch.Tensor, final: torch.Tensor | None, on_cuda: bool):
    """Copy states off the device without stalling it: pinned buffers, non-blocking copies, and
    an event the encoders wait on."""
    if not on_cuda:
        return hidden, final, None
    h = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
    h.copy_(hidden, non_blocking=True)
    f = None
    if final is not None:
        f = torch.empty(final.shape, dtype=final.dtype, pin_memory=True)
        f.copy_(final, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return h, f, ready


def _encode(sample: Sample, meta: ShardMeta, ready, stats: PipelineStats) -> EncodedRecord:
    if ready is not None:
        ready.synchronize()
    t0 = time.perf_counter()
    sample.hidden_states = sample.hidden_states.contiguous()
    if sample.final_state is not None:
        sample.final_state = sample.final_state.contiguous()
    rec = encode_record(sample, meta)
    stats.add(encode_s=time.perf_counter() - t0)
    return rec
