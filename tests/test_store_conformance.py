"""The shared Store conformance suite (resumable.testing.StoreConformance), run on every built-in store."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path
from typing import Any

import pytest

from resumable import Store
from resumable._stores import open_store
from resumable._stores._fsspec import FsspecStore
from resumable._stores._local import LocalStore
from resumable._stores._memory import MemoryStore
from resumable.testing import StoreConformance

_names = itertools.count()


class TestLocalStore(StoreConformance):
    """A directory on the local disk."""

    concurrency_seconds = 0.5

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        self.base = tmp_path

    def make_store(self) -> Store:
        return LocalStore(self.base / f"store-{next(_names)}")

    def reopen(self, store: Store) -> Store:
        assert isinstance(store, LocalStore)
        return LocalStore(store.root)

    def subprocess_location(self, store: Store) -> str | None:
        assert isinstance(store, LocalStore)
        return store.root


class TestMemoryStore(StoreConformance):
    """resumable's own in-process store (memory:// URLs)."""

    big_object_size = 1024 * 1024
    concurrency_seconds = 0.5

    def make_store(self) -> Store:
        return MemoryStore.named(f"conformance-{uuid.uuid4().hex}")

    def reopen(self, store: Store) -> Store:
        return MemoryStore.named(store.location.removeprefix("memory://"))


class TestFsspecMemoryStore(StoreConformance):
    """The fsspec store over fsspec's in-memory file system (atomic single writes, no conditions)."""

    big_object_size = 1024 * 1024
    concurrency_seconds = 0.5

    def make_store(self) -> Store:
        return FsspecStore(f"memory://resumable-conformance/{uuid.uuid4().hex}")

    def reopen(self, store: Store) -> Store:
        return FsspecStore(store.location)


class TestFsspecLocalStore(StoreConformance):
    """The fsspec store over fsspec's local file system: temp object and move."""

    big_object_size = 1024 * 1024
    concurrency_seconds = 0.5

    @pytest.fixture(autouse=True)
    def _directory(self, tmp_path: Path) -> None:
        self.base = tmp_path

    def make_store(self) -> Store:
        return FsspecStore(f"file://{self.base}/store-{next(_names)}")

    def reopen(self, store: Store) -> Store:
        return FsspecStore(store.location)


class TestS3Store(StoreConformance):
    """S3, on the local moto server."""

    big_object_size = 2 * 1024 * 1024
    concurrency_seconds = 0.5
    lock_recovery_seconds = 2.0

    @pytest.fixture(autouse=True)
    def _server(self, s3) -> None:
        self.server = s3

    def make_store(self) -> Store:
        return FsspecStore(self.server.url(), lease_ttl=2.0)

    def reopen(self, store: Store) -> Store:
        return FsspecStore(store.location, lease_ttl=2.0)

    def subprocess_location(self, store: Store) -> str | None:
        return store.location

    def subprocess_env(self) -> dict[str, str]:
        return {"RESUMABLE_LEASE_TTL": "1"}


class _MinimalStore(Store):
    """A store with the six primitives only: every optional method keeps its default."""

    def __init__(self, name: str) -> None:
        self._inner = MemoryStore.named(name)
        self.location = self._inner.location

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        return self._inner.read(key, start, end)

    def write(self, key: str, chunks: Any, *, durable: bool) -> None:
        self._inner.write(key, chunks, durable=durable)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        self._inner.append(key, data, durable=durable)

    def delete(self, key: str, *, durable: bool) -> None:
        self._inner.delete(key, durable=durable)

    def list(self, prefix: str = "") -> list[str]:
        return self._inner.list(prefix)

    def lock(self, holder: Any) -> Any:
        return self._inner.lock(holder)


class TestMinimalStore(StoreConformance):
    """A store implementing the primitives only: every guarantee holds with the defaults."""

    def make_store(self) -> Store:
        return _MinimalStore(f"minimal-{uuid.uuid4().hex}")

    def reopen(self, store: Store) -> Store:
        return _MinimalStore(store.location.removeprefix("memory://"))


def test_a_minimal_store_runs_a_pipeline():
    """Pipeline(store=obj) with obj implementing the primitives only: steps store and skip."""
    from resumable import Pipeline

    store = _MinimalStore(f"minimal-{uuid.uuid4().hex}")
    calls: list[int] = []
    for _ in range(2):
        pipe = Pipeline("p", store=store)

        @pipe.step
        def one() -> int:
            calls.append(1)
            return 1

        with pipe:
            assert 1 == one()
    assert [1] == calls


def test_something_else_is_not_a_store():
    from resumable import UsageError

    with pytest.raises(UsageError, match="is not a store"):
        open_store(object.__new__(type("Half", (), {"location": "x", "read": lambda s, k: b""})))  # type: ignore[arg-type]
