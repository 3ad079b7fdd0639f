"""
The local directory store: temp file, fsync, rename, directory fsync.

Nothing in the state directory is followed out of it: state files are opened with
``O_NOFOLLOW``, the lock file and the event log must be plain files with one link, a
write, append, copy or delete refuses a key whose directories include a symbolic link,
and listing never descends into one. The run lock is a ``flock`` that forked children
(process-pool workers) give up at once, so a run killed with its workers still alive
never blocks the next one.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import itertools
import json
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._slots import BATCHES, INTERNAL_DIR, is_output_file
from ..exceptions import StateDirectoryError, StateLockedError
from ._base import Buffer, Stamp, Store, check_key, read_file_stamped, stamp_of
from ._fileio import allocate_ahead, datasync, fsync_dir, fsync_path, pwrite_all, with_path, write_all
from ._outlog import LOG_KEY, LOG_MAX, OutputLog, recover

T = TypeVar("T")
_LOCK_FILE = f"{INTERNAL_DIR}/lock"
_counter = itertools.count()
_MAX_APPEND_FDS = 64  # descriptors kept open between appends (the event log, batch chunk logs)
# link() failing with these means "no hard links here" (another file system, one that has
# none, or too many links): copy the bytes instead.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def _temp_path(target: str) -> str:
    """A new temporary file's path beside *target* (``.<name>.<pid>-<thread>-<n>.tmp``)."""
    directory, name = os.path.split(target)
    return os.path.join(directory, f".{name}.{os.getpid()}-{threading.get_ident()}-{next(_counter)}.tmp")


def _copy_with_reads(fd_in: int, fd_out: int) -> None:
    os.lseek(fd_in, 0, os.SEEK_SET)
    os.lseek(fd_out, 0, os.SEEK_SET)
    os.ftruncate(fd_out, 0)
    while data := os.read(fd_in, 1 << 20):
        write_all(fd_out, [data])


def read_file_with(
    path: str | os.PathLike[str], read: Callable[[int, int], T], *, nofollow: bool
) -> tuple[T, Stamp]:
    """
    Open *path* for reading (with *nofollow*, not through a symbolic link: ``OSError``
    ELOOP) and return what ``read(descriptor, size)`` returns, with the stamp of the version
    it read. The descriptor is closed afterwards.
    """
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0))
    try:
        st = os.fstat(fd)
        return read(fd, st.st_size), stamp_of(st)
    finally:
        os.close(fd)


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


def _open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """Open *path* without following a symlink at its last component."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


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
        fd, self._fd = self._fd, None
        if fd is None or os.getpid() != self._pid:
            return  # a forked child: its copy is closed already, and unlocking would free the parent's
        _held_locks.discard(fd)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


class _Appender:
    """
    A file kept open between appends. The event log is opened ``O_APPEND`` (each ``write``
    lands whole at the end). A batch's chunk log (*ahead*) is allocated ahead when appended
    to durably, as the output log is (:func:`~._fileio.allocate_ahead`): an append is
    written at the end of what was appended, within the allocation, so the ``fdatasync``
    that makes it durable has only the bytes to flush, not the file's size.
    The zeros after the last record are cut when the file is closed, and read
    after a kill as the end of the log (:func:`resumable._chunklog.scan`), which the next
    run cuts.
    """

    __slots__ = ("ahead", "allocated", "end", "fd", "pid")

    def __init__(self, fd: int, *, ahead: bool) -> None:
        self.fd, self.ahead, self.pid = fd, ahead, os.getpid()
        self.end = self.allocated = os.fstat(fd).st_size if ahead else 0

    def append(self, data: bytes, *, durable: bool) -> None:
        """Append all of *data* (synced if *durable*), or raise."""
        fd = self.fd
        if not self.ahead:
            written = os.write(fd, data)  # one write: the usual case
            if written < len(data):  # a short write (disk full) goes on where it stopped, or raises
                write_all(fd, [memoryview(data)[max(written, 0) :]])
            if durable:
                os.fsync(fd)
            return
        end = self.end + len(data)
        if durable and end > self.allocated:
            self.allocated = allocate_ahead(fd, self.allocated, end)
        try:
            pwrite_all(fd, data, self.end)
        except OSError:
            self.allocated = max(self.allocated, end)  # part may be there: cut at close
            raise
        self.end, self.allocated = end, max(self.allocated, end)
        if durable:
            datasync(fd)

    def close(self) -> None:
        """Close the file, cutting what was allocated past the end (not synced: zeros read as the end)."""
        if self.allocated > self.end and os.getpid() == self.pid:  # (a forked child's end is stale)
            with contextlib.suppress(OSError):  # left, the zeros are harmless
                os.ftruncate(self.fd, self.end)
        os.close(self.fd)


class LocalStore(Store):
    """A directory on the local file system; files 0600, directories 0700."""

    cheap_appends = True  # an append is one write() (and one sync when durable)

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.location = self.local_root = self.root
        self._append_fds: dict[str, _Appender] = {}
        self._fd_lock = threading.Lock()
        self._log: OutputLog | None = None  # made at the first durable write of an output

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def path(self, key: str) -> str:
        """The file path of *key* (keys use "/", as does every POSIX system)."""
        return f"{self.root}/{check_key(key, self.root)}"

    def linked(self, path: str, what: str = "a symbolic link") -> StateDirectoryError:
        """The error for a state file at *path* that is *what* (and is not followed)."""
        problem = (
            f"{path} is {what}, which resumable does not follow inside a state directory "
            "(it could make it read or write files elsewhere); remove it"
        )
        return StateDirectoryError(self.root, problem, errno=errno.ELOOP)

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

    def _open_own(self, path: str, flags: int) -> int:
        """
        Open a state file that is changed in place (the lock, the event log): never through a
        symbolic link, and only a plain file with no other name (a hard link to a file
        elsewhere would be truncated or appended to).
        """
        try:
            fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.linked(path) from None
            raise
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
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
            if d == self.root:
                _write_gitignore(d)
            if durable:
                fsync_dir(os.path.dirname(d))

    def read(self, key: str) -> bytearray:
        return self.read_stamped(key)[0]

    def read_stamped(self, key: str) -> tuple[bytearray, Stamp]:
        """The object and the stamp of the version read (see :meth:`stamp`)."""
        path = self.path(key)
        try:
            data, stamp = read_file_stamped(path, nofollow=True)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.linked(path) from None
            raise
        end = self._appended_end(key)
        if end is not None:
            del data[end:]
        return data, stamp

    def _appended_end(self, key: str) -> int | None:
        """Where the appends to *key* end, if its file is allocated past them (see :class:`_Appender`)."""
        appender = self._append_fds.get(key)
        if appender is None or appender.allocated <= appender.end:
            return None
        return appender.end

    def read_with(self, key: str, read: Callable[[int, int], T]) -> tuple[T, Stamp]:
        """
        What ``read(descriptor, size)`` returns for *key*, opened without following a
        symbolic link, and the stamp of the version read: for readers that fill their own
        buffer (a large output is checksummed while it is read).
        """
        path = self.path(key)
        try:
            return read_file_with(path, read, nofollow=True)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.linked(path) from None
            raise

    def changed_since(self, key: str, ns: int) -> bool:
        """True if *key* changed (was written, renamed or linked) at or after *ns*."""
        try:
            # ctime: a rename or a hard link (a rollback, a kept version) changes it too
            return os.stat(self.path(key)).st_ctime_ns >= ns
        except OSError:
            return True

    def stamp(self, key: str) -> Stamp:
        """What identifies the current version of *key*; raises FileNotFoundError."""
        return stamp_of(os.stat(self.path(key)))

    def read_range(self, key: str, start: int, end: int | None = None) -> bytes:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.linked(path) from None
            raise
        appended = self._appended_end(key)
        if appended is not None:
            end = appended if end is None else min(end, appended)
        with open(fd, "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else max(0, end - start))

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        """
        Replace *key* atomically. A durable write of a small output file goes through the
        output log (the file is renamed into place before this returns, its bytes are in the
        fsynced log, and a background thread makes the file durable, see :mod:`._outlog`);
        anything else is written in place.
        """
        if durable and is_output_file(key) and sum(memoryview(c).nbytes for c in chunks) <= LOG_MAX:
            log = self._log or self._output_log()
            if log.usable:
                log.write(key, b"".join(chunks))
                return
        self.write_in_place(key, chunks, durable=durable)

    def _output_log(self) -> OutputLog:
        with self._fd_lock:  # one log per store, even when threads store their first outputs at once
            if self._log is None:
                self._log = OutputLog(self)
            return self._log

    def write_in_place(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        """Write a temp file, fsync it (if *durable*), rename it over *key*, fsync the directory."""
        self._forget_append_fd(key)  # an appender must not go on writing the replaced file
        self._replace(key, lambda fd: write_all(fd, chunks), durable=durable)

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        """
        Make *dst* the same file as *src*, atomically: a hard link, no bytes copied, where
        the file system allows one; else a durable copy (written like :meth:`write`).
        """
        target = self.path(dst)
        self._check_dirs(src)
        self._check_dirs(dst)
        if self._log is not None:
            if src in self._log.logged and durable:
                fsync_path(self.path(src))  # a link to a file that may not be durable yet
            self._log.before_change(dst)
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
            if exc.errno not in _NO_LINK:
                raise
            self._copy_bytes(src, dst, durable=durable)
            return
        os.replace(tmp, target)
        # rename() does nothing when both names are links to one file already (a rollback to
        # the version in place): then the temporary name is still there
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if durable:
            fsync_dir(directory)

    def _copy_bytes(self, src: str, dst: str, *, durable: bool) -> None:
        """Copy *src* to *dst* through a temp file, fsync and rename (for when a link cannot be made)."""
        source = self.path(src)
        try:
            fd_in = _open_nofollow(source, os.O_RDONLY)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.linked(source) from None
            raise

        def fill(fd: int) -> None:
            while True:
                try:
                    done = os.copy_file_range(fd_in, fd, 1 << 30)
                except OSError as exc:  # not between these file systems (or not on this kernel)
                    if exc.errno not in {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP}:
                        raise
                    _copy_with_reads(fd_in, fd)
                    return
                if not done:
                    return

        try:
            self._replace(dst, fill, durable=durable)
        finally:
            os.close(fd_in)

    def _forget_append_fd(self, key: str) -> None:
        if key in self._append_fds:
            with self._fd_lock:
                appender = self._append_fds.pop(key, None)
                if appender is not None:
                    appender.close()

    def write_header_last(
        self,
        key: str,
        head_len: int,
        value_chunks: Sequence[Buffer],
        header: Callable[[], bytes],
        *,
        durable: bool,
    ) -> None:
        """
        Like :meth:`write`, for a file whose first *head_len* bytes are only known once its
        value is written (its checksum is computed meanwhile): write the value, then the header.
        """

        def fill(fd: int) -> None:
            os.lseek(fd, head_len, os.SEEK_SET)
            write_all(fd, value_chunks)
            if durable:
                datasync(fd)  # flush the bulk now, while the checksum may still be computing
            data = header()
            if len(data) != head_len:  # pragma: no cover - the codec guarantees it
                msg = f"header of {len(data)} bytes, expected {head_len}"
                raise ValueError(msg)
            pwrite_all(fd, data, 0)

        self._replace(key, fill, durable=durable)

    def _replace(self, key: str, fill: Callable[[int], None], *, durable: bool) -> None:
        """Write a temp file with *fill*, fsync it, rename it over *key*, fsync the directory."""
        if self._log is not None:
            self._log.before_change(key)
        target, tmp, fd = self.temp_file(key, durable=durable)
        directory = os.path.dirname(target)
        try:
            try:
                fill(fd)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, target)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise with_path(exc, target) from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if durable:
            fsync_dir(directory)

    def temp_file(self, key: str, *, durable: bool) -> tuple[str, str, int]:
        """
        Create the temporary file a new version of *key* is written to, beside it (and its
        directories, fsynced if *durable*): its target path, its own path, and its descriptor.
        """
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
            raise with_path(exc, target) from exc
        return target, tmp, fd

    def open_log(self, key: str) -> tuple[int, bool]:
        """
        Open the file *key* for the output log, which writes at offsets of its own (a
        descriptor of its own, not one of :meth:`append`'s); also whether it was created.
        """
        path = self.path(key)
        self._check_dirs(key)
        flags = os.O_RDWR
        try:
            return self._open_own(path, flags), False
        except FileNotFoundError:
            self._makedirs(os.path.dirname(path), durable=True)
            return self._open_own(path, flags | os.O_CREAT), True

    def same_file(self, key: str, data: bytes, *, fsync: bool) -> bool:
        """Whether *key* is a plain file holding exactly *data* (then fsynced, with *fsync*)."""
        if self._linked_dir(key) is not None:
            return False  # not read through a link out of the state directory
        try:
            fd = _open_nofollow(self.path(key), os.O_RDONLY)
        except OSError:
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != len(data):
                return False
            with open(fd, "rb", closefd=False) as f:
                if f.read(len(data) + 1) != data:
                    return False
            if fsync:
                os.fsync(fd)
            return True
        finally:
            os.close(fd)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        """
        Append all of *data* or raise (an ``OSError`` naming the file). With *durable*, the
        file is synced, and its directory too when this append created it. A batch's file
        is allocated ahead (see :class:`_Appender`).
        """
        path = self.path(key)
        if self._log is not None:
            self._log.before_change(key)
        with self._fd_lock:
            appender = self._append_fds.get(key)
            created = False
            try:
                if appender is None:
                    appender, created = self._open_append(key, path, durable=durable)
                appender.append(data, durable=durable)
                if durable and created:
                    # the new name must survive a power loss too, like a renamed file's
                    fsync_dir(os.path.dirname(path))
            except OSError as exc:
                if isinstance(exc, StateDirectoryError):
                    raise
                raise with_path(exc, path) from exc

    def _open_append(self, key: str, path: str, *, durable: bool) -> tuple[_Appender, bool]:
        """Open *key* for appending, keeping the descriptor; also whether the file was created."""
        self._check_dirs(key)
        ahead = key.startswith(BATCHES + "/")
        flags = os.O_WRONLY if ahead else os.O_WRONLY | os.O_APPEND
        created = False
        try:
            fd = self._open_own(path, flags)
        except FileNotFoundError:
            created = True
            try:
                fd = self._open_own(path, flags | os.O_CREAT)
            except FileNotFoundError:
                self._makedirs(os.path.dirname(path), durable=durable)
                fd = self._open_own(path, flags | os.O_CREAT)
        if len(self._append_fds) >= _MAX_APPEND_FDS:
            # a run may append to many batch logs: keep the most recently opened descriptors
            oldest = next(iter(self._append_fds))
            self._append_fds.pop(oldest).close()
        appender = self._append_fds[key] = _Appender(fd, ahead=ahead)
        return appender, created

    def truncate(self, key: str, size: int, *, durable: bool) -> None:
        """Cut *key* to its first *size* bytes in place (a log's torn tail); appends go on at the new end."""
        path = self.path(key)
        if self._log is not None:
            self._log.before_change(key)
        self._check_dirs(key)
        self._forget_append_fd(key)  # the next append starts from the new end
        with self._fd_lock:
            try:
                fd = self._open_own(path, os.O_WRONLY)
            except OSError as exc:
                if isinstance(exc, StateDirectoryError):
                    raise
                raise with_path(exc, path) from exc
            try:
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                    if durable:
                        os.fsync(fd)
            except OSError as exc:
                raise with_path(exc, path) from exc
            finally:
                os.close(fd)

    def close_appends(self) -> None:
        """
        Write the files the output log still holds and empty it, then close the descriptors
        kept open between appends.
        """
        try:
            if self._log is not None:
                self._log.close()
        finally:
            with self._fd_lock:
                appenders = list(self._append_fds.values())
                self._append_fds.clear()
                for appender in appenders:
                    appender.close()

    def delete(self, key: str, *, durable: bool) -> None:
        path = self.path(key)
        self._check_dirs(key)  # never deletes through a linked directory, out of the state
        if self._log is not None:
            self._log.before_change(key)
        self._forget_append_fd(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
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

    def temp_files(self) -> builtins.list[str]:
        """The keys of the temporary files killed writers left behind (``.<name>.<pid>-...tmp``)."""
        keys: builtins.list[str] = []
        for directory, _, files in os.walk(self.root):
            prefix = "" if directory == self.root else os.path.relpath(directory, self.root) + "/"
            keys.extend(prefix + n for n in files if n.startswith(".") and n.endswith(".tmp"))
        return sorted(keys)

    def remove_temp_files(self) -> int:
        """Delete temporary files a killed writer left behind; call it holding the lock."""
        removed = 0
        for key in self.temp_files():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.root, key))
                removed += 1
        return removed

    def list(self, prefix: str = "") -> list[str]:
        base = prefix.rpartition("/")[0]
        start = self.path(base) if base else self.root
        if base and self._linked_dir(f"{base}/") is not None:
            return []  # the prefix leads out of the state directory: nothing of ours is there
        keys: list[str] = []
        stack = [(start, base)]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                key = f"{rel}/{entry.name}" if rel else entry.name
                if entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, key))
                elif (
                    key.startswith(prefix)
                    and key not in {_LOCK_FILE, LOG_KEY, GITIGNORE}
                    and not (entry.name.startswith(".") and entry.name.endswith(".tmp"))
                ):
                    keys.append(key)
        return keys

    def lock(self, holder: Mapping[str, Any]) -> _FileLock:
        path = self.path(_LOCK_FILE)
        self._check_dirs(_LOCK_FILE)
        self._makedirs(os.path.dirname(path), durable=False)
        fd = self._open_own(path, os.O_RDWR | os.O_CREAT)
        _held_locks.add(fd)  # before flock: a fork right after it must not keep the lock
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            _held_locks.discard(fd)
            os.close(fd)
            if exc.errno not in {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}:
                raise with_path(exc, path) from exc
            raise StateLockedError(self.location, self._holder(path)) from None
        # The kernel drops a flock when its process dies, so a crash never blocks the next run.
        lock = _FileLock(fd)
        try:
            os.ftruncate(fd, 0)
            pwrite_all(fd, json.dumps(dict(holder)).encode(), 0)
        except OSError as exc:
            lock.release()
            raise with_path(exc, path) from exc
        try:
            self._log = None  # a log that failed stays failed: the one on disk is applied now
            recover(self)  # what a killed holder had only in the output log
        except BaseException:
            lock.release()
            raise
        return lock

    @staticmethod
    def _holder(path: str) -> dict[str, Any] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            with open(fd, encoding="utf-8") as f:
                info = json.loads(f.read(64 * 1024))
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None
