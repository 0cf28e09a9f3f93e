"""Reused buffers for the bytes GETs bring.

A fresh large buffer is page-faulted in, 4 KiB at a time, as a GET fills it: glibc maps every
buffer above its mmap threshold (at most 32 MiB; in threads, anything over 64 MiB) afresh and
unmaps it when freed. On the VMs we measured, filling a fresh 47 MiB buffer runs at 0.9 GB/s and
a reused one at 5.8-8.1 GB/s (bench/page_faults.py). Keeping finished GETs' buffers and lending
them to later GETs of about the same size takes the loader's reads off that path whatever the
process's MALLOC_* settings.
"""

from __future__ import annotations

import threading

import numpy as np

POOLED_MIN = 1 << 20  # smaller buffers are a few pages, which malloc serves well


def size_class(nbytes: int) -> int:
    """The size of the buffer a GET of `nbytes` gets: from `POOLED_MIN` up, rounded up to one of 8
    sizes per power of two (at most 1/8 wasted), so GETs of slightly different sizes share buffers."""
    if nbytes < POOLED_MIN:
        return nbytes
    unit = 1 << (nbytes.bit_length() - 4)
    return -(-nbytes // unit) * unit


class BufferPool:
    """Idle buffers by size class; the caller decides, against its memory budget, how many idle
    bytes to keep. A `ShardStream` keeps one across its epochs, so each epoch starts warm."""

    def __init__(self) -> None:
        self._idle: dict[int, list[np.ndarray]] = {}
        self.idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, size: int, up_to: int) -> np.ndarray:
        """An uninitialized uint8 buffer of `size` bytes or more: the smallest idle one of at most
        `up_to` bytes and at most 1/4 more than `size`, else a new one of `size`."""
        limit = min(up_to, size + size // 4)
        with self._lock:
            fits = [s for s, free in self._idle.items() if free and size <= s <= limit]
            if fits:
                best = min(fits)
                self.idle_bytes -= best
                return self._idle[best].pop()
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Keep `buf`, which no one reads any more, for a later `take` of its size."""
        if buf.size >= POOLED_MIN:
            with self._lock:
                self._idle.setdefault(buf.size, []).append(buf)
                self.idle_bytes += buf.size

    def trim(self, max_idle: int) -> None:
        """Let idle buffers go, largest first, until at most `max_idle` bytes are kept."""
        with self._lock:
            for size in sorted(self._idle, reverse=True):
                free = self._idle[size]
                while free and self.idle_bytes > max_idle:
                    free.pop()
                    self.idle_bytes -= size
