"""One trainer at a time per training output (`layertap train --out`).

Two trainers writing one output overwrite each other's checkpoints and metrics, and with
--delete-consumed each counts the other's shards as read. It happens without anyone meaning it:
a Slurm resubmission queues a trainer while the last one still runs, or a command is run twice.
So the trainer holds a lease on its output, as an extraction worker holds one on its shard:
`lease/{generation:06d}.ttl{s}` (JSON: host, pid, Slurm job, token), created once, and renewed
every ttl/4 by rewriting a key of the holder's own beside it, `lease/{generation:06d}.ttl{s}.beat-{token}`
(`layout.beat_key`); alive while the newest LastModified of the two + ttl is ahead of the store's
clock. The lease key itself is never rewritten: a renewal that lands late (its trainer paused
between its check and its PUT, for longer than the ttl) would overwrite the lease that a new
trainer created under the same key, and evict the live trainer for the stale one.

A trainer that finds a live lease waits for it to go stale (a holder that died, e.g. a node lost
mid-run) unless it is renewed meanwhile, or its holder is a process gone from this very machine
(`liveness.gone_from_here`: a trainer killed here and started again): then it takes the output
over at once. A renewal proves the holder alive, and the newcomer is refused with who holds it.
A holder that finds a newer generation, or its key gone or holding another holder's token (it
stalled past its ttl and was taken over), stops before its next write.

A `Role` names the holder in what it says and where its keys live: a trainer's are `lease/` at its
output; a `layertap regenerate --task I/N` process holds `tasks/{I}-of-{N}/lease/` at its output the
same way (`regeneration.task_role`), so a resubmission while it runs does not answer its parts twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from layertap.manifests import layout
from layertap.manifests.liveness import gone_from_here, pid_namespace, slurm_job
from layertap.manifests.preemption import shielded
from layertap.storage.errors import ConfigError
from layertap.storage.store import ObjectInfo, ObjectNotFound, ObjectStore, StoreError

log = logging.getLogger(__name__)

PREFIX = "lease/"
DEFAULT_TTL_S = 60.0
_KEY = re.compile(r"lease/(\d{6})\.ttl([0-9.]+)$")


@dataclass(frozen=True)
class Role:
    """Who holds a lease of this kind, as messages name it, and where its keys live."""

    name: str = "trainer"
    command: str = "`layertap train`"
    clash: str = ("two trainers on one --out overwrite each other's checkpoints. Stop that one first, or give this "
                  "one another --out")
    prefix: str = PREFIX


TRAINER = Role()


@dataclass(frozen=True, slots=True)
class Held:
    """A live lease on an output, as another process sees it."""

    key: str
    generation: int
    ttl_s: float
    modified: float
    holder: dict[str, Any]

    def describe(self, now: float) -> str:
        return f"{holder_text(self.holder)}; lease renewed {max(0.0, now - self.modified):.0f} s ago"


def holder_text(holder: Mapping[str, Any]) -> str:
    """'pid P on HOST, Slurm job J': who holds an output, from its lease (or `status`'s trainer)."""
    who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"
    return who + (f", Slurm job {holder['slurm_job']}" if holder.get("slurm_job") else "")


class OutputLeaseTaken(ConfigError):
    """Another live trainer writes to this output, or took it over from this one."""


def latest(store: ObjectStore, prefix: str = PREFIX) -> tuple[int, ObjectInfo, float] | None:
    """The newest lease's (generation, listing entry, ttl) under `prefix`, None when there is none.
    The entry's `modified` is the newest of the key's and its beats' (a lease of a version before
    beats has none: its holder rewrote the key)."""
    return latest_in(list(store.list(prefix)))


def latest_in(listed: list[ObjectInfo]) -> tuple[int, ObjectInfo, float] | None:
    """`latest` of one lease prefix's listing."""
    found = [(int(m[1]), o, float(m[2])) for o in listed if (m := _KEY.search(o.key))]
    if not found:
        return None
    generation, info, ttl = max(found, key=lambda f: f[0])
    renewed = max([info.modified, *(o.modified for o in listed if layout.beat_of(o.key) == info.key)])
    return generation, replace(info, modified=renewed), ttl


def taken_over(store: ObjectStore, role: Role = TRAINER) -> OutputLeaseTaken:
    return OutputLeaseTaken(
        f"another {role.name} took {store.uri.rstrip('/')} over while this one could not renew its lease on it "
        "(a stall, or the store out of reach, for longer than the lease's ttl): stopping without writing")


def live_holder(store: ObjectStore, prefix: str = PREFIX) -> Held | None:
    """The holder of the lease under `prefix` now (alive by the store's clock), else None."""
    return held_by(store, latest(store, prefix))


def held_by(store: ObjectStore, found: tuple[int, ObjectInfo, float] | None) -> Held | None:
    """The holder of the newest lease in `found` (`latest`'s) if that lease is alive, else None."""
    if found is None:
        return None
    generation, info, ttl = found
    if info.modified + ttl <= store.now():
        return None
    return Held(info.key, generation, ttl, info.modified, _payload(store, info.key))


def beat_progress(store: ObjectStore, held: Held) -> dict[str, Any]:
    """What the holder's last beat said of its work (`OutputLease.progress`); {} before its first beat,
    or for a holder that says nothing."""
    token = held.holder.get("token")
    return _payload(store, layout.beat_key(held.key, token)) if isinstance(token, str) else {}


def _payload(store: ObjectStore, key: str) -> dict[str, Any]:
    try:
        body = json.loads(store.get(key))
        return body if isinstance(body, dict) else {}
    except (ObjectNotFound, ValueError):  # released meanwhile, or not ours to read: shown as '?'
        return {}


class OutputLease:
    """The lease of the trainer writing to `store`: `acquire()`, then `check()` before each write,
    `release()` at the end (also as a context manager)."""

    def __init__(self, store: ObjectStore, ttl_s: float = DEFAULT_TTL_S, poll_s: float = 2.0, role: Role = TRAINER):
        self.store, self.ttl_s, self.poll_s, self.role = store, ttl_s, poll_s, role
        self.key: str | None = None
        self.generation = 0
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self.token = uuid.uuid4().hex  # tells this holder's lease from a later one under a reused key
        # what each beat says of the holder's work (the trainer's last step): its lease is renewed by a
        # thread of its own, which went on while every rank hung in a collective
        self.progress: Callable[[], dict[str, Any]] | None = None
        self._body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "pid_ns": pid_namespace(),
                                 "slurm_job": slurm_job(), "started": time.time(),
                                 "token": self.token}).encode()

    def __enter__(self) -> OutputLease:
        try:
            self.acquire()
        except BaseException:  # a stop right after the claim: the lease is ours, and no __exit__ runs
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the output, waiting up to a lease's ttl for a dead holder's lease to go stale.

        Raises OutputLeaseTaken when the holder renews its lease meanwhile (it is alive)."""
        uri = self.store.uri.rstrip("/")
        first_seen: float | None = None
        while True:
            # one listing for both: a generation read from a second listing, made after another
            # trainer had claimed the next one, was past it, and its claim deleted that trainer's lease
            found = latest(self.store, self.role.prefix)
            held = held_by(self.store, found)
            if held is None or gone_from_here(held.holder):
                if held is not None:
                    log.info("%s: its last %s (%s) is no longer running here: taking the output over", uri,
                             self.role.name, held.describe(self.store.now()))
                with shielded():  # a stop in the claim would leave our lease unknown to us
                    created = self._create(1 + (found or (0,))[0])
                if created:
                    break
                continue  # another trainer created that generation first: look again
            if first_seen is not None and held.modified > first_seen:
                raise OutputLeaseTaken(
                    f"another {self.role.command} is writing to {uri} ({held.describe(self.store.now())}): "
                    f"{self.role.clash}")
            if first_seen is None:
                first_seen = held.modified
                log.warning("%s is held by another %s (%s): waiting up to %.0f s for its lease to go stale "
                            "(it died) or be renewed (it runs)", uri, self.role.name, held.describe(self.store.now()),
                            held.ttl_s)
            time.sleep(self.poll_s)
        self._beat = threading.Thread(target=self._renew, name="output-lease", daemon=True)
        self._beat.start()

    def check(self) -> None:
        """Raise if another trainer has taken the output over (this one's lease went stale)."""
        if not self.holds():
            raise taken_over(self.store, self.role)

    def holds(self) -> bool:
        """Whether the output is still this trainer's, looked up on the store now (the heartbeat
        looks only every ttl/4: a trainer back from a stall or an outage would write before it
        noticed). A store that cannot answer says nothing new: the write that follows fails too."""
        if not self.lost.is_set():
            try:
                self._look()
            except StoreError as e:
                log.warning("could not look at the output lease: %s", e)
        return not self.lost.is_set()

    def _look(self) -> None:
        """Set `lost` when a newer generation exists or this lease's key no longer holds this
        holder's token (generations restart once every lease is gone: a key can come back as
        another trainer's)."""
        found = latest(self.store, self.role.prefix)
        if (found is not None and found[0] > self.generation) or not self._owned():
            if not self.lost.is_set():
                log.error("%s: another %s took the output over (lease %s)", self.store.uri, self.role.name,
                          found[1].key if found else "gone")
            self.lost.set()

    def _owned(self) -> bool:
        """Whether this lease's key is there and names this holder (a late beat of ours never
        recreates it: only the claim writes it)."""
        return _payload(self.store, self.key).get("token") == self.token

    def release(self) -> None:
        """Stop the heartbeat and delete our lease; a stop signal meanwhile is raised as it ends
        (cut off, the lease stayed until stale: a rerun on another node waited a ttl for it)."""
        with shielded():
            self._release()

    def _release(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
        if self.key is not None:
            try:
                self.store.delete(layout.beat_key(self.key, self.token))  # our own key, whoever holds the lease
                if self._owned():  # not a later trainer's lease under the same key
                    self.store.delete(self.key)
                self._remove_if_empty()
            except StoreError as e:  # goes stale by itself after ttl_s
                log.warning("could not release the lease %s: %s", self.key, e)
        self.key = None

    def _remove_if_empty(self) -> None:
        """An output that holds nothing once the lease is gone (a command refused after taking it:
        a run without commits, a target not on this machine) is not left behind as an empty
        folder with an empty lease/ in it; one LIST. Outputs with anything in them keep their folders."""
        if next(iter(self.store.list()), None) is None:
            self.store.remove_empty_folders()

    def _create(self, generation: int) -> bool:
        """Claim `generation`; False if another trainer did. A claimant with another ttl writes
        another key of the same generation: of two such, the later sees the other and backs off."""
        key = f"{self.role.prefix}{generation:06d}.ttl{layout.ttl_text(self.ttl_s)}"
        if not self.store.put_if_absent(key, self._body):
            return False
        others = [o.key for o in self.store.list(self.role.prefix) if o.key != key]
        if any((m := _KEY.search(k)) and int(m[1]) >= generation for k in others):
            self.store.delete(key)
            return False
        self.key, self.generation = key, generation
        if others:  # dead holders' leases and beats (also a beat that landed after its lease went)
            self.store.delete_many(others)
        return True

    def _progress_said(self) -> bytes:
        """The beat's body: what `progress` says, or nothing where it fails (the beat must go on)."""
        try:
            return json.dumps(self.progress()).encode() if self.progress is not None else b""
        except Exception as e:  # noqa: BLE001 - a report, never the lease's end
            log.debug("the output lease's progress report failed: %s", e)
            return b""

    def _renew(self) -> None:
        """Beat every ttl/4 while the lease is ours: a PUT of this holder's own beat key, which a
        PUT landing late cannot turn into anyone else's lease (it only refreshes a lease under
        our key's name for up to a ttl, if a new trainer made one; that one's holder still holds)."""
        beat = layout.beat_key(self.key, self.token)
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self._look()
                if self.lost.is_set():
                    return
                self.store.put(beat, self._progress_said())
            except StoreError as e:  # keep trying: the lease only goes stale after ttl_s
                log.warning("output lease heartbeat failed: %s", e)
