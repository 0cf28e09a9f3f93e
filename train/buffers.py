"""Reused buffers for the bytes GETs bring: a fresh large buffer is page-faulted in, 4 KiB at a
time, as the GET fills it.

glibc maps every buffer above its mmap threshold (at most 32 MiB; in threads, anything over
64 MiB) afresh and unmaps it on free, so each GET body would pay those faults again: on the VMs we
measured, filling a fresh 47 MiB buffer runs at 0.9 GB/s and a reused one at 5.8-8.1 GB/s
(bench/page_faults.py). The pool keeps released buffers mapped and lends them again, so the
loader does not depend on the process's MALLOC_* settings for this.
"""

from __future__ import annotations

import threading

import numpy as np

POOLED_MIN = 1 << 20  # smaller buffers are a few pages, which malloc serves well


def _size_class(nbytes: int) -> int:
    """`nbytes` rounded up to one of 8 sizes per power of two (at most 1/8 wasted), so buffers of
    GETs of slightly different sizes can serve each other."""
    unit = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // unit) * unit


class BufferPool:
    """Lends uint8 buffers and keeps those of at least `POOLED_MIN` bytes for reuse once given
    back, as long as what is lent plus what is kept stays within `limit` bytes. A kept buffer is
    lent again only for a request it fits with at most 1/4 to spare."""

    def __init__(self, limit: int):
        self.limit = limit
        self._free: list[np.ndarray] = []
        self._free_bytes = self._lent = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least `nbytes` (uninitialized); give it back when nothing reads it."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.size <= nbytes + nbytes // 4]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].size))
                self._free_bytes -= buf.size
                self._lent += buf.size
                return buf
            size = _size_class(nbytes) if nbytes >= POOLED_MIN else nbytes
            while self._free and self._lent + self._free_bytes + size > self.limit:  # unmap what cannot serve
                self._free_bytes -= self._free.pop(0).size
            self._lent += size
        return np.empty(size, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """`buf`, from `take`, is read by no one any more: keep it for reuse, or let it go."""
        with self._lock:
            self._lent -= buf.size
            if buf.size >= POOLED_MIN and self._lent + self._free_bytes + buf.size <= self.limit:
                self._free.append(buf)
                self._free_bytes += buf.size
