"""
The contract of a store: :class:`Store`, the base class of every backend.

A store holds opaque objects under ``/``-separated keys such as ``parse.msgpack`` or
``fetch_page/3.msgpack``. Everything resumable guarantees about durability rests on the
primitives a backend must implement (abstract here); every faster way of doing something
a backend may offer is a method with a plain default built on the primitives, which a
backend overrides when it can do better. The core calls these methods and nothing else:
it never asks a store what it happens to have.

The file helpers at the end (:func:`read_file` and the :data:`Stamp` of a file version)
serve the local directory store and :func:`resumable.load`.
"""

from __future__ import annotations

import abc
import builtins
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..exceptions import UsageError

Buffer = bytes | bytearray | memoryview
Stamp = tuple[int, int, int, int, int]


@runtime_checkable
class StoreLock(Protocol):
    """A held lock on a store; released explicitly or when its holder dies."""

    def release(self) -> None:
        """Give the lock up. Calling it twice is harmless."""


class Store(abc.ABC):
    """
    The storage behind a pipeline: subclass it, implement the primitives, and override the
    optional methods you can do better than their defaults.

    Keys are relative, ``/``-separated paths. Implementations must guarantee:

    - ``write`` is atomic: a reader sees the previous object or the new one, never a mix,
      even if the writer is killed; with ``durable=True`` the new object survives a
      power loss once ``write`` returns.
    - ``read`` returns the whole object or raises ``FileNotFoundError``.
    - ``lock`` lets one holder at a time in, raises :class:`StateLockedError` naming the
      holder otherwise, and never stays held after its holder died (a lease: once it expired).
    """

    location: str
    """Where the store is, for messages: a directory path or a URL."""

    slow_appends: ClassVar[bool] = False
    """True where each append is a round trip (an object store): events are then appended in batches."""

    cheap_appends: ClassVar[bool] = False
    """
    True where appending a record to an object costs about what writing its bytes does (a
    local file, memory): a batch then appends its committed chunks to one log instead of
    writing an object per chunk. False (the default) where objects are written whole.
    """

    local_root: str | None = None
    """The directory on this machine that holds the store, if it is one (the local store)."""

    # primitives ------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, key: str) -> bytes | bytearray:
        """Return the whole object; raise ``FileNotFoundError`` if there is none."""

    @abc.abstractmethod
    def read_range(self, key: str, start: int, end: int | None = None) -> bytes:
        """Return bytes ``start`` to ``end`` (exclusive; ``None`` = to the end) of an object."""

    @abc.abstractmethod
    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        """Replace the object at *key* with the concatenation of *chunks*, atomically."""

    @abc.abstractmethod
    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        """Append *data* to the object at *key* (creating it): the event log, batches' chunk logs."""

    @abc.abstractmethod
    def delete(self, key: str, *, durable: bool) -> None:
        """Remove the object at *key*; no error if it does not exist."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with *prefix*, recursively, in no particular order."""

    @abc.abstractmethod
    def lock(self, holder: Mapping[str, Any]) -> StoreLock:
        """Take the store's run lock for *holder* (pid, host, since ...)."""

    # optional: defaults built on the primitives ------------------------------------------

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        """
        Make *dst* an atomic copy of *src* (history keeps versions this way). Default: read
        and write. A store that can copy without moving the bytes (a hard link, a server-side
        copy) overrides it; an ``OSError`` meaning "no link here" (``EXDEV``, ``EPERM``,
        ``ENOTSUP``, ``EMLINK``, ``ENOSYS``) makes the caller fall back to read and write.
        """
        self.write(dst, [self.read(src)], durable=durable)

    def write_header_last(
        self,
        key: str,
        head_len: int,  # noqa: ARG002 - what a store reserving the header's place needs
        value_chunks: Sequence[Buffer],
        header: Callable[[], bytes],
        *,
        durable: bool,
    ) -> None:
        """
        Write an output whose header (*head_len* bytes, known only once the value has been
        checksummed, which *header* does) goes first. A store that can write the value and
        then fill the header in overrides this (the checksum then runs during the write).
        Default: compute the header, then :meth:`write` both.
        """
        self.write(key, [header(), *value_chunks], durable=durable)

    def stamp(self, key: str) -> Stamp | None:  # noqa: ARG002 - the default cannot tell
        """
        What identifies the current version of *key*, cheaply (device, inode, size, times);
        ``None`` if the store cannot tell (then nothing is cached by version). Raises
        ``FileNotFoundError`` for a missing key where it can tell.
        """
        return None

    def read_stamped(self, key: str) -> tuple[bytes | bytearray, Stamp | None]:
        """:meth:`read`, with the :meth:`stamp` of the version read (default: no stamp)."""
        return self.read(key), None

    def changed_since(self, key: str, ns: int) -> bool | None:  # noqa: ARG002 - the default cannot tell
        """
        Whether *key* may have changed since *ns* (nanoseconds since the epoch); ``None``
        when the store cannot tell (then the object is read to find out).
        """
        return None

    def remove_temp_files(self) -> int:
        """Remove what killed writers left behind (temporary files); return how many."""
        return 0

    def temp_files(self) -> builtins.list[str]:
        """The keys of temporary files killed writers left behind (none by default)."""
        return []

    def close_appends(self) -> None:  # noqa: B027 - optional, and nothing to do by default
        """Release what appends keep open (file descriptors, buffered segments)."""

    def truncate(self, key: str, size: int, *, durable: bool) -> None:
        """
        Cut the object at *key* to its first *size* bytes (a log whose last record a crash
        cut short); an object that is not longer stays as it is. Appends then go on at the
        new end. Default: read those bytes and :meth:`write` them, atomically.
        """
        self.write(key, [self.read_range(key, 0, size)], durable=durable)


class ProtocolStore(Store):
    """
    A backend written to the ``Store`` protocol without subclassing :class:`Store`: its
    primitives, with the defaults for the rest (and its ``copy``, ``remove_temp_files`` and
    ``slow_appends`` where it has them, as the protocol allowed).
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.location = str(backend.location)
        self.slow_appends = bool(getattr(backend, "slow_appends", False))  # type: ignore[misc]
        self._copy = getattr(backend, "copy", None)
        self._remove_temp_files = getattr(backend, "remove_temp_files", None)

    def __repr__(self) -> str:
        return repr(self.backend)

    def read(self, key: str) -> bytes | bytearray:
        data: bytes | bytearray = self.backend.read(key)
        return data

    def read_range(self, key: str, start: int, end: int | None = None) -> bytes:
        data: bytes = self.backend.read_range(key, start, end)
        return data

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        self.backend.write(key, chunks, durable=durable)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        self.backend.append(key, data, durable=durable)

    def delete(self, key: str, *, durable: bool) -> None:
        self.backend.delete(key, durable=durable)

    def list(self, prefix: str = "") -> list[str]:
        keys: list[str] = self.backend.list(prefix)
        return keys

    def lock(self, holder: Mapping[str, Any]) -> StoreLock:
        lock: StoreLock = self.backend.lock(holder)
        return lock

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        if self._copy is None:
            super().copy(src, dst, durable=durable)
        else:
            self._copy(src, dst, durable=durable)

    def remove_temp_files(self) -> int:
        return int(self._remove_temp_files()) if self._remove_temp_files is not None else 0


PRIMITIVES = ("read", "read_range", "write", "append", "delete", "list", "lock")


def as_store(obj: object) -> Store:
    """*obj* as a :class:`Store`: itself, or a backend written to the protocol, adapted."""
    if isinstance(obj, Store):
        return obj
    missing = [name for name in PRIMITIVES if not callable(getattr(obj, name, None))]
    if missing or not isinstance(getattr(obj, "location", None), str):
        what = ", ".join(missing) if missing else "a str location"
        msg = (
            f"{obj!r} is not a store: it has no {what}. Pass a directory, a URL, or a subclass "
            "of resumable.Store (see docs/storage.md)"
        )
        raise UsageError(msg)
    return ProtocolStore(obj)


def check_key(key: str, location: str) -> str:
    """
    Return *key* if it is a relative path inside the store; raise otherwise.

    Keys come from the library (slots are encoded so that they cannot leave the state),
    but a second line of defence refuses any key that could: an absolute path, a ``.`` or
    ``..`` component, an empty component (a trailing ``/`` marks a prefix and is allowed),
    or a NUL byte.

    Raises:
        UsageError: it is not such a key.
    """
    if not _valid_key(key):
        msg = (
            f"{key!r} is not a key inside the store {location}: keys are relative paths with no "
            "'.' or '..' component"
        )
        raise UsageError(msg)
    return key


@functools.lru_cache(maxsize=4096)  # the keys of a run's hot slots; not one per slot of a large state
def _valid_key(key: str) -> bool:
    *dirs, name = key.split("/")
    return not (
        key.startswith("/") or "\x00" in key or name in {".", ".."} or any(p in {"", ".", ".."} for p in dirs)
    )


def read_file(path: str | os.PathLike[str], *, nofollow: bool = False) -> bytearray:
    """
    Read a whole file into a fresh writable buffer (arrays decoded from it are writable);
    with *nofollow*, a symbolic link is not followed (``OSError`` ELOOP).
    """
    return read_file_stamped(path, nofollow=nofollow)[0]


def stamp_of(st: os.stat_result) -> Stamp:
    """What identifies one version of a file: a rename or a write changes it."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def read_file_stamped(path: str | os.PathLike[str], *, nofollow: bool = False) -> tuple[bytearray, Stamp]:
    """:func:`read_file`, also returning the stamp of the version read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_NOFOLLOW if nofollow else 0))
    try:
        st = os.fstat(fd)
        size = st.st_size
        buf = bytearray(size)
        done = os.readv(fd, [buf])
        if done < size:  # a short read (large files, some file systems): go on
            view = memoryview(buf)
            while done < size:
                n = os.readv(fd, [view[done:]])
                if not n:
                    break
                done += n
            del view
    finally:
        os.close(fd)
    if done < size:
        del buf[done:]
    return buf, stamp_of(st)
