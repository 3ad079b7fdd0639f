"""
Where state lives: the :class:`Store` protocol and the built-in stores.

A store holds opaque objects under ``/``-separated keys such as ``parse.msgpack`` or
``fetch_page/3.msgpack``. Everything resumable guarantees about durability rests on
five operations, which is what a custom backend implements.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class StoreLock(Protocol):
    """A held lock on a store; released explicitly or when its holder dies."""

    def release(self) -> None:
        """Give the lock up. Calling it twice is harmless."""


@runtime_checkable
class Store(Protocol):
    """
    The storage behind a pipeline.

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

    def read(self, key: str) -> bytes | bytearray:
        """Return the whole object; raise ``FileNotFoundError`` if there is none."""

    def read_range(self, key: str, start: int, end: int | None = None) -> bytes:
        """Return bytes ``start`` to ``end`` (exclusive; ``None`` = to the end) of an object."""

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        """Replace the object at *key* with the concatenation of *chunks*, atomically."""

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        """Append *data* to the object at *key* (creating it); used for the event log."""

    def delete(self, key: str, *, durable: bool) -> None:
        """Remove the object at *key*; no error if it does not exist."""

    def list(self, prefix: str = "") -> list[str]:
        """All keys starting with *prefix*, recursively, in no particular order."""

    def lock(self, holder: Mapping[str, Any]) -> StoreLock:
        """Take the store's run lock for *holder* (pid, host, since ...)."""


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
        from ..exceptions import UsageError  # noqa: PLC0415 - only on this error path

        msg = (
            f"{key!r} is not a key inside the store {location}: keys are relative paths with no "
            "'.' or '..' component"
        )
        raise UsageError(msg)
    return key


@functools.lru_cache(maxsize=1 << 16)
def _valid_key(key: str) -> bool:
    *dirs, name = key.split("/")
    return not (
        key.startswith("/") or "\x00" in key or name in {".", ".."} or any(p in {"", ".", ".."} for p in dirs)
    )


def open_store(
    location: str | os.PathLike[str] | Store,
    storage_options: Mapping[str, Any] | None = None,
) -> Store:
    """
    Return the store for a directory, a URL or an existing :class:`Store`.

    ``memory://name`` is an in-process store shared by every pipeline using the same name
    (``memory://`` alone is a fresh private one); ``file://path`` and plain paths are local
    directories. Any other URL (``s3://bucket/prefix`` ...) is opened with fsspec, passing
    it *storage_options* (needs ``pip install "resumable[remote]"``).
    """
    if isinstance(location, Store):
        return location
    text = os.fspath(location)
    scheme, sep, rest = text.partition("://")
    if not sep:
        from ._local import LocalStore  # noqa: PLC0415 - keep import light

        return LocalStore(text)
    if scheme == "file":
        from ._local import LocalStore  # noqa: PLC0415 - keep import light

        return LocalStore(rest)
    if scheme == "memory":
        from ._memory import MemoryStore  # noqa: PLC0415 - keep import light

        return MemoryStore.named(rest)
    from ._fsspec import FsspecStore  # noqa: PLC0415 - fsspec is optional and slow to import

    return FsspecStore(text, storage_options)
