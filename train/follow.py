"""Follow mode's view of a run that is still being extracted: wait for its manifest, find commits
as they land, and decide when extraction is over (docs/LOADER.md, "Follow mode").

Looking costs listings, so every wait backs off: 0.5 s, doubling up to `poll_s`, back to 0.5 s
when something new appeared. A look lists the feed (`feed/`: one key per commit, named by its
time on the store's clock) from the previous look's time, less `layout.FEED_MARGIN_S`: a page or so,
however many shards the run holds, where `commits/` is a page per 1,000. `commits/` is still
the truth of "done": it is listed at the first look, every `FULL_LOOK_S` (finding what the feed
missed: a worker killed between its commit and its feed key, a PUT retried past the margin; each
consumer's first such listing after a random part of it, so that a trainer's consumers, started
together, do not list together), and before extraction is taken to be over. A run with no feed key
at the first look (extracted before the feed existed) has `commits/` listed at every look until
one appears. A consumer with plenty of work in hand looks ahead ever more rarely
(0.5 s doubling up to `poll_s`, new commits or not): with commits landing all the time, thousands
of consumers each listing `commits/` every 0.5 s would ask S3 for far more than a prefix serves.
One whose known work runs low looks ahead every 0.5 s, so its fetcher does not starve, backing
off to LOW_POLL_MAX_S while its looks find nothing new of its own (another consumer's share is no
work for it). However short of work, a consumer of many looks no more often than their number over
RUN_LOOKS_PER_S: at 1,000 ranks and a few dozen samples a shard, a consumer has a share of ~1 shard
in 20, so it is low on work nearly always, and 1,000 ranks x 4 workers looking every 0.5 s listed
the feed 8,000 times a second, past the 5,500 a prefix serves. A look takes everything committed
since the one before, so the wait costs latency, not data.
The first look reads the commit index with the listing when it needs many records
(`manifests.commit_index.read_commits`); later looks GET only commits not seen before. Either
reads only the records of shards the consumer has a share of (`wants`): the counts that decide
the shares are in each commit's feed key and tally marker names, and at thousands of consumers
and a few dozen samples a shard most consumers have no share of most shards. A waiting consumer
says why at most every 30 s.

Extraction is over when every planned shard is committed, or when nothing is left that anyone
will do: no live lease in the run and every uncommitted shard given up by a worker that used up
its --retries on it (`given_up/`), on two looks in a row. A shard whose every attempt failed
therefore ends the epoch (with a warning naming it) instead of hanging the trainer; a shard that
failed with retries left, was preempted, or waits for a worker (pending, a live lease, a worker
held by --window) keeps it waiting: ending early would train the epoch without data that then
lands, and a window run's extraction would wait on a trainer that has left.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from layertap.manifests import layout
from layertap.manifests.commit_index import read_commits
from layertap.manifests.manifest import Manifest, NoRun, load_manifest
from layertap.manifests.records import CommitRecord, FeedCommit, decode_commit
from layertap.manifests.state import (feed_since, fits_plan, listed_shards, over_plan, over_plan_error,
                                      replaced_manifest_error, scan_work)
from layertap.manifests.work import patiently
from layertap.storage.errors import UserError
from layertap.storage.retry import SPREAD, Backoff
from layertap.storage.store import ObjectNotFound, ObjectStore, StoreError, TransientStoreError
from layertap.storage.units import listing, size

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
FIRST_DELAY_S = 0.5
FULL_LOOK_S = 300.0  # the longest time between listings of all of commits/
LOW_POLL_MAX_S = 4.0  # the longest look-ahead wait of a consumer low on work while looks find nothing
# A stall (`_log_stall`) this long, through looks that found no new commit, stops the trainer: neither
# side can move on its own, and both would hold their GPUs until killed. Long enough for an operator who
# saw the STALLED lines to restart extraction with a larger --window, which ends it.
STALL_GIVE_UP_S = 600.0
IDLE_CHECKS = 4  # at most this many uncommitted shards nothing works on: a waiting consumer HEADs their commits
IDLE_CHECK_S = 60.0  # ... each at most this often
OVER_CHECK_AFTER = 3  # empty looks in a row (0.5 + 1 + 2 s) before a wait asks whether extraction is over
RUN_LOOKS_PER_S = 1000.0  # the looks a run's consumers make together at most, each at most consumers / this apart


def _outage_pause() -> float:
    """Seconds before a look that the store failed is tried again: 2-8, jittered, so that the
    consumers that met one outage together do not look again in step."""
    return SPREAD.uniform(2.0, 8.0)


def _looks(poll_s: float) -> Backoff:
    """The wait between looks at the run: 0.5 s, doubling up to `poll_s`."""
    return Backoff(FIRST_DELAY_S, max(FIRST_DELAY_S, poll_s))


QUIET_POLL_S = 30.0  # a quiet waiter's looks for the manifest back off to every 30 s at least (`wait_for_manifest`)


def wait_for_manifest(store: ObjectStore, poll_s: float, quiet: bool = False) -> Manifest:
    """The run's manifest, waiting while extraction has not written it yet (`layertap extract`
    writes it when it starts). `quiet`: the ranks but the first of a trainer, which say nothing
    (each listed the runs beside the prefix, a LIST and up to 50 HEADs, to name them: a thousand
    ranks, a thousand times rank 0's cost), back off to every QUIET_POLL_S at least and spread their
    looks (jittered: not all in step). Not a barrier behind rank 0: a collective times out (30
    min) long before a queued extraction starts."""
    backoff = Backoff(FIRST_DELAY_S, max(poll_s, QUIET_POLL_S), jitter=0.25) if quiet else _looks(poll_s)
    logged, hint = 0.0, None
    while True:
        try:
            return load_manifest(store)
        except NoRun:
            if not quiet and time.monotonic() - logged >= LOG_EVERY_S:
                # Runs beside it may mean a typo: a warning the first time (a Python caller who set up no
                # logging sees warnings alone), then INFO (beside other runs is also where a queued one starts)
                level = logging.WARNING if hint is None and (hint := _runs_beside(store)) else logging.INFO
                log.log(level, "waiting for extraction: no run at %s yet (%s appears when `layertap extract` "
                        "starts)%s", store.uri, layout.MANIFEST, hint)
                logged = time.monotonic()
            backoff.sleep()


def _runs_beside(store: ObjectStore) -> str:
    """The runs in the folder above `store`, for a trainer told to wait where none is coming (a
    typo of --data waited forever without a word): named once, with the likeliest first."""
    import difflib

    from layertap.manifests.cli import outputs_under
    from layertap.storage.store import StoreError, open_store

    parent, _, name = store.uri.rstrip("/").rpartition("/")
    if not name or parent in ("s3:/", "s3:", ""):
        return ""
    try:
        runs = [f for f, kind in outputs_under(open_store(parent)) if f != name and kind == "run"]
    except (StoreError, ValueError):
        return ""
    if not runs:
        return ""
    runs.sort(key=lambda f: -difflib.SequenceMatcher(None, f, name).ratio())
    return f"; runs beside it: {listing(runs, 5)} (is --data one of them?)"


@dataclass(frozen=True)
class PendingWork:
    """What extraction has yet to do, at one look (`pending_work`)."""

    left: list[int]  # planned shards not committed
    running: set[int]  # of those, under a live lease
    given_up: list[int]  # of those, given up (retries used up, no newer failure) and not running
    retrying: list[int]  # of those, failed with retries left
    live: bool  # some lease in the run is live

    @property
    def over(self) -> bool:
        """Nothing left that anyone will do: shards left, every one given up, and no live lease."""
        return bool(self.left) and not self.live and len(self.given_up) == len(self.left)


def pending_work(store: ObjectStore, manifest: Manifest, committed: set[int]) -> PendingWork:
    """The shards of `manifest` not in `committed` and where each stands: the follow watcher's
    test of "extraction is over", shared with a new trainer's check that anything is left."""
    st = scan_work(store, manifest)
    left = [p.id for p in manifest.shards if p.id not in committed]
    verdicts: dict[int, int] = {}  # shard -> its newest given-up record's time (ms)
    for o in store.list(layout.GIVEN_UP):
        shard = layout.shard_of(o.key, layout.GIVEN_UP)
        if shard is not None:
            verdicts[shard] = max(verdicts.get(shard, 0), layout.record_millis(o.key))
    running = {s for s in left if st.live_lease(s)}  # sets: at a run's start most of its shards are left
    # A verdict counts unless a failure is newer (a worker with more --retries is at it again). Both
    # are named by the store's clock, and a verdict never before the failures it was given on
    # (`WorkQueue._give_up`): named by workers' own clocks, a failure of one 5 s ahead outdated
    # the verdict given after it, and the trainer waited for good.
    given_up = sorted(s for s in left if s not in running and s in verdicts and verdicts[s] >= st.last_failure_ms(s))
    done_with = running | set(given_up)
    retrying = [s for s in left if s not in done_with and st.attempt_failures(s)]
    live = any(st.live_lease(s) for s in st.leases)
    return PendingWork(left, running, given_up, retrying, live)


class CommitWatcher:
    """The commits of a run being extracted, as they appear. `complete` turns True once
    extraction is over (see the module's docstring). `wants(shard, records)`: whether the
    consumer needs the commit record of a shard of `records` records; a commit the feed shows
    that it does not need comes as a `FeedCommit` (counts only), without a GET. None: every record.
    `consumers`: how many watch the run (a trainer's ranks x workers), which spaces the looks."""

    def __init__(self, store: ObjectStore, manifest: Manifest, poll_s: float, who: str = "ShardStream",
                 wants: Callable[[int, int], bool] | None = None, deletes_consumed: bool = False,
                 consumers: int = 1):
        self.store, self.manifest, self.who, self._wants = store, manifest, who, wants
        self._min_gap = max(FIRST_DELAY_S, consumers / RUN_LOOKS_PER_S)  # between looks, however low on work
        self._gap = self._min_gap  # this look's: jittered, so that many consumers do not look in step
        self.deletes_consumed = deletes_consumed  # its trainer opens a full window (StreamConfig's)
        self.known: dict[int, CommitRecord | FeedCommit] = {}
        self.complete = False
        self._backoff = _looks(poll_s)  # wait()'s
        # poll_if_due()'s, unless low: its "sleep" only grows the delay, a look ahead never sleeps
        self._ahead = Backoff(FIRST_DELAY_S, max(FIRST_DELAY_S, poll_s), sleep=lambda _: None)
        # poll_if_due(low=True)'s: 0.5 s, doubling on each look that finds nothing, back when one does
        self._low = Backoff(FIRST_DELAY_S, max(FIRST_DELAY_S, min(poll_s, LOW_POLL_MAX_S)), sleep=lambda _: None)
        self._listed = False
        self._feed_from = 0.0  # the store's time from which the next look lists the feed
        self._feed_seen = False  # the run's workers write feed keys (those of old versions did not)
        self._full_at = 0.0  # when commits/ was last listed (our monotonic clock), less this consumer's phase
        self._full_due = False  # list commits/ at the next look: the feed may have missed one
        self._last_look = 0.0
        self._logged = 0.0
        self._given_up_once = False
        self._stalled_looks = 0  # looks in a row that found extraction held by its window
        self._found_own = False  # the last look found a commit with a share for this consumer
        self._stall_reported = False  # this watcher's STALLED report is on the store (`record_stall`)
        self._idle_checked: dict[int, float] = {}  # shards `_idle_ones_committed` looked at, and when
        self._stalled_since: float | None = None  # when those looks began (our monotonic clock)

    def poll(self) -> list[CommitRecord | FeedCommit]:
        """One look: the commits not returned before, in shard order. It lists the feed, and
        `commits/` too at the first look, every FULL_LOOK_S, when `_missed_commits` found one the
        feed missed, and at every look while the run shows no feed key (one extracted before the
        feed existed has none)."""
        self._last_look = now = time.monotonic()
        if not self._listed:
            records = self._list_commits(first=True)
        else:
            records = self._read_feed()
            if self._full_due or not self._feed_seen or now - self._full_at >= FULL_LOOK_S:
                records += self._list_commits()
        foreign = sorted(r.shard for r in records if not fits_plan(r, self.manifest))
        if foreign:
            raise replaced_manifest_error(self.store.uri, foreign)
        over = sorted(r.shard for r in records if over_plan(r, self.manifest))
        if over:  # a consumer would yield past the count every rank pads to
            raise over_plan_error(self.store.uri, over)
        new = sorted({r.shard: r for r in records if r.shard not in self.known}.values(), key=lambda r: r.shard)
        self.known.update((r.shard, r) for r in new)
        self._gap = self._min_gap * SPREAD.uniform(0.8, 1.2) if self._min_gap > FIRST_DELAY_S else FIRST_DELAY_S
        if new:  # extraction moved: a stall seen before is over
            self._stalled_looks = 0
        # work of its own (a read record; a FeedCommit is another consumer's share): a consumer low on it looks promptly
        self._found_own = any(isinstance(r, CommitRecord) for r in new)
        if self._found_own:
            self._low.reset()
        if len(self.known) >= len(self.manifest.shards):
            self.complete = True
        return new

    def _list_commits(self, first: bool = False) -> list[CommitRecord]:
        """Every commit not known yet, from a listing of `commits/` (the first time, with the
        commit index). A commit this listing misses lands after it started, so the feed holds it
        from then on: the feed's next look starts there (less the margin)."""
        started = self.store.now()
        if first:
            records = read_commits(self.store, instead=self._counted()).records
        else:
            keys = [o.key for o in self.store.list(layout.COMMITS)
                    if (s := layout.shard_of(o.key, layout.COMMITS)) is not None and o.key == layout.commit_key(s)
                    and s not in self.known]
            records = [r for r in _get_commits(self.store, keys) if r is not None]
        if first:
            # Whether the run has a feed at all: its recent keys (the next look's) may be none, in a
            # quiet spell, and a run with a feed must not be taken for one without (listed whole at
            # every look). One page: any key will do.
            self._feed_seen = next(iter(self.store.list(layout.FEED)), None) is not None
            # The next full listing after a random 1/4 to all of FULL_LOOK_S, then every FULL_LOOK_S:
            # the consumers of a trainer start together, and would otherwise all list commits/ (a
            # page per 1,000 shards each) within a second of each other every FULL_LOOK_S (`SPREAD`).
            self._full_at = time.monotonic() - SPREAD.uniform(0.0, 0.75) * FULL_LOOK_S
        else:
            self._full_at = time.monotonic()
        self._listed, self._full_due = True, False
        self._feed_from = max(self._feed_from, started - layout.FEED_MARGIN_S)
        return records

    def _counted(self) -> Callable[[int], FeedCommit | None] | None:
        """For the first look: a FeedCommit for each committed shard the consumer has no share
        of, from the counts in its tally marker's name (one listing of `tally/`), so that a
        consumer (re)started late in an extraction does not GET every commit the index lacks
        (the index is not refreshed while a follow trainer runs). A shard with no tally marker,
        or more than one (a shard redone after `verify`), is read."""
        if self._wants is None:
            return None
        counts: dict[int, tuple[int, int] | None] = {}
        for o in self.store.list(layout.TALLY):
            if (parsed := layout.parse_tally(o.key)) is not None:
                shard, tally = parsed
                counts[shard] = None if shard in counts else (tally["records"], tally["skipped"])
        return lambda shard: self._declined(shard, counts.get(shard))

    def _declined(self, shard: int, counts: tuple[int, int] | None) -> FeedCommit | None:
        """What stands for the record of `shard` when its (records, skipped) `counts` are known
        and give the consumer no share of it; None: the record is to be read."""
        if counts is None or self._wants is None or self._wants(shard, counts[0]):
            return None
        return FeedCommit(shard, *counts)

    def _read_feed(self) -> list[CommitRecord | FeedCommit]:
        """The commits whose feed keys were written since the previous look (less the margin) and
        are not known yet: as FeedCommits where `wants` declines the record, else read."""
        started = self.store.now()
        found: dict[int, tuple[int, int] | None] = {}  # shard -> (records, skipped) from its newest key
        for _, shard, counts in feed_since(self.store, self._feed_from):
            self._feed_seen = True
            if shard not in self.known:
                found[shard] = counts
        told = [c for s, counts in sorted(found.items()) if (c := self._declined(s, counts)) is not None]
        keys = [layout.commit_key(s) for s in sorted(found.keys() - {c.shard for c in told})]
        records = told + [r for r in _get_commits(self.store, keys) if r is not None]
        # only once they are read: a look whose reads failed (the store's retries used up) lists from
        # the same point again, or its commits were missed until the next full listing
        self._feed_from = max(self._feed_from, started - layout.FEED_MARGIN_S)
        return records

    def poll_if_due(self, low: bool = False) -> list[CommitRecord | FeedCommit]:
        """A look ahead by a consumer with data to work on: `poll()` when due, else nothing. With
        plenty in hand it is due ever more rarely (0.5 s doubling up to `poll_s`, even when looks
        find commits: they land all the time in a large extraction); with its known work `low`,
        every 0.5 s while looks find commits, doubling up to LOW_POLL_MAX_S while they find none
        (a caught-up consumer in a quiet spell; once its work runs out, `wait()` takes over)."""
        due = max(self._gap, self._low.delay if low else self._ahead.delay)
        if self.complete or time.monotonic() - self._last_look < due:
            return []
        if not low:
            self._ahead.sleep()
        try:
            new = self.poll()
        except TransientStoreError as e:  # it has data to work on: the next look, when due, tries again
            log.warning("%s: a look for new commits failed (%s); training goes on with the data in hand", self.who, e)
            self._last_look = time.monotonic()
            return []
        if low and not self._found_own:  # others' shares are no work for it
            self._low.sleep()
        return new

    def wait(self) -> list[CommitRecord | FeedCommit]:
        """New commits, blocking (with backoff) until some appear or extraction is over. Looks
        are at least 0.5 s apart, and whether extraction is over (listings of leases, failures
        and given-up shards) is asked only after OVER_CHECK_AFTER empty looks in a row, or when
        the waiting line is due: a consumer that commits keep fed lists the feed alone. Looks ride
        out a store outage as extraction's workers do (`work.patiently`): a throttle spell ended
        the trainer, its steps since the last checkpoint lost."""
        empty = 0
        while True:
            if (gap := self._gap - (time.monotonic() - self._last_look)) > 0:
                time.sleep(gap)
            new = patiently(self.poll, _outage_pause)
            if new or self.complete:
                self._backoff.reset()
                return new
            empty += 1
            if ((empty >= OVER_CHECK_AFTER or time.monotonic() - self._logged >= LOG_EVERY_S)
                    and patiently(self._extraction_over, _outage_pause)):
                return []
            self._backoff.sleep()

    def _extraction_over(self) -> bool:
        """Nothing left to wait for: no live lease and every uncommitted shard given up by a worker
        whose --retries it used up (`given_up/`), on two looks in a row. A failure with retries
        left, a preemption or a worker waiting behind --window is not an end: the shard will come.
        Logs what is still pending, at most every 30 s."""
        w = pending_work(self.store, self.manifest, set(self.known))
        left, running, given_up, retrying = w.left, w.running, w.given_up, w.retrying
        if not w.live and self._idle_ones_committed(set(left) - set(given_up) - set(retrying)):
            return False  # the feed missed their commits (a worker killed between the two): the next look lists them
        if w.over and not self._missed_commits():
            if self._given_up_once:
                log.warning("%s: extraction is over with %d shard(s) given up (%s): ending the follow epoch without "
                            "them (`layertap status %s` says why they failed)", self.who, len(given_up),
                            listing(given_up),
                            self.store.uri)
                self.complete = True
                return True
            self._given_up_once = True
        else:
            self._given_up_once = False
        if time.monotonic() - self._logged >= LOG_EVERY_S:
            log.info("%s waiting for extraction: %d of %d shards committed (%d running, %d failed with retries left, "
                     "%d given up, %d pending)", self.who, len(self.known), len(self.manifest.shards), len(running),
                     len(retrying), len(given_up), len(left) - len(running) - len(retrying) - len(given_up))
            self._log_stall(bool(running))
            self._logged = time.monotonic()
        return False

    def _idle_ones_committed(self, idle: set[int]) -> bool:
        """Whether a shard that nothing works on (no live lease in the run, no failure) is committed
        all the same: the feed missed it, and with no worker left to commit anything the full listing
        (every FULL_LOOK_S) was the only way to see it, minutes after the rest. While IDLE_CHECKS or
        fewer such shards are left (a run's end), a HEAD of each at most every IDLE_CHECK_S (4,000
        consumers: ~270 HEADs/s at most); then the next look lists commits/."""
        if len(idle) > IDLE_CHECKS:  # extraction not started, or stopped with much left: the full looks will do
            return self._full_due
        now = time.monotonic()
        due = [s for s in sorted(idle) if now - self._idle_checked.get(s, -IDLE_CHECK_S) >= IDLE_CHECK_S]
        self._idle_checked.update((s, now) for s in due)
        if any(self.store.exists(layout.commit_key(s)) for s in due):
            self._full_due = True
        return self._full_due

    def _missed_commits(self) -> bool:
        """Whether `commits/` lists a commit not known (one the feed missed): then the next look
        lists it all, and extraction is not over."""
        self._full_due = any(s not in self.known for s in listed_shards(self.store, layout.COMMITS))
        return self._full_due

    def _log_stall(self, extracting: bool = False) -> None:
        """Training waits for data while extraction waits for training (its --window is full).
        `layertap train --delete-consumed` answers the first sign by a checkpoint, which frees
        what it trained on; a stall still there a look later (30 s) is for good: samples in the
        consumers' shuffle buffers and batches in flight keep their shards from counting as
        consumed, so the window must hold more than that."""
        from layertap.manifests.consumption import clear_stall, consumer_of, record_stall, stalled

        # Shards still being extracted (by workers that passed the window's gate before it filled)
        # mean no stall: their commits will come, and training goes on with them. Such a look is no
        # sign of one: STALLED, and the give-up clock, count from the first look with none running.
        found = None if extracting else stalled(self.store)
        if found is not None and not self.deletes_consumed and self._consumer_at_work():
            found = None  # the run's --delete-consumed trainer opens the window as it checkpoints: no stall of ours
        if found is None or self._stalled_looks == 0:  # no stall, or new commits since (`poll`): start over
            self._stalled_since = time.monotonic() if found is not None else None
        self._stalled_looks = self._stalled_looks + 1 if found is not None else 0
        if found is None or self._stalled_looks < 2:
            if self._stall_reported:  # over: extraction moved, or the window opened
                clear_stall(self.store)
                self._stall_reported = False
            return
        b, window = found
        if consumer_of(self.store) is None:
            message = (f"{self.who}: STALLED: extraction waits for training to consume ({size(b.bytes)} at rest in "
                       f"{b.shards} shards, window {size(window)}) while training waits for data, and no `layertap "
                       f"train --delete-consumed` has claimed {self.store.uri}: nothing trained on is deleted, so "
                       "the window never opens. Restart the trainer with --delete-consumed (--resume continues it), "
                       "or restart extraction without --window.")
        else:
            # the shards at rest: the same whichever rank says it (the commits a consumer read are those it has a share of)
            largest = max([b.largest, *(r.bytes for r in self.known.values() if isinstance(r, CommitRecord))])
            message = (f"{self.who}: STALLED: extraction waits for training to consume ({size(b.bytes)} at rest in "
                       f"{b.shards} shards, window {size(window)}) while training waits for data. A shard counts "
                       "as consumed once every sample of it has left the consumers' shuffle buffers and is trained "
                       "on, and a checkpoint covers it (a waiting `layertap train --delete-consumed` takes one), so "
                       "the window must exceed ranks x (buffers x --shuffle-buffer + batches held x --batch-size) x the "
                       f"largest shard ({size(largest)} here), where a rank has a buffer per DataLoader worker (at "
                       "least one) and holds 1 + max(2, --grad-accum) + 2 per DataLoader worker batches "
                       "(`consumption.window_floor`). Restart extraction with a larger --window (it and this "
                       "trainer go on where they are); a smaller --shuffle-buffer, --batch-size or --num-workers "
                       "needs a trainer started anew (--resume keeps a checkpoint's), before any shard is consumed.")
        record_stall(self.store, self.who, message)  # `status` of the run shows it while it lasts
        self._stall_reported = True
        if time.monotonic() - (self._stalled_since or time.monotonic()) >= STALL_GIVE_UP_S:
            # neither side can move: a trainer waiting on for good would hold its GPUs, and the run's, forever
            raise Stalled(f"{message} Stopping after {STALL_GIVE_UP_S / 60:.0f} min of it.")
        log.error("%s", message)


    def _consumer_at_work(self) -> bool:
        """Whether another trainer, the run's `--delete-consumed` one, runs: a full window is then
        that trainer's to open (at its next checkpoint, which may be more than STALL_GIVE_UP_S away),
        and this one, which deletes nothing, waits for it rather than give up. Once that trainer
        stops (its lease goes stale), a stall is this one's to count."""
        from layertap.manifests.consumption import consumer_of, consumer_state
        from layertap.manifests.manifest import ManifestError

        try:
            output = consumer_of(self.store)
        except (StoreError, ManifestError):  # cannot tell: counted as before
            return False
        return output is not None and consumer_state(output) == "running"


class Stalled(UserError):
    """Training and extraction wait on each other for good (`CommitWatcher._log_stall`)."""


def _get_commits(store: ObjectStore, keys: list[str]) -> list[CommitRecord | None]:
    root = store.uri.rstrip("/")

    def get(key: str) -> CommitRecord | None:
        try:
            return decode_commit(store.get(key), f"{root}/{key}")
        except ObjectNotFound:  # withdrawn by `verify` since the listing
            return None

    if len(keys) <= 1:
        return [get(k) for k in keys]
    with ThreadPoolExecutor(min(16, len(keys))) as pool:
        return list(pool.map(get, keys))
