"""Commit and failure records: small JSON objects, versioned, one per event."""

from __future__ import annotations

import json
import os
import reprlib
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from layertap.manifests import layout
from layertap.manifests.liveness import pid_namespace, slurm_job
from layertap.manifests.manifest import ManifestError, UnsupportedVersion

RECORD_VERSION = 1


@dataclass(frozen=True, slots=True)
class Producer:
    """Who did the work: enough to find the log of the process that wrote or failed a shard."""

    host: str
    pid: int
    rank: int
    job_id: str | None
    token: str  # unique per worker process; makes racing payloads distinct
    pid_ns: str | None = None  # the PID namespace `pid` is in (`liveness.gone_from_here`)

    @classmethod
    def current(cls, rank: int = 0) -> Producer:
        return cls(socket.gethostname(), os.getpid(), rank, slurm_job(), uuid.uuid4().hex[:12], pid_namespace())


def holder_name(producer: dict[str, Any]) -> str | None:
    """Who a recorded producer is, as a user finds it: its Slurm job id (an array's own, as
    `submit train --after` takes it), or `pid P on HOST` outside Slurm; None if it says neither."""
    job, pid, host = producer.get("job_id"), producer.get("pid"), producer.get("host")
    if job:
        return str(job).split("_")[0]
    return f"pid {pid} on {host}" if pid and host else None


@dataclass(frozen=True, kw_only=True)
class CommitRecord:
    shard: int
    data_key: str
    bytes: int
    xxh3_128: str
    num_records: int
    num_tokens: int
    raw_bytes: int
    sample_ids: list[str]
    skipped: list[dict[str, str]] = field(default_factory=list)  # [{"sample_id", "reason"}]
    truncated: int = 0
    relative_error: float | None = None
    producer: dict[str, Any]
    attempt: int
    started_at: float
    committed_at: float

    @property
    def covered(self) -> int:
        """Planned samples the commit accounts for: stored or skipped."""
        return self.num_records + len(self.skipped)


@dataclass(frozen=True, slots=True)
class FeedCommit:
    """A commit as its feed key tells it (`layout.feed_key`): shard and counts, not the record. All
    a follow consumer needs of a shard it has no share of: at thousands of consumers and a few
    dozen samples a shard, most consumers have none of most shards, and need not GET the record."""

    shard: int
    num_records: int
    skipped: int

    @property
    def covered(self) -> int:
        return self.num_records + self.skipped


@dataclass(frozen=True, kw_only=True)
class FailureRecord:
    shard: int
    error_type: str
    error: str
    producer: dict[str, Any]
    attempt: int
    time: float
    preempted: bool = False


def encode(record: CommitRecord | FailureRecord) -> bytes:
    kind = "commit" if isinstance(record, CommitRecord) else "failure"
    return json.dumps({"kind": kind, "version": RECORD_VERSION, **asdict(record)}, separators=(",", ":")).encode()


TO_WITHDRAW = "; run `layertap verify` to withdraw it"  # a corrupt record's advice (not in verify's own reason)


def decode_commit(raw: bytes | dict, where: str) -> CommitRecord:
    """A commit record from its stored bytes, or from their parsed JSON object (the commit index).
    `where`: its key (with the run's root before it or not), which names its shard."""
    record = _decode(raw, where, "commit", CommitRecord)
    named = layout.shard_of(where.rpartition(layout.COMMITS)[2], "") if layout.COMMITS in where else None
    if named is not None and named != record.shard:
        # shard N's key naming shard M's object: M would be read twice, and N never
        raise ManifestError(f"{where}: corrupt commit record (it names shard {record.shard}, its key shard {named})"
                            + TO_WITHDRAW)
    if not layout.is_data_key(record.data_key, record.shard):
        # Never follow it: a key such as "../../x" must not become a path outside the run.
        raise ManifestError(f"{where}: corrupt commit record (data_key {record.data_key!r} is not a data object "
                            f"of shard {record.shard}){TO_WITHDRAW}")
    return record


def decode_failure(raw: bytes, where: str) -> FailureRecord:
    return _decode(raw, where, "failure", FailureRecord)


def _count(v: Any) -> bool:
    return type(v) is int and v >= 0


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _strs(v: Any) -> bool:
    return type(v) is list and all(type(s) is str for s in v)


# What each field of a record must hold: a record of valid JSON and other types (a count as a
# string, `skipped` as a number) crashed the loader, `verify` and `status` deep inside.
_COUNT = (_count, "a count (an integer >= 0)")
_NUMBER = (_number, "a number")
_STRING = (lambda v: type(v) is str, "a string")
_OBJECT = (lambda v: type(v) is dict, "an object")
_FIELD_TYPES: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "commit": {"shard": _COUNT, "data_key": _STRING, "bytes": _COUNT, "xxh3_128": _STRING, "num_records": _COUNT,
               "num_tokens": _COUNT, "raw_bytes": _COUNT, "sample_ids": (_strs, "a list of strings"),
               "skipped": (lambda v: type(v) is list and all(type(s) is dict and _strs(list(s.values())) for s in v),
                           "a list of objects of strings"),
               "truncated": _COUNT, "relative_error": (lambda v: v is None or _number(v), "a number or null"),
               "producer": _OBJECT, "attempt": _COUNT, "started_at": _NUMBER, "committed_at": _NUMBER},
    "failure": {"shard": _COUNT, "error_type": _STRING, "error": _STRING, "producer": _OBJECT, "attempt": _COUNT,
                "time": _NUMBER, "preempted": (lambda v: type(v) is bool, "true or false")},
}


def _check_types(obj: dict[str, Any], types: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """ValueError naming the first field whose value is not of its type (absent ones: the
    dataclass says whether they may be)."""
    for name, (fits, what) in types.items():
        if name in obj and not fits(obj[name]):
            raise ValueError(f"its {name} is {reprlib.repr(obj[name])}, not {what}")


def _decode(raw: bytes | dict, where: str, kind: str, cls):
    try:
        obj = dict(raw) if isinstance(raw, dict) else json.loads(raw)
        if obj.get("kind") != kind:
            raise ValueError(f"expected a {kind} record, found {obj.get('kind')!r}")
        version = obj.get("version")
        if type(version) is not int or version < 1:  # damage, not a newer layertap: `verify` withdraws it
            raise ValueError(f"its version is {version!r}, not a record version")
        if version != RECORD_VERSION:
            raise UnsupportedVersion(f"{where}: {kind} record version {obj.get('version')} is not supported "
                                f"(this layertap reads {RECORD_VERSION}); use a matching layertap release")
        del obj["kind"], obj["version"]
        _check_types(obj, _FIELD_TYPES[kind])
        return cls(**obj)
    except ManifestError:
        raise
    except (ValueError, TypeError, AttributeError, KeyError, RecursionError) as e:
        raise ManifestError(f"{where}: corrupt {kind} record ({e}){TO_WITHDRAW}") from None


def now() -> float:
    return time.time()
