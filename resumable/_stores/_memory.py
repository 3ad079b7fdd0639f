"""The in-process store behind ``memory://`` URLs (tests, ephemeral services)."""

from __future__ import annotations

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
                store._holder = None  # noqa: SLF001


class MemoryStore(Store):
    """
    Objects in a dict; ``memory://name`` returns the same store for the same name, as long
    as something (a pipeline) holds it: the last one dropped, its objects are freed.
    """

    _named: ClassVar[weakref.WeakValueDictionary[str, MemoryStore]] = weakref.WeakValueDictionary()
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, name: str = "") -> None:
        self.location = f"memory://{name}"
        self._objects: dict[str, bytes | bytearray] = {}
        self._mutex = threading.Lock()
        self._holder: dict[str, Any] | None = None

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

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytearray:
        try:
            # a copy: values decoded from it (NumPy arrays) must not alias the store
            return bytearray(memoryview(self._objects[key])[start:end])
        except KeyError:
            raise FileNotFoundError(f"{self.location}/{key}") from None

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:  # noqa: ARG002
        data = b"".join(chunks)
        with self._mutex:
            self._objects[key] = data

    def append(self, key: str, data: bytes, *, durable: bool) -> None:  # noqa: ARG002
        with self._mutex:
            current = self._objects.get(key)
            if isinstance(current, bytearray):
                current += data
            else:
                self._objects[key] = bytearray(current or b"") + data

    def delete(self, key: str, *, durable: bool) -> None:  # noqa: ARG002
        with self._mutex:
            self._objects.pop(key, None)

    def list(self, prefix: str = "") -> list[str]:
        with self._mutex:
            if prefix.startswith(SESSIONS_DIR):
                return [k for k in self._objects if k.startswith(prefix)]
            return [k for k in self._objects if k.startswith(prefix) and not k.startswith(_SESSIONS)]

    def lock(self, holder: Mapping[str, Any]) -> _MemoryLock:
        with self._mutex:
            if self._holder is not None:
                raise StateLockedError(self.location, self._holder)
            self._holder = dict(holder)
        return _MemoryLock(self)
