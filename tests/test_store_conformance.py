"""The shared Store conformance suite (resumable.testing.StoreConformance), run on every built-in store."""

from __future__ import annotations

import itertools
import uuid
from pathlib import Path

import pytest

from resumable import Store
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
