"""A worker's loop over the shards it claims: shard n finishes while shard n+1's forwards run.

A shard's tail (its last batch's encodes, the object's completion, the commit record, the
lease's release) and the next claim and tokenization are I/O and CPU work. Done in turn, the
device idles through all of them once per shard: at Qwen3.6-27B's shapes a 1 GB shard is about
two 16k-token batches (~3 s on an H200), so a tail of a fraction of a second costs a
double-digit share of the GPU-hours. Here shard n's `ShardTail.finish`, its commit and its
claim's exit run on a thread of their own while the loop claims, tokenizes and runs shard n+1;
at most one shard finishes behind the one extracting. With a storage window the tail is
awaited before the next claim, so the window's check sees every shard this worker produced; on
CPU too, where the tail's work would only take the forward's cores.

A stop signal never breaks into a shard's work here: each shard runs in a `StopSignals.deferred`
block, where the stop is a flag read at batch boundaries (`start` raises it), and the loop waits
for a finishing shard on an event its thread sets as it ends, never on `Thread.join` (which a
signal's exception broke in CPython 3.11: the thread then counted as ended, so a stopped worker
exited while its shard was committing).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from layertap.extract.estimate import fmt_bytes
from layertap.extract.pipeline import ShardTail
from layertap.manifests.preemption import Interrupted, Preempted, StopSignals
from layertap.manifests.work import Claim
from layertap.storage.units import counted
from layertap.storage.writer import ShardInfo

log = logging.getLogger("layertap.extract")


@dataclass
class Started:
    """A shard whose forwards are done (`tail`), with what its commit records besides."""

    tail: ShardTail
    skipped: list[dict[str, str]]
    truncated: int


class Finishing(threading.Thread):
    """Shard n's tail, commit and claim exit, on a thread of its own; then `report(self)`, from
    this thread too, so the progress counts a commit as soon as its tally marker exists."""

    def __init__(self, claim: Claim, started: Started, records: _Counter, report: Callable[[Finishing], None]):
        super().__init__(name=f"finish-shard-{claim.shard}", daemon=True)
        self.claim, self.started, self.records, self.report = claim, started, records, report
        self.info: ShardInfo | None = None
        self.committed = False
        self.error: BaseException | None = None
        self.done = threading.Event()  # set as `run` ends, whatever happened: what the loop waits on

    def run(self) -> None:
        try:
            self.info = self.started.tail.finish()
            self.claim.commit(self.info, skipped=self.started.skipped, truncated=self.started.truncated)
        except BaseException as e:  # recorded by the claim's exit, reported below
            self.error = e
        finally:
            self.committed = self.claim.committed  # set once the commit record exists, even if a later step failed
            e = None if self.committed else self.error  # an error after the commit: the shard is done
            try:
                self.claim.__exit__(type(e) if e else None, e, e.__traceback__ if e else None)
                if self.claim.superseded:  # another attempt's commit counts the shard
                    self.error = None
            except BaseException as exit_error:  # e.g. the store gone: the lease goes stale
                self.error = self.error or exit_error
            try:
                self.report(self)
            except Exception:
                log.exception("shard %d: reporting its end failed", self.claim.shard)
            finally:
                self.done.set()


class ShardLoop:
    """Claims shards from `claims` and runs each: `start(claim, on_record)` runs the forwards and
    returns a `Started`; the rest finishes behind the next shard (`overlap`) or at once.
    `committed(claim, info, skipped)` and `abandoned(claim, records)` report each outcome (from
    the finishing thread for a finished shard: they must be thread-safe).

    `stops`: the process's stop signals (entered by the caller, at once); each shard runs in its
    `deferred()` block, so `start` must stop at its safe points (`stops.raise_if_requested()`)."""

    STOP_WAIT_S = 30.0  # how long a stop waits for the shard finishing behind (within Slurm's usual KillWait)
    POLL_S = 0.2  # how often a wait for the finishing shard looks whether a stop came

    def __init__(self, start: Callable[[Claim, Callable], Started], *, overlap: bool,
                 committed: Callable[[Claim, ShardInfo, int], None], abandoned: Callable[[Claim, int], None],
                 stops: StopSignals | None = None):
        self.start, self.overlap = start, overlap
        self.on_committed, self.on_abandoned = committed, abandoned
        self.stops = stops if stops is not None else StopSignals(at_once=True)  # not entered: no stop ever comes
        self.committed = 0
        self._pending: Finishing | None = None

    def run(self, claims: Iterable[Claim]) -> int:
        """Work through `claims`; the number of shards this worker committed."""
        handed: Claim | None = None  # handed over by the queue, not yet taken by `_one`
        try:
            for handed in claims:
                with self.stops.deferred():
                    claim, handed = handed, None
                    self._one(claim)
            self.settle()  # the last shard's tail
        except BaseException as e:
            if handed is not None:  # a stop landed between the queue's hand-over and the deferred block:
                handed.release()  # the queue let the lease go to us, and no one else releases it
            if isinstance(e, Exception):
                try:
                    self.settle()
                except Preempted:  # a stop while waiting: as below
                    self._settle_within(self.STOP_WAIT_S)
                    raise
            else:  # a stop: the shard finishing behind is kept if it completes soon, else left as a kill leaves it
                self._settle_within(self.STOP_WAIT_S)
            raise
        return self.committed

    def _one(self, claim: Claim) -> None:
        count = _Counter()
        started: Started | None = None
        finishing: Finishing | None = None
        try:
            claim.__enter__()
            started = self.start(claim, count)
            self.settle()  # shard n-1, normally finished during this shard's forwards
            finishing = Finishing(claim, started, count, self._report)
            finishing.start()
            self._pending = finishing
        except BaseException as e:
            if finishing is not None and finishing.ident is not None:  # started: it finishes the shard itself
                self._pending = finishing
                raise
            try:
                if started is not None:
                    started.tail.abort()
            finally:
                claim.__exit__(type(e), e, e.__traceback__)
            if isinstance(e, Preempted):
                claim.release()  # idempotent: done by the claim's exit unless the store failed it
                log.warning("%s: shard %d aborted, its lease released",
                            "interrupted" if isinstance(e, Interrupted) else "preempted", claim.shard)
            self.on_abandoned(claim, count.n)  # before a stop goes up too: the last progress line counts them
            if not isinstance(e, Exception):
                raise
            if claim.superseded:  # another attempt's commit counts the shard (the claim logged it)
                return
            log.error("shard %d failed: %s: %s", claim.shard, type(e).__name__, e,
                      exc_info=log.isEnabledFor(logging.DEBUG))
            return
        if not self.overlap:
            self.settle()

    def settle(self) -> bool:
        """Wait for the shard finishing behind this one; False if there was none. The work queue
        calls it before it would wait for leases to free up (`on_idle`): one of them may be this
        worker's own finishing shard. A stop signal meanwhile raises here (the shard is still
        pending: `run` gives it `STOP_WAIT_S` more)."""
        pending = self._pending
        if pending is None:
            return False
        with self.stops.deferred():
            while not pending.done.wait(self.POLL_S):
                self.stops.raise_if_requested()
        self._pending = None
        return True

    def _settle_within(self, seconds: float) -> None:
        pending = self._pending
        if pending is None:
            return
        if not pending.done.wait(seconds):
            log.warning("shard %d was still finishing %.0f s after the stop; leaving it: its lease goes stale and "
                        "the shard is redone (or its commit, if it lands, counts)", pending.claim.shard, seconds)
            self.on_abandoned(pending.claim, pending.records.n)  # left unfinished: the stop's message names it
        self._pending = None

    def _report(self, done: Finishing) -> None:
        """How a shard that finished behind the next one ended (on its finishing thread)."""
        claim = done.claim
        if done.committed:
            self.committed += 1  # one finishing thread at a time
            info = done.info
            self.on_committed(claim, info, len(done.started.skipped))
            log.info("shard %d committed: %s, %s, %s (%d skipped, %d truncated)", claim.shard,
                     counted(info.num_records, "sample"), counted(info.num_tokens, "token"), fmt_bytes(info.bytes),
                     len(done.started.skipped), done.started.truncated)
            if done.error is not None:
                log.warning("shard %d: after its commit: %s: %s", claim.shard, type(done.error).__name__, done.error)
        elif done.error is not None:
            self.on_abandoned(claim, done.records.n)
            log.error("shard %d failed: %s: %s", claim.shard, type(done.error).__name__, done.error,
                      exc_info=(type(done.error), done.error, done.error.__traceback__)
                      if log.isEnabledFor(logging.DEBUG) else None)
        else:
            self.on_abandoned(claim, done.records.n)  # another attempt's commit counts these samples


class _Counter:
    """Records written for one shard (the writer thread calls it)."""

    def __init__(self):
        self.n = 0

    def __call__(self, rec) -> None:
        self.n += 1
