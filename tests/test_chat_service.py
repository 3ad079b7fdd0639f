"""examples/chat_service.py: the web-service recipe, with FastAPI's test client and a real uvicorn process."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("fastapi", reason="fastapi (in the test extra) is not installed")
pytest.importorskip("uvicorn", reason="uvicorn (in the test extra) is not installed")
pytest.importorskip("httpx2", reason="httpx2 (starlette's test client; in the test extra) is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (in the test extra) is not installed")

from fastapi.testclient import TestClient  # noqa: E402 - after the skips

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "chat_service.py"


def _load(monkeypatch: pytest.MonkeyPatch, state: Path) -> ModuleType:
    monkeypatch.setenv("RESUMABLE_STATE_DIR", str(state))
    spec = importlib.util.spec_from_file_location("chat_service_under_test", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_conversations_with_the_test_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    service = _load(monkeypatch, tmp_path / "state")
    client = TestClient(service.app)
    first = client.post("/chat/alice", json={"id": "m1", "text": "Hello"}).json()
    assert first["assistant"] == "turn 1: you said 'Hello'"
    second = client.post("/chat/alice", json={"id": "m2", "text": "Again"}).json()
    assert second["assistant"] == "turn 2: you said 'Again'"
    assert client.post("/chat/bob", json={"id": "m1", "text": "Hi"}).json()["assistant"].startswith("turn 1")
    assert service.calls["model"] == 3
    retried = client.post("/chat/alice", json={"id": "m1", "text": "Hello"}).json()
    assert retried == first  # a retried message is answered from its stored reply
    assert service.calls["model"] == 3
    assert [t["user"] for t in client.get("/chat/alice").json()] == ["Hello", "Again"]
    assert {s.id for s in service.pipe.sessions()} == {"alice", "bob"}
    with service.pipe.session("alice"):  # another worker holds the conversation
        busy = client.post("/chat/alice", json={"id": "m3", "text": "?"})
    assert busy.status_code == 409
    assert client.delete("/chat/bob").json() == {"deleted": "bob"}
    assert client.get("/chat/bob").json() == []
    assert [s.id for s in service.pipe.sessions()] == ["alice"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_uvicorn_workers_on_one_state_directory(tmp_path: Path) -> None:
    """Two real server processes share the state: a conversation started on one continues on the other."""
    env = {**os.environ, "RESUMABLE_STATE_DIR": str(tmp_path / "state"), "PYTHONPATH": str(ROOT)}
    env = {k: v for k, v in env.items() if k != "RESUMABLE_SESSION"}
    ports = [_free_port(), _free_port()]
    servers = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE), str(port)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        deadline = time.monotonic() + 30
        for url in urls:
            while True:
                try:
                    httpx.get(f"{url}/chat/none", timeout=1)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
        for n in range(6):  # alternate servers, two conversations
            for who in ("carol", "dave"):
                got = httpx.post(
                    f"{urls[n % 2]}/chat/{who}", json={"id": f"m{n}", "text": f"{who} {n}"}, timeout=10
                )
                assert got.status_code == 200, got.text
                assert got.json()["assistant"] == f"turn {n + 1}: you said '{who} {n}'"
        transcript = httpx.get(f"{urls[1]}/chat/carol", timeout=10).json()
        assert [t["user"] for t in transcript] == [f"carol {n}" for n in range(6)]
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.wait(timeout=30)
