"""Work assignment through leases on the store, and the commit protocol.

A worker claims a shard by creating the next lease generation for it (create-if-absent, so
exactly one claimant wins each generation); while it works, a heartbeat rewrites a key of its
own beside the lease (`layout.beat_key`), never the lease itself: a renewal that lands late, after
a takeover (a worker paused between its check and its PUT), must not overwrite a lease that a new
claimant created under the same key. A dead worker's lease goes stale `ttl_s` after its newest
beat, and any worker may then claim the next generation. Finishing a shard means: data object complete, then
the commit record created if absent. Two workers that both finish one shard (a takeover of a
worker that was only slow) therefore yield exactly one commit; the loser deletes its data. The
winner then writes the shard's tally marker and its feed key (`layout.feed_key`, named by the
time: how a follow-mode trainer finds new commits without listing all of them).

Each attempt writes its data under a key of its own (`shards/{id}-{attempt}.lts`: the worker's
token and a nonce, named in its lease), so neither a crashed or zombie attempt nor an earlier
attempt of the same worker can overwrite the bytes that a commit points at.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, TypeVar

from layertap.manifests import layout
from layertap.manifests.liveness import gone_from_here
from layertap.manifests.manifest import Manifest, ManifestError, ShardPlan
from layertap.manifests.records import CommitRecord, FailureRecord, Producer, decode_commit, decode_failure, encode
from layertap.manifests.state import Lease, RunState, feed_since, fits_plan, over_plan, scan, scan_shard, shard_leases
from layertap.storage.errors import ConfigError
from layertap.storage.retry import SPREAD, Backoff
from layertap.storage.store import ObjectNotFound, ObjectStore, StoreError, TransientStoreError
from layertap.storage.units import id_ranges

if TYPE_CHECKING:  # not imported at run time: the writer imports the codecs, and they torch
    from layertap.storage.writer import ShardInfo

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 60.0
WAIT_LOG_S = 30.0  # an idle worker says what it waits on at most this often
HOLDERS_READ_PER_PASS = 16  # lease payloads an idle worker reads per pass (`WorkQueue._dead_here`)
# How long a worker rides out a store failing past its retries before it gives up (`patiently`).
OUTAGE_S = 600.0
LONG_LOOK_S = 900.0  # longer than a request failing past its retries takes (8 tries of 10 s connect + 60 s read)
# How long after a stop signal a lease is still renewed: past a stopped worker's wait for the shard
# finishing behind (extract.worker's STOP_WAIT_S, 30 s) and its cleanup, so one that hangs on its
# way out lets its shard go after this and a TTL, not never.
STOP_GRACE_S = 60.0
# Attempts of one shard that the store may fail (past its own retries: throttled, 5xx, down) in one
# run, and for at least `OUTAGE_S`, before the shard is given up as one past --retries is
# (`store_gave_out`). Not counted at --retries: a burst of throttling by 1,000 workers gave up
# shards that were fine. Not unbounded either: a store failing one shard for good (MinIO's 507
# XMinioStorageFull on a full disk, a key that always answers 500) had every worker retry it
# forever, a failure record each time. 20 is ten times the default --retries' 2 tries, and each
# such attempt lasts its request's ~11 s of retries (`storage.retry`) on top of the shard's work;
# the span keeps a short shard that fails fast from being given up within an outage that workers
# ride out. Never fewer than --retries allows (`WorkQueue.store_failures`).
STORE_FAILURES = 20
# Store failures of a shard this close together are one streak of a store failing it
# (`store_gave_out`); a longer pause between two starts another.
STREAK_GAP_S = OUTAGE_S / 4
# An end-of-run sweep claimed but not marked done this long after is taken for one whose worker was
# killed (or whose store failed), and another worker sweeps again. A sweep lists about a minute at
# 150,000 shards; one taken over too early only costs a second sweep: sweeps are idempotent.
SWEEP_TTL_S = 600.0
SWEPT = ".done"  # beside a sweep's claim: that sweep ran to its end (`WorkQueue._sweep`)
COMMITS_LOOK_S = 300.0  # a worker lists every commit record this often; between, the feed keys (`CommitView`)
T = TypeVar("T")


def patiently(look: Callable[[], T], pause: Callable[[], float]) -> T:
    """`look` at the store, riding out an outage: a store throttling or failing for longer than
    its own retries (`storage.retry`, ~10-20 s) ended the worker (and with srun's
    --kill-on-bad-exit, its node's other workers), when 1,000 workers' requests are what makes
    a store throttle. Tries again after `pause()` seconds, for up to `OUTAGE_S` of failing looks:
    counted from the first failure, and afresh after a look that ran longer than `LONG_LOOK_S`
    before it failed (no failing request lasts that long: the store answered in it; a window
    gate's look waits for hours, and its deadline had passed before the outage began)."""
    deadline = None
    while True:
        began = time.monotonic()
        try:
            return look()
        except TransientStoreError as e:
            now = time.monotonic()
            if now - began > LONG_LOOK_S:  # the store answered in this look: the outage began late in it
                deadline = now + OUTAGE_S
            elif deadline is None:
                deadline = began + OUTAGE_S
            if now > deadline:
                raise
            wait = pause()
            log.warning("the store is failing (%s); looking again in %.0f s", e, wait)
            time.sleep(wait)


class Gate(enum.Enum):
    """What `WorkQueue`'s `before_claim` answers: go on at once (OPEN), go on after a wait (WAITED:
    others may have taken the shard meanwhile), or do not claim it (REDO: the storage window is
    still full, but a shard `verify` withdrew awaits its redo, which no window holds back)."""

    OPEN = "open"
    WAITED = "waited"
    REDO = "redo"


class Claim:
    """A leased shard. Use as a context manager around the work; see `WorkQueue`."""

    def __init__(self, queue: WorkQueue, plan: ShardPlan, generation: int, attempt: str, redo: bool = False,
                 first: bool = False):
        self.queue, self.plan, self.generation = queue, plan, generation
        self.redo = redo  # of a shard `verify` withdrew: its commit removes the shard's `layout.redo_key`
        # claimed where no attempt had been (no lease, no failure record): its commit need not look for
        # what earlier attempts left
        self.first = first
        self.shard = plan.id
        self.lease_key = layout.lease_key(plan.id, generation, queue.ttl_s)
        self.beat_key = layout.beat_key(self.lease_key, attempt)  # what the heartbeat rewrites
        self.data_key = layout.data_key(plan.id, attempt)
        self.started_at = time.time()
        self.lost = threading.Event()  # set when another worker took the lease over
        self.committed = False
        self.superseded = False  # this attempt failed after another one committed the shard
        self._creating_commit = False  # inside the commit's create: a failure there may still land
        self._stop = threading.Event()
        self._released = False
        self._beaten = False  # a beat key of this attempt's may exist (`release` deletes it)
        self._heartbeat = threading.Thread(target=self._beat, name=f"lease-{plan.id}", daemon=True)

    @property
    def attempt(self) -> int:
        return self.generation

    def __enter__(self) -> Claim:
        self.queue.progress()
        self._heartbeat.start()
        return self

    def lease_payload(self) -> bytes:
        return self.queue.lease_payload(self.generation, self.data_key)

    def _beat(self) -> None:
        """Renew the lease while it is ours, by rewriting this attempt's beat key: a PUT that lands
        late touches no one else's key (it counts as a beat of a lease under our key name, if a
        new claim made one: that lease then looks alive at most one ttl longer). A lease no longer
        ours (`_lost_to`) is never created again: the attempt is abandoned."""
        store, period = self.queue.store, self.queue.ttl_s / 4
        # The stall watchdog looks more often than the lease is renewed where its timeout is short;
        # the store hears of the lease every ttl/4 whatever --stall-timeout is.
        look = min(period, self.queue.stall_s / 4) if self.queue.stall_s else period
        due = time.monotonic() + period
        while not self._stop.wait(look) and not self.lost.is_set():
            if (since := self.queue.stopped_for()) is not None and since > STOP_GRACE_S:
                log.warning("shard %d: still held %.0f s after a stop signal; no longer renewing its lease, which "
                            "goes stale in %g s", self.shard, since, self.queue.ttl_s)
                return
            if self.queue.stalled(self.shard):  # the worker is hung: the shard goes to another one
                self.lost.set()
                return
            if time.monotonic() < due:
                continue
            due = time.monotonic() + period
            try:
                if why := self._lost_to():
                    log.warning("shard %d: %s; abandoning this attempt", self.shard, why)
                    self.lost.set()
                else:
                    self._beaten = True  # before the PUT: one cut short may still land
                    store.put(self.beat_key, b"")
            except StoreError as e:  # keep trying: the lease only goes stale after ttl_s
                log.warning("shard %d: lease heartbeat failed: %s", self.shard, e)

    def _lost_to(self) -> str | None:
        """Why the lease is no longer this attempt's (None while it is): a newer generation
        exists; the key is gone (only a takeover or the sweep of a committed shard deletes a
        lease that is not its holder's: creating it again made two holders, e.g. beside a
        claim of the same generation under another --lease-ttl); or the key names another
        attempt (generations restart once a shard's leases are all gone)."""
        store = self.queue.store
        leases = [o.key for o in store.list(layout.lease_prefix(self.shard)) if layout.parse_lease(o.key)]
        if newer := [k for k in leases if layout.parse_lease(k)[1] > self.generation]:
            return f"lease taken over by {newer[-1]}"
        # By a GET, not the listing: a listing that lags a fresh write (some S3-compatible servers)
        # would make a holder abandon its own new lease.
        if lease_attempt(store, self.lease_key) != self.data_key:
            return f"lease {self.lease_key} taken over (deleted, or claimed anew by another attempt)"
        return None

    def commit(self, info: ShardInfo, *, skipped: Sequence[dict[str, str]] = (), truncated: int = 0) -> bool:
        """Publish the finished data object; False if another attempt committed this shard first."""
        store = self.queue.store
        self.queue.progress()  # its object is complete
        record = CommitRecord(
            shard=self.shard, data_key=self.data_key, bytes=info.bytes, xxh3_128=info.xxh3_128,
            num_records=info.num_records, num_tokens=info.num_tokens, raw_bytes=info.raw_bytes,
            sample_ids=info.sample_ids, skipped=list(skipped), truncated=truncated,
            relative_error=info.relative_error, producer=asdict(self.queue.producer), attempt=self.attempt,
            started_at=self.started_at, committed_at=time.time(),
        )
        if not fits_plan(record, self.queue.manifest):  # a sample lost between the forward and the object
            planned = self.queue.manifest.shards[self.shard].num_samples
            raise ManifestError(f"shard {self.shard}: its object holds {info.num_records} sample(s) and "
                                f"{len(skipped)} were skipped, the plan has {planned}: not committed")
        if over_plan(record, self.queue.manifest):  # a follow trainer's epoch is sized by the plan's count
            plan = self.queue.manifest.shards[self.shard]
            raise ManifestError(f"shard {self.shard}: its object holds {info.num_records} sample(s), but the planner "
                                f"found {plan.skips} of its {plan.num_samples} rows yield none ({plan.planned_records} "
                                "at most): this worker tokenizes otherwise than the planner did (another layertap "
                                "or tokenizer version?): not committed")
        self._creating_commit = True
        try:
            created = store.put_if_absent(layout.commit_key(self.shard), encode(record))
        except TransientStoreError:
            # Its retries used up after a try that landed (a 503 or a timeout on the answer): the
            # shard is committed, by this attempt. Taken for a failure, it skipped the tally and
            # feed keys (follow trainers saw the commit only at their next full listing).
            if self._commit_names() != self.data_key:
                raise
            log.warning("shard %d: the commit's create failed, but the record it stored is there: committed",
                        self.shard)
            created = True
        self._creating_commit = False
        if not created:
            log.info("shard %d was committed by another attempt; dropping ours", self.shard)
            store.delete(self.data_key)
            return False
        self.committed = True
        # The lease has done its job: released before the commit's other records, so a worker
        # killed after its commit leaves no lease (a rerun at once found it still fresh, kept it).
        self.release()
        store.put(layout.tally_key(self.shard, info.num_records, info.num_tokens, info.bytes, info.raw_bytes,
                                   len(skipped), truncated), b"")
        store.put(layout.feed_key(int(store.now() * 1000), self.shard, info.num_records, len(skipped)), b"")
        if self.redo:
            store.delete(layout.redo_key(self.shard))
        # Leftovers of crashed attempts: their data objects, and the uploads a SIGKILL left open
        # (billed until aborted; ours is complete, so it is not among them). Not those of an
        # attempt still at work: it drops its own when its commit loses. Looked for only where an
        # attempt came before this one, or one took it over: two LISTs a commit, and on a folder
        # store (a shared file system) each read all of shards/ (0.16 s at 90,000 shards, and
        # O(shards^2) over a run). What a first attempt's rivals leave later, the run's end sweeps.
        if self.first and not self.lost.is_set():
            return True
        leftovers = f"{layout.SHARDS}{self.shard:06d}-"
        objects = [o.key for o in store.list(leftovers) if o.key != self.data_key]
        uploads = [up.key for up in store.list_pending_uploads(leftovers)]
        if objects or uploads:  # the leases are read only then: most commits find nothing to sweep
            leases = shard_leases(store, self.queue.manifest, self.shard)
            spared = rivals_at_work(store, leases, self.shard, own_lease=self.lease_key)
            for key in objects:
                if key not in spared:
                    store.delete(key)
            for key in uploads:
                if key not in spared:
                    store.abort_pending_uploads(key)
        return True

    def fail(self, error: BaseException, preempted: bool = False) -> None:
        # A stop without a message (a bare KeyboardInterrupt) says what it was, not its name twice.
        text = str(error)[:2000] or ("stopped before the shard was finished" if preempted else type(error).__name__)
        record = FailureRecord(
            shard=self.shard, error_type=type(error).__name__, error=text,
            producer=asdict(self.queue.producer), attempt=self.attempt, time=time.time(), preempted=preempted,
        )
        # Stopped from outside (a signal, or a takeover whose lease this attempt lost): no fault of the shard's.
        # A store failing past its retries (throttled, down) is not either: 1,000 workers' bursts gave
        # shards up after `--retries` such failures. Such a stop is named apart, and counted against a
        # bound of its own (`STORE_FAILURES`) that a store failing for good reaches. The record still
        # says what happened.
        outside = preempted or self.lost.is_set()
        by_store = not outside and isinstance(error, TransientStoreError)
        try:
            # Named by the store's clock, as given-up verdicts are (`WorkQueue._give_up`):
            # a worker whose clock ran 5 s ahead named a failure newer than the verdict given 28 ms later,
            # and a follow trainer waited for a retry that no worker would make.
            key = layout.failure_key(self.shard, int(self.queue.store.now() * 1000), self.queue.producer.token,
                                     self.generation, stopped=outside, by_store=by_store)
            self.queue.store.put(key, encode(record))
        except StoreError as e:
            log.error("shard %d: could not write the failure record: %s", self.shard, e)

    def release(self) -> None:
        """Stop the heartbeat and delete the lease. Idempotent. A worker calls it where no stop
        signal breaks in (its finishing thread, or a `StopSignals.deferred` block: an exception
        raised into the join left CPython 3.11 taking the heartbeat for ended); should anything
        cut the join short all the same, the lease is still deleted."""
        if self._released:
            return
        try:
            self._stop.set()
            if self._heartbeat.is_alive():
                self._heartbeat.join()
        finally:  # even if a signal's exception cut the join short
            try:
                if self._beaten:  # our own key, whoever holds the lease now
                    self.queue.store.delete(self.beat_key)
                if lease_attempt(self.queue.store, self.lease_key) == self.data_key:  # not a new claim's
                    self.queue.store.delete(self.lease_key)
                self.queue._leases_written.discard(self.lease_key)
                self._released = True
            except StoreError as e:  # it will simply go stale
                log.warning("shard %d: could not release the lease: %s", self.shard, e)

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc is not None and not self.committed:
                # Not an Exception: a signal, Ctrl-C or exit stopped the work, the shard is fine.
                if isinstance(exc, Exception) and self._committed_by_another():
                    # A slow attempt taken over: the winner's sweep may have removed its upload
                    # under it. The shard is done, so its error is no failure of the shard.
                    self.superseded = True
                    log.info("shard %d was committed by another attempt; this one stopped with %s: %s",
                             self.shard, type(exc).__name__, exc)
                else:
                    self.fail(exc, preempted=not isinstance(exc, Exception))
                self._discard_own_data()
        finally:
            self.release()

    def _committed_by_another(self) -> bool:
        """Whether the shard's commit record exists (and names another attempt's data); False
        when it cannot be read, so that the failure is recorded."""
        return self._commit_names() not in (None, self.data_key)

    def _commit_names(self) -> str | None:
        """The data object the shard's commit record names; None where there is none, or it
        cannot be read."""
        key = layout.commit_key(self.shard)
        try:
            return decode_commit(self.queue.store.get(key), key).data_key
        except (StoreError, ManifestError):  # absent (ObjectNotFound) or unreadable
            return None

    def _discard_own_data(self) -> None:
        """Whatever point the work was interrupted at, leave nothing of this attempt: no pending
        upload, and no data object, which is complete if the stop came between the writer's close
        and the commit. Kept only if a commit names it: a stop inside the commit's own create may
        have come after the record landed. Kept too where that create failed (its retries used
        up, a timeout): a request still queued at the server or a gateway may land after this
        look finds no commit, and would name a deleted object. Left, it is an orphan if none
        lands, which the next commit of the shard removes (its sweep of other attempts' data)."""
        store, commit_key = self.queue.store, layout.commit_key(self.shard)
        if self._creating_commit:
            log.warning("shard %d: the commit's create failed with its outcome unknown: the attempt's data (%s) is "
                        "kept, in case it lands late", self.shard, self.data_key)
            return
        try:
            store.abort_pending_uploads(self.data_key)
            try:
                named = decode_commit(store.get(commit_key), commit_key).data_key
            except ObjectNotFound:
                named = None
            if named != self.data_key:
                store.delete(self.data_key)
        except (StoreError, ManifestError) as e:  # an orphan costs space; the next commit's sweep removes it
            log.warning("shard %d: could not remove the attempt's data: %s", self.shard, e)


class CommitView:
    """The run's state as a worker's passes see it, at a cost that does not grow with the run
    between full looks: a full `scan` (every commit record, and the manifest's for a replaced
    plan) at the first look and every `COMMITS_LOOK_S`; between, the leases, failures and redo
    markers, and the feed keys written since the last look (`layout.feed_after`). At 90,000
    commits a full scan is ~96 LIST pages: 1,000 workers idle near a run's end, a scan each every
    <=30 s, sent ~3,200 LISTs a second to one prefix. A commit the feed missed (its worker killed
    before the feed key) costs one HEAD before a claim, which then `learn`s it; a shard `verify`
    withdrew has a redo marker, so it is open again at once."""

    def __init__(self, store: ObjectStore, manifest: Manifest):
        self.store, self.manifest = store, manifest
        self._times: dict[int, float] = {}  # committed shard -> its commit's time (store's clock)
        self._confirmed: set[int] = set()  # redo-marked shards a fresh look found committed (a stale marker)
        self._reopened: set[int] = set()  # committed shards the last look opened for their redo markers
        self._full_at = -math.inf  # the store's time of the last full scan
        self._feed_from = -math.inf
        self.last_full = False  # whether the last `scan` was a full one

    def scan(self, full: bool = False) -> RunState:
        if full or self.store.now() - self._full_at >= COMMITS_LOOK_S:
            st = scan(self.store, self.manifest, with_tallies=False)
            self._times, self._confirmed, self._reopened, self.last_full = dict(st.commit_times), set(), set(), True
            # The first full look's successor comes after a random 1/4 to all of COMMITS_LOOK_S (as
            # follow mode's): 1,000 workers (re)started together would list every commit record
            # within seconds of each other every COMMITS_LOOK_S (`SPREAD`: ranks may seed `random` alike).
            first = self._full_at == -math.inf
            self._full_at = st.now - (SPREAD.uniform(0.0, 0.75) * COMMITS_LOOK_S if first else 0.0)
        else:
            st = scan(self.store, self.manifest, with_tallies=False, with_commits=False)
            for millis, shard, _ in feed_since(self.store, self._feed_from):
                self._times.setdefault(shard, millis / 1000)
            self._reopened = {s for s in st.redo_marked - self._confirmed if s in self._times}
            st.commit_times = {s: t for s, t in self._times.items() if s not in self._reopened}
            st.committed = set(st.commit_times)
            self.last_full = False
        self._feed_from = st.now - layout.FEED_MARGIN_S
        return st

    def learn(self, shard: int) -> None:
        """A shard this view had open that a fresh look (`scan_shard`) found committed: where its
        redo marker opened it, the marker is a stale one (its redo's commit did not delete it).
        Not otherwise: a marker `verify` writes later must open the shard."""
        self._times.setdefault(shard, self.store.now())
        if shard in self._reopened:
            self._confirmed.add(shard)


class WorkQueue:
    """Yields claims on unfinished shards until none is left.

    Dynamic by default: any worker takes any shard. With `shards`, a static assignment (e.g. a
    Slurm array task's range) is worked through the same leases. A worker that finds no free
    shard while others hold leases on unfinished ones waits for those to finish or go stale
    rather than exit with work undone. A shard that failed `retries + 1` times since this queue
    started is left failed (its failure records say why) so a bad input cannot loop forever; so is
    one whose attempts the store failed more than `STORE_FAILURES` times (or `retries`, if more).

    `before_claim`, if given, is called right before each claim and may block (the storage
    window, `consumption.WindowGate`), with the shard and a test of the shards this queue would redo; it answers
    a `Gate`: after a wait, the shard is checked afresh, since others may have taken or finished it
    meanwhile; on `Gate.REDO` the pass ends and the next, from a fresh scan, redoes the shard. A
    shard `verify` withdrew is walked first and claimed without `before_claim`: the data its redo
    restores was at rest, counted by the window, until it was withdrawn, and a trainer resuming
    past it needs it back before it consumes anything (with the window full, nothing else moved). `on_idle`, if given,
    is called when no shard is free, before waiting on the leases; it returns whether it finished
    one of the caller's own (a shard completing behind the next, `extract.worker`), and then the
    queue looks again at once instead of waiting a poll for its own lease.

    `stopped_for`, if given, says how long ago the process was told to stop (None before that,
    `StopSignals.stopped_for`): leases are not renewed past `STOP_GRACE_S` after a stop.
    """

    def __init__(self, store: ObjectStore, manifest: Manifest, producer: Producer, *,
                 ttl_s: float = DEFAULT_LEASE_TTL_S, shards: Sequence[int] | None = None,
                 retries: int = 1, world_size: int = 1, poll_s: float | None = None,
                 before_claim: Callable[[int, Callable[[int], bool]], Gate] | None = None,
                 on_idle: Callable[[], bool] | None = None,
                 stopped_for: Callable[[], float | None] = lambda: None,
                 stall_s: float | None = None, on_stall: Callable[[float, int], None] | None = None):
        self.store, self.manifest, self.producer, self.ttl_s = store, manifest, producer, ttl_s
        self.stall_s, self.on_stall = stall_s, on_stall
        self._progressed = time.monotonic()  # when this worker last moved a shard on (`progress`)
        self._stall_told = threading.Lock()  # taken by the first heartbeat to find the worker stalled
        ids = range(len(manifest.shards)) if shards is None else shards
        check_shard_ids(ids, len(manifest.shards))
        self.candidates = list(ids)
        self._candidate_set = set(ids)
        self.retries, self.world_size = retries, max(1, world_size)
        self.store_failures = max(STORE_FAILURES, retries)  # attempts the store may fail (`Claim.fail`)
        self.poll_s = poll_s if poll_s is not None else max(0.5, ttl_s / 8)
        self.max_poll_s = 4 * self.poll_s  # ttl_s / 2 by default: see `_claims`
        # `--retries` counts the failures since this queue started: those listed now are not its. By
        # their keys, not their times: failure keys are named by each worker's reading of the store's
        # clock, which on S3 (a whole-second Date header) differs by up to a second from worker to
        # worker, and a rerun started within that second counted the last run's failures as its own
        # and gave the shard up without a try.
        self.failures_before = frozenset(self._patiently(lambda: [o.key for o in store.list(layout.FAILURES)]))
        self.given_up: set[int] = set()
        self.before_claim, self.on_idle, self.stopped_for = before_claim, on_idle, stopped_for
        self._leases_written: set[str] = set()  # lease keys this queue wrote (or was writing), not yet handed over
        self._holders_read: set[str] = set()  # live leases whose holder `_dead_here` has looked at
        self._told_wait = 0.0  # when the last "waiting on leases" line was logged (time.monotonic)
        self._view = CommitView(store, manifest)
        self.done_state: RunState | None = None  # the full scan that found this queue's shards all committed

    def _release_held(self) -> None:
        """Delete each lease this queue wrote and still holds, else left to go stale: the shard
        would look running for a TTL. Each is read first and deleted only if it is ours: a PUT
        cut short may have lost its race to another worker."""
        for key in sorted(self._leases_written):
            try:
                if lease_holder(self.store, key) == self.producer.token:
                    self.store.delete(key)
            except StoreError as e:  # it will simply go stale
                log.warning("could not release the lease %s: %s", key, e)
            self._leases_written.discard(key)

    def _give_up(self, shard: int, st: RunState, failed_by_store: Sequence[str] = ()) -> None:
        """Leave the shard, and say so on the store (once): a follow-mode trainer ends its epoch
        without a shard only on this verdict, not on a failure that a retry may still mend, so
        one named before the failures it is based on (`st`'s) would never count. Named by the
        store's clock, and never before those failures' times: workers' clocks (and their
        estimates of the store's, to a second on S3) differ. `failed_by_store`: the failure keys
        of the attempts the store failed (`store_gave_out`), which the log and the verdict count,
        with the last one's error."""
        if shard in self.given_up:
            return
        self.given_up.add(shard)
        verdict = {"producer": asdict(self.producer), "retries": self.retries}
        if failed_by_store:
            verdict.update(store_failures=len(failed_by_store), error=self._error_of(failed_by_store[-1]))
            log.error("shard %d: giving it up: the store failed %d of its attempts in this run, the last with %s. "
                      "No fault of the shard's: once the store is healthy again, the same command finishes it",
                      shard, verdict["store_failures"], verdict["error"])
        try:
            millis = max(int(self.store.now() * 1000), st.last_failure_ms(shard))
            key = layout.given_up_key(shard, millis, self.producer.token)
            self.store.put(key, json.dumps(verdict).encode())
        except StoreError as e:  # the trainer then waits on the shard until someone finishes it
            log.error("shard %d: could not record that it was given up: %s", shard, e)

    def _error_of(self, key: str) -> str:
        """The error a failure record says (one GET), as `status` shows it."""
        try:
            f = decode_failure(self.store.get(key), key)
            return f"{f.error_type}: {f.error}"
        except (StoreError, ManifestError) as e:
            return f"(its record {key} is unreadable: {e})"

    def lease_payload(self, generation: int, data_key: str) -> bytes:
        return json.dumps({"holder": asdict(self.producer), "generation": generation, "data_key": data_key,
                           "ttl_s": self.ttl_s, "claimed_at": time.time()}).encode()

    def _patiently(self, look: Callable[[], T]) -> T:
        """`patiently`, with a jittered pause of one to four polls."""
        return patiently(look, lambda: SPREAD.uniform(self.poll_s, 4 * self.poll_s))

    def _order(self, todo: list[int]) -> list[int]:
        """Each rank starts at its own fraction of the list, so ranks rarely collide, turned by an
        offset of its job's own: the ranks of one node spread evenly, and the nodes of an array
        (each with ranks 0..7 of its own accelerate world) start at different places. Without that
        offset, 125 array tasks' ranks shared 8 starting points and walked the list together,
        each claim passing the shards the others had just taken (~27x the requests per shard at
        1,000 workers). The offset hashes the job id (crc32: the same on every rank of a job)."""
        turn = zlib.crc32(self.producer.job_id.encode()) / 2**32 if self.producer.job_id else 0.0
        k = int(((self.producer.rank % self.world_size) / self.world_size + turn) % 1.0 * len(todo))
        return todo[k:] + todo[:k]

    def finished(self) -> bool:
        """Whether every shard of this queue is committed already (one scan), as a rerun asks
        before loading a model; if so, what killed attempts left behind is removed, as at the end
        of a pass (a rerun that answers "nothing to do" is often the one that follows a crash)."""
        st, todo = self._look()
        if todo:
            return False
        self.done_state = st
        self._sweep(st)
        return True

    def _look(self, full: bool = False) -> tuple[RunState, list[int]]:
        """The run as `CommitView` sees it (`full`: a full scan), and this queue's shards it has
        uncommitted; a replaced manifest raises."""
        st = self._patiently(lambda: self._view.scan(full))
        st.raise_if_replaced(self.store.uri)
        return st, [s for s in self.candidates if s not in st.committed]

    def __iter__(self) -> Iterator[Claim]:
        """The claims, one at a time (see `_claims`). A stop signal that lands in here, where no
        claim has reached its holder (inside a lease's PUT after the server stored it, or before
        the claim is yielded), releases the leases this queue still holds on the way out. Not
        GeneratorExit: a caller that drops the iterator keeps the claim it was handed."""
        try:
            yield from self._claims()
        except BaseException as e:
            if not isinstance(e, (Exception, GeneratorExit)):
                self._release_held()
            raise

    def _claims(self) -> Iterator[Claim]:
        """Passes over the unfinished shards. A pass starts from a look at the whole run (`CommitView`:
        the commits from the feed between full scans) and walks its shards in this rank's order,
        checking each the scan found free against the store afresh (`scan_shard`: a HEAD and two small listings) before claiming it (a shard the scan
        found leased is waited on without a look: near a run's end, idle workers looked afresh at
        every running shard on every pass, ~3 requests a running shard a poll), and goes on after each
        claim: a claim costs requests in proportion to the shards it walks past, not to the size
        of the run. When the walk keeps meeting shards that others finished since the scan, or
        after a pass that claimed something, the next pass takes a fresh scan.

        A pass that finds nothing to claim waits `poll_s`, twice that after the next such pass, and
        so on up to `max_poll_s` (reset by a claim): near a run's end ~1,000 idle workers scanned
        every ~7.5 s, ~50 listings each at 25,000 shards, and a lease kept fresh by its heartbeat
        cannot be claimed anyway. Never past the earliest expiry of a lease seen: a dead worker's
        shard is taken over as promptly as before."""
        soonest = 0.0  # when the earliest lease the last pass waited on goes stale (time.time())

        def nap(pause: float) -> None:
            time.sleep(min(pause, max(0.0, soonest - time.time()) + SPREAD.uniform(0, self.poll_s / 4)))

        idle = Backoff(self.poll_s, self.max_poll_s, sleep=nap, jitter=0.25)
        woken_before = False  # the last pass ended on `Gate.REDO` and claimed nothing
        while True:
            st, todo = self._look()
            if not todo and not self._view.last_full:  # the feed said so: a full scan has the last word
                st, todo = self._look(full=True)
            if not todo:
                self.done_state = st
                self._sweep(st)
                return
            # Past this many shards found finished that the scan thought open, a fresh scan is cheaper.
            rescan_after = 2 * (len(st.committed) // 1000 + 1) + 2
            waiting_on: list[float] = []
            held: list[Lease] = []  # the live leases waited on
            claimed = stale = 0
            woken = False  # the window gate told of a withdrawn shard to redo: rescan for it
            order = self._order(todo)
            redos = {s for s in order if st.withdrawn(s)}
            for s in [s for s in order if s in redos] + [s for s in order if s not in redos]:
                if stale > rescan_after:
                    break
                if lease := st.live_lease(s):  # held at the pass's scan: wait on it, no fresh look
                    waiting_on.append(lease.modified + lease.ttl_s - st.now + time.time())
                    held.append(lease)
                    continue
                fresh = self._patiently(lambda: scan_shard(self.store, self.manifest, s))
                if s in fresh.committed:
                    stale += 1
                    self._view.learn(s)
                    continue
                lease = fresh.live_lease(s)
                if lease:
                    waiting_on.append(lease.modified + lease.ttl_s - fresh.now + time.time())
                    held.append(lease)
                    continue
                if fresh.attempt_failures(s, self.failures_before) > self.retries:
                    self._give_up(s, fresh)
                    continue
                if store_gave_out(failed := failed_by_store(fresh, s, self.failures_before), self.store_failures):
                    self._give_up(s, fresh, failed)
                    continue
                redo = s in redos or fresh.withdrawn(s)  # withdrawn since the pass's scan, too
                # the gate's looks ride out an outage like the queue's own: it polls while 1,000 workers wait
                gate = Gate.OPEN if self.before_claim is None or redo else \
                    self._patiently(lambda: self.before_claim(s, self._would_redo))
                if gate is Gate.REDO:
                    woken = True
                    break
                if gate is Gate.WAITED:
                    fresh = self._patiently(lambda: scan_shard(self.store, self.manifest, s))  # others went on
                    if s in fresh.committed:
                        stale += 1
                        self._view.learn(s)
                        continue
                    if lease := fresh.live_lease(s):
                        waiting_on.append(lease.modified + lease.ttl_s - fresh.now + time.time())
                        continue
                self._raise_if_deleted()
                claim = self._try_claim(s, fresh, redo=redo)
                if claim is None:
                    waiting_on.append(time.time())  # lost the race for it: another worker holds it now
                    continue
                claimed, stale = claimed + 1, 0
                yield claim
                # The holder has it now (`Claim.release` deletes it): a stop signal in here later (a
                # scan, `on_idle`) must not delete the lease of a shard still finishing behind the next.
                self._leases_written.discard(claim.lease_key)
            if claimed:
                idle.reset()
            if claimed or stale > rescan_after:
                woken_before = False
                continue
            if woken:  # rescan for the redo; after a second such pass in a row that claimed nothing, a poll first
                if woken_before:
                    idle.sleep()
                woken_before = True
                continue
            woken_before = False
            if stale and not waiting_on:
                continue  # shards the look had open were committed (their feed keys missed): look again
            if not waiting_on:  # what is left failed too often in this run; status tells why
                self._sweep(self._look(full=True)[0])  # its committed shards: no worker sees the run all done
                return
            if self.on_idle is not None and self.on_idle():
                continue  # a shard of this worker's own finished meanwhile: look again at once
            if self._dead_here(held):
                continue  # a lease of a process that exited here is gone: claim its shard now
            soonest = min(waiting_on)
            if time.monotonic() - self._told_wait >= WAIT_LOG_S:
                self._told_wait = time.monotonic()
                log.info("no free shard: %d left run under live leases elsewhere; the soonest goes stale in %.0f s "
                         "unless its holder renews it", len(waiting_on), max(0.0, soonest - time.time()))
            idle.sleep()

    def progress(self) -> None:
        """The worker moved a shard on (a claim taken, a record written, an object complete): the
        stall watchdog (`stalled`) counts from the last such moment."""
        self._progressed = time.monotonic()

    def stalled(self, shard: int) -> bool:
        """Whether the worker holding `shard` has made no progress for `stall_s` (a hung GPU, a
        kernel or a call that never returns): its heartbeat threads still renewed its leases, so
        its shards were never taken over and the run never ended. The first heartbeat to see it
        logs it and calls `on_stall(seconds, shard)` (extract's dumps every thread's stack and ends
        the process, so the job ends and its other leases go too); each stops renewing its lease."""
        since = time.monotonic() - self._progressed
        if not self.stall_s or since < self.stall_s:
            return False
        if self._stall_told.acquire(blocking=False):
            log.error("shard %d: this worker has made no progress for %.0f s (--stall-timeout %g: no record "
                      "written, no object completed): it looks hung (a GPU fault, a kernel or a call that never "
                      "returns); no longer renewing its leases: its shards go to other workers once they are stale",
                      shard, since, self.stall_s)
            if self.on_stall is not None:
                self.on_stall(since, shard)
        return True

    def _would_redo(self, shard: int) -> bool:
        """Whether this queue would claim `shard`'s redo: one of its shards, not given up."""
        return shard in self._candidate_set and shard not in self.given_up

    def _dead_here(self, held: list[Lease]) -> bool:
        """Delete the live leases of holders that exited on this machine (`liveness.gone_from_here`:
        a worker SIGKILLed and run again here waited a whole TTL on its own dead lease, saying
        nothing). Each lease is read once, up to `HOLDERS_READ_PER_PASS` a pass: only while this
        worker has nothing to claim, so a large run's busy workers read none. Whether one went."""
        fresh = [lease for lease in held if lease.key not in self._holders_read][:HOLDERS_READ_PER_PASS]
        freed = False
        for lease in fresh:
            self._holders_read.add(lease.key)
            try:
                payload = read_lease(self.store, lease.key)
                if payload is None or not gone_from_here(payload["holder"]):
                    continue
                # once more, just before: another worker here may have taken it over under the same key
                if lease_holder(self.store, lease.key) != payload["holder"]["token"]:
                    continue
                log.info("shard %d: the holder of its lease (pid %s on this machine) has exited: taking the shard "
                         "over now, not after the lease's %g s", lease.shard, payload["holder"].get("pid"), lease.ttl_s)
                for key in lease.keys:
                    self.store.delete(key)
                freed = True
            except StoreError as e:  # an outage: the lease goes stale by itself
                log.warning("could not look at the holder of %s: %s", lease.key, e)
        return freed

    def _sweep(self, st: RunState) -> None:
        """Once this queue's shards are all committed (or those left are given up), sweep what killed
        attempts left behind on the committed ones (`_sweep_leftovers`), once per run rather than once per worker: a sweep lists all of
        shards/ and the pending uploads, and 1,000 workers finishing together sent ~150,000 LISTs
        at 150,000 shards. The first to finish claims the sweep, created if absent under a name of
        the commits it sweeps (a shard redone, or another worker's `--shards`, makes another name);
        the others skip it, at one LIST each. A sweep done is done again only when the scan shows
        what a killed attempt leaves (a stale lease or a stray beat of a committed shard: one that
        a sweep spared as still at work, then killed) and the last sweep ended before the scan
        (workers finishing together scan while the first of them sweeps: what a worker saw before
        a sweep's end, that sweep removed, unless an attempt was killed during it); an unfinished
        one (its worker killed, its store failing) is taken over once its claim is `SWEEP_TTL_S` old."""
        mine = set(self.candidates) & st.committed
        commits = "".join(f"{s}@{st.commit_times[s]:.3f}\n" for s in sorted(mine))
        prefix = f"{layout.SWEEPS}{hashlib.sha256(commits.encode()).hexdigest()[:16]}/"
        try:
            listed = {o.key: o.modified for o in self.store.list(prefix)}
            claims = sorted(k for k in listed if k[len(prefix):].isdigit())  # generations, as leases have
            if claims:
                done = claims[-1] + SWEPT in listed
                if not done and st.now - listed[claims[-1]] < SWEEP_TTL_S:
                    return  # another worker is sweeping
                if done and (not leftovers_seen(st, mine) or listed[claims[-1] + SWEPT] >= st.now):
                    return  # swept, and the scan shows nothing left since, or the sweep ended after the scan
            claim = f"{prefix}{int(claims[-1][len(prefix):]) + 1 if claims else 1:06d}"
            payload = json.dumps({"producer": asdict(self.producer), "nonce": uuid.uuid4().hex, "shards": len(mine)})
            if not self.store.put_if_absent(claim, payload.encode()):
                return  # another worker claimed it first
        except StoreError as e:  # leftovers cost space, not correctness
            log.warning("could not claim the sweep of what crashed attempts left behind: %s", e)
            return
        if self._sweep_leftovers(st, mine):
            try:
                self.store.put(claim + SWEPT, b"")
            except StoreError as e:  # the claim goes stale: swept again after SWEEP_TTL_S
                log.warning("could not record the sweep of what crashed attempts left behind: %s", e)

    def _sweep_leftovers(self, st: RunState, mine: set[int]) -> bool:
        """Remove what killed attempts left behind on the committed shards `mine` that no later
        commit cleaned up: leases, uploads and data objects (an attempt SIGKILLed after its commit,
        before its own cleanup), and temp files of small records on a local folder (a killed put)
        once older than the lease TTL: a live put takes milliseconds. A committed shard's lease can
        only belong to an attempt that lost: a stale one is removed; a live one's attempt is still
        finishing, and its upload is left to it. Whether the store let it finish."""
        try:
            at_work: set[str] = set()  # data keys of attempts that lost but are still finishing
            for shard in sorted(mine & set(st.leases)):
                at_work |= rivals_at_work(self.store, st, shard)
                for lease in st.leases[shard]:
                    if not lease.alive(st.now):
                        self.store.delete_many(lease.keys)
            for shard in sorted(mine & set(st.stray_beats)):  # beats that landed after their lease went
                self.store.delete_many(st.stray_beats[shard])
            now = self.store.now()
            for up in self.store.list_pending_uploads():
                shard = layout.shard_of(up.key, layout.SHARDS) if up.key.startswith(layout.SHARDS) else None
                if shard in mine and up.key not in at_work:
                    self.store.abort_pending_uploads(up.key)
                # Not a key of this run's records: a run or output nested below this prefix writes there.
                elif shard is None and layout.is_run_key(up.key) and now - up.initiated >= self.ttl_s:
                    self.store.abort_pending_uploads(up.key, older_than_s=self.ttl_s)
            objects: dict[int, list[str]] = {}
            for o in self.store.list(layout.SHARDS):
                shard = layout.shard_of(o.key, layout.SHARDS)
                if shard in mine:
                    objects.setdefault(shard, []).append(o.key)
            for shard, keys in objects.items():
                if len(keys) > 1:
                    kept = decode_commit(self.store.get(layout.commit_key(shard)), layout.commit_key(shard)).data_key
                    for key in keys:
                        if key != kept and key not in at_work:
                            self.store.delete(key)
            return True
        except (StoreError, ManifestError) as e:  # leftovers cost space, not correctness
            log.warning("could not remove what crashed attempts left behind: %s", e)
            return False

    def _raise_if_deleted(self) -> None:
        """Stop if the run was deleted (`layertap delete` removes manifest.json last): a worker
        waiting behind a --window holds no lease, so nothing kept the run from being deleted, and
        its next claim would commit into the deleted prefix. One HEAD a claim."""
        if not self._patiently(lambda: self.store.exists(layout.MANIFEST)):
            raise ManifestError(f"the run at {self.store.uri} was deleted ({layout.MANIFEST} is gone): stopping")

    def _try_claim(self, shard: int, st: RunState, redo: bool = False) -> Claim | None:
        gen = st.next_generation(shard)
        first = gen == 1 and not redo and not st.failures.get(shard) and not st.stray_beats.get(shard)
        claim = Claim(self, self.manifest.shards[shard], gen, f"{self.producer.token}{uuid.uuid4().hex[:8]}", redo,
                      first=first)
        key, payload = claim.lease_key, claim.lease_payload()
        self._leases_written.add(key)  # before the PUT: a stop signal inside it must find the key (_release_held)
        # Every request here rides out an outage as the scans do (`patiently`): a 503 past the
        # store's retries ended the worker, and with srun's --kill-on-bad-exit its node's others.
        # A PUT answered with an error may have stored the lease all the same: then the retry
        # finds it, and it is ours if it names this attempt.
        def lease() -> bool:
            return self.store.put_if_absent(key, payload) or lease_attempt(self.store, key) == claim.data_key

        if not self._patiently(lease):
            self._leases_written.discard(key)
            return None
        try:
            if self._patiently(lambda: self.store.exists(layout.commit_key(shard))):  # committed after our scan
                self._patiently(lambda: self.store.delete(key))
                return None
            # A worker with another --lease-ttl creates this generation under another key: of two
            # such claims, at least the later one sees the other here and backs off.
            listed = self._patiently(lambda: [o.key for o in self.store.list(layout.lease_prefix(shard))])  # lazy pages
            others = [k for k in listed if k != key]
            if any((p := layout.parse_lease(k)) and p[1] >= gen for k in others):
                self._patiently(lambda: self.store.delete(key))
                return None
            # Stale generations of dead (or taken-over) workers, their beats, and beats of no lease
            # (one landed late); this attempt has written no beat yet.
            self._patiently(lambda: self.store.delete_many(others))
            self.given_up.discard(shard)
            log.debug("shard %d: leased, generation %d, ttl %gs", shard, gen, self.ttl_s)
            return claim
        except BaseException:  # e.g. a stop signal before the claim reached its holder: no lease left behind
            self.store.delete(key)
            self._leases_written.discard(key)
            raise


def check_shard_ids(ids: Iterable[int], total: int) -> None:
    """Refuse shard ids (--shards) that a run of `total` shards does not have."""
    bad = [s for s in ids if not 0 <= s < total]
    if bad:
        named = str(bad[0]) if len(bad) == 1 else f"{id_ranges(bad, 5)} ({len(bad):,} ids)"
        raise ConfigError(f"--shards names {named}, which the run does not have (it has shards 0-{total - 1})")


def leftovers_seen(st: RunState, shards: set[int]) -> bool:
    """Whether a scan shows, among `shards` (committed), what a killed attempt leaves: a stale
    lease, or a beat of no lease. Seen in the scan a worker makes anyway: no request of its own."""
    return any(st.stray_beats.get(s) for s in shards) or \
        any(not lease.alive(st.now) for s in shards for lease in st.leases.get(s, []))


def failed_by_store(st: RunState, shard: int, excluding: Collection[str]) -> list[str]:
    """The failure keys, oldest first, of the shard's attempts that the store failed (`Claim.fail`),
    except those in `excluding` (listed at a queue's start: not its run's), as
    `RunState.attempt_failures` counts the others."""
    return [k for k in st.failures.get(shard, []) if k.endswith(layout.STORE_STOPPED) and k not in excluding]


def store_gave_out(failed: Sequence[str], bound: int) -> bool:
    """Whether the store failed a shard's attempts (`failed_by_store`) more than `bound` times for
    at least `OUTAGE_S` by their keys' times (the store's clock): a store failing it for good. Over
    the last `bound + 1` failures (attempts that fail slowly), or over the newest unbroken streak,
    each failure within `STREAK_GAP_S` of the next (attempts that fail fast: a store answering 400
    BadDigest to every upload of a shard failed it every 13 s, and the last 21 never spanned 10
    min, so it was tried forever). Not over all: a shard failed once early, then failing fast within
    a later outage, would be given up within seconds of it."""
    if len(failed) <= bound:
        return False
    times = [layout.record_millis(k) for k in failed]
    if times[-1] - times[-bound - 1] >= 1000 * OUTAGE_S:
        return True
    first = len(times) - 1
    while first > 0 and times[first] - times[first - 1] <= 1000 * STREAK_GAP_S:
        first -= 1
    return len(times) - first > bound and times[-1] - times[first] >= 1000 * OUTAGE_S


def read_lease(store: ObjectStore, key: str) -> dict | None:
    """A lease's payload (`WorkQueue.lease_payload`); None if the lease is gone or does not name its holder."""
    try:
        payload = json.loads(store.get(key))
        payload["holder"]["token"]  # every lease names its holder
        return payload
    except ObjectNotFound:
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("lease %s does not name its holder", key)
        return None


def lease_holder(store: ObjectStore, key: str) -> str | None:
    """The producer token a lease names; None if the lease is gone or unreadable."""
    payload = read_lease(store, key)
    return payload["holder"]["token"] if payload else None


def lease_attempt(store: ObjectStore, key: str) -> str | None:
    """The data key of the attempt a lease names; None if the lease is gone or unreadable. (A
    lease written before leases named their attempt names its worker, whose token was the key's.)"""
    payload = read_lease(store, key)
    if payload is None:
        return None
    parsed = layout.parse_lease(key)
    if payload.get("data_key") or parsed is None:
        return payload.get("data_key")
    return layout.data_key(parsed[0], payload["holder"]["token"])


def rivals_at_work(store: ObjectStore, st: RunState, shard: int, own_lease: str | None = None) -> set[str]:
    """Data keys of the attempts on `shard` whose lease is alive (`own_lease` aside): after a
    commit they are attempts that lost but may still be writing (a takeover racing a slow
    worker). Each deletes its own object when its commit is refused; removing its upload under
    it would fail it instead, with a failure record for a shard that is done. A killed attempt's
    lease goes stale, and then what it left is a leftover."""
    keys = set()
    for lease in st.leases.get(shard, []):
        if lease.key != own_lease and lease.alive(st.now) and (attempt := lease_attempt(store, lease.key)):
            keys.add(attempt)
    return keys
