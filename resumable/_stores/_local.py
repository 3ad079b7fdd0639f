"""The local directory store: temp file, fsync, rename, directory fsync."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._codec import Stamp, read_file, read_file_stamped, stamp_of
from .._slots import INTERNAL_DIR
from ..exceptions import StateLockedError
from . import Buffer

_LOCK_FILE = f"{INTERNAL_DIR}/lock"
_WRITE_MAX = 1 << 30  # bytes per write() call; Linux caps a single write just below 2 GiB
_counter = itertools.count()
# link() failing with these means "no hard links here" (another file system, one that has
# none, or too many links): copy the bytes instead.
_NO_LINK = frozenset({errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def _fsync_dir(path: str) -> None:
    # fsync the directory too, or the rename can be lost on power failure.
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _with_path(exc: OSError, path: str) -> OSError:
    """The same kind of error, naming *path* (os.write errors carry no file name)."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror, path)


def _write_all(fd: int, chunks: Sequence[Buffer]) -> None:
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            written = os.write(fd, view[:_WRITE_MAX])
            view = view[written:]


def _copy_with_reads(fd_in: int, fd_out: int) -> None:
    os.lseek(fd_in, 0, os.SEEK_SET)
    os.lseek(fd_out, 0, os.SEEK_SET)
    os.ftruncate(fd_out, 0)
    while data := os.read(fd_in, 1 << 20):
        _write_all(fd_out, [data])


def _open_nofollow(path: str, flags: int, mode: int = 0o600) -> int:
    """Open *path* without following a symlink at its last component."""
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


class _FileLock:
    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


class LocalStore:
    """A directory on the local file system; files 0600, directories 0700."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.location = self.root
        self._append_fds: dict[str, int] = {}
        self._fd_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def path(self, key: str) -> str:
        """The file path of *key* (keys use "/", as does every POSIX system)."""
        return f"{self.root}/{key}"

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
            if durable:
                _fsync_dir(os.path.dirname(d))

    def read(self, key: str) -> bytearray:
        return read_file(self.path(key))

    def read_stamped(self, key: str) -> tuple[bytearray, Stamp]:
        """The object and the stamp of the version read (see :meth:`stamp`)."""
        return read_file_stamped(self.path(key))

    def stamp(self, key: str) -> Stamp:
        """What identifies the current version of *key*; raises FileNotFoundError."""
        return stamp_of(os.stat(self.path(key)))

    def read_range(self, key: str, start: int, end: int | None = None) -> bytes:
        with open(self.path(key), "rb") as f:
            f.seek(start)
            return f.read(-1 if end is None else max(0, end - start))

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        self._forget_append_fd(key)  # an appender must not go on writing the replaced file
        self._replace(key, lambda fd: _write_all(fd, chunks), durable=durable)

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        """
        Make *dst* the same file as *src*, atomically: a hard link, no bytes copied, where
        the file system allows one; else a durable copy (written like :meth:`write`).
        """
        target = self.path(dst)
        directory, name = os.path.split(target)
        tmp = os.path.join(directory, f".{name}.{os.getpid()}-{threading.get_ident()}-{next(_counter)}.tmp")
        try:
            try:
                os.link(self.path(src), tmp)
            except FileNotFoundError:
                if not os.path.exists(self.path(src)):
                    raise
                self._makedirs(directory, durable=durable)
                os.link(self.path(src), tmp)
        except OSError as exc:
            if exc.errno not in _NO_LINK:
                raise
            self._copy_bytes(src, dst, durable=durable)
            return
        os.replace(tmp, target)
        if durable:
            _fsync_dir(directory)

    def _copy_bytes(self, src: str, dst: str, *, durable: bool) -> None:
        """Copy *src* to *dst* through a temp file, fsync and rename (for when a link cannot be made)."""
        source = self.path(src)
        fd_in = _open_nofollow(source, os.O_RDONLY)

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
                fd = self._append_fds.pop(key, None)
                if fd is not None:
                    os.close(fd)

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
            _write_all(fd, value_chunks)
            if durable:
                os.fdatasync(fd)  # flush the bulk now, while the checksum may still be computing
            data = header()
            if len(data) != head_len:  # pragma: no cover - the codec guarantees it
                msg = f"header of {len(data)} bytes, expected {head_len}"
                raise ValueError(msg)
            os.pwrite(fd, data, 0)

        self._replace(key, fill, durable=durable)

    def _replace(self, key: str, fill: Callable[[int], None], *, durable: bool) -> None:
        """Write a temp file with *fill*, fsync it, rename it over *key*, fsync the directory."""
        target = self.path(key)
        directory, name = os.path.split(target)
        tmp = os.path.join(directory, f".{name}.{os.getpid()}-{threading.get_ident()}-{next(_counter)}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            self._makedirs(directory, durable=durable)
            fd = os.open(tmp, flags, 0o600)
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
            raise _with_path(exc, target) from exc
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if durable:
            _fsync_dir(directory)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        with self._fd_lock:
            fd = self._append_fds.get(key)
            if fd is None:
                path = self.path(key)
                flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
                try:
                    fd = os.open(path, flags, 0o600)
                except FileNotFoundError:
                    self._makedirs(os.path.dirname(path), durable=durable)
                    fd = os.open(path, flags, 0o600)
                self._append_fds[key] = fd
            # one write() per record: O_APPEND keeps concurrent appenders from interleaving
            os.write(fd, data)
            if durable:
                os.fsync(fd)

    def close_appends(self) -> None:
        """Close the event-log descriptors kept open between appends."""
        with self._fd_lock:
            for fd in self._append_fds.values():
                os.close(fd)
            self._append_fds.clear()

    def delete(self, key: str, *, durable: bool) -> None:
        path = self.path(key)
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
            _fsync_dir(directory)

    def remove_temp_files(self) -> int:
        """Delete temporary files a killed writer left behind; call it holding the lock."""
        removed = 0
        for directory, _, files in os.walk(self.root):
            for name in files:
                if name.startswith(".") and name.endswith(".tmp"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(directory, name))
                        removed += 1
        return removed

    def list(self, prefix: str = "") -> list[str]:
        base = prefix.rpartition("/")[0]
        start = self.path(base) if base else self.root
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
                    and key != _LOCK_FILE
                    and not (entry.name.startswith(".") and entry.name.endswith(".tmp"))
                ):
                    keys.append(key)
        return keys

    def lock(self, holder: Mapping[str, Any]) -> _FileLock:
        path = self.path(_LOCK_FILE)
        self._makedirs(os.path.dirname(path), durable=False)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in {errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES}:
                raise
            raise StateLockedError(self.location, self._holder(path)) from None
        # The kernel drops a flock when its process dies, so a crash never blocks the next run.
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(dict(holder)).encode(), 0)
        return _FileLock(fd)

    @staticmethod
    def _holder(path: str) -> dict[str, Any] | None:
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        return info if isinstance(info, dict) else None
