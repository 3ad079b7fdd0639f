"""Sessions on an object store (the local S3 server): a lease per session, the index as objects."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resumable import Pipeline, SessionBusyError

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 90

SERVE = """
import os, sys, time
from resumable import Pipeline
pipe = Pipeline("chat", store=sys.argv[1])

@pipe.step(key="{i}")
def turn(i: int, who: str) -> str:
    time.sleep(0.05)
    return f"{who}:{i}"

with pipe.session(sys.argv[2], wait=30) as s:
    print("OPEN", flush=True)
    for i in range(5):
        turn(i, sys.argv[2])
    print("RESULT", ",".join(s.outputs("turn").values()), flush=True)
"""


def _env(s3) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RESUMABLE_"))}
    return {**env, **s3.env(), "PYTHONPATH": str(ROOT), "RESUMABLE_LEASE_TTL": "5"}


def test_two_processes_serve_two_sessions_of_one_bucket_at_once(s3, tmp_path: Path) -> None:
    url = s3.url("chat")
    program = tmp_path / "serve.py"
    program.write_text(SERVE)
    procs = []
    for who in ("alice", "bob"):
        cwd = tmp_path / f"machine-{who}"  # nothing local is shared
        cwd.mkdir()
        procs.append(
            subprocess.Popen(
                [sys.executable, str(program), url, who],
                cwd=cwd,
                env=_env(s3),
                stdout=subprocess.PIPE,
                text=True,
            )
        )
    started = time.monotonic()
    outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    for who, out in zip(("alice", "bob"), outs, strict=True):
        assert f"RESULT {','.join(f'{who}:{i}' for i in range(5))}" in out
    assert time.monotonic() - started < TIMEOUT
    pipe = Pipeline("chat", store=url)
    infos = {s.id: s for s in pipe.sessions()}
    assert set(infos) == {"alice", "bob"}
    assert all(s.completed == 5 and s.status == "completed" for s in infos.values())


def test_session_lease_fork_and_delete_on_s3(s3) -> None:
    url = s3.url()
    pipe = Pipeline("chat", store=url)
    ran: list[int] = []

    @pipe.step(key="{i}")
    def turn(i: int) -> int:
        ran.append(i)
        return i * 10

    with pipe.session("a") as s:
        turn(1)
        turn(2)
        with pytest.raises(SessionBusyError):
            with pipe.session("a"):
                pass
        with pipe.session("b"):  # another session's lease is free
            turn(1)
    pipe.fork("a", "c")
    with pipe.session("c") as c:
        turn(1)
        turn(2)
        assert dict(c.outputs("turn")) == {"1": 10, "2": 20}
    assert ran == [1, 2, 1]
    pipe.delete_session("a")
    assert sorted(s.id for s in pipe.sessions()) == ["b", "c"]
    with pipe.session("a") as s:
        assert dict(s.outputs("turn")) == {}
    with pipe:  # the default session does not see the named ones
        turn(5)
    assert pipe.store.list()
    assert not [k for k in pipe.store.list() if k.startswith(".sessions")]


def test_listing_sessions_reads_the_index_in_a_few_requests(s3, monkeypatch) -> None:
    import s3fs

    url = s3.url("listing")
    pipe = Pipeline("chat", store=url)

    @pipe.step(key="{i}")
    def turn(i: int) -> int:
        return i

    for n in range(25):
        with pipe.session(f"user-{n:02d}", metadata={"plan": "free"}):
            turn(n)
    pipe.delete_session("user-03")
    calls: list[str] = []
    real = s3fs.S3FileSystem._call_s3

    async def counting(self, method, *args, **kwargs):
        calls.append(method)
        return await real(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counting)
    infos = pipe.sessions()
    assert len(calls) <= 2, calls  # a listing: a request per 1,000 sessions
    assert len(infos) == 24
    assert "user-03" not in {s.id for s in infos}
    assert infos[0].id == "user-24"
    assert infos[0].metadata == {"plan": "free"}
    assert all(s.status == "completed" and s.runs == 1 and s.completed == 1 for s in infos)
    with pipe.session("user-05", metadata={"plan": "x" * 300}):  # too long for a name: read
        turn(99)
    calls.clear()
    infos = {s.id: s for s in pipe.sessions()}
    assert infos["user-05"].metadata == {"plan": "x" * 300}
    assert infos["user-05"].runs == 2
    assert calls.count("get_object") == 1, calls
