"""The order of an epoch: a pure function of (seed, epoch, rank, world, worker, workers).

Nothing here touches data. The committed shards are permuted per (seed, epoch); their records,
end to end, form the epoch's sequence of N samples. Each rank takes a contiguous slice of it
and each DataLoader worker a contiguous part of its rank's slice (contiguous, so a consumer
reads whole runs of adjacent records: few, large ranged GETs). A consumer's samples then pass
through a shuffle buffer of K slots whose every choice comes from a counter-based generator, so
the output order is a permutation computed from indices alone. Resuming therefore needs only
the number of samples already consumed: the buffer's content at that point is recomputed, and
no skipped record is fetched or decoded.

Uneven counts: with `uneven="pad"` every rank gets ceil(N / world) samples and the last rank's
slice wraps to the start of the epoch's sequence for the few (< world) it lacks; the loader
yields those repeats with `padding=True` and an all-zero loss mask, so every sample counts
exactly once in the loss while every rank runs the same number of steps. `uneven="drop"`
gives floor(N / world) each and leaves out the last N mod world samples of the (shuffled)
sequence, a different few every epoch. Within a rank, workers get counts that depend only on
the rank's count, so every rank yields the same number of batches from each worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

Uneven = Literal["pad", "drop"]
_SHARD_STREAM, _BUFFER_STREAM = 0x5348, 0x4255  # keep the two generators' streams apart


def _raw(words: tuple[int, ...], n: int) -> np.ndarray:
    """n uint64 draws from PCG64 seeded by `words`; the raw bit stream is stable across numpy
    versions (unlike Generator methods), so an order computed today is the order tomorrow."""
    return np.random.PCG64(np.random.SeedSequence(list(words))).random_raw(n) if n else np.empty(0, np.uint64)


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Indices into the sorted list of committed shards, in the order the epoch reads them."""
    if not shuffle:
        return np.arange(num_shards)
    return np.argsort(_raw((seed, epoch, _SHARD_STREAM), num_shards), kind="stable")


def rank_count(total: int, world: int, uneven: Uneven) -> int:
    """Samples per rank: the same on every rank."""
    if total == 0:
        return 0
    return -(-total // world) if uneven == "pad" else total // world


def worker_span(per_rank: int, workers: int, worker: int) -> tuple[int, int]:
    """(offset within the rank's slice, count) of one worker; depends on the rank's count only."""
    base, extra = divmod(per_rank, workers)
    return worker * base + min(worker, extra), base + (worker < extra)


def buffer_shuffle(n: int, k: int, words: tuple[int, ...]) -> np.ndarray:
    """out[t] = the input index a K-slot shuffle buffer emits as its t-th output.

    The buffer starts with inputs 0..K-1; each step emits a random slot and refills it with the
    next input; at the end the remaining slots drain in random order. out[t] <= t + K - 1, so a
    reader that fetches inputs in ascending order holds at most K undelivered samples.
    """
    if k <= 1 or n <= 1:
        return np.arange(n, dtype=np.int64)
    draws = _raw((*words, _BUFFER_STREAM), n).tolist()
    buf = list(range(min(k, n)))
    out = [0] * n
    t = 0
    for i in range(len(buf), n):
        j = draws[t] % k
        out[t], buf[j] = buf[j], i
        t += 1
    while buf:
        j = draws[t] % len(buf)
        out[t] = buf[j]
        buf[j] = buf[-1]
        buf.pop()
        t += 1
    return np.asarray(out, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class ConsumerPlan:
    """One (rank, worker)'s share of an epoch, in the consumer's own input order (index i)."""

    shard: np.ndarray  # [m] index into the sorted list of committed shards
    record: np.ndarray  # [m] record index within that shard
    padding: np.ndarray  # [m] bool: a repeat that fills the last rank's slice (uneven="pad")
    order: np.ndarray  # [m] order[t] = the input index emitted t-th

    def __len__(self) -> int:
        return len(self.order)


def plan_consumer(records_per_shard: list[int], *, seed: int, epoch: int, shuffle: bool, shuffle_buffer: int,
                  rank: int, world: int, worker: int, workers: int, uneven: Uneven) -> ConsumerPlan:
    """Everything one consumer needs to know about its part of the epoch, from indices alone."""
    counts = np.asarray(records_per_shard, dtype=np.int64)
    perm = shard_order(len(counts), seed, epoch, shuffle)
    starts = np.concatenate([[0], np.cumsum(counts[perm])])
    total = int(starts[-1])
    per_rank = rank_count(total, world, uneven)
    offset, m = worker_span(per_rank, workers, worker)
    g = rank * per_rank + offset + np.arange(m, dtype=np.int64)  # position in the padded sequence
    padding = g >= total
    real = g % total if total else g
    k = np.searchsorted(starts, real, side="right") - 1
    words = (seed, epoch, rank, world, worker, workers)
    order = buffer_shuffle(m, shuffle_buffer if shuffle else 1, words)
    return ConsumerPlan(shard=perm[k] if m else k, record=real - starts[k] if m else real, padding=padding,
                        order=order)
