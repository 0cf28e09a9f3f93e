"""The object-store interface every layer of layertap reads and writes through.

Two backends implement it: a local folder (`storage.local`) and S3 or any S3-compatible server
(`storage.s3`). The interface is deliberately the common denominator of both, so a run prefix can
move between them without code changes. Keys are always relative to the store's root (the URI the
store was opened with) and use "/" as separator.
"""

from __future__ import annotations

import abc
import os
import posixpath
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from layertap.storage.errors import UserError

if TYPE_CHECKING:
    from layertap.storage.s3 import S3Options


class StoreError(UserError):
    """A store operation failed; the message names the key and, where known, the fix."""


class TransientStoreError(StoreError):
    """Worth another try: a 5xx, throttling, a timeout, a connection or a body that failed. The
    store retries these itself (`storage.retry`): raised to a caller, it persisted."""


class EndpointUnreachable(TransientStoreError):
    """No connection could be made (refused, unknown host): the server is down or the endpoint is
    wrong, so the store gives up after a few quick tries."""


class RangeNotSatisfiable(StoreError):
    """A ranged read that starts at or past the object's end (HTTP 416)."""


class ObjectNotFound(StoreError):
    """The key does not exist."""


class InvalidKey(StoreError, ValueError):
    """A key that could escape the store root or is otherwise malformed."""


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    modified: float = 0.0  # unix time of the last write, by the store's clock, at the latest (S3: `S3Store.list`)
    version: str = ""  # changes whenever the object is written again (S3's ETag); "" if unknown


@dataclass(frozen=True, slots=True)
class PendingUpload:
    """An upload that was started and neither completed nor aborted (a crashed writer)."""

    key: str
    upload_id: str
    initiated: float  # unix time


# The keys `S3Store` checks the server's conditional writes with (storage/s3.py), at the root of
# its prefix and deleted at once. One is left behind only by a process killed mid-check, so the
# checks that judge a prefix by what it holds (`layertap delete`, `layertap export`) ignore them.
WRITE_PROBE = ".layertap-write-probe-"


def is_write_probe(key: str) -> bool:
    """Whether `key` (relative to the store root) is a left-over conditional-write probe."""
    return key.startswith(WRITE_PROBE)


def check_key(key: str) -> str:
    """Refuse keys that could leave the root: sample ids and shard names never become stray paths."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKey(f"invalid object key {key!r}: must be relative and use '/' separators")
    parts = key.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise InvalidKey(f"invalid object key {key!r}: empty, '.' or '..' path components are not allowed")
    return key


def join_key(*parts: str) -> str:
    """Join key components with '/', ignoring empty ones."""
    return posixpath.join(*[p.strip("/") for p in parts if p and p.strip("/")])


class ObjectWriter(abc.ABC):
    """A streaming writer: bytes go out while the caller is still producing them.

    The object becomes visible only when `close()` succeeds. Leaving the `with` block through an
    exception (or calling `abort()`) discards everything written so far; nothing half-written is
    ever visible under the key.
    """

    key: str

    @abc.abstractmethod
    def write(self, data: bytes | memoryview) -> int: ...

    @abc.abstractmethod
    def close(self) -> None:
        """Finish the object and make it visible under its key."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Discard the object; safe to call more than once and after a failed close."""

    @property
    @abc.abstractmethod
    def bytes_written(self) -> int: ...

    @property
    def peak_buffered_bytes(self) -> int:
        """Largest number of bytes this writer held in memory at once."""
        return 0

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ObjectStore(abc.ABC):
    """put / create-if-absent / get / ranged get / list / delete / streaming writer.

    A backend retries its own transient failures (`storage.retry`); callers do not retry."""

    uri: str
    retries: int = 0  # requests this store has retried so far, all threads together
    _clock_offset: float | None = None  # the store's clock minus ours, once measured (`now`)

    def now(self) -> float:
        """The time by the store's clock, the one that stamps `ObjectInfo.modified`: leases age by
        it, and a machine whose own clock ran ahead by most of a TTL would take live leases for
        stale ones (a worker taking shards over, `status` calling them stale, `delete` running over
        them). The offset is measured once per store object (`_measure_clock_offset`), erring
        towards a store clock behind ours, and `modified` is the latest a write may have been:
        objects look younger, never older, than they are."""
        if self._clock_offset is None:
            measured = self._measure_clock_offset()
            if measured is None:  # not yet measurable (a folder not made yet): our clock, this time
                return time.time()
            self._clock_offset = measured
        return time.time() + self._clock_offset

    def _measure_clock_offset(self) -> float | None:
        return 0.0

    def parent(self) -> ObjectStore | None:
        """The store at the prefix one level up (its bucket's or file system's root: None)."""
        return None

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write (or overwrite) a whole object atomically."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create the object only if the key does not exist; True if this call created it.

        Atomic against concurrent callers on any host: exactly one of them gets True. An object
        found equal to `data` counts as this call's (a retried request that landed answers "exists"
        on S3 and on NFS), so racers must write distinct payloads (commits and leases carry an
        owner token).
        """

    @abc.abstractmethod
    def get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object; `end` past the object's size is clipped."""

    def read_range_into(self, key: str, start: int, out: memoryview) -> int:
        """Fill `out` with the object's bytes from `start` on; the number filled, fewer than
        `len(out)` if the object ends first. A reader that reuses its buffers this way skips the
        page faults of a fresh one per GET (docs/LOADER.md); this default copies a `get_range`."""
        data = self.get_range(key, start, start + len(out))
        out[: len(data)] = data
        return len(data)

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except ObjectNotFound:
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str = "", start_after: str = "") -> Iterator[ObjectInfo]:
        """All objects whose key starts with `prefix`, in key order (pages fetched lazily); with
        `start_after`, only keys after it: on S3 the listing starts there (ListObjectsV2's
        StartAfter), so the keys before it cost nothing."""

    def folders(self, limit: int = 1000) -> list[str]:
        """Up to `limit` names of the "folders" right under the store's root (keys' first part,
        without the slash), in order: what `status` lists when the root itself holds no run."""
        return sorted({o.key.split("/", 1)[0] for o in self.list() if "/" in o.key})[:limit]

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    def delete_many(self, keys: Sequence[str]) -> None:
        """Remove every one of `keys`, missing ones included. S3 overrides it with batches
        (DeleteObjects: 1,000 keys a request, where `delete` spends one a key)."""
        for key in keys:
            self.delete(key)

    def remove_empty_folders(self, prefix: str = "") -> None:
        """Remove the folders that deletes left empty under `prefix` (a folder's, "a/b/"; "": the
        whole store, its root included). Only a local store has folders; S3 has none. Call it
        where nothing writes under `prefix` meanwhile: a writer's new file there needs its folder."""

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter: ...

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        """Uploads left behind by writers that died before finishing (e.g. SIGKILL)."""
        return []

    def abort_pending_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        """Abort uploads left behind by dead writers; returns how many were aborted."""
        return 0

    def open_stream(self, key: str, chunk_size: int = 8 << 20, size: int | None = None) -> BinaryIO:
        """A read-only file object over the object, for front-to-back parsing (`size`: the
        object's, when the caller has it: one HEAD less)."""
        return _RangeStream(self, key, chunk_size, size)

    def close(self) -> None:
        """Release connections and thread pools."""

    def reopen(self) -> ObjectStore:
        """The same store with connections of its own, for a forked process: a forked copy of an
        S3 client shares its parent's sockets, and two processes reading one socket mix up their
        responses. A local folder holds nothing to share."""
        return self


class _RangeStream:
    """Sequential reads served by ranged GETs of `chunk_size`; never touches local disk."""

    def __init__(self, store: ObjectStore, key: str, chunk_size: int, size: int | None = None):
        self._store, self._key, self._chunk = store, key, chunk_size
        self._size = store.size(key) if size is None else size
        self._pos = 0
        self._buf = b""
        self._buf_start = 0

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self._size - self._pos
        out = bytearray()
        while n > 0 and self._pos < self._size:
            offset = self._pos - self._buf_start
            if not (0 <= offset < len(self._buf)):
                want = max(self._chunk, n)
                self._buf = self._store.get_range(self._key, self._pos, self._pos + want)
                self._buf_start, offset = self._pos, 0
                if not self._buf:
                    break
            take = self._buf[offset : offset + n]
            out += take
            self._pos += len(take)
            n -= len(take)
        return bytes(out)

    def tell(self) -> int:
        return self._pos

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._buf = b""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_store(uri: str, **options) -> ObjectStore:
    """Open `s3://bucket/prefix`, `file:///path` or a plain local path.

    Options are passed to the backend (see `storage.s3.S3Options` for the S3 ones).
    """
    if uri.startswith("s3://"):
        from layertap.storage.s3 import S3Store

        return S3Store(uri, s3_options(options))
    # taken for a local path: s3:/b/x, S3://b/x, s3a://b/x, and s3//b/x (a folder s3/b/x written at once)
    if uri.lower().startswith(("s3:", "s3a:", "s3n:", "s3//", "s3a//", "s3n//")) and not uri.startswith("s3://"):
        raise StoreError(f"{uri!r} is not an S3 URI: write s3://bucket/prefix (lower case, two slashes)")
    if "://" in uri and not uri.startswith("file://"):
        scheme = uri.split("://", 1)[0]
        raise StoreError(f"unsupported store URI {uri!r}: scheme {scheme!r}; use s3://bucket/prefix or a local path")
    from layertap.storage.local import LocalStore

    if options:
        raise StoreError(f"the local store takes no options, got {sorted(options)}")
    if not uri.removeprefix("file://").strip():  # an unset variable in a script: not the current folder by accident
        raise StoreError(f"no store location in {uri!r}: give s3://bucket/prefix or a folder (./ for the current one)")
    return LocalStore(uri.removeprefix("file://"))


def open_configured_store(uri: str, s3: Mapping[str, Any] | None) -> ObjectStore:
    """Open `uri` with the "s3" settings of a --config file. They configure S3 stores only: one
    config serves a command whose stores are S3 and local folders mixed (training from S3 into a
    local output), and a local folder is opened without them. They are checked whatever the URI,
    so a misspelt setting is refused even when every store is local."""
    checked = s3_options(dict(s3 or {}))  # raises on an unknown name or a bad value
    if uri.startswith("s3://"):
        from layertap.storage.s3 import S3Store

        return S3Store(uri, checked)
    return open_store(uri)


S3_ENV_PREFIX = "LAYERTAP_S3_"


def s3_options(options: dict[str, Any]) -> S3Options:
    """`storage.s3.S3Options` from the "s3" settings of a --config file (sizes as "64MiB"), checked,
    over those of `LAYERTAP_S3_<SETTING>` variables (LAYERTAP_S3_READ_TIMEOUT_S=10): the commands
    without --config (status, verify, inspect, export, ...) are set that way, and a Slurm job's
    tasks inherit them. A setting in both: the --config file's."""
    from layertap.storage.flags import typed_values
    from layertap.storage.s3 import S3Options

    env = {k.removeprefix(S3_ENV_PREFIX).lower(): v for k, v in os.environ.items()
           if k.startswith(S3_ENV_PREFIX) and v.strip()}
    from_env = typed_values(S3Options, env, f"the environment ({S3_ENV_PREFIX}* variables)") if env else {}
    return S3Options(**{**from_env, **typed_values(S3Options, options, 'the "s3" settings (of --config)')})


def split_object_uri(uri: str) -> tuple[str, str]:
    """Split the URI of one object into (store root URI, key) for `open_store`."""
    uri = uri.rstrip("/")
    if uri.startswith("s3://"):
        bucket_and_key = uri[len("s3://") :]
        bucket, _, key = bucket_and_key.partition("/")
        if not key:
            raise StoreError(f"{uri!r} names a bucket, not an object")
        root, _, name = key.rpartition("/")
        return (f"s3://{bucket}/{root}" if root else f"s3://{bucket}"), name
    path = uri.removeprefix("file://")
    root, name = posixpath.split(path)
    return root or ".", name
