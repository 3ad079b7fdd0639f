"""A store inside another, with a lock of its own: where a named session keeps its state."""

from __future__ import annotations

import weakref

from ..exceptions import UsageError
from ._base import Store
from ._local import LocalStore
from ._memory import MemoryStore


def sub_store(store: Store, prefix: str) -> Store:
    """The store whose keys are *store*'s keys under ``prefix/``, with a lock of its own."""
    child: Store | None = None
    if isinstance(store, LocalStore):
        child = LocalStore(f"{store.root}/{prefix}")
    elif isinstance(store, MemoryStore):
        child = store.sub(prefix)
    elif type(store).__name__ == "FsspecStore":
        from ._fsspec import FsspecStore  # noqa: PLC0415 - fsspec is optional and slow to import

        if isinstance(store, FsspecStore):
            options = dict(getattr(store.fs, "storage_options", {}) or {})
            child = FsspecStore(f"{store.location}/{prefix}", options, lease_ttl=store.lease_ttl)
    if child is not None:
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


# the store each store made by sub_store is inside (what files sessions share live there)
_parents: weakref.WeakKeyDictionary[Store, Store] = weakref.WeakKeyDictionary()
