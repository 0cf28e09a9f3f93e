"""Stop signals (Slurm's preemption and time-limit warnings, a user's kill or Ctrl-C), one helper
for extraction and training.

It lives in `manifests/`, the lowest package both `extract/` and `train/` import that knows
about jobs: `storage/` is the byte layer and has no notion of a job being stopped, while a
stopped attempt is part of a run's record (a failure record's `preempted`, which `WorkQueue`
sets for any stop that is not an `Exception`, as `Preempted` is not).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)


class Preempted(BaseException):
    """SIGTERM/SIGUSR1 from Slurm or a user: the job stops and is rerun (or requeued) later.

    A BaseException, so that no `except Exception` on the way up records it as a failure."""

    exit_code = 143


class Interrupted(Preempted):
    """Ctrl-C: stopped as a preemption is, not a failure; the same command resumes."""

    exit_code = 130


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def _stop_for(signum: int) -> Preempted:
    if signum == signal.SIGINT:
        return Interrupted("Ctrl-C (SIGINT)")
    return Preempted(f"received {signal.Signals(signum).name}")


class StopSignals:
    """Handlers for `signals` while in the `with` block; the previous handlers come back after it.

    `at_once=True` (extraction): the handler raises `Preempted` (or `Interrupted`) wherever the
    main thread is, so a wait (the model loading, the work queue's pause, a storage window) ends
    at once. Not inside `deferred()` blocks: there it only records the stop in `requested`, which
    the block raises as it ends and the code inside reads at safe points (`raise_if_requested`).
    Code that joins threads or hands items through queues runs in such blocks: an exception raised
    into `Thread.join` made CPython 3.11 take the thread for ended (a stopped worker exited while
    its last shard was committing, its lease left behind), and one raised inside `Queue.put`'s
    notify lost the wake-up of the thread waiting on it (a worker hung for good after SIGUSR1).

    Either way it ignores every later stop signal: under Slurm the signal can come twice (to every
    process of the job, and again through a launcher), and Ctrl-C reaches a launcher and its
    workers alike; a second one must not break off the cleanup, which takes seconds.

    `at_once=False` (training): the handler only records the stop in `requested`, which the loop
    reads at its next step boundary, where a checkpoint can be saved. A second Ctrl-C raises
    KeyboardInterrupt there and then: a user who will not wait for the step gets out at once
    (from the last checkpoint).

    A SIGINT the shell told the process to ignore (`nohup`, a background job) stays ignored.
    """

    def __init__(self, *, at_once: bool, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.at_once, self.signals = at_once, signals
        self.requested: Preempted | None = None
        self._requested_at: float | None = None  # time.monotonic() of the first stop signal
        self._deferring = 0  # depth of `deferred()` blocks the main thread is in
        self._previous: dict[int, object] = {}

    _installed: list[StopSignals] = []  # the blocks this process is in, innermost last (handlers are per process)

    def __enter__(self) -> StopSignals:
        self.requested, self._requested_at, self._deferring = None, None, 0
        for sig in self.signals:
            if not (sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN):
                self._previous[sig] = signal.signal(sig, self._on_signal)
        StopSignals._installed.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self in StopSignals._installed:
            StopSignals._installed.remove(self)

    def _on_signal(self, signum: int, frame: object) -> None:
        stop = _stop_for(signum)
        if self.at_once:
            if self.requested is not None:  # a signal that was already pending when the first came
                return
            self.requested, self._requested_at = stop, time.monotonic()
            for sig in self._previous:
                signal.signal(sig, signal.SIG_IGN)
            if not self._deferring:
                raise stop
            log.warning("%s: stopping at the next safe point (the batch or shard under way ends first)", stop)
            return
        if self.requested is None:
            self.requested, self._requested_at = stop, time.monotonic()
            log.warning("%s: stopping at the next step boundary, with a checkpoint%s", stop,
                        "; Ctrl-C again stops at once, without one" if isinstance(stop, Interrupted) else "")
        elif isinstance(stop, Interrupted) and isinstance(self.requested, Interrupted):
            raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A block that a stop signal does not break into (see the class): the stop is raised as
        the outermost such block ends, also in place of an error leaving it (chained to it): a
        caller that logs errors and goes on (import's next shard) would otherwise go on with the
        stop pending, deaf to signals (the first set SIG_IGN) while it waits for work."""
        self._deferring += 1
        try:
            yield
        except Exception as e:
            if self._deferring == 1 and self.requested is not None:
                raise self.requested from e
            raise
        finally:
            self._deferring -= 1
        if not self._deferring:
            self.raise_if_requested()

    def raise_if_requested(self) -> None:
        """Raise the stop a signal asked for, if one did: a safe point to stop at."""
        if self.requested is not None:
            raise self.requested

    def stopped_for(self) -> float | None:
        """Seconds since the first stop signal; None if none came."""
        return None if self._requested_at is None else time.monotonic() - self._requested_at


@contextmanager
def shielded() -> Iterator[None]:
    """A block that no stop signal breaks into, for code that cannot know which `StopSignals` it
    runs under and leaves shared state behind when cut off (an output lease's claim and release:
    cut off, the lease stayed on the store until it went stale, and the rerun waited for it). Under
    the innermost `StopSignals(at_once=True)` it is that one's `deferred()`; elsewhere (no block, a
    training loop's, or after a stop, when later signals are ignored) a plain block."""
    stops = StopSignals._installed[-1] if StopSignals._installed else None
    if stops is None or not stops.at_once or stops.requested is not None:
        yield
        return
    with stops.deferred():
        yield


class AsyncStop:
    """`StopSignals(at_once=True)` for code on an asyncio loop, entered in its main task: a stop
    signal cancels that task, and the block raises `Preempted` (or `Interrupted`) as it ends.

    A handler that raises, as `StopSignals` does, raises in whatever the loop runs then: once it
    landed in asyncio's socket write, which reported a "fatal write error", the request was
    retried and `layertap regenerate` went on to exit 0 after a SIGTERM. The loop's own signal
    handling runs the callback between its steps instead. Later stop signals are ignored, as
    `StopSignals` ignores them; the handlers from before come back after the block."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS):
        self.signals = signals
        self.requested: Preempted | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> AsyncStop:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        for sig in self.signals:
            previous = signal.getsignal(sig)
            if not (sig == signal.SIGINT and previous == signal.SIG_IGN):
                self._previous[sig] = previous
                self._loop.add_signal_handler(sig, self._on_signal, sig)
        return self

    def _on_signal(self, signum: int) -> None:
        if self.requested is None:
            self.requested = _stop_for(signum)
            self._task.cancel()

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, previous in self._previous.items():
            self._loop.remove_signal_handler(sig)
            signal.signal(sig, previous)
        self._previous.clear()
        if self.requested is not None and (exc_type is None or issubclass(exc_type, asyncio.CancelledError)):
            raise self.requested from None
