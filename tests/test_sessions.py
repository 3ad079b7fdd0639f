"""Sessions (SPEC §13): named, independent slices of one store."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest

import resumable
from resumable import (
    Pipeline,
    ResumableWarning,
    SessionBusyError,
    SessionInfo,
    StateLockedError,
    StepChangedError,
    UsageError,
    step,
)
from resumable._exit import exit_hooks
from resumable._stores._local import LocalStore
from resumable._stores._memory import MemoryStore

ROOT = Path(__file__).resolve().parent.parent


def _tree(path: Path) -> dict[str, str]:
    """Every file under *path* with a digest of its bytes."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _chat(state_dir: Path) -> tuple[Pipeline, list[tuple[str, int]], object]:
    pipe = Pipeline("chat", state_dir=state_dir)
    calls: list[tuple[str, int]] = []

    @pipe.step(key="{i}")
    def turn(i: int, text: str) -> str:
        calls.append((text, i))
        return text.upper()

    return pipe, calls, turn


def test_exports() -> None:
    assert issubclass(SessionBusyError, StateLockedError)
    assert resumable.SessionInfo is SessionInfo


def test_session_runs_its_steps_apart_and_outputs_reads_them(state_dir: Path) -> None:
    pipe, calls, turn = _chat(state_dir)
    with pipe.session("alice", metadata={"user": 7}) as s:
        assert turn(1, "hi") == "HI"
        assert turn(2, "yo") == "YO"
        assert list(s.outputs("turn").items()) == [("1", "HI"), ("2", "YO")]
    with pipe.session("bob") as s:
        assert turn(1, "hi") == "HI"  # another session: runs again
        assert len(s.outputs("turn")) == 1
    with pipe.session("alice"):
        turn(1, "hi")
        turn(2, "yo")
    assert calls == [("hi", 1), ("yo", 2), ("hi", 1)]
    assert not (state_dir / "manifest.json").exists()  # the default session was not used
    assert (state_dir / ".gitignore").exists()  # the state directory's, made with the session's
    assert not (state_dir / ".sessions" / "alice" / ".gitignore").exists()
    assert (state_dir / ".sessions" / "alice" / "turn" / "1.msgpack").exists()
    infos = {s.id: s for s in pipe.sessions()}
    assert set(infos) == {"alice", "bob"}
    assert infos["alice"].runs == 2
    assert infos["alice"].completed == 2
    assert infos["alice"].status == "completed"
    assert infos["alice"].metadata == {"user": 7}
    assert infos["alice"].bytes > 0
    assert [s.id for s in pipe.sessions()] == ["alice", "bob"]  # newest first
    assert [s.id for s in pipe.sessions(prefix="b")] == ["bob"]
    assert len(pipe.sessions(limit=1)) == 1


def test_module_level_steps_run_in_the_session(state_dir: Path) -> None:
    pipe = Pipeline("p", state_dir=state_dir)
    ran = []

    @step
    def unbound(x: int) -> int:
        ran.append(x)
        return x * 2

    with pipe.session("s1"):
        assert unbound(2) == 4
    with pipe.session("s1"):
        assert unbound(2) == 4
    assert ran == [2]
    assert (state_dir / ".sessions" / "s1" / "unbound.msgpack").exists()


def test_same_session_twice_is_busy_or_waits(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("c"):
        with pytest.raises(SessionBusyError, match="session 'c' is in use") as info:
            with pipe.session("c"):
                pass
        assert isinstance(info.value, StateLockedError)
        with pipe.session("other"):  # another session is free
            turn(1, "x")

    release = threading.Event()

    def hold() -> None:
        with pipe.session("c"):
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    time.sleep(0.2)
    threading.Timer(0.3, release.set).start()
    started = time.monotonic()
    with pipe.session("c", wait=10):
        turn(2, "y")
    assert time.monotonic() - started >= 0.1
    holder.join()
    with pytest.raises(UsageError):
        pipe.session("c", wait=-1)
    with pytest.raises(UsageError):
        pipe.session("")


def test_async_wait_does_not_block_the_event_loop(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)

    async def main() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            for _ in range(20):
                await asyncio.sleep(0.01)
                ticks += 1

        async def holder() -> None:
            async with pipe.session("x"):
                await asyncio.sleep(0.3)

        async def waiter() -> None:
            await asyncio.sleep(0.05)
            async with pipe.session("x", wait=5):
                turn(1, "a")

        await asyncio.gather(holder(), waiter(), ticker())
        return ticks

    assert asyncio.run(main()) == 20


def test_pipeline_session_option_and_environment(state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = Pipeline("p", state_dir=state_dir, session="job-1")

    @pipe.step
    def one() -> int:
        return 1

    with pipe:
        assert one() == 1
    assert (state_dir / ".sessions" / "job-1" / "one.msgpack").exists()
    monkeypatch.setenv("RESUMABLE_SESSION", "Job 2")
    env_pipe = Pipeline("p", state_dir=state_dir)
    assert env_pipe.session_id == "Job 2"
    env_pipe.step(name="one")(lambda: 1)
    with env_pipe:
        env_pipe.run()
    assert {s.id for s in pipe.sessions()} == {"job-1", "Job 2"}
    assert (state_dir / ".sessions" / "%4Aob%202").is_dir()  # encoded as keys are


def test_default_session_is_todays_layout(tmp_path: Path) -> None:
    """Sessions leave the default session's files as a run without sessions leaves them."""

    def run(state: Path, with_sessions: bool) -> None:
        pipe = Pipeline("p", state_dir=state)

        @pipe.step
        def a() -> int:
            return 1

        @pipe.step(key="{i}")
        def b(i: int) -> int:
            return i

        with pipe:
            a()
            b(1)
        if with_sessions:
            with pipe.session("s"):
                a()
                b(2)
            pipe.reset()  # the default session's reset
            with pipe:
                a()
                b(1)
        else:
            pipe.reset()
            with pipe:
                a()
                b(1)

    run(tmp_path / "plain", with_sessions=False)
    run(tmp_path / "mixed", with_sessions=True)

    def names(tree: dict[str, str]) -> list[str]:  # kept versions are named by content (with times)
        return sorted(
            k.rpartition("/")[0] if "/objects/" in k else k for k in tree if not k.startswith(".sessions/")
        )

    assert names(_tree(tmp_path / "plain")) == names(_tree(tmp_path / "mixed"))
    assert (tmp_path / "mixed" / ".sessions" / "s" / "b" / "2.msgpack").exists()


def test_state_changes_in_one_session_leave_the_others_byte_identical(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)
    for sid in ("a", "b"):
        with pipe.session(sid) as s:
            turn(1, "one")
            s.snapshot("first")
            turn(2, "two")
    with pipe:
        turn(1, "root")
    other = _tree(state_dir / ".sessions" / "b")
    root = {k: v for k, v in _tree(state_dir).items() if not k.startswith(".sessions/")}
    a = pipe.session("a")
    a.rollback("first")
    a.reset("turn")
    with a:
        turn(3, "three")
    import datetime as dt

    from resumable._clean import clean

    clean(a, older_than=dt.timedelta(0))
    a.why("turn")
    a.checkpoints()
    assert _tree(state_dir / ".sessions" / "b") == other
    assert {k: v for k, v in _tree(state_dir).items() if not k.startswith(".sessions/")} == root
    pipe.reset()  # the default session's reset leaves the named ones alone
    assert _tree(state_dir / ".sessions" / "b") == other


def test_threads_and_tasks_each_have_their_own_session(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with pipe.session(f"t{n}"):
                for i in range(5):
                    assert turn(i, f"{n}-{i}") == f"{n}-{i}".upper()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors

    async def one(n: int) -> dict[str, str]:
        async with pipe.session(f"task{n}") as s:
            for i in range(3):
                turn(i, f"{n}:{i}")
                await asyncio.sleep(0)
            return dict(s.outputs("turn"))

    async def main() -> list[dict[str, str]]:
        return await asyncio.gather(*(one(n) for n in range(100)))

    results = asyncio.run(main())
    assert results == [{str(i): f"{n}:{i}".upper() for i in range(3)} for n in range(100)]
    assert len(pipe.sessions()) == 108
    for n in range(8):  # each session holds exactly its own slots
        assert sorted(os.listdir(state_dir / ".sessions" / f"t{n}" / "turn")) == [
            f"{i}.msgpack" for i in range(5)
        ]


def test_fork_shares_files_and_reruns_exactly_what_changed(state_dir: Path) -> None:
    pipe = Pipeline("p", state_dir=state_dir)
    ran: list[str] = []

    @pipe.step
    def load(n: int) -> list[int]:
        ran.append("load")
        return list(range(n))

    @pipe.step
    def double(load: list[int]) -> list[int]:
        ran.append("double")
        return [x * 2 for x in load]

    @pipe.step
    def label(tag: str) -> str:
        ran.append("label")
        return tag

    with pipe.session("src"):
        pipe.run(n=3, tag="x")
    ran.clear()
    info = pipe.fork("src", "dst")
    assert info.id == "dst"
    assert info.parent == "src"
    src, dst = state_dir / ".sessions" / "src", state_dir / ".sessions" / "dst"
    assert os.stat(src / "double.msgpack").st_ino == os.stat(dst / "double.msgpack").st_ino  # a hard link
    with pipe.session("dst"):
        run = pipe.run(n=3, tag="x")
    assert ran == []
    assert run.executed == []
    with pipe.session("dst"):
        pipe.run(n=3, tag="y")
    assert ran == ["label"]  # only the step whose input changed
    ran.clear()
    with pipe.session("src") as s:  # the source is untouched
        assert pipe.run(n=3, tag="x").executed == []
        assert s.status().completed_steps == ["load", "double", "label"]
    with pytest.raises(UsageError, match="already exists"):
        pipe.fork("src", "dst")
    with pytest.raises(UsageError, match="no session"):
        pipe.fork("nope", "dst2")


def test_a_sessions_id_creation_parent_and_metadata_live_in_its_manifest_and_log(state_dir: Path) -> None:
    """No file of their own: a session event in the log, folded into the manifest's ``session``."""
    pipe, calls, turn = _chat(state_dir)
    folder = state_dir / ".sessions" / "a"
    with pipe.session("a", metadata={"user": 7, "when": dt.date(2026, 1, 2)}):
        turn(1, "one")
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == [
        "1.msgpack", "events.jsonl", "lock", "manifest.json", "turn.records"
    ]  # fmt: skip
    created = json.loads((folder / "manifest.json").read_bytes())["session"]
    assert created == {
        "id": "a", "created_at": created["created_at"], "parent": None,
        "metadata": {"user": 7, "when": "2026-01-02"},  # JSON values: a date as its str
    }  # fmt: skip
    log = (folder / "events.jsonl").read_bytes()
    with pipe.session("a"):  # metadata not given: kept, and nothing is written for it
        turn(1, "one")
    assert (folder / "events.jsonl").read_bytes().count(b'"event":"session"') == 1
    assert log.count(b'"event":"session"') == 1
    with pipe.session("a", metadata={"user": 8}):  # given: replaces it, in the log at once
        turn(1, "one")
    (folder / "manifest.json").unlink()  # lost: rebuilt from the log, identity included
    with pytest.warns(ResumableWarning, match="rebuilt"), pipe.session("a") as s:
        assert s.status().session == {**created, "metadata": {"user": 8}}
    (info,) = pipe.sessions()
    assert (info.created_at, info.parent, info.metadata) == (created["created_at"], None, {"user": 8})
    assert calls == [("one", 1)]

    pipe.fork("a", "b")  # the fork: a new creation time, its parent, the source's metadata
    forked = {s.id: s for s in pipe.sessions()}["b"]
    assert (forked.parent, forked.metadata) == ("a", {"user": 8})
    assert forked.created_at > created["created_at"]
    with pipe.session("b") as s:
        assert s.status().session == {
            "id": "b", "created_at": forked.created_at, "parent": "a", "metadata": {"user": 8}
        }  # fmt: skip

    state = pipe.session("a").save_state()
    pipe.session("b").load_state(state)  # another session's state: b stays b
    with pipe.session("b") as s:
        assert s.status().session == {
            "id": "b", "created_at": forked.created_at, "parent": "a", "metadata": {"user": 8}
        }  # fmt: skip
        assert list(s.outputs("turn")) == ["1"]
    assert {s.id: s.parent for s in pipe.sessions()} == {"a": None, "b": "a"}
    with pipe:
        turn(1, "one")
    assert "session" not in json.loads((state_dir / "manifest.json").read_bytes())  # the default's


def test_a_session_directory_copied_under_another_id_is_that_session(state_dir: Path) -> None:
    pipe, calls, turn = _chat(state_dir)
    with pipe.session("orig", metadata={"k": 1}):
        turn(1, "one")
    shutil.copytree(state_dir / ".sessions" / "orig", state_dir / ".sessions" / "copy")
    with pipe.session("copy") as s:
        turn(1, "one")  # its outputs came with it
        meta = s.status().session
    assert calls == [("one", 1)]
    assert meta is not None
    assert (meta["id"], meta["parent"], meta["metadata"]) == ("copy", None, {})
    assert {s.id for s in pipe.sessions()} == {"orig", "copy"}


def test_a_requests_skips_go_in_the_write_of_its_next_event(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Open a session, skip 10 slots, store one, close: four appends to its log, the skips in order."""
    pipe, calls, turn = _chat(state_dir)
    with pipe.session("c"):
        for i in range(10):
            turn(i, "x")
    appends: list[bytes] = []
    real = LocalStore.append

    def append(self: LocalStore, key: str, data: bytes, *, durable: bool) -> None:
        if key == "events.jsonl":
            appends.append(data)
        real(self, key, data, durable=durable)

    monkeypatch.setattr(LocalStore, "append", append)
    with pipe.session("c"):
        for i in range(10):
            turn(i, "x")
        turn(10, "x")
    events = [[json.loads(line)["event"] for line in chunk.splitlines()] for chunk in appends]
    assert events == [
        ["run_started"], ["step_skipped"] * 10 + ["step_started"], ["step_completed"], ["run_finished"]
    ]  # fmt: skip
    assert len(calls) == 11


def test_fork_at_a_checkpoint(state_dir: Path) -> None:
    pipe, calls, turn = _chat(state_dir)
    with pipe.session("a") as s:
        turn(1, "one")
        s.snapshot("after-one")
        turn(2, "two")
    pipe.fork("a", "b", at="after-one")
    pipe.fork("a", "c")
    with pipe.session("b") as b:
        assert list(b.outputs("turn")) == ["1"]
        calls.clear()
        turn(1, "one")
        assert calls == []
        # its history says where it came from: a snapshot to roll back to
        assert [(c.id, c.label) for c in b.checkpoints()][-1] == (4, "forked from a@2")
    with pipe.session("c") as c:
        assert c.checkpoints()[-1].label == "forked from a@3"
        turn(3, "three")
        c.rollback("forked from a@3")
        assert list(c.outputs("turn")) == ["1", "2"]
    with pipe.session("a") as a:
        assert list(a.outputs("turn")) == ["1", "2"]


def test_fork_of_a_changed_non_idempotent_step_raises(state_dir: Path) -> None:
    pipe = Pipeline("p", state_dir=state_dir)

    @pipe.step(idempotent=False)
    def charge(amount: int) -> int:
        return amount

    with pipe.session("a"):
        charge(5)
    pipe.fork("a", "b")
    with pipe.session("b"), pytest.raises(StepChangedError):
        charge(6)


def test_delete_then_reuse_starts_empty(state_dir: Path) -> None:
    pipe, calls, turn = _chat(state_dir)
    with pipe.session("gone"):
        turn(1, "one")
    pipe.delete_session("gone")
    assert not (state_dir / ".sessions" / "gone").exists()
    assert pipe.sessions() == []
    with pipe.session("gone") as s:
        assert len(s.outputs("turn")) == 0
        turn(1, "one")
    assert calls == [("one", 1), ("one", 1)]
    with pytest.raises(UsageError, match="no session"):
        pipe.delete_session("never")
    with pipe.session("gone"), pytest.raises(SessionBusyError):
        pipe.delete_session("gone")


def test_memory_store_sessions_and_freeing() -> None:
    pipe = Pipeline("m", store="memory://sessions-test")
    ran = []

    @pipe.step(key="{i}")
    def t(i: int) -> int:
        ran.append(i)
        return i

    with pipe.session("a"):
        t(1)
    with pipe.session("b"):
        t(1)
    with pipe.session("a"):
        t(1)
        with pytest.raises(SessionBusyError):
            with pipe.session("a"):
                pass
    assert ran == [1, 1]
    assert {s.id for s in pipe.sessions()} == {"a", "b"}
    pipe.delete_session("a")
    assert not [k for k in MemoryStore.named("sessions-test")._objects if k.startswith(".sessions/a/")]


@step(key="{i}")
def _remembered(i: int) -> int:
    return i


def test_named_memory_store_is_freed_with_its_last_pipeline() -> None:
    pipe = Pipeline(store="memory://freed-test")
    with pipe.session("a"):
        _remembered(1)
    other = Pipeline(store="memory://freed-test")  # the same store while a pipeline holds it
    assert other.sessions()[0].id == "a"
    ref = weakref.ref(pipe.store)
    exit_hooks.forget(pipe)
    exit_hooks.forget(other)
    del pipe, other
    gc.collect()
    assert ref() is None
    assert Pipeline(store="memory://freed-test").sessions() == []


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


WORKER = """
import sys
from resumable import Pipeline
pipe = Pipeline("w", state_dir=sys.argv[1])

@pipe.step(key="{i}")
def square(i: int, who: str) -> int:
    return i * i

for sid in sys.argv[2:]:
    with pipe.session(sid, wait=60) as s:
        for i in range(20):
            square(i, sid)
        print(sid, sum(s.outputs("square").values()), flush=True)
"""


def test_processes_on_sessions_of_one_directory(tmp_path: Path) -> None:
    """Two processes on two sessions both complete; 8 processes on overlapping sessions give a serial run's results."""
    program = _write(tmp_path / "worker.py", WORKER)
    state = tmp_path / "state"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(program), str(state), *[f"s{(n + k) % 8}" for k in range(3)]],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for n in range(8)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    expected = sum(i * i for i in range(20))
    lines = [line.split() for out in outs for line in out.splitlines()]
    assert len(lines) == 24
    assert all(int(total) == expected for _sid, total in lines)
    pipe = Pipeline("w", state_dir=state)
    infos = pipe.sessions()
    assert sorted(s.id for s in infos) == [f"s{n}" for n in range(8)]
    assert all(s.completed == 20 and s.runs == 3 for s in infos)


def test_an_open_session_is_listed_as_running(state_dir: Path) -> None:
    """docs/sessions.md: on a local store the index says running as a run opens, and how it ended at its close."""
    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("open"):
        turn(0, "hi")
        assert [(s.id, s.status) for s in pipe.sessions()] == [("open", "running")]
    assert [(s.id, s.status) for s in pipe.sessions()] == [("open", "completed")]


def test_index_lines_with_fields_of_the_wrong_type_still_list(state_dir: Path) -> None:
    """The index is a cache: a summary with odd field types lists with those fields left out."""
    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("good"):
        turn(0, "hi")
    index = state_dir / ".sessions" / ".index.jsonl"
    bad = {"id": "odd", "updated_at": 5, "status": ["x"], "runs": "3", "metadata": [1], "bytes": 1.5}
    with index.open("a") as f:
        f.write(json.dumps(bad) + "\n")
    listed = {s.id: s for s in pipe.sessions()}
    assert listed["good"].status == "completed"
    odd = listed["odd"]
    assert (odd.status, odd.updated_at, odd.runs, odd.bytes, odd.metadata) == ("new", "", 0, 0, {})
    assert [s.id for s in pipe.sessions()] == ["good", "odd"]  # newest first; no date sorts last
    # and `resumable status` summarises the sessions as `resumable sessions` lists them
    from resumable._sessions_cli import summary

    info = summary(LocalStore(state_dir))
    assert info is not None
    assert ({"completed": 1, "new": 1}, "good") == (info["by_status"], info["latest"]["id"])


def test_a_damaged_index_is_no_index(state_dir: Path) -> None:
    """A deeply nested line or a FIFO in place of the index: nothing listed, nothing hangs."""
    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("a"):
        turn(0, "hi")
    index = state_dir / ".sessions" / ".index.jsonl"
    with index.open("a") as f:
        f.write("[" * 100_000 + "\n")
    assert [s.id for s in pipe.sessions()] == ["a"]
    index.unlink()
    os.mkfifo(index)
    code = f"""
import resumable
pipe = resumable.Pipeline("p", state_dir={str(state_dir)!r})
assert pipe.sessions() == []
with pipe.session("b"):
    pass
pipe.delete_session("a")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_failed_session_is_listed_with_its_error(state_dir: Path) -> None:
    pipe = Pipeline("p", state_dir=state_dir)

    @pipe.step
    def boom() -> int:
        raise ValueError("no luck")

    with pytest.raises(ValueError, match="no luck"), pipe.session("bad"):
        boom()
    info = pipe.sessions(status="failed")[0]
    assert info.id == "bad"
    assert info.error is not None
    assert "no luck" in info.error
    assert pipe.sessions(status="completed") == []


def test_reading_a_session_that_does_not_exist_creates_nothing(state_dir: Path) -> None:
    pipe = Pipeline("p", state_dir=state_dir)
    assert dict(pipe.session("nobody").outputs("turn")) == {}
    assert pipe.session("nobody").status().completed_steps == []
    assert pipe.sessions() == []
    assert not state_dir.exists()


def test_long_ids_and_odd_characters(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)
    ids = ["x" * 200, "Ünïcode/../..", ".hidden", "a b"]
    for sid in ids:
        with pipe.session(sid) as s:
            turn(1, sid[:5])
            assert s.id == sid
    assert sorted(s.id for s in pipe.sessions()) == sorted(ids)
    names = set(os.listdir(state_dir / ".sessions"))
    assert {".index.jsonl", "%2Ehidden"} <= names  # no id leaves .sessions/ or looks internal
    assert all(not name.startswith(".") or name.startswith(".index") for name in names)
    with pytest.raises(UsageError):
        pipe.session("y" * 201)
    pipe.delete_session("x" * 200)
    assert len(pipe.sessions()) == 3


def test_is_cached_and_forget_act_in_the_entered_session(state_dir: Path) -> None:
    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("a"):
        turn(1, "x")
        assert turn.is_cached(1, "x")
    with pipe.session("b"):
        assert not turn.is_cached(1, "x")
    with pipe.session("a"):
        turn.forget(1, "x")
        assert not turn.is_cached(1, "x")
    assert not turn.is_cached(1, "x")  # the default session never had it


def test_a_sessions_manifest_lags_its_log_by_at_most_lag_and_readers_see_every_run(state_dir: Path) -> None:
    import json

    from resumable._session import LAG

    pipe, calls, turn = _chat(state_dir)
    folder = state_dir / ".sessions" / "c"
    lagged = []
    for request in range(40):
        with pipe.session("c") as s:
            for i in range(request + 1):
                turn(i, f"m{i}")
        manifest = json.loads((folder / "manifest.json").read_bytes())
        log_size = (folder / "events.jsonl").stat().st_size
        assert log_size - manifest["events_offset"] < LAG  # rewritten at a close once it lags that much
        lagged.append(log_size > manifest["events_offset"])
        status = s.status()
        assert (status.runs, status.status, len(status.completed_steps)) == (
            request + 1,
            "completed",
            request + 1,
        )
    assert len(calls) == 40
    assert any(lagged)  # closes that did not rewrite it (a slow run may also rewrite it midway)
    assert pipe.sessions()[0].runs == 40


def _copy_without_leases(url: str) -> str:
    """What an object store holds for the next process after a kill: the bucket without its leases."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    src, dst = url.removeprefix("memory://"), f"sessions-kill/{os.urandom(6).hex()}"
    for path in fs.find("/" + src):
        if "lease" not in path:
            fs.pipe("/" + dst + path[len("/" + src) :], fs.cat(path))
    return f"memory://{dst}"


def _on_an_object_store() -> tuple[str, Pipeline, Any]:
    """A pipeline with one step on a new fsspec ``memory://`` store (appends wait there, as on S3)."""
    from resumable._stores._fsspec import FsspecStore

    url = f"memory://sessions-kill/{os.urandom(6).hex()}"
    pipe = Pipeline("p", store=FsspecStore(url))

    @pipe.step
    def f(x: int) -> int:
        return x * 2

    return url, pipe, f


def test_a_new_sessions_identity_is_stored_at_once_on_an_object_store() -> None:
    """Killed during its first request, a new session keeps its metadata and creation time."""
    from resumable._stores._fsspec import FsspecStore

    url, pipe, f = _on_an_object_store()
    with pipe.session("conv", metadata={"user": "alice"}):
        f(1)
        # a kill here: the events wait for the close on an object store, but not this one
        after = Pipeline("p", store=FsspecStore(_copy_without_leases(url)))
        with after.session("conv") as s:
            assert {"user": "alice"} == s.status().session["metadata"]
        created = pipe.session("conv").status().session["created_at"]
        assert created == after.session("conv").status().session["created_at"]


def test_a_fork_killed_after_it_completed_keeps_its_parent_and_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork is complete only with its events in the log: a kill before its close loses neither."""
    from resumable import _session
    from resumable._stores._fsspec import FsspecStore

    url, pipe, f = _on_an_object_store()
    with pipe.session("a", metadata={"user": "alice"}):
        f(1)

    class Killed(BaseException):
        pass

    def killed(self: object, *args: object, **kwargs: object) -> None:
        raise Killed  # a kill right after the fork removed its incomplete marker

    monkeypatch.setattr(_session.RunState, "close", killed)
    with pytest.raises(Killed):
        pipe.fork("a", "b")
    monkeypatch.undo()
    after = Pipeline("p", store=FsspecStore(_copy_without_leases(url)))
    with after.session("b") as b:
        assert ("a", {"user": "alice"}) == (b.status().session["parent"], b.status().session["metadata"])
        assert ["f"] == b.status().completed_steps


def test_load_state_drops_the_replaced_states_unwritten_skips(state_dir: Path) -> None:
    """A skip waiting for the next write belongs to the state load_state replaces: it is not logged into the new one."""
    other = Pipeline("p", state_dir=state_dir / "other")

    @other.step
    def g(x: int) -> int:
        return x + 1

    with other:
        g(1)
    state = other.save_state()
    pipe = Pipeline("p", state_dir=state_dir / "mine")

    @pipe.step
    def f(x: int) -> int:
        return x * 2

    with pipe:
        f(2)
    with pipe.session("s"):
        f(2)
    with pipe.session("s") as s:
        f(2)  # a skip: its event waits for the next write
        s.load_state(state)
        assert ["g"] == s.status().completed_steps
    logged = (state_dir / "mine" / ".sessions" / "s" / "events.jsonl").read_text()
    assert "step_skipped" not in logged
    with pipe.session("s") as s:
        assert ["g"] == s.status().completed_steps


def test_the_cli_reads_nothing_of_a_session_a_killed_fork_or_delete_left(state_dir: Path, capsys) -> None:
    """A session holding the incomplete marker is empty to the command line, as to the next run."""
    from resumable._cli import main

    pipe, _calls, turn = _chat(state_dir)
    with pipe.session("x"):
        turn(0, "hi")
    assert 0 == main(["--state-dir", str(state_dir), "--session", "x", "status"])
    (state_dir / ".sessions" / "x" / ".resumable" / "incomplete").write_bytes(b"delete\n")
    capsys.readouterr()
    assert 3 == main(["--state-dir", str(state_dir), "--session", "x", "status"])
