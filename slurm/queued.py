"""Array tasks still queued in Slurm for a run (or a regeneration): what a resubmission leaves to them.

A task holds a lease only once it runs, so leases alone let a resubmission made while an array
still waits in the queue (an `%N` cap, a busy partition, a task requeued at its time limit)
submit that array's work again: the second array's tasks start, find the shards taken, and
hold their nodes to wait on the first one's leases. Each extraction array names its run in its
Slurm comment (`tag`), and `squeue` lists the pending tasks that carry it: a static task's
range, and a dynamic task's share of the free shards, are left to them. Regeneration arrays
(`regeneration_tag`) likewise: a pending task keeps its index.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace

from layertap.extract.config import parse_ids
from layertap.slurm.scripts import compress
from layertap.slurm.work import Remaining

log = logging.getLogger(__name__)

_TAG = re.compile(r"layertap-extract k=(\d+) shards=(\S+) out=(.+)")
_REGENERATION_TAG = re.compile(r"layertap-regenerate tasks=(\d+) out=(.+)")


MAX_TAG = 1000  # Slurm refuses a comment over 1,024 characters ("Pathname ... too long"), the whole job with it
SHARDS_SPEC = 200  # a longer --shards list is tagged "some": read as any shard (work left, never taken twice)


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

    @property
    def array(self) -> str:
        return self.job.split("_", 1)[0]

    def owns(self, shard: int) -> bool:
        """A static task's range holds `shard`; a dynamic task may take it."""
        if self.shards is not None and shard not in self.shards:
            return False
        if not self.shards_per_task:
            return True
        index = int(self.job.split("_", 1)[1])
        return index * self.shards_per_task <= shard < (index + 1) * self.shards_per_task


# why a pending job waits, when it never will run (squeue's %r): its work is not left to it
_NEVER = ("DependencyNeverSatisfied",)


def _tasks(listing: str) -> list[tuple[str, str]]:
    """(array task, comment) of `squeue -h -r -t PENDING -o '%i|%r|%k'` lines (the comment last: it
    may hold a '|'), less the tasks that will never start."""
    found = []
    for line in listing.splitlines():
        job, _, rest = line.partition("|")
        reason, _, comment = rest.partition("|")
        if reason.strip() not in _NEVER:
            found.append((job.strip(), comment.rstrip("\r\n")))  # unpadded: a location may end in a space
    return found


def parse_squeue(listing: str, location: str) -> list[QueuedTask]:
    """The tasks of `listing` (squeue's lines, `_tasks`) tagged with the run at `location`."""
    found = []
    for job, comment in _tasks(listing):
        m = _TAG.fullmatch(comment)
        if m is None or m[3] != location or "_" not in job or not job.split("_", 1)[1].isdigit():
            continue
        shards = None if m[2] in ("all", "some") else frozenset(parse_ids(m[2]))
        found.append(QueuedTask(job, int(m[1]), shards))
    return found


def _pending() -> str:
    """squeue's pending array tasks, a line each (`123_4|reason|comment`), every user's it lets
    this one see; none where squeue is not here or fails (the submission goes on as before)."""
    if shutil.which("squeue") is None:
        return ""
    p = subprocess.run(["squeue", "-h", "-r", "-t", "PENDING", "-o", "%i|%r|%k"], capture_output=True, text=True)
    if p.returncode != 0:
        log.warning("squeue failed (%s): tasks still queued for this output are not left their work",
                    (p.stderr or p.stdout).strip() or f"exit {p.returncode}")
        return ""
    return p.stdout


def queued_tasks(location: str) -> list[QueuedTask]:
    """The pending extraction tasks of the run at `location`."""
    return parse_squeue(_pending(), location)


def regeneration_tag(location: str, tasks: int) -> str | None:
    """The comment a regeneration array carries: its output and its split (`--tasks`); None where
    too long for Slurm."""
    text = f"layertap-regenerate tasks={tasks} out={location}"
    return text if len(text) <= MAX_TAG else None


def queued_regeneration(location: str, listing: str | None = None) -> list[tuple[int, int, str]]:
    """The pending regeneration tasks of the output at `location` (of `listing`, squeue's lines;
    default: asked now), as (task index, its split --tasks, its array job)."""
    found = []
    for job, comment in _tasks(_pending() if listing is None else listing):
        array, _, index = job.partition("_")
        m = _REGENERATION_TAG.fullmatch(comment)
        if m is not None and m[2] == location and index.isdigit():
            found.append((int(index), int(m[1]), array))
    return found


def leave_to_queued(remaining: Remaining, queued: list[QueuedTask]) -> Remaining:
    """`remaining` with what `queued` will do left out of its free shards: a static task's range,
    and for the dynamic ones their count (`dynamic_plan` starts that many fewer tasks). Tasks
    with nothing left to take count for nothing."""
    todo = remaining.free
    busy = [t for t in queued if any(t.owns(s) for s in todo)]
    static = [t for t in busy if t.shards_per_task]
    return replace(remaining, queued=len(busy), queued_dynamic=len(busy) - len(static),
                   queued_jobs=sorted({t.array for t in busy}),
                   queued_for=[s for s in todo if any(t.owns(s) for t in static)])
