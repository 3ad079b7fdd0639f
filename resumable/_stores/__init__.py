"""
Where state lives: the :class:`Store` base class (:mod:`._base`) and the built-in stores.

``open_store`` turns a directory, a URL or a store object into a :class:`Store`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ..exceptions import UsageError
from ._base import Buffer, Stamp, Store, StoreLock, check_key
from ._local import LocalStore
from ._memory import MemoryStore

__all__ = ["Buffer", "Stamp", "Store", "StoreLock", "check_key", "key_stamp", "open_store", "unchanged_since"]


def key_stamp(store: Store, key: str) -> Stamp | None:
    """
    The :data:`Stamp` of *key*'s current version in a local directory (FileNotFoundError if
    there is none); ``None`` in any other store, where nothing is cached by version.
    """
    return store.stamp(key) if isinstance(store, LocalStore) else None


def unchanged_since(store: Store, key: str, ns: int) -> bool:
    """
    True if *key* is a local file that has not changed (been written, renamed or linked)
    since *ns*, nanoseconds since the epoch.
    """
    try:
        found = key_stamp(store, key)
    except OSError:
        return False
    return found is not None and found[4] < ns


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
    if not isinstance(location, (str, os.PathLike)):
        msg = (
            f"{location!r} is not a store. Pass a directory, a URL, or an instance of a subclass "
            "of resumable.Store (see docs/storage.md)"
        )
        raise UsageError(msg)
    text = os.fspath(location)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return LocalStore(text)
    if scheme == "file":
        return LocalStore(rest)
    if scheme == "memory":
        return MemoryStore.named(rest)
    from ._fsspec import FsspecStore  # noqa: PLC0415 - remote stores only: fsspec is optional

    return FsspecStore(text, storage_options)
