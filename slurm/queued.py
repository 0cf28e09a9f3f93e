"""Array tasks still queued in Slurm for a run (or a regeneration): what a resubmission leaves to them.

A task holds a lease only once it runs, so leases alone let a resubmission made while an array
still waits in the queue (an `%N` cap, a busy partition, a task requeued at its time limit)
submit that array's work again: the second array's tasks start, find the shards taken, and
hold their nodes to wait on the first one's leases. Each extraction array names its run in its
Slurm comment (`tag`), and `squeue` lists the pending tasks that carry it: a static task's
range, and a dynamic task's share of the free shards, are left to them. Regeneration arrays
(`regeneration_tag`) likewise: a pending task keeps its index.

Tasks that have started count too (`started`): between its start and its first lease (the
environment, Python's imports, tokenizing, loading the model) a running task is neither in the
queue nor among the leases, and its work was submitted again. A static task keeps its range
while it runs (it works through all of it); a dynamic one keeps its share until a lease of its
own shows (its shards are then the leases'); neither keeps a shard it gave up. Tasks held for
good (an admin's hold, a failed launch) keep nothing: their work is submitted again, and the log
names them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar
from urllib.parse import quote, unquote

from layertap.extract.config import parse_ids
from layertap.manifests.work import read_lease
from layertap.slurm.scripts import compress
from layertap.slurm.work import Remaining, given_up_by_task, read_all, within
from layertap.storage.store import ObjectStore, StoreError

log = logging.getLogger(__name__)
T = TypeVar("T")

_TAG = re.compile(r"layertap-extract k=(\d+) shards=(\S+) out=(.+)")
_REGENERATION_TAG = re.compile(r"layertap-regenerate tasks=(\d+) out=(.+)")
# data= (percent-encoded: no space) names the run a --delete-consumed trainer consumes, which `status`
# of the run reads before the trainer claims it; absent from the tags of layertap before 2026-12
_TRAINING_TAG = re.compile(r"layertap-train follow=([01]) delete=([01])(?: data=(\S+))? out=(.+)")


SQUEUE_TIMEOUT_S = 30.0  # squeue waits this long at most: past it, the command goes on without the queue
MAX_TAG = 1000  # Slurm refuses a comment over 1,024 characters ("Pathname ... too long"), the whole job with it
SHARDS_SPEC = 200  # a longer --shards list is tagged "some": read as no shard known (its work submitted again,
# which the leases keep done once; read as any shard, the work of shards it could never take was left to it)


def tag(location: str, shards_per_task: int | None, shards: Sequence[int] | None) -> str | None:
    """The comment an extraction array carries: its run (`location`, one text per store place),
    its static range size (0: dynamic) and the shards its tasks may take (extract's --shards).
    None where it would be too long for Slurm (a path of near a thousand characters)."""
    spec = "all" if not shards else compress(list(shards))
    text = f"layertap-extract k={shards_per_task or 0} shards={spec if len(spec) <= SHARDS_SPEC else 'some'} " \
           f"out={location}"
    return text if len(text) <= MAX_TAG else None


@dataclass(frozen=True)
class QueuedTask:
    job: str  # `123_4`: the array task, as squeue names it
    shards_per_task: int  # 0: dynamic
    shards: frozenset[int] | None  # what it may take; None: any of the run's
    running: bool = False  # started (squeue's RUNNING): it may hold leases already
    given_up: frozenset[int] = field(default_factory=frozenset)  # shards it gave up (`started`): never taken again

    @property
    def array(self) -> str:
        return self.job.split("_", 1)[0]

    @property
    def range(self) -> tuple[int, int] | None:
        """A static task's shards, [first, last]; None for a dynamic one."""
        if not self.shards_per_task:
            return None
        index = int(self.job.split("_", 1)[1])
        return index * self.shards_per_task, (index + 1) * self.shards_per_task - 1

    def owns(self, shard: int) -> bool:
        """A static task's range holds `shard`; a dynamic task may take it. Not a shard it gave up."""
        if (self.shards is not None and shard not in self.shards) or shard in self.given_up:
            return False
        return self.range is None or self.range[0] <= shard <= self.range[1]

    def owned(self, todo: Sequence[int], todo_set: frozenset[int]) -> Iterator[int]:
        """The shards of sorted `todo` (`todo_set`, the same as a set) it owns, lazily, walking only
        its own share where it has one (a static range, --shards): every shard against every task
        was shards x tasks (31 s at 100,000 shards and 1,000 static tasks queued)."""
        if self.range is not None:
            todo = within(todo, [self.range])
        elif self.shards is not None and len(self.shards) < len(todo):
            todo = (s for s in sorted(self.shards) if s in todo_set)
        return (s for s in todo if self.owns(s))


# The states of tasks that will still do work: waiting, booting their nodes, or started. A
# started task may not hold a lease yet (`started`); COMPLETING and SUSPENDED ones take no shard.
_STATES = "PENDING,CONFIGURING,RUNNING"
# why a pending job waits, when it never will run (squeue's %r): its work is not left to it. Past a
# partition's or a QOS's limits (a --time over the partition's maximum, under EnforcePartLimits=NO, the
# default), Slurm keeps the job pending for good
_NEVER = ("DependencyNeverSatisfied", "PartitionTimeLimit", "BadConstraints", "InvalidQOS",
          "InvalidAccount", "QOSMaxWallDurationPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit",
          "QOSMaxGRESPerJob")
# ... or runs only once someone releases it, which its owner cannot count on: an admin's hold, or
# Slurm's own after the node failed to launch it (its reason then reads as its description)
_HELD = ("JobHeldAdmin", "launch failed requeued held", "JobLaunchFailure")


@dataclass(frozen=True)
class _Listed:
    """A line of `squeue -h -r -t {_STATES} -o '%i|%T|%r|%k'`."""
    job: str
    state: str
    reason: str
    comment: str


def listed_jobs(listing: str) -> set[str]:
    """The jobs and array tasks (`123_4`) squeue's `listing` shows: those still queued or running."""
    return {t.job for t in _listed(listing)}


def _listed(listing: str) -> list[_Listed]:
    """squeue's lines, the comment last (it may hold a '|') and unpadded (a location may end in a space)."""
    found = []
    for line in listing.splitlines():
        job, state, reason, comment = (line.split("|", 3) + ["", "", ""])[:4]
        found.append(_Listed(job.strip(), state.strip(), reason.strip(), comment.rstrip("\r\n")))
    return found


def _will_start(tagged: list[tuple[_Listed, T]], what: str) -> list[T]:
    """What `tagged` tasks (of `what`, a run or an output) stand for, less those that will never
    start: one whose dependency can never be met, and one held for good (`_HELD`), whose work is
    submitted again. The log names the held ones: released later, they would do it twice."""
    never = [t for t, _ in tagged if t.reason in _NEVER and t.reason != "DependencyNeverSatisfied"]
    if never:
        jobs = " ".join(t.job for t in never)
        log.warning("Slurm task(s) %s queued for %s will never start (%s: past a limit of the partition or QOS): "
                    "their work is submitted again; `scancel %s`", jobs, what,
                    ", ".join(sorted({t.reason for t in never})), jobs)
    held = [t for t, _ in tagged if t.reason in _HELD]
    if held:
        jobs = " ".join(t.job for t in held)
        log.warning("Slurm task(s) %s queued for %s are held (%s) and start only if released (`scontrol release`): "
                    "their work is not left to them but submitted again. `scancel %s` unless you release them, "
                    "or a release would do it twice", jobs, what, ", ".join(sorted({t.reason for t in held})), jobs)
    return [x for t, x in tagged if _starts(t)]


def _starts(t: _Listed) -> bool:
    """Whether a listed job will start: not one whose dependency or limits forbid it, nor one held for good."""
    return t.reason not in _NEVER and t.reason not in _HELD


def parse_squeue(listing: str, location: str) -> list[QueuedTask]:
    """The tasks of `listing` (squeue's lines, `_listed`) tagged with the run at `location`, less
    those that will never start (`_will_start`)."""
    tagged = []
    for t in _listed(listing):
        m = _TAG.fullmatch(t.comment)
        if m is None or m[3] != location or "_" not in t.job or not t.job.split("_", 1)[1].isdigit():
            continue
        shards = None if m[2] == "all" else frozenset() if m[2] == "some" else frozenset(parse_ids(m[2]))
        tagged.append((t, QueuedTask(t.job, int(m[1]), shards, running=t.state == "RUNNING")))
    return _will_start(tagged, f"the run at {location}")


_NO_CLUSTER = "Could not establish a configuration source"  # squeue's fatal error where no cluster is configured


def squeue_listing(unasked: str = "tasks still queued for this output are not left their work",
                   level: int = logging.WARNING) -> str | None:
    """squeue's jobs and array tasks still to do work (`_STATES`), a line each (`123_4|state|reason|
    comment`), every user's it lets this one see; None where squeue is not here or fails (the
    submission goes on as before)."""
    if shutil.which("squeue") is None:
        return None
    # -a: also the jobs of hidden partitions and of those unavailable to this user's group, which squeue
    # leaves out by default (their leases were taken for dead jobs', their queued tasks for none)
    try:
        p = subprocess.run(["squeue", "-h", "-a", "-r", "-t", _STATES, "-o", "%i|%T|%r|%k"], capture_output=True,
                           text=True, timeout=SQUEUE_TIMEOUT_S)
    except (subprocess.TimeoutExpired, OSError) as e:  # a slurmctld that does not answer must not hang the command
        log.log(level, "squeue did not answer (%s): %s", e, unasked)
        return None
    if p.returncode != 0:
        said = (p.stderr or p.stdout).strip().splitlines()  # its last line: a fatal error follows its causes
        # a Slurm client installed with no cluster configured (no slurm.conf, no configless server): no jobs to
        # look for, and a warning at every `delete` read as the delete's fault
        unset = any(_NO_CLUSTER in line for line in said) and not os.environ.get("SLURM_CONF") \
            and not os.path.exists("/etc/slurm/slurm.conf")  # configless: a slurmctld not reached is a failure
        log.log(logging.DEBUG if unset else level, "squeue failed (%s): %s", said[-1] if said else f"exit {p.returncode}",
                unasked)
        return None
    return p.stdout


def _pending() -> str:
    return squeue_listing() or ""


def queued_tasks(location: str, listing: str | None = None) -> list[QueuedTask]:
    """The extraction tasks of the run at `location` still to do work, pending or running (see
    `started`), of `listing` (`squeue_listing`'s; default: asked now)."""
    return parse_squeue(_pending() if listing is None else listing, location)


def lease_jobs(store: ObjectStore, remaining: Remaining) -> dict[int, str]:
    """The Slurm job (`123_4`) holding each running shard's live lease, read once (a GET a running
    shard, 16 at a time) for `without_dead_holders` and `started`; a worker outside Slurm, or a
    lease unreadable or released meanwhile, is left out."""
    def job_of(item: tuple[int, str]) -> tuple[int, str] | None:
        shard, key = item
        try:
            lease = read_lease(store, key)
        except StoreError:
            return None
        job = lease["holder"].get("job_id") if lease and isinstance(lease.get("holder"), dict) else None
        return (shard, job) if isinstance(job, str) and job else None
    return dict(read_all(remaining.leases.items(), job_of))


def without_dead_holders(remaining: Remaining, jobs: dict[int, str], listing: str) -> Remaining:
    """`remaining` with the running shards whose live lease a Slurm job holds (`jobs`, of
    `lease_jobs`) that squeue's `listing` no longer shows (cancelled, killed, out of time: its
    lease lives on for up to --lease-ttl) taken for pending: they were counted as running, and a
    resubmission made then left them to no one ("nothing to submit: shards 2 are running under
    live leases"). A worker outside Slurm, or one whose lease cannot be read, still counts as
    running. A job squeue does not show this user (a cluster's PrivateData) is taken for gone:
    its shard's new task waits on its lease, which keeps the work done once."""
    alive = listed_jobs(listing)
    gone = {shard for shard, job in jobs.items() if job not in alive}
    if not gone:
        return remaining
    log.info("shard(s) %s: their lease's Slurm job is no longer in squeue (its lease goes stale within --lease-ttl): "
             "submitted again", compress(sorted(gone)))
    return replace(remaining, running=[s for s in remaining.running if s not in gone],
                   todo=sorted({*remaining.todo, *gone}), leases={s: k for s, k in remaining.leases.items()
                                                                   if s not in gone}, orphaned=sorted(gone))


@dataclass(frozen=True)
class QueuedTrainer:
    """A training job squeue shows for an output (`training_tag`)."""
    job: str
    follow: bool  # --follow: takes every shard as it is committed, whichever array commits it
    deletes: bool  # --delete-consumed: opens a --window extraction waits on


def training_tag(location: str, follow: bool, deletes: bool, data: str | None = None) -> str | None:
    """The comment a training job carries: its output (`location`, one text per store place), its
    kind and, for a --delete-consumed trainer, the run it consumes (`data`, a `store_location`);
    None where too long for Slurm."""
    named = f" data={quote(data, safe='/:')}" if deletes and data else ""
    for text in (f"layertap-train follow={int(follow)} delete={int(deletes)}{named} out={location}",
                 f"layertap-train follow={int(follow)} delete={int(deletes)} out={location}"):  # data= too long
        if len(text) <= MAX_TAG:
            return text
    return None


def queued_training(location: str, listing: str | None = None) -> list[QueuedTrainer]:
    """The training jobs for the output at `location` pending or running (of `listing`, squeue's;
    default: asked now), less those that will never start: a resubmission queued a second trainer
    beside one still waiting for its extraction."""
    tagged = [(t, QueuedTrainer(t.job, m[1] == "1", m[2] == "1"))
              for t in _listed(_pending() if listing is None else listing)
              if (m := _TRAINING_TAG.fullmatch(t.comment)) is not None and m[4] == location]
    return _will_start(tagged, f"the training output at {location}")


def consuming_trainers(run: str, listing: str) -> list[str]:
    """The --delete-consumed training jobs of squeue's `listing` that will start and consume the run
    at `run` (a `store_location`; their tag's data=): queued, or started and not yet claimed, they
    are the trainer a --window run waits on, though the run names no consumer yet."""
    return [t.job for t in _listed(listing) if _starts(t) and (m := _TRAINING_TAG.fullmatch(t.comment)) is not None
            and m[2] == "1" and m[3] is not None and unquote(m[3]) == run]


def store_location(uri: str) -> str:
    """Where `open_store` puts a store, one text for each place: the store's own URI (its S3
    prefix without outer slashes; a local folder's absolute path, `file://` and `~` read), a local
    folder's with symlinks resolved too: what a job's comment names, and how a trainer's --data and
    an extraction's --out are told to be the same run."""
    from layertap.storage.store import open_store

    where = open_store(uri).uri
    return where if where.startswith("s3://") else os.path.realpath(where)


@dataclass(frozen=True)
class TaggedJob:
    """A job of `layertap submit` that squeue shows for a prefix (`jobs_naming`)."""
    job: str  # `123_4`: an array task, or a job
    kind: str  # what it runs: "extract", "train" or "regenerate"
    starts: bool  # False: held for good, or never to start (`_will_start`): released, it would still write


def jobs_naming(uri: str, listing: str | None = None, quiet: bool = False) -> list[TaggedJob]:
    """The Slurm jobs pending or running whose comment names the run or output at `uri` (an
    extraction, training or regeneration job of `layertap submit`), of `listing` (squeue's lines;
    default: asked now; [] where squeue is not here or does not answer). What `layertap delete`
    refuses to delete under (a queued extraction task planned the run anew at the prefix once it
    started), and what `status` names where no shard runs (`quiet`: a failing squeue is not warned
    of)."""
    location = store_location(uri)
    if listing is None:
        listing = squeue_listing("Slurm jobs queued for it are not looked for",
                                 logging.DEBUG if quiet else logging.WARNING) or ""
    kinds = (("extract", _TAG), ("train", _TRAINING_TAG), ("regenerate", _REGENERATION_TAG))
    return [TaggedJob(t.job, kind, _starts(t)) for t in _listed(listing)
            for kind, tag in kinds if (m := tag.fullmatch(t.comment)) is not None and m[m.re.groups] == location]


def regeneration_tag(location: str, tasks: int) -> str | None:
    """The comment a regeneration array carries: its output and its split (`--tasks`); None where
    too long for Slurm."""
    text = f"layertap-regenerate tasks={tasks} out={location}"
    return text if len(text) <= MAX_TAG else None


def queued_regeneration(location: str, listing: str | None = None) -> list[tuple[int, int, str]]:
    """The regeneration tasks of the output at `location` still to do work (of `listing`, squeue's
    lines; default: asked now), pending or running, as (task index, its split --tasks, its array
    job). A running one is at work, or about to take its task's lease."""
    tagged = []
    for t in _listed(_pending() if listing is None else listing):
        array, _, index = t.job.partition("_")
        m = _REGENERATION_TAG.fullmatch(t.comment)
        if m is not None and m[2] == location and index.isdigit():
            tagged.append((t, (int(index), int(m[1]), array)))
    return _will_start(tagged, f"the output at {location}")


def started(store: ObjectStore, remaining: Remaining, queued: list[QueuedTask],
            jobs: dict[int, str]) -> list[QueuedTask]:
    """`queued` less the running dynamic tasks that hold a live lease (`jobs`, the holders
    `lease_jobs` read: their shards are `remaining.running`, and they take more only as the new
    tasks do: counted again, the
    resubmission would start too few), with each running task's given-up shards, which it will
    never take again (`WorkQueue._give_up`). A running task with no lease yet is starting (or has
    no free shard it may take: then it owns none). Reads the store only while tasks run. (A task
    requeued since it gave a shard up tries it anew, yet keeps none of it here: that shard is
    submitted beside it, and the leases keep the data right.) Nor a running task waiting behind a
    full --window: it holds no lease, and its work is counted as the waiting workers' (`waited_for`)."""
    waiting = set(remaining.waiting_tasks)
    queued = [t for t in queued if not (t.running and t.job in waiting)]
    dynamic = {t.job for t in queued if t.running and not t.shards_per_task}
    holding = {jobs[s] for s in remaining.running if s in jobs} & dynamic  # `lease_jobs`
    gave_up = given_up_by_task(store, set(remaining.todo)) if any(t.running for t in queued) else {}
    return [replace(t, given_up=frozenset(gave_up.get(t.job, ()))) if t.running else t
            for t in queued if t.job not in holding]


def leave_to_queued(remaining: Remaining, queued: list[QueuedTask]) -> Remaining:
    """`remaining` with what `queued` will do left out of its free shards: a static task's range,
    and for the dynamic ones their count (`dynamic_plan` starts that many fewer tasks). Tasks
    with nothing left to take count for nothing. Running tasks count as `started` leaves them."""
    todo = remaining.free
    todo_set = frozenset(todo)
    busy = [t for t in queued if next(t.owned(todo, todo_set), None) is not None]
    static = [t for t in busy if t.shards_per_task]
    return replace(remaining, queued=len(busy), queued_dynamic=len(busy) - len(static),
                   queued_running=sum(t.running for t in busy),
                   queued_jobs=sorted({t.array for t in busy}),
                   queued_for=sorted({s for t in static for s in t.owned(todo, todo_set)}))
