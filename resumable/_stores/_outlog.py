"""
The local store's output log: a durable output costs one fsync on the caller's thread.

A durable write of a step's output file (a key :func:`~resumable._slots.is_output_file`
accepts, of at most :data:`LOG_MAX` bytes) goes like this:

1. The key and the bytes are written as one record after the last one in
   ``.resumable/outputs.log``, and the log is synced (``fdatasync``): from here the output
   survives a power loss. The log is allocated ahead (see
   :func:`~resumable._stores._fileio.allocate_ahead`), so a record leaves the file's size
   as it is and the sync flushes the record alone; the zeros after the last record end the
   log like a record cut short, but without a warning.
2. Meanwhile, a helper thread writes the bytes to a temporary file beside the target (not
   fsynced), so that the caller's thread creates no file while the disk is busy.
3. The temporary file is renamed over the target, and ``write`` returns: the new file is
   there for this process and for any other reader, as with every other write.
4. A background thread makes the files written within :data:`SYNC_DELAY` durable together:
   one ``syncfs`` on Linux (a few µs a file, where an fsync each costs 160 µs here), else
   an fsync of each file and then of each directory.
5. Once every file the log holds is durable so, and the log has grown past
   :data:`EMPTY_AT`, the log is emptied; closing the store empties it too.

Changing a key the log holds in any other way (a delete, a non-durable write, a link over
it) first waits for the thread and empties the log, so that the log never holds a version
older than the file; a file the log holds is fsynced before it is linked (a kept version).

If the process dies before the log is emptied (a kill, a power loss), the next holder of
the lock calls :func:`recover`: every output the log holds is fsynced if its file has the
logged bytes and written again (durably, in place) if not, and the log is emptied. A record
carries a CRC-32 of its bytes and of a salt that changes whenever the log starts again, so
a record cut short or left over from before ends the log (with a warning, unless its write
stopped part-way: its end still the allocated zeros). The log is read as untrusted
input: a record for a key that is not an output file is ignored with a warning, and no
file outside the state directory is ever written (the store's own checks apply).
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import functools
import os
import queue
import struct
import sys
import threading
import time
import zlib
from typing import TYPE_CHECKING, Protocol, cast

from .._slots import INTERNAL_DIR, is_output_file
from .._warn import warn
from ..exceptions import StateDirectoryError
from ._base import _valid_key
from ._fileio import (
    allocate_ahead,
    datasync,
    fsync_dir,
    fsync_path,
    pwrite_all,
    with_path,
    write_all,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from ._base import Buffer

LOG_KEY = f"{INTERNAL_DIR}/outputs.log"
LOG_MAX = 64 * 1024
"""Outputs up to this size go through the log; larger ones are written and fsynced in place."""
EMPTY_AT = 4 * 1024 * 1024
"""The log is emptied once it is this long and every file it holds has been written."""
READ_MAX = 256 * 1024 * 1024
"""A log longer than this (which resumable never writes) is read only this far when applied."""
SYNC_DELAY = 0.05
"""Seconds the background thread lets written files gather before it makes them durable together."""
_MAGIC = b"RSMLOG01"
_START = struct.Struct("<8s8s")  # magic, salt
_RECORD = struct.Struct("<IIH")  # crc32 of salt + sizes + key + bytes, bytes' size, key's size
_CRC, _SIZES = struct.Struct("<I"), struct.Struct("<IH")  # its two parts


class LogHost(Protocol):
    """What the log needs of its store (the local store, which imports this module)."""

    def path(self, key: str) -> str: ...
    def temp_file(self, key: str, *, durable: bool) -> tuple[str, str, int]: ...
    def open_log(self, key: str) -> tuple[int, bool]: ...
    def same_file(self, key: str, data: bytes, *, fsync: bool) -> bool: ...
    def write_in_place(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None: ...
    def truncate(self, key: str, size: int, *, durable: bool) -> None: ...
    def linked(self, path: str, what: str = ...) -> StateDirectoryError: ...

    @property
    def local_root(self) -> str | None: ...


class OutputLog:
    """The output log of one local store (see the module's docstring)."""

    def __init__(self, store: LogHost) -> None:
        self._store = store
        self._path = store.path(LOG_KEY)
        self._pid = os.getpid()
        self._cond = threading.Condition()
        self._unsynced: list[str] = []  # files written, not yet durable
        self._since = 0.0  # when the oldest of them was written
        self.logged: set[str] = set()  # keys with a record in the log since it was emptied
        self._fd: int | None = None
        self._size = 0  # where the log's records end (the file is allocated further)
        self._allocated = 0
        self._salt = b""
        self._appending = 0  # records appended whose fsync has not returned
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._hurry = False  # someone waits: make the files durable now
        self._draining = 0  # callers of empty(): new records wait until it is done
        self._error: OSError | None = None
        self._temps: _TempWriter | None = None

    @property
    def usable(self) -> bool:
        """False in a forked child (its parent's thread is not there): it writes in place."""
        return os.getpid() == self._pid

    # writing -----------------------------------------------------------------------------

    def write(self, key: str, data: bytes) -> None:
        """Make *data* the durable content of output *key* (see the module's docstring)."""
        self._raise_failure()
        job = self._helper().submit(key, data)  # written meanwhile, while the log is fsynced
        target = self._store.path(key)
        try:
            log_fd = self._append(key, data)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(job.result())
            if isinstance(exc, OSError):
                raise with_path(exc, target) from None
            raise
        tmp = None
        try:
            try:
                datasync(log_fd)
            finally:
                tmp = job.result()
            # Renamed only now: a full disk or a failed fsync leaves the previous file. (A
            # record whose fsync failed may still be applied by the next run: its bytes are
            # a whole output all the same.)
            os.replace(tmp, target)
        except BaseException as exc:  # an interrupt too: the log must stay free to be emptied
            with self._cond:
                self._appending -= 1
                self._cond.notify_all()
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if isinstance(exc, OSError):
                raise with_path(exc, target) from None
            raise
        with self._cond:
            self._appending -= 1
            if not self._unsynced:
                self._since = time.monotonic()
            self._unsynced.append(target)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="resumable-outputs", daemon=True)
                self._thread.start()
            if len(self._unsynced) == 1 or self._draining or self._hurry:
                self._cond.notify_all()

    def _helper(self) -> _TempWriter:
        temps = self._temps
        if temps is None:
            with self._cond:
                if self._temps is None:
                    self._temps = _TempWriter(self._store)
                temps = self._temps
        return temps

    def _append(self, key: str, data: bytes) -> int:
        """Append the record of *key* and *data* to the log (not fsynced yet); the log's descriptor."""
        with self._cond:
            while self._draining:
                self._cond.wait()
            log_fd = self._open()
            start = b"" if self._size else self._start()  # (a new salt, before the record is sealed)
            sealed = start + self._sealed(key, data)
            end = self._size + len(sealed)
            try:
                if end > self._allocated:
                    self._allocated = allocate_ahead(log_fd, self._allocated, end)
                pwrite_all(log_fd, sealed, self._size)
            except OSError:
                # a record cut short would end the log for the records after it
                with contextlib.suppress(OSError):
                    os.ftruncate(log_fd, self._size)
                self._allocated = self._size
                raise
            self._size = end
            self._appending += 1
            self.logged.add(key)
        return log_fd

    def _sealed(self, key: str, data: bytes) -> bytes:
        """The record of *key* and *data*, its CRC over the salt of the log it goes to."""
        name = key.encode()
        body = _SIZES.pack(len(data), len(name)) + name + data
        return _CRC.pack(zlib.crc32(body, zlib.crc32(self._salt))) + body

    def _start(self) -> bytes:
        """The first bytes of a log that starts again: a new salt, so old records end it."""
        self._salt = os.urandom(8)
        return _START.pack(_MAGIC, self._salt)

    def _open(self) -> int:
        if self._fd is None:
            fd, created = self._store.open_log(LOG_KEY)
            if created:
                fsync_dir(os.path.dirname(self._path))
            elif os.fstat(fd).st_size:  # a store written without taking its lock: apply it now
                recover(self._store)
            self._fd, self._size, self._allocated = fd, 0, 0
        return self._fd

    # the background thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._unsynced or self._stopping):
                    self._cond.wait()
                if not self._unsynced:
                    return
                # let files gather, so that one sync makes many durable
                while not (self._hurry or self._stopping):
                    left = self._since + SYNC_DELAY - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            try:
                self._make_durable()
            except OSError as exc:
                with self._cond:
                    self._error = exc
                    self._cond.notify_all()
                return

    def _make_durable(self) -> None:
        """
        Make the files written and their names durable: on Linux one ``syncfs`` of the
        state's file system (about 20 µs a file, where an fsync each costs 160 µs here),
        elsewhere an fsync of each file and then of each directory. Once the log is longer
        than :data:`EMPTY_AT`, new records wait meanwhile, so that it can be emptied (with
        records coming all the time, it would never be).
        """
        with self._cond:
            drain = self._size >= EMPTY_AT
            if drain:
                self._draining += 1
                while self._appending:
                    self._cond.wait()
            files = list(self._unsynced)
        try:
            root = self._store.local_root
            if root is None or not sync_filesystem(root):
                _fsync_each(files)
            with self._cond:
                del self._unsynced[: len(files)]
                if not self._unsynced:
                    self._hurry = False
                emptied = drain and self._empty_locked()
        finally:
            with self._cond:
                if drain:
                    self._draining -= 1
                self._cond.notify_all()
        if emptied:
            self._sync_log()

    def _empty_locked(self) -> bool:
        """Empty the log if every file it holds is durable (holding the condition's lock)."""
        if self._unsynced or self._appending or self._fd is None or not self._size:
            return False
        os.ftruncate(self._fd, 0)
        self._size = self._allocated = 0
        self.logged.clear()
        return True

    def _sync_log(self) -> None:
        fd = self._fd
        if fd is not None:
            os.fsync(fd)  # the emptied log must not come back after a power loss

    # waiting -----------------------------------------------------------------------------

    def _raise_failure(self) -> None:
        error = self._error
        if error is not None:
            msg = (
                f"writing an output file in the background failed ({error}); the outputs are safe "
                f"in {self._path}, and the next run (or any command that changes the state) "
                "writes them"
            )
            raise type(error)(error.errno, msg, error.filename) from error

    def _wait(self, done: Callable[[], bool], *, hurry: bool = False) -> None:
        with self._cond:
            if hurry:
                self._hurry = True
                self._cond.notify_all()
            while not done():
                self._raise_failure()
                self._cond.wait()

    def before_change(self, key: str) -> None:
        """Before *key* is changed other than through the log: the log must not hold it."""
        if self.usable and key in self.logged:
            self.empty()

    def empty(self) -> None:
        """Wait until every file is durable, holding new records back, then empty the log."""
        if not self.usable:
            return
        with self._cond:
            self._draining += 1  # other threads' records wait: with them coming, it might never be empty
        try:
            self._wait(lambda: not (self._unsynced or self._appending), hurry=True)
            with self._cond:
                emptied = self._empty_locked()
            if emptied:
                self._sync_log()
        finally:
            with self._cond:
                self._draining -= 1
                self._cond.notify_all()
        self._raise_failure()

    def close(self) -> None:
        """Write every file the log holds, make them durable, empty it, stop the thread."""
        if not self.usable:
            return
        try:
            self.empty()
        finally:
            with self._cond:
                self._stopping = True
                self._cond.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None:
                thread.join()
            temps, self._temps = self._temps, None
            if temps is not None:
                temps.close()
            with self._cond:
                self._stopping = False
                self._unsynced.clear()  # left by a failure: the log on disk still holds them
                if self._fd is not None:
                    os.close(self._fd)
                    self._fd = None


def _fsync_each(files: list[str]) -> None:
    """fsync each file (a missing one was replaced since: its successor comes later), then each directory."""
    directories: dict[str, None] = {}
    for path in files:
        try:
            fsync_path(path)
        except FileNotFoundError:
            continue
        directories[os.path.dirname(path)] = None
    for directory in directories:
        fsync_dir(directory)


class _Job:
    """A temporary file to write: its key and bytes, then its path or the error."""

    __slots__ = ("data", "done", "key", "outcome")

    def __init__(self, key: str, data: bytes) -> None:
        self.key, self.data = key, data
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.outcome: str | BaseException = ""

    def result(self) -> str:
        """The temporary file's path, once written; raises what writing it raised."""
        with self.done:
            pass
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


class _TempWriter:
    """A thread that writes outputs' temporary files while their callers fsync the log."""

    def __init__(self, store: LogHost) -> None:
        self._store = store
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="resumable-temp-files", daemon=True)
        self._thread.start()

    def submit(self, key: str, data: bytes) -> _Job:
        job = _Job(key, data)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                target, tmp, fd = self._store.temp_file(job.key, durable=True)
                try:
                    write_all(fd, [job.data])
                except OSError as exc:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise with_path(exc, target) from None
                finally:
                    os.close(fd)
                job.outcome = tmp
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                job.outcome = exc
            finally:
                job.done.release()

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()


def sync_filesystem(path: str) -> bool:
    """
    ``syncfs`` the file system holding *path* (Linux): every file written on it, and every
    name, is then durable. False where there is no ``syncfs``.

    Raises:
        OSError: the file system reported a write error.
    """
    syncfs = _syncfs()
    if syncfs is None:
        return False
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if syncfs(fd) != 0:
            import ctypes  # noqa: PLC0415 - only where syncfs is

            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code), path)
    finally:
        os.close(fd)
    return True


@functools.cache
def _syncfs() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # noqa: PLC0415 - a few milliseconds, paid by the background thread

    try:
        function = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return cast("Callable[[int], int]", function)


def parse(data: bytes | bytearray) -> tuple[dict[str, bytes], int]:
    """
    The outputs a log holds (the last bytes logged for each key, in the order of their last
    record) and where its whole records end.
    """
    outputs: dict[str, bytes] = {}
    if len(data) < _START.size:
        return outputs, 0
    magic, salt = _START.unpack_from(data)
    if magic != _MAGIC:
        return outputs, 0
    view = memoryview(data)
    end = pos = _START.size
    seed = zlib.crc32(salt)
    while pos + _RECORD.size <= len(data):
        crc, size, name_size = _RECORD.unpack_from(data, pos)
        if not name_size:
            break  # the allocated rest of the log (zeros): no record has an empty key
        stop = pos + _RECORD.size + name_size + size
        if stop > len(data) or zlib.crc32(view[pos + 4 : stop], seed) != crc:
            break
        try:
            key = bytes(view[pos + _RECORD.size : pos + _RECORD.size + name_size]).decode()
        except UnicodeDecodeError:
            break
        outputs.pop(key, None)
        outputs[key] = bytes(view[stop - size : stop])
        end = pos = stop
    return outputs, end


def _stopped(data: bytes | bytearray, pos: int) -> bool:
    """
    Whether the bytes at *pos* are a record whose write stopped part-way (a kill, or a power
    loss before its sync) and zeros after it: its last byte, and all that follows, still the
    allocated zeros. Nothing was promised for it (its write never returned), so it is dropped
    without a warning; a record damaged otherwise is warned about.
    """
    if pos + _RECORD.size > len(data):
        return False
    _, size, name_size = _RECORD.unpack_from(data, pos)
    stop: int = pos + _RECORD.size + name_size + size
    return bool(name_size) and stop <= len(data) and data.count(0, stop - 1) == len(data) - stop + 1


def _apply(store: LogHost, path: str, key: str, value: bytes) -> bool | None:
    """Write one logged output if its file differs (True), fsync it if not (False); None: refused."""
    if not (_valid_key(key) and is_output_file(key)):
        warn(f"{path}: ignored a record for {key[:200]!r}, which is not an output file.")
        return None
    try:
        if store.same_file(key, value, fsync=True):
            return False
        store.write_in_place(key, [value], durable=True)
    except StateDirectoryError as exc:  # a link planted on its way: not followed
        warn(f"{path}: did not write {key[:200]!r}: {exc}")
        return None
    return True


def read_head(path: str, limit: int) -> tuple[bytes, int]:
    """The first *limit* bytes of the file at *path* (not through a link), and its size."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        with open(fd, "rb", closefd=False) as f:
            return f.read(min(size, limit)), size
    finally:
        os.close(fd)


def recover(store: LogHost) -> int:
    """
    Apply the log a dead writer left (the caller holds the lock): write each output whose
    file is missing or differs, fsync the others, then empty the log. Returns how many
    files were written.
    """
    path = store.path(LOG_KEY)
    try:
        data, size = read_head(path, READ_MAX)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise store.linked(path) from None
        raise
    if not data:
        return 0
    if size > len(data):
        warn(
            f"{path} is {size} bytes, more than any output log resumable writes: only its first "
            f"{len(data)} bytes are read."
        )
    outputs, end = parse(data)
    written = 0
    directories: dict[str, None] = {}
    for key, value in outputs.items():
        applied = _apply(store, path, key, value)
        if applied is not None:
            written += applied
            directories[os.path.dirname(store.path(key))] = None
    for directory in directories:
        fsync_dir(directory)
    if end < len(data) == size and data.count(0, end) < size - end and not _stopped(data, end):
        # (zeros: the log's allocated rest; a log read only so far was warned about already)
        warn(
            f"{path}: the last {len(data) - end} bytes are not a whole record (cut short by a power "
            "loss, or damaged) and were dropped; an output they held is computed again if its "
            "file is missing."
        )
    store.truncate(LOG_KEY, 0, durable=True)
    return written
