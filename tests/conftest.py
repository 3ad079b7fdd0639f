"""Shared fixtures: a pipeline in a temporary directory, a clean environment."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from resumable import Pipeline
from resumable._exit import exit_hooks
from resumable._files import file_digests
from resumable._fingerprint import provenance

settings.register_profile(
    "default",
    deadline=None,
    max_examples=60,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile("thorough", parent=settings.get_profile("default"), max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No RESUMABLE_* variable leaks in from the caller; no provenance leaks between tests."""
    for name in list(os.environ):
        if name.startswith("RESUMABLE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RESUMABLE_PROGRESS", "0")
    provenance.clear()
    file_digests.clear()
    yield
    provenance.clear()
    file_digests.clear()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """Where the test pipeline keeps its state (not created yet)."""
    return tmp_path / "state"


@pytest.fixture
def pipe(state_dir: Path) -> Iterator[Pipeline]:
    """A pipeline in a temporary directory; any run still open is closed afterwards."""
    pipeline = Pipeline("test", state_dir=state_dir)
    yield pipeline
    exit_hooks.forget(pipeline)
    pipeline._close("completed", None)


# remote stores ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A local S3-compatible server (moto) with a bucket, for the whole session."""
    pytest.importorskip("s3fs", reason="the remote extra (fsspec, s3fs) is not installed")
    pytest.importorskip("moto.server", reason="moto[server] (in the test extra) is not installed")
    from s3_server import running_server

    with running_server(tmp_path_factory.mktemp("aws")) as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch: pytest.MonkeyPatch):
    """The S3 server, with the standard AWS variables pointing at it for this test."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
