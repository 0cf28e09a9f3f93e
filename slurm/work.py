"""What is left of a run, and the array that does it: sized from the manifest and one scan.

Remaining work is every shard without a commit that no live lease holds: pending, failed, and
those whose worker died (its lease went stale). Shards under a live lease belong to a task that
is still running, so a resubmission while a first array is still going does not double it; the
tasks still queued in Slurm are left theirs too (`slurm.queued`).
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from layertap.manifests import layout
from layertap.manifests.consumption import waiting_records, waiting_workers
from layertap.manifests.manifest import ConfigMismatch, Manifest, load_manifest
from layertap.manifests.records import holder_name
from layertap.manifests.state import scan
from layertap.manifests.work import check_shard_ids, read_lease
from layertap.slurm.scripts import ArrayPlan
from layertap.storage.errors import ConfigError
from layertap.storage.store import ObjectStore, StoreError

K, T = TypeVar("K"), TypeVar("T")

DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize: array indices go up to 1000


@dataclass(frozen=True, kw_only=True)
class Remaining:
    run_id: str
    total: int  # the run's shards
    selected: int | None = None  # with --shards: how many it names (the counts below are of those)
    done: int
    running: list[int]  # held by live leases
    failed: list[int]  # failure records and no commit; part of `todo`
    interrupted: list[int] = field(default_factory=list)  # of `failed`: its last attempt stopped from outside
    todo: list[int]  # to be (re)done: not committed, not held
    leases: dict[int, str] = field(default_factory=dict)  # running shard -> its live lease's key
    # of `todo`: shards under a live lease of a Slurm job squeue no longer shows (`without_dead_holders`)
    orphaned: list[int] = field(default_factory=list)
    # extraction workers waiting behind a full --window (they hold no lease) that may take some of `todo`,
    # their jobs (Slurm job ids, or `pid P on HOST`), and the shards of `todo` they wait to take
    waiting: int = 0
    waiting_jobs: list[str] = field(default_factory=list)
    waiting_tasks: list[str] = field(default_factory=list)  # of those, the Slurm array tasks (`123_4`)
    waited_for: list[int] = field(default_factory=list)
    # array tasks still pending in Slurm for this run, or started but holding no lease yet
    # (`slurm.queued`), their jobs, the shards of `todo` in the ranges of the static ones, how many
    # of them are dynamic (each takes free shards), and how many of them are running
    queued: int = 0
    queued_jobs: list[str] = field(default_factory=list)
    queued_for: list[int] = field(default_factory=list)
    queued_dynamic: int = 0
    queued_running: int = 0

    @property
    def free(self) -> list[int]:
        """What new tasks are for: `todo` less what waiting workers will take as training
        consumes, and the ranges of static tasks still queued."""
        left = set(self.waited_for) | set(self.queued_for)
        return [s for s in self.todo if s not in left]

    def summary(self) -> str:
        # as `layertap status` counts them: a preempted or taken-over shard is interrupted, not failed
        stopped = f", {len(self.interrupted)} interrupted" if self.interrupted else ""
        shards = f"{self.total} shards" if self.selected is None else \
            f"{self.selected} of the run's {self.total} shards (--shards)"
        dead = f" ({len(self.orphaned)} under the lease of a job gone from squeue)" if self.orphaned else ""
        return (f"{shards}: {self.done} done, {len(self.running)} running, "
                f"{len(self.failed) - len(self.interrupted)} failed, {len(self.todo) - len(self.failed)} "
                f"pending{dead}{stopped}")


def remaining_work(store: ObjectStore, only: Sequence[int] | None = None,
                   settings: Mapping[str, Any] | None = None,
                   dataset_of: Callable[[Manifest], Mapping[str, Any]] | None = None,
                   fingerprint: Callable[[], str | None] | None = None,
                   slurm_jobs: Collection[str] | None = None) -> Remaining:
    """The run's unfinished shards (among `only`, if given); raises `NoRun` if there is no run,
    and `ConfigMismatch` if `settings` (a subset of the manifest's config), the chat-template
    settings of the `dataset_of` the run, or the dataset's `fingerprint` (asked only of a run that
    exists) differ from the run's: every task would be refused, so better now than in the queue."""
    from layertap.extract.config import as_run_recorded  # the same tolerance as the extractor's own check

    manifest = load_manifest(store)
    settings = as_run_recorded(manifest.config, settings or {})
    diffs = [f"{k}: run has {manifest.config.get(k)!r}, now {v!r}" for k, v in settings.items()
             if manifest.config.get(k) != v]
    diffs += manifest.template_differences(dataset_of(manifest)) if dataset_of is not None else []
    if fingerprint is not None and (differs := manifest.fingerprint_difference(fingerprint())) is not None:
        diffs.append(differs)
    if diffs:
        raise ConfigMismatch(f"the run at {store.uri} was made with a different configuration:\n  " + "\n  ".join(diffs)
                             + "\nuse the run's settings to resume it, or write the new run to another prefix")
    total = len(manifest.shards)
    ids = range(total) if only is None else sorted(set(only))
    check_shard_ids(ids, total)
    st = scan(store, manifest, with_tallies=False)  # commits, leases and failures are what it reads
    st.raise_if_replaced(store.uri)  # submitting would only start tasks that stop on the same error
    states = {s: st.state(s) for s in ids}
    running = [s for s, v in states.items() if v == "running"]
    failed = [s for s, v in states.items() if v == "failed"]
    todo = [s for s, v in states.items() if v in ("failed", "pending")]
    waiting = [w for w in (waiting_workers(store, waiting_records(store), slurm_jobs) if todo else [])
               if w.shards is None or any_within(todo, w.shards)]
    waited_for = todo if any(w.shards is None for w in waiting) else within(todo, [r for w in waiting for r in w.shards])
    return Remaining(run_id=manifest.run_id, total=total, selected=None if only is None else len(ids), done=sum(1 for v in states.values() if v == "done"),
                     running=running, failed=failed,
                     interrupted=[s for s in failed if st.failures[s][-1].endswith(layout.STOPPED)],
                     todo=todo, leases={s: st.live_lease(s).key for s in running},
                     waiting=len(waiting), waiting_jobs=sorted({w.who or "unknown" for w in waiting}),
                     waiting_tasks=sorted({w.task for w in waiting if w.task}),
                     waited_for=_not_given_up(store, waited_for, waiting) if waiting else [])


def _not_given_up(store: ObjectStore, shards: list[int], waiting: list) -> list[int]:
    """`shards` (what `waiting` workers may take) less those every waiting worker that may take it
    gave up (its --retries used up: it never takes it again): such a shard was reported as theirs,
    and no resubmission did it. A worker of no Slurm task is taken to give up nothing."""
    by_shard: dict[int, set[str]] = {}
    for job, shards_of in given_up_by_task(store, set(shards)).items():
        for s in shards_of:
            by_shard.setdefault(s, set()).add(job)

    def takers(s: int) -> list:
        return [w for w in waiting if w.shards is None or any(lo <= s <= hi for lo, hi in w.shards)]
    gone = {s for s, jobs in by_shard.items() if all(w.task in jobs for w in takers(s))}
    return [s for s in shards if s not in gone]


def any_within(ids: Sequence[int], ranges: Iterable[Sequence[int]]) -> bool:
    """Whether sorted `ids` hold one inside any of the inclusive [first, last] `ranges`."""
    return any((i := bisect_left(ids, lo)) < len(ids) and ids[i] <= hi for lo, hi in ranges)


def within(ids: Sequence[int], ranges: Iterable[Sequence[int]]) -> list[int]:
    """The ids of sorted `ids` inside any of the inclusive [first, last] `ranges`, by bisection:
    each id tested against each waiting worker's or queued task's range was shards x workers (55 s
    at 100,000 shards and 1,000 workers)."""
    out: set[int] = set()
    for lo, hi in ranges:
        out.update(ids[bisect_left(ids, lo):bisect_right(ids, hi)])
    return sorted(out)


def dynamic_plan(remaining: Remaining | None, nodes: int | None, procs_per_node: int,
                 max_array_size: int = DEFAULT_MAX_ARRAY_SIZE, shards: Sequence[int] | None = None,
                 queued: int = 0) -> ArrayPlan:
    """Tasks that each take free shards until none is left: as many as `nodes`, but no more than
    the remaining shards can keep busy (a task with no shard to take would load the model for
    nothing), nor than the cluster's MaxArraySize allows (fewer tasks each take more shards).
    Without a run yet, `nodes` decides: the first task to plan wins, the rest adopt it; with
    `shards` (extract's --shards), no more tasks than those shards keep busy. `queued` dynamic
    tasks still pending in Slurm for the run take free shards too: that many fewer are started."""
    if nodes is not None and nodes > max_array_size:
        raise ConfigError(f"--nodes {nodes:,} is above this cluster's MaxArraySize of {max_array_size:,} array tasks: "
                          f"give at most {max_array_size:,} (each task takes free shards until none is left)")
    if remaining is None:
        if not nodes:
            raise ConfigError("there is no run at --out yet, so its work cannot be sized: give --nodes N "
                             "(array tasks to start; the first to plan the run wins, the others adopt its plan)")
        if shards is not None:
            nodes = min(nodes, math.ceil(len(shards) / procs_per_node))
        return ArrayPlan(indices=list(range(max(0, nodes - queued))))
    useful = min(math.ceil(len(remaining.free) / procs_per_node), max_array_size)
    return ArrayPlan(indices=list(range(max(0, min(nodes or useful, useful) - queued))))


def static_plan(remaining: Remaining, shards_per_task: int, max_parallel: int | None,
                max_array_size: int = DEFAULT_MAX_ARRAY_SIZE) -> ArrayPlan:
    """Task i owns shards [i*k, (i+1)*k): only the tasks owning unfinished shards are started,
    at most `max_parallel` at once."""
    if shards_per_task < 1:
        raise ConfigError(f"--shards-per-task must be at least 1, got {shards_per_task}")
    indices = sorted({s // shards_per_task for s in remaining.free})
    if indices and indices[-1] >= max_array_size:
        need = math.ceil(remaining.total / max_array_size)
        raise ConfigError(f"with --shards-per-task {shards_per_task} the array needs index {indices[-1]}, above this "
                         f"cluster's MaxArraySize of {max_array_size}: use --shards-per-task {need} or more")
    return ArrayPlan(indices=indices, max_parallel=max_parallel, shards_per_task=shards_per_task,
                     num_shards=remaining.total)


def not_waited_for(remaining: Remaining, plan: ArrayPlan) -> list[int]:
    """The running shards that no task of `plan` waits for. A task waits on the live leases of
    the shards it may take: a dynamic task on all of the run's (of --shards), a static one on its
    own range's only. So when every task of `plan` has succeeded, another job may still be
    extracting these."""
    if plan.shards_per_task is None:
        return [] if plan.indices else list(remaining.running)
    tasks = set(plan.indices)
    return [s for s in remaining.running if s // plan.shards_per_task not in tasks]


def lease_holders(store: ObjectStore, remaining: Remaining, shards: Sequence[int], most: int = 16) -> list[str]:
    """Who holds the live leases of `shards`, read from at most `most` of them spread over the
    list: Slurm job ids (an array's own, as `submit train --after` takes it), or `pid P on HOST`
    for a worker outside Slurm."""
    found = set()
    for s in shards[::max(1, math.ceil(len(shards) / most))]:
        try:
            lease = read_lease(store, remaining.leases[s])
        except StoreError:
            lease = None
        if lease is not None and (name := holder_name(lease["holder"])):  # else released meanwhile, or unreadable
            found.add(name)
    return sorted(found)


def read_all(keys: Iterable[K], read: Callable[[K], T | None],
             enough: Callable[[set[T]], bool] = lambda found: False) -> set[T]:
    """What `read` says of `keys` (16 at a time; None is nothing), stopping once `enough` of it was found."""
    keys, found = list(keys), set()
    with ThreadPoolExecutor(16) as pool:
        for start in range(0, len(keys), 64):
            found |= {x for x in pool.map(read, keys[start:start + 64]) if x is not None}
            if enough(found):
                break
    return found


def given_up_by_task(store: ObjectStore, todo: set[int]) -> dict[str, set[int]]:
    """The shards of `todo` given up (`layout.given_up_key`), by the task (`123_4`) that gave each up."""
    keys = [o.key for o in store.list(layout.GIVEN_UP) if layout.shard_of(o.key, layout.GIVEN_UP) in todo]

    def verdict(key: str) -> tuple[str, int] | None:
        try:
            job = json.loads(store.get(key))["producer"].get("job_id")
        except (StoreError, ValueError, KeyError, TypeError, AttributeError):
            return None  # unreadable, or gone: the shard is left to the task, as before this was read
        return (job, layout.shard_of(key, layout.GIVEN_UP)) if job else None
    by_task: dict[str, set[int]] = {}
    for job, shard in read_all(keys, verdict):
        by_task.setdefault(job, set()).add(shard)
    return by_task
