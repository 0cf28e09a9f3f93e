"""The order of an epoch: a pure function of (seed, epoch, rank, world, worker, workers).

Nothing here touches data. The committed shards are permuted per (seed, epoch); their records,
end to end, form the epoch's sequence of N samples. Each rank takes a contiguous slice of it
and each DataLoader worker a contiguous part of its rank's slice (contiguous, so a consumer
reads whole runs of adjacent records: few, large ranged GETs). A consumer's samples then pass
through a shuffle buffer of K slots whose every choice comes from a counter-based generator, so
the output order is a permutation computed from indices alone. Resuming therefore needs only
the number of samples already consumed: the buffer's content at that point is recomputed, and
no skipped record is fetched or decoded.

Uneven counts: with `uneven="pad"` every rank gets ceil(N / world) samples and the slices that
run past the N-th sample (the last rank's; with world near N, the last few ranks') wrap to the
start of the epoch's sequence for the world·M − N (< world) they lack; the loader yields those
repeats with `padding=True` and an all-zero loss mask, so every sample counts exactly once in
the loss while every rank runs the same number of steps. `uneven="drop"` gives floor(N / world)
each and leaves out the last N mod world samples of the sequence: the tail records of the
shard(s) the epoch's permutation puts last (records keep their order inside a shard). Within a rank, workers get counts that depend only on
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


# -- follow mode: the first epoch of a run that is still being extracted ----------------------------

def follow_share(n: int, shard: int, consumers: int, consumer: int) -> tuple[int, int]:
    """(offset, count) of `consumer`'s contiguous part of shard `shard`'s `n` records in a follow
    epoch: `consumers` near-equal parts, in consumer order; the n mod C parts one record larger
    are those of consumers shard mod C, shard mod C + 1, ... (cyclic), so which consumers get an
    extra record rotates with the shard and the totals stay close."""
    base, extra = divmod(n, consumers)
    a = shard % consumers

    def extras_below(c: int) -> int:  # consumers < c among the cyclic interval [a, a + extra)
        if a + extra <= consumers:
            return min(max(c - a, 0), extra)
        return min(max(c - a, 0), consumers - a) + min(c, a + extra - consumers)

    below = extras_below(consumer)
    return consumer * base + below, base + extras_below(consumer + 1) - below


def follow_target(records_per_shard: list[int], consumers: int) -> int:
    """Samples every consumer yields in the follow epoch: the largest consumer's total over the
    PLANNED records of every shard. Known from the manifest before any shard exists (so is the
    epoch's batch count), and at least any consumer's real total (a share never grows when a
    shard commits fewer records than planned), so padding always fills up to it."""
    counts = np.asarray(records_per_shard, dtype=np.int64)
    if consumers < 1 or counts.size == 0:
        return 0
    base, extra = np.divmod(counts, consumers)
    starts = np.arange(counts.size, dtype=np.int64) % consumers
    diff = np.zeros(consumers + 1, dtype=np.int64)
    ends = starts + extra
    np.add.at(diff, starts, 1)
    np.add.at(diff, np.minimum(ends, consumers), -1)
    wrap = ends > consumers
    diff[0] += int(wrap.sum())
    np.add.at(diff, ends[wrap] - consumers, -1)
    return int(base.sum() + np.cumsum(diff[:-1]).max())


class StreamingShuffle:
    """`buffer_shuffle` computed while its inputs are still arriving (follow mode).

    Emits only when the K slots are full, or once `end()` said no input follows: the slot an emit
    frees is filled by the next input, or, if input ends first, by the last slot (the drain step).
    So the t-th emit equals buffer_shuffle(n, K, words)[t] for the final input count n, and the
    first n_known - K + 1 emits are fixed as soon as n_known inputs are known."""

    def __init__(self, k: int, words: tuple[int, ...]):
        self.k, self.words = max(1, k), words
        self.slots: list[int] = []
        self.hole: int | None = None
        self.emitted = 0
        self.ended = False
        self._draws: list[int] = []

    def _draw(self) -> int:
        if self.emitted >= len(self._draws):  # a prefix of the same counter-based stream, regrown
            self._draws = _raw((*self.words, _BUFFER_STREAM), max(1024, 2 * len(self._draws))).tolist()
        return self._draws[self.emitted]

    def wants_input(self) -> bool:
        return not self.ended and (self.hole is not None or len(self.slots) < self.k)

    def ready(self) -> bool:
        return self.hole is None and bool(self.slots) and (self.ended or len(self.slots) == self.k)

    def add(self, i: int) -> None:
        if self.hole is not None:
            self.slots[self.hole], self.hole = i, None
        else:
            self.slots.append(i)

    def end(self) -> None:
        self.ended = True
        if self.hole is not None:
            self.slots[self.hole] = self.slots[-1]
            self.slots.pop()
            self.hole = None

    def emit(self) -> int:
        """The next input index out (call only when `ready()`)."""
        j = self._draw() % (len(self.slots) if self.ended else self.k)
        out = self.slots[j]
        if self.ended:
            self.slots[j] = self.slots[-1]
            self.slots.pop()
        else:
            self.hole = j
        self.emitted += 1
        return out

    def upcoming(self, n: int, fed: int, known: int) -> list[int]:
        """The next (up to) `n` emits, as far as they are fixed already: inputs `fed` .. `known`-1
        are known and go in, in order, as the consumer's loop adds them; the look stops where it
        would need an input not known yet (or the end, which is only known when it comes).
        Changes nothing: lets a consumer decode the samples it will emit next."""
        sim = StreamingShuffle(self.k, self.words)
        sim.slots, sim.hole, sim.emitted, sim.ended, sim._draws = list(self.slots), self.hole, self.emitted, \
            self.ended, self._draws
        out: list[int] = []
        while len(out) < n:
            if sim.ready():
                out.append(sim.emit())
            elif sim.wants_input() and fed < known:
                sim.add(fed)
                fed += 1
            else:
                break
        self._draws = sim._draws  # a longer prefix of the same stream, if the look drew past it
        return out

    def held(self) -> list[int]:
        """Input indices in the slots, not emitted yet."""
        return [x for j, x in enumerate(self.slots) if j != self.hole]
