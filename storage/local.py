"""A local folder as an object store: the embedded default, and a shared filesystem on clusters.

Objects are files under the root. Every write goes to a hidden temporary file in the target's
folder and is published with one atomic filesystem call, so readers never see a partial object:
`os.replace` for put, `os.link` (which fails if the name exists) for create-if-absent. A data
object's and a created record's folder is synced after, so a commit never outlives the name of
its data across a power loss.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

from layertap.storage.store import (
    InvalidKey,
    ObjectInfo,
    ObjectNotFound,
    ObjectStore,
    ObjectWriter,
    PendingUpload,
    StoreError,
    check_key,
)

_PART_SUFFIX = ".part"


def _is_temp(name: str) -> bool:
    return name.startswith(".") and name.endswith(_PART_SUFFIX)


class LocalStore(ObjectStore):
    def __init__(self, root: str):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.uri = self.root
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreError(f"local store root {self.root!r} exists and is not a folder")

    def parent(self) -> LocalStore | None:
        """None at the file system's root, and where the folder above is none (a file: the write
        that follows says so, naming it)."""
        up = os.path.dirname(self.root)
        return None if up == self.root or (os.path.exists(up) and not os.path.isdir(up)) else LocalStore(up)

    def _path(self, key: str) -> str:
        path = os.path.join(self.root, *check_key(key).split("/"))
        if os.path.commonpath([self.root, os.path.abspath(path)]) != self.root:
            raise InvalidKey(f"invalid object key {key!r}: resolves outside {self.root}")
        return path

    def _temp_path(self, path: str) -> str:
        folder, name = os.path.split(path)
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise _os_error(e, folder) from e
        return os.path.join(folder, f".{name}.{uuid.uuid4().hex}{_PART_SUFFIX}")

    def _open_temp(self, path: str) -> tuple[str, BinaryIO]:
        """A new temporary file beside `path`, open for writing. Its folder, made just before, may be
        removed as empty by another process before the file is there (`remove_empty_folders` of a
        refused trainer's output, a prune, a delete): it is made again, once."""
        try:
            try:
                tmp = self._temp_path(path)
                return tmp, open(tmp, "wb")
            except FileNotFoundError:
                tmp = self._temp_path(path)
                return tmp, open(tmp, "wb")
        except OSError as e:
            raise _os_error(e, path) from e

    def _write_temp(self, path: str, data: bytes) -> str:
        tmp, f = self._open_temp(path)
        with _undone_on_error(functools.partial(_remove_quietly, tmp), path):
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        return tmp

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self._write_temp(path, data)
        with _undone_on_error(functools.partial(_remove_quietly, tmp), path):
            os.replace(tmp, path)
        _sync_folder(path)  # the new name too: latest.json could go back to an older checkpoint on a power loss

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._path(key)
        if os.path.exists(path):
            return False
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
            _sync_folder(path)
        except FileExistsError:
            # On NFS a LINK retransmitted after its reply was lost answers EEXIST for our own link.
            # As on S3 (a retried conditional PUT), an object equal to `data` counts as ours.
            return self._holds(key, data)
        except OSError as e:
            if e.errno in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):  # the temp file beside it was written
                raise StoreError(f"cannot create {path}: the filesystem of {self.root} has no hard links (link(2) "
                                 f"answered {errno.errorcode.get(e.errno, e.errno)}; FUSE mounts of object stores "
                                 "often have none), which layertap's create-if-absent of commits and leases needs "
                                 "to keep every shard exactly once: use a local, NFS or Lustre folder, or the "
                                 "object store itself through its S3 endpoint") from e
            raise _os_error(e, path) from e
        finally:
            _remove_quietly(tmp)
        return True

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.get(key) == data
        except ObjectNotFound:  # another writer's object, deleted since
            return False

    def folders(self, limit: int = 1000) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))[:limit]
        except (FileNotFoundError, NotADirectoryError, PermissionError):  # no folder to hold any: a write says why
            return []

    def get(self, key: str) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None
        except OSError as e:
            raise _os_error(e, path, reading=True) from e

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ValueError(f"invalid byte range [{start}, {end}) for {key!r}")
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                f.seek(start)  # `end` clipped first: read(n) allocates n bytes, however few are there
                return f.read(max(0, min(end, os.fstat(f.fileno()).st_size) - start))
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None
        except OSError as e:
            raise _os_error(e, path, reading=True) from e

    def read_range_into(self, key: str, start: int, out: memoryview) -> int:
        path = self._path(key)
        got = 0
        try:
            with open(path, "rb", buffering=0) as f:
                f.seek(start)
                while got < len(out):
                    n = f.readinto(out[got:])
                    if not n:
                        break
                    got += n
        except FileNotFoundError:
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None
        except OSError as e:
            raise _os_error(e, path, reading=True) from e
        return got

    def size(self, key: str) -> int:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(f"no object {key!r} in {self.root}") from None
        except OSError as e:
            raise _os_error(e, path, reading=True) from e
        if not os.path.isfile(path):
            raise ObjectNotFound(f"{path} is a folder, not an object")
        return st.st_size

    def list(self, prefix: str = "", start_after: str = "") -> Iterator[ObjectInfo]:
        # Walk only the folder that can hold the prefix, not the whole root.
        found = []
        for dirpath, dirnames, filenames in os.walk(self._folder_of(prefix), onerror=_unlisted):
            dirnames.sort()
            rel = os.path.relpath(dirpath, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            for name in filenames:
                key = base + name
                if _is_temp(name) or not key.startswith(prefix) or key <= start_after:
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:  # deleted while listing
                    continue
                except OSError as e:
                    raise _os_error(e, os.path.join(dirpath, name), reading=True) from e
                # Objects are replaced by renaming a new file over them: a new inode, a new mtime.
                found.append(ObjectInfo(key, st.st_size, st.st_mtime, f"{st.st_ino}.{st.st_mtime_ns}"))
        yield from sorted(found, key=lambda o: o.key)

    def _measure_clock_offset(self) -> float | None:
        """A shared file system may stamp files by its server's clock: a temp file's mtime (which
        listings skip) against our clock after it was written. None while the folder is not there;
        0 where it is not writable (`status` on a read-only copy): only our clock can count then."""
        if not os.path.isdir(self.root):
            return None
        probe = os.path.join(self.root, f".clock.{uuid.uuid4().hex}{_PART_SUFFIX}")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except OSError:
            return 0.0
        try:
            os.write(fd, b"t")
            stamped, written = os.fstat(fd).st_mtime, time.time()
        except OSError:  # a full disk
            return 0.0
        finally:
            os.close(fd)
            _remove_quietly(probe)
        return stamped - written

    def delete(self, key: str) -> None:
        _remove(self._path(key))

    def open_writer(self, key: str) -> ObjectWriter:
        return LocalWriter(self, key)

    def remove_empty_folders(self, prefix: str = "") -> None:
        top = os.path.join(self.root, *prefix.strip("/").split("/")) if prefix.strip("/") else self.root
        if not os.path.isdir(top):
            return
        for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -len(w[0])):  # the deepest first
            try:
                os.rmdir(dirpath)
            except OSError:  # not empty: something else lives there
                pass

    def list_pending_uploads(self, prefix: str = "") -> list[PendingUpload]:
        pending = []
        for dirpath, _, filenames in os.walk(self._folder_of(prefix), onerror=_unlisted):
            for name in filenames:
                if not _is_temp(name):
                    continue
                final = name[1:].rsplit(".", 2)[0]
                rel = os.path.relpath(os.path.join(dirpath, final), self.root).replace(os.sep, "/")
                if rel.startswith(prefix):
                    path = os.path.join(dirpath, name)
                    try:
                        pending.append(PendingUpload(rel, path, os.stat(path).st_mtime))
                    except FileNotFoundError:  # finished or aborted while we looked
                        continue
        return pending

    def _folder_of(self, prefix: str) -> str:
        """The deepest folder that holds every key starting with `prefix`."""
        folder = prefix.rpartition("/")[0]
        return os.path.join(self.root, *folder.split("/")) if folder else self.root

    def abort_pending_uploads(self, prefix: str = "", older_than_s: float = 0.0) -> int:
        now, aborted = self.now(), 0  # uploads start by the store's clock
        for up in self.list_pending_uploads(prefix):
            if older_than_s <= 0 or now - up.initiated >= older_than_s:  # 0: every one, whatever the clocks
                _remove(up.upload_id)
                aborted += 1
        return aborted


class LocalWriter(ObjectWriter):
    """Streams into a hidden temporary file; `close()` renames it into place."""

    def __init__(self, store: LocalStore, key: str):
        self.key = key
        self._path = store._path(key)
        self._tmp, self._file = store._open_temp(self._path)
        self._written = 0
        self._done = False

    def write(self, data: bytes | memoryview) -> int:
        if self._done:
            raise StoreError(f"writer for {self.key!r} is already closed")
        try:
            n = self._file.write(data)
        except OSError as e:
            self.abort()
            raise _os_error(e, self._path) from e
        self._written += n
        return n

    def close(self) -> None:
        if self._done:
            return
        with _undone_on_error(self.abort, self._path):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self._tmp, self._path)
            _sync_folder(self._path)
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        try:  # close flushes what is buffered: on a full disk that fails again, and the temp file must still go
            self._file.close()
        except OSError:
            pass
        finally:
            _remove_quietly(self._tmp)

    @property
    def bytes_written(self) -> int:
        return self._written


@contextlib.contextmanager
def _undone_on_error(undo: Callable[[], None], path: str) -> Iterator[None]:
    """Run `undo` (remove the temp file) on any exception, a signal handler's included (a SIGTERM
    raises wherever the worker is), so no cut-short write is left to read as a pending upload;
    an OSError is raised as the store's error naming `path`."""
    try:
        yield
    except BaseException as e:
        undo()
        if isinstance(e, OSError):
            raise _os_error(e, path) from e
        raise


def _sync_folder(path: str) -> None:
    """Make the name just given to `path` (a rename or link) survive a power loss: a data object
    is named, then its commit record created; without a sync of their folders the record could
    outlive the name of the data it vouches for, and `verify` would withdraw the shard. A
    filesystem that cannot sync a folder (some FUSE mounts) is left as it is."""
    try:
        fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path: str) -> None:
    """Remove a temp file on the way out of a failed or finished write: whatever fails here (a
    read-only filesystem answers EROFS even for a file that is not there) must not replace the
    error being raised, or the result being returned."""
    try:
        os.remove(path)
    except OSError:
        pass


def _remove(path: str) -> None:
    """Remove an object's file; one already gone is fine, any other failure is the store's error."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise _os_error(e, path) from e


def _unlisted(e: OSError) -> None:
    """os.walk's error handler: a folder that is not there (none yet, or deleted while listing)
    holds no objects; any other error (EIO, ESTALE on NFS, EACCES) is raised. Left to os.walk,
    which skips what it cannot read, a folder of commits that failed to list read as none: verify
    checked nothing and exited 0, status said nothing was done, delete left what it did not see."""
    if isinstance(e, (FileNotFoundError, NotADirectoryError)):
        return
    raise _os_error(e, e.filename or "a folder", reading=True) from e


CHOOSE_WRITABLE = "choose a writable output folder"  # the end of a failed write's message


def _os_error(e: OSError, path: str, *, reading: bool = False) -> StoreError:
    """The store's error for a failed filesystem call on `path`, with what to do about it."""
    if reading and e.errno in (errno.EACCES, errno.EPERM):
        return StoreError(f"cannot read {path}: permission denied; check the folder's permissions "
                          "(another user's run?)")
    if e.errno == errno.EROFS:
        return StoreError(f"cannot write {path}: the filesystem is read-only; {CHOOSE_WRITABLE}")
    if e.errno in (errno.EACCES, errno.EPERM):
        return StoreError(f"cannot write {path}: permission denied; {CHOOSE_WRITABLE}")
    if e.errno == errno.ENOSPC:
        return StoreError(f"cannot write {path}: no space left on device; free some or choose another output folder")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return StoreError(f"cannot use {path}: a part of that path is a file, not a folder; "
                          "choose another output folder")
    if reading:
        return StoreError(f"cannot read {path}: {e.strerror or e}")
    return StoreError(f"cannot access {path}: {e.strerror or e}; {CHOOSE_WRITABLE}")
