"""The contract of a store: :class:`Store`, the base class of every backend."""

from __future__ import annotations

import abc
import builtins
import errno
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from ..exceptions import UsageError

Buffer = bytes | bytearray | memoryview
Stamp = tuple[int, int, int, int, int]  # device, inode, size, mtime_ns, ctime_ns: one file version


@runtime_checkable
class StoreLock(Protocol):
    """A held lock on a store; released explicitly or when its holder dies."""

    def release(self) -> None:
        """Give the lock up. Calling it twice is harmless."""


class Store(abc.ABC):
    """
    The storage behind a pipeline: subclass it, set :attr:`location`, implement the six
    primitives, and override the optional members you can do better than their defaults.

    Keys are relative, ``/``-separated paths. Implementations must guarantee:

    - ``write`` is atomic: a reader sees the previous object or the new one, never a mix,
      even if the writer is killed; with ``durable=True`` the new object survives a
      power loss once ``write`` returns, or once :meth:`sync` returns where the store
      shares that work among writes that follow closely.
    - ``read`` returns the whole object (or the range asked for) or raises ``FileNotFoundError``.
    - ``lock`` lets one holder at a time in, raises :class:`StateLockedError` naming the
      holder otherwise, and never stays held after its holder died (a lease: once it expired).
    """

    location: str
    """Where the store is, for messages: a directory path or a URL."""

    slow_appends: ClassVar[bool] = False
    """
    True where each append is a round trip (an object store): events are then appended in
    batches, and a batch writes an object per committed chunk instead of appending to a log.
    """

    # primitives ------------------------------------------------------------------------

    @abc.abstractmethod
    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        """
        Bytes *start* to *end* (exclusive, clipped to the object; ``None``: to its end) of
        the object, by default all of it; raise ``FileNotFoundError`` if there is none.
        """

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
        copy) overrides it.
        """
        self.write(dst, [self.read(src)], durable=durable)

    def sync(self) -> None:  # noqa: B027 - nothing to do by default
        """
        Make every durable write that returned survive a power loss now. Called before a
        step that must not run twice begins or is recorded, and when a run closes. Default:
        nothing to do (each durable write is complete when it returns).
        """

    def remove_temp_files(self, *, dry_run: bool = False) -> builtins.list[str]:  # noqa: ARG002 - none by default
        """
        Remove what killed writers left behind (temporary objects) and return their keys
        (with *dry_run*, only return them). Called holding the lock. Default: there are none.
        """
        return []


_NO_DIR = frozenset({"", ".", ".."})  # components a key's directories cannot be


def check_key(key: str, location: str) -> str:
    """
    Return *key* if it is a relative path inside the store, else raise :class:`UsageError`:
    a second line of defence (slots are encoded so that they cannot leave the state) against
    an absolute path, a ``.``, ``..`` or empty directory component, or a NUL byte.
    """
    *dirs, name = key.split("/")
    if key.startswith("/") or "\x00" in key or name in {".", ".."} or not _NO_DIR.isdisjoint(dirs):
        msg = (
            f"{key!r} is not a key inside the store {location}: keys are relative paths with no "
            "'.' or '..' component"
        )
        raise UsageError(msg)
    return key


def is_temp(key: str) -> bool:
    """True for the temporary objects writers make (``.<name>.<token>.tmp``), by key or path."""
    name = key.rpartition("/")[2]
    return name.startswith(".") and name.endswith(".tmp")


def with_path(exc: OSError, path: str) -> OSError:
    """The same kind of error, naming *path* (os.write's and object stores' errors often name nothing)."""
    if exc.filename is not None:
        return exc
    try:
        return type(exc)(exc.errno or errno.EIO, exc.strerror or str(exc), path)
    except TypeError:  # pragma: no cover - an OSError subclass with its own signature
        return OSError(exc.errno or errno.EIO, exc.strerror or str(exc), path)
