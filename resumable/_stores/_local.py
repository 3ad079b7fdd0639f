"""
The local directory store: temp file, fsync, rename, directory fsync; nothing followed out
of the directory; a ``flock`` as the run lock (docs/storage.md, "The local directory").
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import functools
import itertools
import json
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from .._slots import LOCK, SESSIONS_DIR
from ..exceptions import StateDirectoryError, StateLockedError
from ._base import Buffer, Stamp, Store, check_key, is_temp, with_path

_counter = itertools.count()
# link() failing with these means "no hard links here" (another file system, one that has
# none, or too many links): copy the bytes instead.
NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})
# errors that mean the state directory itself is unusable here, not that one write failed
_UNUSABLE = {
    errno.EROFS: "the file system is read-only",
    errno.EISDIR: "a directory is in the way",
    errno.ENOTDIR: "a file is in the way of a directory",
}


def fsync_dir(path: str) -> None:
    """fsync a directory, so that the names created or renamed in it survive a power loss."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise with_path(exc, path) from exc


# SPEC §6: the directory fsync of a durable store is shared with the durable stores that follow
# it within GROUP_WINDOW seconds; LocalStore.sync() (the close of a run, a step that must not
# run twice) does the ones still due at once. Directory -> when its first unsynced rename was
# made; process-wide, as the directories are.
GROUP_WINDOW = 0.1
_unsynced: dict[str, float] = {}
_syncing = threading.Lock()  # held while directories are fsynced: a sync() waits for one under way


def _fsync_grouped(directory: str) -> None:
    """Note a rename in *directory*; fsync the directories whose first unsynced rename is old enough."""
    now = time.monotonic()
    _unsynced.setdefault(directory, now)
    if min(_unsynced.values(), default=now) <= now - GROUP_WINDOW:
        _fsync_unsynced(noted_by=now - GROUP_WINDOW)


def _fsync_unsynced(*, noted_by: float = float("inf")) -> None:
    """fsync the directories noted by *noted_by* (all by default); one gone since has nothing to keep."""
    with _syncing:
        for path, since in list(_unsynced.items()):
            # taken out first: a rename made while it is fsynced notes the directory again
            if since <= noted_by and _unsynced.pop(path, None) is not None:
                try:
                    fsync_dir(path)
                except (FileNotFoundError, NotADirectoryError):
                    pass  # it is gone, with the names it held
                except BaseException:
                    _unsynced.setdefault(path, since)  # still to do
                    raise


def _new_sync_lock() -> None:
    global _syncing  # noqa: PLW0603 - a forked child's copy may be held by a thread it does not have
    _syncing = threading.Lock()


os.register_at_fork(after_in_child=_new_sync_lock)


def write_all(fd: int, chunks: Iterable[Buffer]) -> None:
    """Write every byte of *chunks*, going on after short writes; complete or raise."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            written = os.write(fd, view)
            if written <= 0:  # no progress: the disk is full (a regular file never returns 0 else)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]


# What a state directory resumable creates holds, so that nobody commits it by accident (as
# joblib does for its cache). Only a new directory gets one: an existing directory is the
# user's, who may keep a state in git on purpose.
GITIGNORE = ".gitignore"
_GITIGNORE_TEXT = b"# Created by resumable: a state directory is not meant for version control.\n*\n"


def _write_gitignore(directory: str) -> None:
    # Not atomic, not fsynced: a kill or power loss can only leave it empty, which ignores nothing.
    path = os.path.join(directory, GITIGNORE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return
    try:
        write_all(fd, [_GITIGNORE_TEXT])
    finally:
        os.close(fd)


def _temp_path(target: str) -> str:
    """A new temporary file's path beside *target* (``.<name>.<pid>-<thread>-<n>.tmp``)."""
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{os.getpid()}-{threading.get_ident()}-{next(_counter)}.tmp")


# Descriptors of the run locks this process holds. A forked child shares their open file
# description, and a flock lasts while any process has it open: the child closes its copies
# at once, so orphaned workers of a killed run do not keep the state directory locked.
_held_locks: set[int] = set()


def _drop_inherited_locks() -> None:
    # Runs in the child right after fork, when it has one thread: no lock may be taken here.
    for fd in tuple(_held_locks):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_locks.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


class _FileLock:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._pid = os.getpid()

    def release(self) -> None:
        fd = self._fd
        if fd is None or os.getpid() != self._pid:
            self._fd = None
            return  # a forked child: its copy is closed already, and unlocking would free the parent's
        try:
            os.ftruncate(fd, 0)  # an empty lock file: its holder left cleanly (see LocalStore.lock)
        finally:
            self._fd = None
            _held_locks.discard(fd)
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class AppendFile:
    """A file of a :class:`LocalStore` open for appending until closed."""

    def __init__(self, store: LocalStore, path: str, fd: int, *, new: bool) -> None:
        self.path = path
        self._store = store
        self._fd = fd
        self._new = new  # just created: its name is not fsynced yet

    def append(self, data: bytes, *, durable: bool) -> None:
        """Append all of *data* or raise (an ``OSError`` naming the file); with *durable*, fsync it."""
        try:
            write_all(self._fd, [data])  # O_APPEND: one write lands whole at the end
            if durable:
                os.fsync(self._fd)
                if self._new:  # the new name must survive a power loss too, like a renamed file's
                    fsync_dir(os.path.dirname(self.path))
                    self._new = False
        except OSError as exc:
            raise self._store.error(exc, self.path) from None

    def close(self) -> None:
        os.close(self._fd)


class LocalStore(Store):
    """A directory on the local file system; files 0600, directories 0700."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.location = self.root

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def path(self, key: str) -> str:
        """The file path of *key* (keys use "/", as does every POSIX system)."""
        return f"{self.root}/{check_key(key, self.root)}"

    def linked(self, path: str, what: str = "a symbolic link") -> StateDirectoryError:
        """The error for a state file at *path* that is *what* (and is not followed)."""
        problem = (
            f"{path} is {what}, which resumable does not follow inside a state directory "
            "(it could make it read or write files elsewhere, or block); remove it"
        )
        return StateDirectoryError(self.root, problem, errno=errno.ELOOP)

    def error(self, exc: OSError, path: str) -> OSError:
        """
        *exc* naming *path*; a :class:`StateDirectoryError` when the directory itself is
        unusable (read-only, a directory or file in the way, a symbolic link).
        """
        if isinstance(exc, StateDirectoryError):
            return exc
        if exc.errno == errno.ELOOP:
            return self.linked(path)
        if exc.errno in _UNUSABLE:
            problem = f"{_UNUSABLE[exc.errno]} at {exc.filename or path}"
            return StateDirectoryError(self.root, problem, errno=exc.errno)
        return with_path(exc, path)

    def _linked_dir(self, key: str) -> str | None:
        """The first directory on the way to *key* that is a symbolic link, if any."""
        path = self.root
        for part in key.split("/")[:-1]:
            path = f"{path}/{part}"
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                return None  # created as a real directory when written
            if stat.S_ISLNK(st.st_mode):
                return path
        return None

    def _check_dirs(self, key: str) -> None:
        """Refuse to change anything under *key* if one of its directories is a symbolic link."""
        linked = self._linked_dir(key)
        if linked is not None:
            raise self.linked(linked)

    def _open(self, path: str, flags: int, *, own: bool = False) -> int:
        """
        Open a state file: never through a symbolic link, never blocking (a FIFO), and only
        a plain file; with *own* (a file changed in place: the lock, a log), only one with
        no other name (a hard link to a file elsewhere would be truncated or appended to).
        """
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened to write
                raise self.linked(path, "not a plain file") from None
            raise self.error(exc, path) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (own and st.st_nlink != 1):
            os.close(fd)
            what = "not a plain file" if not stat.S_ISREG(st.st_mode) else "a hard link to another file"
            raise self.linked(path, what)
        return fd

    def _makedirs(self, directory: str, *, durable: bool) -> None:
        missing = []
        while not os.path.isdir(directory):
            missing.append(directory)
            directory = os.path.dirname(directory)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue
            parent = os.path.dirname(d)
            if os.path.basename(parent) == SESSIONS_DIR:  # a named session's: its state directory has one
                if parent in missing:  # ... made just now, with it
                    _write_gitignore(os.path.dirname(parent))
            elif d == self.root:
                _write_gitignore(d)
            if durable:
                fsync_dir(os.path.dirname(d))

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytearray:
        path = self.path(key)
        fd = self._open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(max(0, (size if end is None else min(end, size)) - start))
            done = 0
            with memoryview(buf) as view:
                while done < len(buf) and (n := os.preadv(fd, [view[done:]], start + done)):
                    done += n
        except OSError as exc:
            raise self.error(exc, path) from None
        finally:
            os.close(fd)
        del buf[done:]  # the file got shorter while it was read: what was read
        return buf

    def stamp(self, key: str) -> Stamp:
        """What identifies the current version of *key* (see :func:`key_stamp`); raises FileNotFoundError."""
        st = os.stat(self.path(key))
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def write(self, key: str, chunks: Iterable[Buffer], *, durable: bool) -> None:
        """Write a temp file, rename it over *key*; with *durable*, fsync it and (shared) the directory."""
        target = self.path(key)
        self._check_dirs(key)
        directory = os.path.dirname(target)
        tmp = _temp_path(target)
        # O_EXCL: never opens an existing file, nor follows a symbolic link planted there
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            try:
                fd = os.open(tmp, flags, 0o600)
            except FileNotFoundError:
                self._makedirs(directory, durable=durable)
                fd = os.open(tmp, flags, 0o600)
        except OSError as exc:
            raise self.error(exc, target) from None
        try:
            try:
                write_all(fd, chunks)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if isinstance(exc, OSError):
                raise self.error(exc, target) from exc
            raise
        if durable:
            _fsync_grouped(directory)

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        """
        Make *dst* the same file as *src*, atomically: a hard link, no bytes copied, where
        the file system allows one; else a copy (written like :meth:`write`).
        """
        target = self.path(dst)
        self._check_dirs(src)
        self._check_dirs(dst)
        directory = os.path.dirname(target)
        tmp = _temp_path(target)
        try:
            try:
                os.link(self.path(src), tmp, follow_symlinks=False)
            except FileNotFoundError:
                if not os.path.lexists(self.path(src)):
                    raise
                self._makedirs(directory, durable=durable)
                os.link(self.path(src), tmp, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in NO_LINK:
                raise self.error(exc, target) from None
            fd = self._open(self.path(src), os.O_RDONLY)
            try:  # in pieces: an output of many GB is never held in memory whole
                self.write(dst, iter(functools.partial(os.read, fd, 1 << 20), b""), durable=durable)
            finally:
                os.close(fd)
            return
        os.replace(tmp, target)
        # rename() does nothing when both names are links to one file already (a rollback to
        # the version in place): then the temporary name is still there
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if durable:
            _fsync_grouped(directory)

    def sync(self) -> None:
        """fsync the directories of the durable writes whose directory fsync is still to come."""
        _fsync_unsynced()

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        file = self.open_append(key, durable=durable)
        try:
            file.append(data, durable=durable)
        finally:
            file.close()

    def open_append(self, key: str, *, durable: bool) -> AppendFile:
        """*key* opened to append to it (created, with its directories, if missing); close it when done."""
        path = self.path(key)
        self._check_dirs(key)
        flags = os.O_WRONLY | os.O_APPEND
        try:
            try:
                return AppendFile(self, path, self._open(path, flags, own=True), new=False)
            except FileNotFoundError:
                pass  # created below
            try:
                fd = self._open(path, flags | os.O_CREAT, own=True)
            except FileNotFoundError:
                self._makedirs(os.path.dirname(path), durable=durable)
                fd = self._open(path, flags | os.O_CREAT, own=True)
            return AppendFile(self, path, fd, new=True)
        except OSError as exc:
            raise self.error(exc, path) from None

    def delete(self, key: str, *, durable: bool) -> None:
        path = self.path(key)
        self._check_dirs(key)  # never deletes through a linked directory, out of the state
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise self.error(exc, path) from None
        directory = os.path.dirname(path)
        if directory != self.root:
            try:
                os.rmdir(directory)  # drop a keyed step's directory once it is empty
            except OSError:
                pass
            else:
                directory = os.path.dirname(directory)
        if durable:
            fsync_dir(directory)

    def remove_temp_files(self, *, dry_run: bool = False) -> builtins.list[str]:
        """Each named session sweeps its own temporary files (see :meth:`Store.remove_temp_files`)."""
        keys = sorted(k for k in self._files("", sessions=False) if is_temp(k))
        if not dry_run:
            for key in keys:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{self.root}/{key}")
        return keys

    def list(self, prefix: str = "") -> list[str]:
        base = prefix.rpartition("/")[0]
        if base and self._linked_dir(f"{base}/") is not None:
            return []  # the prefix leads out of the state directory: nothing of ours is there
        return [
            k
            for k in self._files(base, sessions=prefix.startswith(SESSIONS_DIR))
            if k.startswith(prefix) and k not in {LOCK, GITIGNORE} and not is_temp(k)
        ]

    def _files(self, base: str, *, sessions: bool) -> Iterator[str]:
        """The files under directory *base*, not through links; with named sessions' if *sessions*."""
        stack = [base]
        while stack:
            rel = stack.pop()
            try:
                entries = list(os.scandir(self.path(rel) if rel else self.root))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if not entry.is_dir(follow_symlinks=False):
                    yield key
                elif key != SESSIONS_DIR or sessions:
                    stack.append(key)

    def lock(self, holder: Mapping[str, Any]) -> _FileLock:
        """
        Take the run lock. A lock file that is not empty was left by a holder that died
        (a released lock is emptied): what it was writing, its temporary files, is removed.
        """
        path = self.path(LOCK)
        try:
            self._check_dirs(LOCK)
            self._makedirs(os.path.dirname(path), durable=False)
            fd = self._open(path, os.O_RDWR | os.O_CREAT, own=True)
        except PermissionError as exc:
            problem = f"permission denied on {exc.filename or path} (read-only, or another user's)"
            raise StateDirectoryError(self.root, problem, errno=exc.errno) from exc
        except OSError as exc:
            self.check_root()  # (looked at only when the lock cannot be taken)
            raise self.error(exc, path) from None
        _held_locks.add(fd)  # before flock: a fork right after it must not keep the lock
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _held_locks.discard(fd)
            os.close(fd)
            if exc.errno not in {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}:
                raise self.error(exc, path) from exc
            raise StateLockedError(self.location, self._holder()) from None
        # The kernel drops a flock when its process dies, so a crash never blocks the next run.
        lock = _FileLock(fd)
        try:
            replaced = os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # the lock file was removed (a deleted session) after we opened it
            lock.release()
            raise StateLockedError(self.location, None)
        try:
            died = os.fstat(fd).st_size > 0
            os.ftruncate(fd, 0)
            write_all(fd, [json.dumps(dict(holder)).encode()])  # at offset 0: just truncated
            if died:
                self.remove_temp_files()
        except OSError as exc:
            lock.release()
            raise self.error(exc, path) from exc
        return lock

    def check_root(self) -> None:
        """Raise :class:`StateDirectoryError` if the state directory is a file."""
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StateDirectoryError(self.root, "it is a file, not a directory", errno=errno.ENOTDIR)

    def _holder(self) -> dict[str, Any] | None:
        try:
            info = json.loads(self.read(LOCK))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None
