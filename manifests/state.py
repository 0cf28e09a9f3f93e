"""The state of every shard of a run, from one listing per record type."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from layertap.manifests import layout
from layertap.manifests.manifest import Manifest, ManifestError
from layertap.manifests.records import CommitRecord, FeedCommit, decode_commit
from layertap.storage.store import ObjectInfo, ObjectNotFound, ObjectStore
from layertap.storage.units import listing

ShardState = Literal["done", "running", "failed", "pending"]


@dataclass(frozen=True, slots=True)
class Lease:
    key: str
    shard: int
    generation: int
    ttl_s: float
    modified: float  # the newest LastModified of the key and its beats (`layout.beat_key`)
    beats: tuple[str, ...] = ()  # the keys of its beats

    def alive(self, now: float) -> bool:
        return self.modified + self.ttl_s > now

    @property
    def keys(self) -> list[str]:
        """What deleting the lease deletes: its beats first, so that an interruption leaves the
        lease key (which goes stale) rather than a beat of no lease."""
        return [*self.beats, self.key]


@dataclass
class RunState:
    manifest: Manifest
    now: float
    committed: set[int] = field(default_factory=set)
    commit_times: dict[int, float] = field(default_factory=dict)  # when each commit was written (store's clock)
    tallies: dict[int, dict[str, int]] = field(default_factory=dict)  # of the shards with one tally marker
    tally_keys: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # every marker
    leases: dict[int, list[Lease]] = field(default_factory=lambda: defaultdict(list))
    failures: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # keys, oldest first
    stray_beats: dict[int, list[str]] = field(default_factory=lambda: defaultdict(list))  # beats of no lease
    data_objects: dict[int, list[str]] | None = None
    stale_commits: list[int] = field(default_factory=list)  # committed under a replaced manifest
    redo_marked: set[int] = field(default_factory=set)  # shards with a `layout.redo_key` (`scan` lists them)

    def live_lease(self, shard: int) -> Lease | None:
        alive = [l for l in self.leases.get(shard, []) if l.alive(self.now)]
        return max(alive, key=lambda l: l.generation) if alive else None

    def next_generation(self, shard: int) -> int:
        return 1 + max((l.generation for l in self.leases.get(shard, [])), default=0)

    def attempt_failures(self, shard: int, excluding: Collection[str] = ()) -> int:
        """Failures of the shard's own, except the keys in `excluding` (those a worker found at its
        start: `WorkQueue`); not attempts stopped from outside (preempted, taken over) nor
        withdrawals by `verify`, which say nothing of it (`layout.counts_as_attempt`)."""
        return sum(1 for k in self.failures.get(shard, []) if layout.counts_as_attempt(k) and k not in excluding)

    def withdrawn(self, shard: int) -> bool:
        """Whether the shard awaits the redo of a commit `verify` withdrew: not committed, with a
        withdrawal record or a redo marker, which the window gate goes by (a redo's commit ends the
        wait; the record stays)."""
        return shard not in self.committed and (shard in self.redo_marked or any(
            k.endswith(layout.WITHDRAWN) for k in self.failures.get(shard, [])))

    def last_failure_ms(self, shard: int) -> int:
        """The time (ms, in the key) of the shard's newest failure record that is no stop from
        outside (a stop by the store counts: a worker still tries the shard): a given-up verdict
        stands only if it is at least as new (`train.follow.pending_work`)."""
        return max((layout.record_millis(k) for k in self.failures.get(shard, [])
                    if not k.endswith(layout.STOPPED) or k.endswith(layout.STORE_STOPPED)), default=0)

    def raise_if_replaced(self, uri: str) -> None:
        """Refuse to work on a run whose manifest was replaced: its commits are another plan's."""
        if self.stale_commits:
            raise replaced_manifest_error(uri, self.stale_commits)

    def state(self, shard: int) -> ShardState:
        if shard in self.committed:
            return "done"
        if self.live_lease(shard):
            return "running"
        if self.failures.get(shard):
            return "failed"
        return "pending"


def scan(store: ObjectStore, manifest: Manifest, with_data: bool = False, with_tallies: bool = True,
         with_commits: bool = True) -> RunState:
    """List commits, tallies, leases, failures and redo markers (and with `with_data`, data objects), the
    listings side by side: on S3 each is a chain of 1,000-key pages, so they overlap well. Leases
    age by the store's clock (`ObjectStore.now`). Without `with_tallies`, `tallies` stays empty:
    the work queue never reads them, and at 25,000 shards their listing is ~25 of a scan's pages.
    Without `with_commits`, neither the commits nor the manifest are listed (`committed` stays
    empty, and a replaced manifest unseen): a caller that keeps up with the commits from the feed
    (`manifests.work.CommitView`) lists only what grows with the workers at work."""
    st = RunState(manifest, store.now())
    prefixes = ([layout.MANIFEST, layout.COMMITS] if with_commits else []) + [layout.LEASES, layout.FAILURES] \
        + [layout.REDO] + ([layout.TALLY] if with_tallies else []) + ([layout.SHARDS] if with_data else [])
    listed = _listings(store, prefixes)
    head, commits = listed.get(layout.MANIFEST, []), listed.get(layout.COMMITS, [])
    leases, failures = listed[layout.LEASES], listed[layout.FAILURES]
    for o in commits:
        shard = layout.shard_of(o.key, layout.COMMITS)
        if shard is not None:
            st.committed.add(shard)
            st.commit_times[shard] = o.modified
    if with_commits:
        st.stale_commits = stale_commits(store, manifest, head, commits)
    for o in listed.get(layout.TALLY, []):
        parsed = layout.parse_tally(o.key)
        if parsed:
            st.tally_keys[parsed[0]].append(o.key)
    # A shard with several markers (one left by a `verify` killed while it withdrew an earlier commit)
    # has no trusted numbers: `status` reads its commit, and `verify` leaves it the commit's marker alone.
    st.tallies = {s: layout.parse_tally(keys[0])[1] for s, keys in st.tally_keys.items() if len(keys) == 1}
    _add_leases_and_failures(st, leases, failures)
    st.redo_marked = {s for o in listed[layout.REDO] if (s := layout.shard_of(o.key, layout.REDO)) is not None}
    if with_data:
        st.data_objects = defaultdict(list)
        for o in listed[layout.SHARDS]:
            shard = layout.shard_of(o.key, layout.SHARDS)
            if shard is not None:
                st.data_objects[shard].append(o.key)
    return st


def stale_commits(store: ObjectStore, manifest: Manifest, manifest_listing: list[ObjectInfo],
                  commits: list[ObjectInfo]) -> list[int]:
    """Shards committed under a manifest that has since been replaced. A commit is only ever
    written after its run's manifest, so candidates are commit records older than manifest.json
    (the store's own clock). Age alone proves nothing: copying a run (`aws s3 sync`, `cp -r`)
    stamps its objects anew in any order. So up to 3 candidates are read, and the run is stale
    only if one of them does not fit this manifest's plan."""
    written = next((o.modified for o in manifest_listing if o.key == layout.MANIFEST), None)
    if written is None:
        return []
    older = sorted(s for o in commits if o.modified < written
                   and (s := layout.shard_of(o.key, layout.COMMITS)) is not None)
    for shard in older[:3]:
        key = layout.commit_key(shard)
        try:
            commit = decode_commit(store.get(key), key)
        except (ObjectNotFound, ManifestError):  # withdrawn meanwhile, or corrupt: `verify` deals with it
            continue
        if not fits_plan(commit, manifest):
            return older
    return []


def fits_plan(commit: CommitRecord | FeedCommit, manifest: Manifest) -> bool:
    """Whether a commit covers exactly the samples the manifest planned for its shard."""
    return 0 <= commit.shard < len(manifest.shards) and commit.covered == manifest.shards[commit.shard].num_samples


def over_plan(commit: CommitRecord | FeedCommit, manifest: Manifest) -> bool:
    """Whether a commit holds more samples than its plan counts (`ShardPlan.planned_records`): made
    by a worker that keeps rows the planner found yield none (`Claim.commit` refuses that; one of
    a layertap that ignores the plan's `planned_skips` does not)."""
    return commit.num_records > manifest.shards[commit.shard].planned_records


def over_plan_error(uri: str, shards: list[int]) -> ManifestError:
    """For a follow trainer, which sizes its epoch by the plan's samples and cannot take more."""
    return ManifestError(
        f"{len(shards)} commit(s) under {uri.rstrip('/')}/{layout.COMMITS} hold more samples than the run's plan "
        f"counts for their shard (shards {listing(shards)}): rows the planner found yield none were stored, by a "
        "worker that tokenizes otherwise (an older layertap, which ignores the plan's skipped rows, or another "
        "tokenizer version). A follow epoch is sized by the plan and cannot train them: extract with the "
        "layertap that planned the run, or train once extraction is done, without --follow")


def replaced_manifest_error(uri: str, shards: list[int]) -> ManifestError:
    shown = listing(shards)
    return ManifestError(
        f"{len(shards)} commit record(s) under {uri.rstrip('/')}/{layout.COMMITS} were made for another "
        f"plan than its {layout.MANIFEST}'s (shards {shown}): the manifest was replaced after a run had "
        "committed shards here. Restore that run's manifest, or delete the prefix's objects (or write "
        "the new run under another prefix) and extract again")


def scan_shard(store: ObjectStore, manifest: Manifest, shard: int) -> RunState:
    """The state of one shard, fresh: a HEAD of its commit record, then (if none) listings of its
    leases and failures. What a worker checks before claiming a shard, at a cost that does not
    grow with the run (`scan` lists every shard's records)."""
    st = RunState(manifest, store.now())
    if store.exists(layout.commit_key(shard)):
        st.committed.add(shard)
        return st
    _add_leases_and_failures(st, store.list(layout.lease_prefix(shard)),
                             store.list(layout.failure_prefix(shard)))
    return st


def scan_work(store: ObjectStore, manifest: Manifest) -> RunState:
    """The run's leases and failures, listed side by side, and not its commits: what a follow
    consumer, which knows the commits already, asks of a run whose next shard is late. Both
    listings grow with the workers at work and the failures, not with the run."""
    st = RunState(manifest, store.now())
    listed = _listings(store, [layout.LEASES, layout.FAILURES])
    _add_leases_and_failures(st, listed[layout.LEASES], listed[layout.FAILURES])
    return st


def feed_since(store: ObjectStore, since_s: float) -> Iterator[tuple[int, int, tuple[int, int] | None]]:
    """(millis, shard, (records, skipped) or None) of each feed key written at or after `since_s`
    (the store's clock): one listing from there (`layout.feed_after`), whatever the run's size."""
    for o in store.list(layout.FEED, start_after=layout.feed_after(int(since_s * 1000))):
        if (parsed := layout.parse_feed(o.key)) is not None:
            yield parsed


def listed_shards(store: ObjectStore, prefix: str) -> set[int]:
    """The shard ids of the records under `prefix` (`commits/`, `consumed/shards/`): one listing."""
    return {s for o in store.list(prefix) if (s := layout.shard_of(o.key, prefix)) is not None}


def _listings(store: ObjectStore, prefixes: list[str]) -> dict[str, list[ObjectInfo]]:
    """Each prefix's listing, side by side: on S3 each is a chain of 1,000-key pages."""
    with ThreadPoolExecutor(len(prefixes)) as pool:
        return dict(zip(prefixes, pool.map(lambda p: list(store.list(p)), prefixes)))


def shard_leases(store: ObjectStore, manifest: Manifest, shard: int) -> RunState:
    """One shard's leases, fresh, committed or not: a commit's sweep asks which are alive."""
    st = RunState(manifest, store.now())
    _add_leases_and_failures(st, store.list(layout.lease_prefix(shard)), [])
    return st


def _add_leases_and_failures(st: RunState, leases: Iterable[ObjectInfo], failures: Iterable[ObjectInfo]) -> None:
    """A lease lives by the newest of its key's and its beats' LastModified (`layout.beat_key`;
    a lease written by a version before beats has none: its holder rewrote the key itself). A
    beat of no lease (one landed late, after a takeover deleted its lease) is kept apart, to be
    swept: it keeps nothing alive."""
    leases = list(leases)
    beats: dict[str, list[ObjectInfo]] = defaultdict(list)
    for o in leases:
        if (lease := layout.beat_of(o.key)) is not None:
            beats[lease].append(o)
    for o in leases:
        if parsed := layout.parse_lease(o.key):
            own = beats.pop(o.key, [])
            st.leases[parsed[0]].append(Lease(o.key, parsed[0], parsed[1], parsed[2],
                                              max([o.modified, *(b.modified for b in own)]),
                                              tuple(b.key for b in own)))
    for lease, stray in beats.items():
        if (shard := layout.shard_of(lease, layout.LEASES)) is not None:
            st.stray_beats[shard] += [b.key for b in stray]
    for o in failures:
        shard = layout.shard_of(o.key, layout.FAILURES)
        if shard is not None:
            st.failures[shard].append(o.key)
