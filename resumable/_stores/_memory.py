"""The in-process store behind ``memory://`` URLs (tests, ephemeral services)."""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from .._slots import SESSIONS_DIR
from ..exceptions import StateLockedError
from ._base import Buffer, Store

_SESSIONS = SESSIONS_DIR + "/"


class _MemoryLock:
    def __init__(self, store: MemoryStore) -> None:
        self._store: MemoryStore | None = store

    def release(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            with store._mutex:  # noqa: SLF001 - the lock belongs to its store
                store._holders.pop(store._prefix, None)  # noqa: SLF001


class MemoryStore(Store):
    """
    Objects in a dict; ``memory://name`` returns the same store for the same name, as long
    as something (a pipeline) holds it: the last one dropped, its objects are freed. A named
    session's store (:meth:`sub`) is a view of the keys under a prefix, with a lock of its own.
    """

    _named: ClassVar[weakref.WeakValueDictionary[str, MemoryStore]] = weakref.WeakValueDictionary()
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.location = f"memory://{name}"
        self._objects: dict[str, bytearray] = {}
        self._mutex = threading.Lock()
        self._holders: dict[str, dict[str, Any]] = {}  # the lock's holder, per prefix
        self._prefix = ""

    def __repr__(self) -> str:
        return f"MemoryStore({self.location!r})"

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """The shared store called *name*; a new private store if *name* is empty."""
        if not name:
            return cls()
        with cls._registry_lock:
            store = cls._named.get(name)
            if store is None:
                store = cls._named[name] = cls(name)
            return store

    def sub(self, prefix: str) -> MemoryStore:
        """The keys under ``prefix/``, sharing this store's objects."""
        view = copy.copy(self)
        view._prefix = f"{self._prefix}{prefix.rstrip('/')}/"  # noqa: SLF001 - a view of this store
        view.location = f"{self.location}/{prefix.rstrip('/')}"
        return view

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytearray:
        try:
            # a slice is a copy (values decoded from it must not alias the store), made
            # without exporting the buffer, which would make a concurrent append fail
            return self._objects[self._prefix + key][start:end]
        except KeyError:
            raise FileNotFoundError(f"{self.location}/{key}") from None

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:  # noqa: ARG002
        data = bytearray().join(chunks)  # (appends extend it in place)
        with self._mutex:
            self._objects[self._prefix + key] = data

    def append(self, key: str, data: bytes, *, durable: bool) -> None:  # noqa: ARG002
        with self._mutex:
            self._objects.setdefault(self._prefix + key, bytearray()).extend(data)

    def delete(self, key: str, *, durable: bool) -> None:  # noqa: ARG002
        with self._mutex:
            self._objects.pop(self._prefix + key, None)

    def list(self, prefix: str = "") -> list[str]:
        start, n = self._prefix + prefix, len(self._prefix)
        with self._mutex:
            keys = [k[n:] for k in self._objects if k.startswith(start)]
        if prefix.startswith(SESSIONS_DIR):
            return keys
        return [k for k in keys if not k.startswith(_SESSIONS)]

    def lock(self, holder: Mapping[str, Any]) -> _MemoryLock:
        with self._mutex:
            if self._prefix in self._holders:
                raise StateLockedError(self.location, self._holders[self._prefix])
            self._holders[self._prefix] = dict(holder)
        return _MemoryLock(self)
