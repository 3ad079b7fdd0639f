"""
A store inside another: where a named session keeps its state (``.sessions/<id>/``).

A session is a store of its own, in the default session's layout, under a prefix of the
store it belongs to, with its own lock: a local directory is a :class:`LocalStore` of the
sub-directory (a ``flock`` of its own), an fsspec URL an :class:`FsspecStore` of the
sub-URL (a lease of its own), and a ``memory://`` store a :class:`PrefixStore` view whose
lock is held per prefix in this process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ..exceptions import StateLockedError, UsageError
from ._base import Buffer, Store
from ._local import LocalStore
from ._memory import MemoryStore


def sub_store(store: Store, prefix: str) -> Store:
    """The store whose keys are *store*'s keys under ``prefix/``, with a lock of its own."""
    child: Store | None = None
    if isinstance(store, LocalStore):
        child = LocalStore(f"{store.root}/{prefix}")
    elif isinstance(store, MemoryStore | PrefixStore):
        child = PrefixStore(store, prefix)
    elif type(store).__name__ == "FsspecStore":  # not imported unless in use: fsspec is slow to import
        from ._fsspec import FsspecStore  # noqa: PLC0415 - fsspec is optional and slow to import

        if isinstance(store, FsspecStore):
            options = dict(getattr(store.fs, "storage_options", {}) or {})
            child = FsspecStore(f"{store.location}/{prefix}", options, lease_ttl=store.lease_ttl)
    if child is not None:
        with _holders_lock:
            _parents[child] = root_of(store)
        return child
    msg = (
        f"{store!r} cannot hold named sessions: they need a local directory, a memory:// store "
        "or an fsspec URL (a store of your own can hold the default session)"
    )
    raise UsageError(msg)


def root_of(store: Store) -> Store:
    """The outermost store *store* is inside (itself if it is inside none)."""
    return _parents.get(store, store)


_holders_lock = threading.Lock()
# the store each store made by sub_store is inside (what files sessions share live there)
_parents: weakref.WeakKeyDictionary[Store, Store] = weakref.WeakKeyDictionary()
# the session locks held in this process, per memory store and prefix
_holders: weakref.WeakKeyDictionary[Store, dict[str, dict[str, Any]]] = weakref.WeakKeyDictionary()


class _PrefixLock:
    def __init__(self, base: Store, prefix: str) -> None:
        self._base: Store | None = base
        self._prefix = prefix

    def release(self) -> None:
        base, self._base = self._base, None
        if base is not None:
            with _holders_lock:
                _holders.get(base, {}).pop(self._prefix, None)


class PrefixStore(Store):
    """The keys of an in-process store under a prefix, locked per prefix in this process."""

    def __init__(self, base: Store, prefix: str) -> None:
        if isinstance(base, PrefixStore):
            prefix = f"{base.prefix}{prefix}"
            base = base.base
        self.base: Store = base
        self.prefix: str = prefix.rstrip("/") + "/"
        self.location = f"{base.location}/{prefix.rstrip('/')}"
        self.slow_appends = base.slow_appends  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"PrefixStore({self.location!r})"

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return self.base.read(self.prefix + key, start, end)

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:
        self.base.write(self.prefix + key, chunks, durable=durable)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        self.base.append(self.prefix + key, data, durable=durable)

    def delete(self, key: str, *, durable: bool) -> None:
        self.base.delete(self.prefix + key, durable=durable)

    def list(self, prefix: str = "") -> list[str]:
        n = len(self.prefix)
        return [k[n:] for k in self.base.list(self.prefix + prefix)]

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        self.base.copy(self.prefix + src, self.prefix + dst, durable=durable)

    def lock(self, holder: Mapping[str, Any]) -> _PrefixLock:
        with _holders_lock:
            held = _holders.setdefault(self.base, {})
            if self.prefix in held:
                raise StateLockedError(self.location, held[self.prefix])
            held[self.prefix] = dict(holder)
        return _PrefixLock(self.base, self.prefix)
