"""What training has consumed, and the storage window it opens for extraction (issue 20).

A trainer that reads a run while it is being extracted writes, after each committed checkpoint,
one watermark per rank: the shards that rank has read for the last time, as [first, last] runs
(`consumed/ranks/{rank}.json`). A shard every rank of the latest world has consumed can go: its
marker `consumed/shards/{id}` is written first, then its data object is deleted, so a crash in
between leaves a marker that the next `delete_consumed` finishes. The commit record and tally
stay: `status`, resume and a rerun of `layertap extract` still see the shard as done, and never
redo it. Watermarks are only written once a checkpoint covers them, so a trainer that restarts
from its checkpoint never needs a deleted shard. Watermarks and markers name the run they were
written for (`run_id`): a trainer of a deleted run still writing at its prefix must not have a new
run's fresh shards deleted; records written before they named it count for any run.

`at_rest` is the data objects in `shards/`: what the storage holds and the window bounds (`status`
reports it, and the backlog: committed shards not consumed yet). `WindowGate` holds a worker
back from its next claim while that is at or above `--window`; it reads only `shards/` (as large
as the window, not the run) unless the window is full.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

from layertap.manifests import layout
from layertap.manifests.manifest import Manifest, ManifestError, load_manifest
from layertap.manifests.records import Producer, decode_commit, holder_name
from layertap.manifests.state import listed_shards, scan_shard
from layertap.manifests.work import Gate
from layertap.storage.retry import Backoff
from layertap.storage.errors import ConfigError
from layertap.storage.store import ObjectInfo, ObjectNotFound, ObjectStore, StoreError
from layertap.storage.units import id_ranges, listing, size

log = logging.getLogger(__name__)

T = TypeVar("T")

WAITING_RENEW_S = 60.0  # a waiting worker rewrites its `layout.waiting_key` this often
# ... and is taken for gone once it has not for this long: a look between renewals may take a poll (up to
# 37.5 s) and a store's retries (S3 throttling: over a minute)
WAITING_STALE_S = 5 * WAITING_RENEW_S
TRAINER_LOOK_S = 300.0  # a waiting worker looks at whether the run's trainer runs this often


@dataclass(frozen=True, slots=True)
class AtRest:
    """The data objects in the run's `shards/`: the shards they belong to and their bytes. What
    the storage holds, which is what the window bounds: committed data not consumed yet, plus any
    object whose commit or deletion is under way (or was cut short by a crash, until the shard's
    next commit or consumption removes it)."""

    shards: int
    bytes: int
    largest: int = 0  # the largest data object's bytes


def claim_consumer(store: ObjectStore, output: str) -> None:
    """Make the trainer writing to `output` the run's one `--delete-consumed` trainer, or refuse.

    Watermarks are per rank, not per trainer, and the data of a shard goes once every rank of
    the latest world has consumed it: a second such trainer (another drafter trained on the same
    extraction) would overwrite the first's watermarks, and each would delete shards the other
    had yet to read. The first to start writes `consumed/trainer.json` naming its output; the
    same trainer restarting (every rank writes the same body) is let through."""
    body = json.dumps({"output": output}).encode()
    if store.put_if_absent(layout.CONSUMER, body):
        return
    holder = consumer_of(store)
    if holder is not None and holder != output:
        raise ConfigError(
            f"{store.uri} is already consumed by the --delete-consumed trainer writing to {holder}: a second one "
            f"would delete shards the first has yet to read. Train {output} without --delete-consumed (it reads "
            f"what is left once the first has finished), or, if that trainer is gone for good, delete "
            f"{store.uri.rstrip('/')}/{layout.CONSUMER}")


def consumer_of(store: ObjectStore) -> str | None:
    """The output of the run's `--delete-consumed` trainer (`claim_consumer`), None if it has none."""
    try:
        return str(json.loads(store.get(layout.CONSUMER))["output"])
    except ObjectNotFound:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise ManifestError(f"{store.uri.rstrip('/')}/{layout.CONSUMER} is unreadable ({e}); delete it if no "
                            "--delete-consumed trainer reads the run now") from e


def trainer_state(store: ObjectStore) -> Literal["none", "stopped", "finished", "running"]:
    """Who consumes a --window run: "none" (no --delete-consumed trainer claimed it), "stopped" (the
    one that did holds no live lease on its output: `consumer_state`), "finished" (it exported its
    drafter), else "running" (also when this machine cannot see its output: a node-local folder,
    another endpoint)."""
    return consumer_state(consumer_of(store))


def consumer_state(output: str | None) -> Literal["none", "stopped", "finished", "running"]:
    """`trainer_state` of the run whose consumer writes to `output` (`consumer_of`): "stopped"
    where its lease went stale, or is gone from an output that holds its training (a trainer
    stopped by Ctrl-C or a signal saves a checkpoint and releases its lease: it was taken for
    running, and the window for one being consumed); "finished" where it is gone from an output
    whose drafter is exported."""
    from layertap.manifests.liveness import gone_from_here
    from layertap.manifests.output_lease import held_by, latest
    from layertap.manifests.train_output import EXPORT_CONFIG, LATEST, METRICS
    from layertap.storage.store import open_store

    if output is None:
        return "none"
    try:
        out = open_store(output)
        if (found := latest(out)) is not None:
            # a holder killed on this machine is not running, its lease however fresh (as `status` of the output says)
            held = held_by(out, found)
            return "running" if held is not None and not gone_from_here(held.holder) else "stopped"
        # no lease: released (its drafter exported: finished), where the output holds a checkpoint or
        # metrics; else not seen from here
        if out.exists(EXPORT_CONFIG):
            return "finished"
        return "stopped" if out.exists(LATEST) or out.exists(METRICS) else "running"
    except StoreError:  # cannot tell: as if it ran
        return "running"


def waiting_records(store: ObjectStore) -> list[ObjectInfo]:
    """The records of the extraction workers waiting behind a full window now (`WindowGate`): those
    renewed within `WAITING_STALE_S` by the store's clock (a worker killed while it waited leaves
    one that goes stale). One listing."""
    now = store.now()
    return [o for o in store.list(layout.WAITING) if now - o.modified < WAITING_STALE_S]


@dataclass(frozen=True)
class Waiting:
    """An extraction worker waiting behind a full window: who (`holder_name`), and the shards it
    may claim as [first, last] runs (its --shards; None: any)."""

    who: str | None
    shards: list[list[int]] | None
    task: str | None = None  # its Slurm array task (`123_4`), where it is one


def waiting_workers(store: ObjectStore, records: list[ObjectInfo],
                    slurm_jobs: Collection[str] | None = None) -> list[Waiting]:
    """The waiting workers of `records` (`waiting_records`), read 16 at a time; one gone meanwhile
    is left out, an unreadable one counts as one that may take any shard. So is one whose record
    outlives it, as a lease's holder is: its process gone from this host, or its Slurm task not
    among `slurm_jobs` (squeue's, where given). Killed while it waited (an OOM, a node lost, a
    scancel), it counted as waiting until its record went stale, 5 minutes: `submit` refused to
    replace it meanwhile, and `status` said extraction waited."""
    from layertap.manifests.liveness import gone_from_here

    def read(key: str) -> Waiting | None:
        try:
            body = json.loads(store.get(key))
            producer = body["producer"]
            task = producer.get("job_id")
            if gone_from_here(producer) or (slurm_jobs is not None and task and task not in slurm_jobs):
                return None
            return Waiting(holder_name(producer), body.get("shards"), task)
        except ObjectNotFound:
            return None  # went on
        except (ValueError, KeyError, TypeError, AttributeError):
            return Waiting(None, None)

    with ThreadPoolExecutor(16) as pool:
        return [w for w in pool.map(read, [o.key for o in records]) if w is not None]


def record_consumed(store: ObjectStore, *, rank: int, world_size: int, shards: list[int], step: int,
                    run_id: str | None = None, output: str | None = None) -> None:
    """Rank `rank`'s watermark: the shards it has fully consumed for the last time, as of the
    training checkpoint at `step`, of run `run_id` (the one the trainer reads; None: unnamed, as
    before watermarks named it), by the trainer writing to `output` (`claim_consumer`'s; None:
    unnamed). Call it only after that checkpoint is committed: the shards it names may be
    deleted at once, and a restart resumes from the checkpoint."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    body = {"world_size": world_size, "step": step, "ranges": shard_runs(shards), "time": time.time()}
    if run_id is not None:
        body["run_id"] = run_id
    if output is not None:
        body["output"] = output
    _put_json(store, layout.consumed_rank_key(rank), body)


def shard_runs(shards: list[int]) -> list[list[int]]:
    """The shard ids as [first, last] runs. A watermark names every shard its rank consumed; as
    runs it stays a few per extraction worker however long the run (a list of ids was ~1 MB per
    rank at 140,000 shards, read for every rank after every checkpoint)."""
    runs: list[list[int]] = []
    for s in sorted(set(shards)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return runs


def _intersect(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The runs of ids in both `a` and `b` (each sorted, disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append([lo, hi])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def consumed_shards(store: ObjectStore) -> set[int]:
    """Shards marked consumed (their data deleted, or about to be): one listing. What a reader
    checks before taking a missing data object for a lost one."""
    return listed_shards(store, layout.CONSUMED_SHARDS)


def marker_times(store: ObjectStore) -> dict[int, float]:
    """When each shard was marked consumed (the store's clock): what `status` measures training's
    rate of consumption by, as watermarks keep no history."""
    return {s: o.modified for o in store.list(layout.CONSUMED_SHARDS)
            if (s := layout.shard_of(o.key, layout.CONSUMED_SHARDS)) is not None}


def consumed_everywhere(store: ObjectStore, marked: set[int] | None = None) -> set[int]:
    """Shards every rank of the latest world has consumed, plus those already marked (`marked`:
    `consumed_shards`, when the caller listed them already). The latest world is the one of the
    newest watermark; its ranks' watermarks must all be there and agree on it (during a restart
    with another world size, only the marked shards count)."""
    return (consumed_shards(store) if marked is None else marked) | _agreed(store)


def delete_consumed(store: ObjectStore, listed: dict[int, list[ObjectInfo]] | None = None, *,
                    run_id: str | None = None) -> list[int]:
    """Delete the data of each shard consumed everywhere: markers first, then the data objects their
    commits name (and any a crashed attempt left). Idempotent, and crash-safe: a marker whose
    data is still listed is finished here. `listed`: `data_objects`, when the caller has it.
    `run_id`: the run at the prefix; watermarks and markers of another run are left out (None:
    every one counts). Returns the ids whose data this call deleted.

    Training consumes 1,000s of shards a minute at scale, so the requests go in bulk rather than
    three a shard one after another: the commits are read and the markers written 8 at a time,
    and only once every marker is written are the data objects deleted, 1,000 a request on S3
    (`delete_many`). A crash in between leaves markers whose data the next call deletes.
    The markers' listing and the watermarks (both as large as the run) are read side by side.
    With `run_id`, nothing is deleted unless the prefix still holds that run: a trainer of a deleted
    run still running there (after `delete --force`, or its lease lapsed) would find its own
    watermarks' shard ids in the new run's commits and delete that run's data."""
    if run_id is not None and (here := _run_here(store)) != run_id:
        log.warning("%s holds %s, not run %s that these consumption records are of: deleting nothing",
                    store.uri, f"run {here}" if here else "no run", run_id)
        return []
    with ThreadPoolExecutor(2) as pool:
        marked, agreed = pool.submit(consumed_shards, store), pool.submit(_agreed, store, run_id)
        marked, agreed = marked.result(), agreed.result()
    listed = data_objects(store) if listed is None else listed
    if run_id is not None:
        marked -= _markers_of_other_runs(store, marked & set(listed), run_id)
    fresh = sorted(agreed - marked)
    data_keys = dict(zip(fresh, _each(lambda shard: _committed_data(store, shard), fresh)))
    fresh = [shard for shard in fresh if data_keys[shard] is not None]
    body = json.dumps({"run_id": run_id}).encode() if run_id else b""
    _each(lambda shard: store.put(layout.consumed_marker_key(shard), body), fresh)  # every marker before any data
    deleted = sorted(set(fresh) | (marked & set(listed)))
    keys = {o.key for shard in deleted for o in listed.get(shard, [])} | {data_keys[shard] for shard in fresh}
    store.delete_many(sorted(keys))
    if deleted:
        log.info("deleted the data of %d consumed shard(s) at %s: %s", len(deleted), store.uri, id_ranges(deleted))
    return deleted


def _committed_data(store: ObjectStore, shard: int) -> str | None:
    """The data object a consumed shard's commit names; None when its data is not consumed data (no
    commit any more) or must be kept (a corrupt commit record: `verify` withdraws it)."""
    key = layout.commit_key(shard)
    try:
        return decode_commit(store.get(key), key).data_key
    except ObjectNotFound:
        return None
    except ManifestError as e:
        log.warning("shard %d: consumed, but its commit record is unreadable (%s); its data is kept", shard, e)
        return None


def _each(fn: Callable[[int], T], shards: list[int]) -> list[T]:
    """`fn` of each shard, 8 at a time: one request each, side by side (serial, 1,000s of shards
    consumed a minute took minutes; 8 stay within an S3 store's connection pool, 20 at least,
    past which urllib3 warns at every request). Raises the first failure once all are done or failed."""
    if not shards:
        return []
    with ThreadPoolExecutor(min(8, len(shards))) as pool:
        return list(pool.map(fn, shards))


def _run_here(store: ObjectStore) -> str | None:
    """The run_id of the manifest at the prefix, None without a readable one."""
    try:
        return load_manifest(store).run_id
    except ManifestError:  # NoRun included
        return None


def _markers_of_other_runs(store: ObjectStore, shards: set[int], run_id: str) -> set[int]:
    """Those of `shards` whose consumption marker names another run than `run_id`: left by a
    trainer of a deleted run, they do not make this run's data consumed. Read only for markers
    whose data is still listed: a crash's leftovers, a few."""
    ordered = sorted(shards)
    return {s for s, run in zip(ordered, _each(lambda s: _marker_run(store, s), ordered)) if run not in (None, run_id)}


def _marker_run(store: ObjectStore, shard: int) -> str | None:
    """The run a shard's consumption marker names; None if it names none (empty: written before
    markers named their run), is unreadable, or is gone."""
    try:
        body = json.loads(store.get(layout.consumed_marker_key(shard)) or b"{}")
    except (ObjectNotFound, ValueError):
        return None
    return body.get("run_id") if isinstance(body, dict) else None


def data_objects(store: ObjectStore) -> dict[int, list[ObjectInfo]]:
    """The run's data objects by shard: one listing of `shards/`."""
    listed: dict[int, list[ObjectInfo]] = {}
    for o in store.list(layout.SHARDS):
        if (shard := layout.shard_of(o.key, layout.SHARDS)) is not None:
            listed.setdefault(shard, []).append(o)
    return listed


def at_rest(store: ObjectStore, listed: dict[int, list[ObjectInfo]] | None = None) -> AtRest:
    """What the storage window bounds (`AtRest`), from one listing of `shards/` (`listed`:
    `data_objects`, when the caller has it)."""
    listed = data_objects(store) if listed is None else listed
    sizes = [o.size for objects in listed.values() for o in objects]
    return AtRest(len(listed), sum(sizes), max(sizes, default=0))


def forget_watermarks(store: ObjectStore) -> int:
    """Delete every rank's watermark, as the run's `--delete-consumed` trainer starts from step 0:
    they tell of an earlier start of it (its checkpoints removed) or of another trainer, whose
    consumption the new start does not share. Left in place, an old rank's watermark and a new
    one's named a shard together that the new trainer's other ranks had yet to read, and a sweep
    deleted it under them. What was agreed already is in the markers, which stay. Returns how
    many it deleted."""
    keys = [o.key for o in store.list(layout.CONSUMED_RANKS)]
    if keys:
        store.delete_many(keys)
    return len(keys)


def watermarks(store: ObjectStore, listing: list[ObjectInfo] | None = None) -> dict[int, dict]:
    """Every rank's watermark by rank (unreadable ones left out, with a warning); read 16 at a
    time, as each names every shard its rank consumed. `listing`: of `consumed/ranks/`, when the
    caller has it."""

    def read(key: str) -> dict | None:
        try:
            body = json.loads(store.get(key))
            ranges = ([[int(a), int(b)] for a, b in body["ranges"]] if "ranges" in body
                      else shard_runs([int(s) for s in body["shards"]]))  # "shards": written before 2026-12
            if any(a > b for a, b in ranges) or any(p[1] >= n[0] for p, n in zip(ranges, ranges[1:])):
                raise ValueError("ranges are not sorted, disjoint [first, last] runs")
            return {"world_size": int(body["world_size"]), "step": int(body["step"]), "ranges": ranges,
                    "time": float(body["time"]), "run_id": body.get("run_id"), "output": body.get("output")}
        except ObjectNotFound:
            return None
        except (ValueError, KeyError, TypeError) as e:
            log.warning("%s: unreadable consumption watermark (%s); ignored", key, e)
            return None

    listing = list(store.list(layout.CONSUMED_RANKS)) if listing is None else listing
    ranks = {rank: o.key for o in listing
             if (rank := layout.shard_of(o.key, layout.CONSUMED_RANKS)) is not None}
    with ThreadPoolExecutor(max(1, min(16, len(ranks)))) as pool:
        bodies = dict(zip(ranks, pool.map(read, ranks.values())))
    return {rank: body for rank, body in bodies.items() if body is not None}


def _agreed(store: ObjectStore, run_id: str | None = None) -> set[int]:
    """Shards every rank of the latest world has consumed, by the watermarks of run `run_id` and
    those naming no run (None: every watermark), of the run's consumer (`_consumer`)."""
    return _agree(watermarks(store), run_id, _consumer(store)) or set()


def _consumer(store: ObjectStore) -> str | None:
    """`consumer_of`, for `_agree`; an unreadable claim is one no watermark matches."""
    try:
        return consumer_of(store)
    except ManifestError as e:
        log.warning("%s; deleting nothing by the watermarks", e)
        return "(unreadable)"


def _agree(marks: dict[int, dict], run_id: str | None, output: str | None = None) -> set[int] | None:
    """`_agreed` of watermarks read already; None while the latest world's are incomplete (a trainer
    restarting with another world size), when only the markers tell what was consumed. Those of
    another trainer than the run's consumer `output` (one whose claim was removed, the run then
    claimed by another with the same world size) are left out: mixed with the new one's, a rank
    of each named a shard that no rank of the new trainer had all read. Those naming no trainer
    (written before they did) count."""
    marks = {rank: m for rank, m in marks.items() if (run_id is None or m["run_id"] in (None, run_id))
             and m.get("output") in (None, output)}
    if not marks:
        return set()
    world = max(marks.values(), key=lambda m: m["time"])["world_size"]
    ranks = [marks.get(r) for r in range(world)]
    if any(m is None or m["world_size"] != world for m in ranks):
        return None
    agreed = functools.reduce(_intersect, (m["ranges"] for m in ranks))
    return {s for first, last in agreed for s in range(first, last + 1)}


class WindowGate:
    """Holds a worker back from claiming its next shard while `window` bytes or more of data are
    at rest (`at_rest`: committed data not consumed yet, and little else).

    Called before a claim with a test of the shards its worker would redo (`WorkQueue`); answers a
    `work.Gate`. While it waits, it also lists `redo/` (empty but for shards `verify` withdrew) and
    stops waiting (`Gate.REDO`) for a withdrawn shard of the worker's that no one redoes: no
    window holds a redo back (a trainer resuming past the shard needs it, and with the window
    full, nothing else moves; `WorkQueue` claims it without the gate). A check lists `shards/`
    alone, which the window keeps small however long the run: it runs before every claim, on the
    worker's critical path. The trainer deletes after each checkpoint, so the gate's sweep only
    finishes what a trainer killed in between left: a full window, at most every `sweep_every_s`,
    lists the watermarks (`consumed/ranks/`, one page), reads them again only when that listing
    changed (a checkpoint), and sweeps (`delete_consumed`: the manifest, the markers' listing, as
    large as the run, and the watermarks) only when they name a shard still at rest. With 1,000
    workers waiting, every look swept before: 1,000 manifest GETs and run-sized listings a poll.
    While waiting it lists with a backoff (`poll_s` doubling to `max_poll_s`, jittered so that
    workers held back together do not look in step; at 30 s a window opened by a checkpoint kept
    every waiting GPU idle up to 30 s, and 1,000 workers looking every 10 s list `shards/`, a page,
    100 times a second), logs why at most every `log_every_s`, and
    tells `on_wait` (a progress line) what is at rest, then None once it goes on. A stop signal
    raises in the main thread wherever it is, so a waiting worker ends at once.

    The bound: a worker checks before each claim, not during its shard, so the data at rest stays
    under `window` plus one shard per worker (each may have passed the gate just below it), plus
    the redos of withdrawn shards, whose data the window counted until `verify` withdrew it.
    """

    def __init__(self, store: ObjectStore, window: int, *, producer: Producer | None = None,
                 shards: Sequence[int] | None = None, poll_s: float = 2.0, max_poll_s: float = 10.0,
                 sweep_every_s: float = 30.0, log_every_s: float = 30.0,
                 on_wait: Callable[[AtRest | None], None] | None = None, sleep: Callable[[float], None] = time.sleep):
        self.store, self.window, self.producer = store, window, producer
        self.shards = None if shards is None else shard_runs(list(shards))  # its worker's --shards, for its record
        self._trainer_looked = -float("inf")  # when `_say_if_no_trainer` last looked (time.monotonic)
        self.poll_s, self.max_poll_s, self.log_every_s = poll_s, max_poll_s, log_every_s
        self.sweep_every_s = sweep_every_s
        self.on_wait, self.sleep = on_wait, sleep
        self._recorded = False  # `record` written once before the first claim, and again as each wait begins
        self._recorded_at = -float("inf")  # when `record` last wrote (time.monotonic)
        self._swept = -float("inf")
        self._ranks: list[ObjectInfo] | None = None  # the watermarks' listing `_agreed` was read at
        self._agreed: set[int] | None = set()
        self._listed: dict[int, list[ObjectInfo]] = {}  # the last `check`'s data objects
        self._committed: set[int] = set()  # shards of `_listed` found committed (`_redo_leftovers`)

    @functools.cached_property
    def manifest(self) -> Manifest:
        return load_manifest(self.store)

    @property
    def run_id(self) -> str:
        """The run the gate's worker extracts: what its sweeps delete for (`delete_consumed`)."""
        return self.manifest.run_id

    def record(self) -> None:
        """Tell training what window extraction runs with (`recorded_window`): a follow trainer
        that waits for data while the window is full knows it is stalled, and says so."""
        _put_json(self.store, layout.CONSUMED_WINDOW, {"window": self.window, "time": time.time()})
        self._recorded_at = time.monotonic()

    def check(self) -> AtRest:
        """What is at rest: one listing of `shards/`; when that fills the window, first delete
        what the watermarks allow (at most every `sweep_every_s`)."""
        listed = self._listed = data_objects(self.store)
        rest = at_rest(self.store, listed)
        if rest.bytes >= self.window and time.monotonic() - self._swept >= self.sweep_every_s:
            self._swept = time.monotonic()
            if self._consumed_at_rest(listed) and \
                    (deleted := set(delete_consumed(self.store, listed, run_id=self.run_id))):
                rest = at_rest(self.store, {s: objects for s, objects in listed.items() if s not in deleted})
        return rest

    def _consumed_at_rest(self, listed: dict[int, list[ObjectInfo]]) -> bool:
        """Whether a sweep may delete any of `listed`: some shard of it consumed everywhere, or the
        latest world's watermarks incomplete (then only the markers tell). The watermarks are read
        only when their listing changed since the last reading; a shard consumed needs a new one."""
        ranks = list(self.store.list(layout.CONSUMED_RANKS))
        if ranks != self._ranks:
            self._agreed = _agree(watermarks(self.store, ranks), self.run_id, _consumer(self.store))
            self._ranks = ranks
        return self._agreed is None or not self._agreed.isdisjoint(listed)

    def redos_waiting(self, would_redo: Callable[[int], bool]) -> list[int]:
        """The withdrawn shards (`layout.redo_key`) its worker `would_redo` that no one redoes yet: one
        listing, then a look at each such shard (a HEAD, two small listings). A marker whose shard
        is committed again (its redo was killed before removing it) is passed over, not removed: a
        `verify` may be withdrawing that commit and writing the marker anew right now."""
        waiting = []
        for o in self.store.list(layout.REDO):
            shard = layout.shard_of(o.key, layout.REDO)
            if shard is None or shard >= len(self.manifest.shards) or not would_redo(shard):
                continue
            st = scan_shard(self.store, self.manifest, shard)
            if shard not in st.committed and st.live_lease(shard) is None:
                waiting.append(shard)
        return waiting

    def __call__(self, shard: int, would_redo: Callable[[int], bool]) -> Gate:
        """Before the claim of `shard`: wait while the window is full, unless a withdrawn shard that
        its worker `would_redo` awaits its redo (`Gate.REDO`), or another worker commits `shard`
        meanwhile (one HEAD a poll: a worker whose shards are all done by others ends, rather
        than wait for a window that only training opens). While it waits, its `producer` (if
        given) is on record under `waiting/` (`waiting_workers`: `submit` and `status` count it)."""
        outcome, on_record, since = Gate.OPEN, -float("inf"), time.monotonic()
        if not self._recorded:
            self.record()
            self._recorded = True
        waited, backoff, logged = False, Backoff(self.poll_s, self.max_poll_s, self.sleep, jitter=0.25), 0.0
        try:
            while (rest := self.check()).bytes >= self.window:
                if redos := self.redos_waiting(would_redo):
                    log.info("window full, but shard(s) %s, withdrawn by `layertap verify`, await their redo, which "
                             "the window does not hold back: redoing", listing(redos))
                    outcome = Gate.REDO
                    break
                if waited and self.store.exists(layout.commit_key(shard)):
                    log.info("shard %d was committed by another worker while this one waited for the window", shard)
                    break
                if not waited and self._recorded_at < since:
                    # again as each wait begins: an extraction started without --window on the same run
                    # removed it (`forget_window`), and trainers then saw no window, nor the stall
                    self.record()
                if self.producer is not None and time.monotonic() - on_record >= WAITING_RENEW_S:
                    on_record = time.monotonic()
                    _put_json(self.store, layout.waiting_key(self.producer.token),
                              {"producer": asdict(self.producer), "shard": shard, "shards": self.shards,
                               "window": self.window})
                if time.monotonic() - logged >= self.log_every_s:
                    logged = time.monotonic()
                    log.info("window full: %s at rest not yet consumed by training (%d shards; window %s); waiting "
                             "for training", size(rest.bytes), rest.shards, size(self.window))
                    # after a first log's wait, and at most every TRAINER_LOOK_S across this worker's waits
                    if time.monotonic() - since >= self.log_every_s and \
                            time.monotonic() - self._trainer_looked >= TRAINER_LOOK_S:
                        self._trainer_looked = time.monotonic()
                        self._say_if_no_trainer()
                        self._sweep_stale_records()
                        if self._redo_leftovers():
                            continue  # the next look finds them as redos
                if self.on_wait:
                    self.on_wait(rest)
                waited, outcome = True, Gate.WAITED
                backoff.sleep()
            else:
                if waited:
                    log.info("window open: %s at rest (window %s); claiming again", size(rest.bytes),
                             size(self.window))
        finally:
            if on_record > -float("inf"):
                try:
                    self.store.delete(layout.waiting_key(self.producer.token))
                except StoreError as e:  # it goes stale
                    log.warning("could not remove this worker's record of waiting for the window: %s", e)
        if waited and self.on_wait:
            self.on_wait(None)
        return outcome

    def _say_if_no_trainer(self) -> None:
        """Warn when no trainer will open the window (`trainer_state`): workers wait for good."""
        try:
            output = consumer_of(self.store)
            state = consumer_state(output)
        except (StoreError, ManifestError) as e:
            log.warning("could not tell whether the run's trainer runs: %s", e)
            return
        if state == "none":
            log.warning("no `layertap train --delete-consumed` has claimed this run: nothing trained on is deleted, so "
                        "the window opens only once one does (a trainer job still queued claims it as it starts: "
                        "`layertap status` of the run names one; else start the trainer with --follow "
                        "--delete-consumed, or restart the extraction without --window)")
        elif state == "finished":
            log.warning("the run's --delete-consumed trainer has finished (its drafter is exported to %s): nothing "
                        "consumes what this extraction adds, so the window does not open; train on the rest with "
                        "another --delete-consumed trainer (another --out), or restart the extraction without --window",
                        output)
        elif state == "stopped":
            log.warning("the run's --delete-consumed trainer is not running (no live lease on %s): nothing is "
                        "consumed, so the window opens only once it is restarted (--resume continues it)", output)

    def _redo_leftovers(self) -> list[int]:
        """Mark for redo (`layout.redo_key`, as `verify` marks a shard it withdrew) each uncommitted
        shard at rest with no live lease: the data of an attempt killed between its object's
        completion and its commit. The window counts it, and only that shard's commit removes it,
        which the full window held back: such leftovers shut a window for good. One look (a HEAD)
        at each shard at rest not found committed at an earlier look; returns those marked."""
        marked = []
        try:
            for shard in sorted(set(self._listed) - self._committed):
                if shard >= len(self.manifest.shards):
                    continue
                st = scan_shard(self.store, self.manifest, shard)
                if shard in st.committed:
                    self._committed.add(shard)
                elif st.live_lease(shard) is None:
                    self.store.put(layout.redo_key(shard), b"")
                    marked.append(shard)
        except StoreError as e:
            log.warning("could not look for data that killed attempts left at rest: %s", e)
        if marked:
            log.warning("window full, and shard(s) %s hold data at rest of attempts killed before their commit: "
                        "redoing them (their commit removes it)", listing(marked))
        return marked

    def _sweep_stale_records(self) -> None:
        """Delete the `waiting/` records of workers killed while they waited (stale: every reader
        ignores them), which stayed until the run was deleted."""
        try:
            now = self.store.now()
            stale = [o.key for o in self.store.list(layout.WAITING) if now - o.modified >= WAITING_STALE_S]
            if stale:
                self.store.delete_many(stale)
                log.info("removed %d stale record(s) of extraction workers that stopped while they waited for the "
                         "window", len(stale))
        except StoreError as e:
            log.warning("could not sweep stale records of waiting workers: %s", e)


def _put_json(store: ObjectStore, key: str, body: dict) -> None:
    store.put(key, json.dumps(body).encode())


def prefetch_depth(grad_accum: int = 1) -> int:
    """Batches a follow trainer's prefetch thread holds ready beside the one being trained: a
    step's every batch (`train.trainer`: it waits for them all at the step boundary), at least 2."""
    return max(2, grad_accum)


def batches_in_flight(num_workers: int, grad_accum: int = 1) -> int:
    """Batches one training rank holds that it has not trained on yet, the one being trained
    included: that one, the prefetch thread's (`prefetch_depth`), and with DataLoader workers,
    the 2 each has under way (torch's prefetch_factor). Counted by collating in
    tests/test_window.py: 3, 5 and 7 at 0, 1 and 2 workers; 5 at --grad-accum 4."""
    return 1 + prefetch_depth(grad_accum) + 2 * num_workers


def window_floor(ranks: int, num_workers: int, shuffle_buffer: int, batch_size: int, shard_bytes: int,
                 grad_accum: int = 1) -> int:
    """The --window under which a window run may stall for good: each sample in a consumer's
    shuffle buffer (one per rank, or per DataLoader worker) or in a batch in flight
    (`batches_in_flight`) can keep a whole shard from counting as consumed. A bound, not an
    estimate: stalls need less where shards hold many samples each."""
    samples = max(1, num_workers) * shuffle_buffer + batches_in_flight(num_workers, grad_accum) * batch_size
    return ranks * samples * shard_bytes


def window_shortfall(window: int, ranks: int, num_workers: int, shuffle_buffer: int, batch_size: int,
                     shard_bytes: int, grad_accum: int = 1, planned: bool = True) -> str | None:
    """What is wrong with a --window below `window_floor` for this training (None when it is not):
    `submit --train-while-extracting` warns of it, and so does a --delete-consumed trainer at its
    start, before the run would stall. `shard_bytes`: the run's largest shard, or (`planned` False:
    no plan yet) --shard-bytes."""
    from layertap.storage.units import size

    floor = window_floor(ranks, num_workers, shuffle_buffer, batch_size, shard_bytes, grad_accum)
    if window >= floor:
        return None
    buffers = f"{num_workers} DataLoader workers x " if num_workers > 1 else ""
    held = batches_in_flight(num_workers, grad_accum)
    return (f"--window {size(window)} is below {size(floor)} = {ranks} training ranks x ({buffers}--shuffle-buffer "
            f"{shuffle_buffer} + {held} x --batch-size {batch_size}) x "
            + (f"shards of {size(shard_bytes)} (the run's largest, as planned)" if planned else
               f"--shard-bytes {size(shard_bytes)} (the run is not planned yet: smaller if it is smaller than a shard)")
            + ": each sample "
            f"in a shuffle buffer or in the {held} batches a rank holds before training them (the one in training, "
            "those prefetched" + (f": a step's {grad_accum} with --grad-accum {grad_accum}" if grad_accum > 2 else "")
            + (", 2 per DataLoader worker" if num_workers else "") + ") can keep a shard from counting as consumed, "
            "and the run may stall for good. Raise --window, or lower --shard-bytes, --shuffle-buffer, --batch-size "
            "or --num-workers")


def forget_window(store: ObjectStore) -> None:
    """An extraction without --window: remove the record an earlier --window extraction of the
    run left (`WindowGate.record`), so that trainers and `status` see no window. The record is the
    latest extraction's: written by a --window worker before its first claim and as each of its
    waits begins (a --window extraction still at work beside this one then records it again),
    removed by one started without."""
    store.delete(layout.CONSUMED_WINDOW)


def recorded_window(store: ObjectStore) -> int | None:
    """The --window the run's extraction workers run with, once one has started (else None)."""
    try:
        return int(json.loads(store.get(layout.CONSUMED_WINDOW))["window"])
    except ObjectNotFound:
        return None
    except (ValueError, KeyError, TypeError):  # unreadable: no stall check rather than a failed trainer
        log.warning("%s/%s is unreadable; the stall check is off", store.uri.rstrip("/"), layout.CONSUMED_WINDOW)
        return None


# A STALLED report older than this is a trainer's that stopped reporting (it renews it each look, 30 s)
STALL_REPORT_S = 300.0


def record_stall(store: ObjectStore, who: str, message: str) -> None:
    """A follow trainer's STALLED report on the run (`consumed/stalled.json`), renewed at each look
    while it lasts: the trainer's log said so, and `status` of the run said workers wait "as
    training consumes", though nothing could be consumed. Best effort: the log has it anyway."""
    try:
        store.put(layout.CONSUMED_STALL, json.dumps({"who": who, "message": message}).encode())
    except StoreError as e:
        log.debug("could not record the stall: %s", e)


def clear_stall(store: ObjectStore) -> None:
    """The stall is over (new commits, or the window opened): its report goes."""
    try:
        store.delete(layout.CONSUMED_STALL)
    except StoreError as e:
        log.debug("could not remove the stall report: %s", e)


def recent_stall(store: ObjectStore, max_age_s: float = STALL_REPORT_S) -> dict[str, Any] | None:
    """The STALLED report of a trainer still reporting it (renewed within `max_age_s`, by the
    store's clock), with its age in `age_s`; None where there is none (or only an old one)."""
    found = next(iter(store.list(layout.CONSUMED_STALL)), None)
    if found is None or (age := store.now() - found.modified) > max_age_s:
        return None
    try:
        report = json.loads(store.get(layout.CONSUMED_STALL))
    except (ObjectNotFound, ValueError):
        return None
    return {"who": report.get("who"), "message": report.get("message"), "age_s": round(max(0.0, age), 1)} \
        if isinstance(report, dict) else None


def stalled(store: ObjectStore) -> tuple[AtRest, int] | None:
    """(at rest, window) when extraction is held back by its window (`WindowGate`'s measure),
    which training waiting for data then cannot open: a stall. None when there is no window or
    it is open."""
    window = recorded_window(store)
    if window is None:
        return None
    rest = at_rest(store)
    return (rest, window) if rest.bytes >= window else None

