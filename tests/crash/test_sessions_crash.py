"""
Kills in the middle of a session's fork, delete, and the index's append and compaction.

Each trial forks a child process that does one operation and SIGKILLs itself at the N-th
line resumable executes (N chosen at random over the operation's length, so trials hit
every stage of it, between any two file operations); the parent, which saw none of it,
then checks what a later run finds:

- a fork is all there or not at all: the session runs with nothing to recompute, or it
  starts empty; the source's files are byte-identical;
- a delete leaves the whole session (it had not begun) or nothing of it: a session reusing
  the id starts empty;
- the index always reads, and lists only whole sessions;
- ``verify`` finds nothing wrong in any session afterwards.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from resumable import Pipeline
from resumable._sessions import session_store
from resumable._sessions_index import LogIndex
from resumable._stores._local import LocalStore
from resumable._verify import find_damage

pytestmark = pytest.mark.slow

PACKAGE = str(Path(__import__("resumable").__file__).parent)
SLOTS = 6


def _tree(path: Path) -> dict[str, str]:
    """The files of a state and their digests; not its lock, nor a killed writer's temporary file."""
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != "lock" and not (p.name.startswith(".") and p.name.endswith(".tmp"))
    }


def _kill_at_line(n: int) -> None:
    """SIGKILL this process at the *n*-th line executed in resumable's own code."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
            if count >= n:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename.startswith(PACKAGE) else None

    sys.settrace(tracer)


def _lines_of(action: Callable[[], None]) -> int:
    """How many lines of resumable *action* executes (to spread the kills over)."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    sys.settrace(lambda f, e, a: local if f.f_code.co_filename.startswith(PACKAGE) else None)
    try:
        action()
    finally:
        sys.settrace(None)
    return count


def _in_child(action: Callable[[], None], kill_at: int) -> bool:
    """Run *action* in a forked child killed at line *kill_at*; True if it was killed before finishing."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            _kill_at_line(kill_at)
            action()
            sys.settrace(None)
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the operation failed in the child"
    return False


def _pipe(state: Path) -> tuple[Pipeline, list[int], Any]:
    pipe = Pipeline("crash", state_dir=state, durable=False)
    calls: list[int] = []

    @pipe.step(key="{i}")
    def turn(i: int) -> dict[str, int]:
        calls.append(i)
        return {"i": i, "square": i * i}

    return pipe, calls, turn


def _fill(pipe: Pipeline, turn: Any, sid: str) -> None:
    with pipe.session(sid) as s:
        for i in range(SLOTS // 2):
            turn(i)
        s.snapshot("half")
        for i in range(SLOTS // 2, SLOTS):
            turn(i)


def _check_clean(pipe: Pipeline, sid: str) -> None:
    _checked, problems = find_damage(session_store(pipe._root_store, sid), secret=None)
    assert problems == [], (sid, problems)


def _trials(default: int) -> int:
    return int(os.environ.get("SESSION_CRASH_TRIALS", default))


@pytest.mark.parametrize("at", [None, "half"])
def test_killed_fork_is_all_or_nothing(tmp_path: Path, at: str | None) -> None:
    pipe, calls, turn = _pipe(tmp_path / "state")
    _fill(pipe, turn, "src")
    src = _tree(tmp_path / "state" / ".sessions" / "src")
    length = _lines_of(lambda: pipe.fork("src", "probe", at=at))
    rng = random.Random(1)  # noqa: S311 - where to kill, not secrets
    killed = 0
    expected = SLOTS if at is None else SLOTS // 2
    for n in range(_trials(60)):
        dst = f"dst{n}"
        if not _in_child(lambda dst=dst: pipe.fork("src", dst, at=at), rng.randint(1, length)):
            continue
        killed += 1
        calls.clear()
        with pipe.session(dst) as s:
            got = dict(s.outputs("turn"))
            assert len(got) in {0, expected}, f"half-forked: {sorted(got)}"
            for i in range(SLOTS):
                turn(i)
        assert len(calls) == SLOTS - len(got)  # what was forked runs no step again
        _check_clean(pipe, dst)
        listed = {s.id: s for s in pipe.sessions()}
        assert listed[dst].parent == ("src" if got else None)  # a fork's identity comes with it, or none
    assert killed > _trials(60) // 2
    assert _tree(tmp_path / "state" / ".sessions" / "src") == src


def test_killed_delete_leaves_all_or_nothing_and_a_reused_id_starts_empty(tmp_path: Path) -> None:
    pipe, calls, turn = _pipe(tmp_path / "state")
    _fill(pipe, turn, "probe")
    length = _lines_of(lambda: pipe.delete_session("probe"))
    rng = random.Random(2)  # noqa: S311 - where to kill, not secrets
    for n in range(_trials(60)):
        sid = f"gone{n}"
        _fill(pipe, turn, sid)
        whole = _tree(tmp_path / "state" / ".sessions" / sid)
        created = {s.id: s for s in pipe.sessions()}[sid].created_at
        if not _in_child(lambda sid=sid: pipe.delete_session(sid), rng.randint(1, length)):
            assert not (tmp_path / "state" / ".sessions" / sid).exists()
            continue
        left = tmp_path / "state" / ".sessions" / sid
        began = left.exists() and _tree(left) != whole
        calls.clear()
        with pipe.session(sid) as s:
            got = dict(s.outputs("turn"))
            if began:
                assert got == {}, f"a deleted session's outputs were seen: {sorted(got)}"
                assert s.status().session["created_at"] != created  # a new session of that id
            else:
                assert len(got) in {0, SLOTS}
            turn(0)
        _check_clean(pipe, sid)
        pipe.delete_session(sid)  # and a delete after the kill finishes
        assert sid not in {s.id for s in pipe.sessions()}
        with pipe.session(sid) as s:
            assert dict(s.outputs("turn")) == {}


def test_killed_index_append_and_compaction_leave_a_readable_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import resumable._sessions_index as index_module

    monkeypatch.setattr(index_module, "_MIN_COMPACT", 2048)  # compact often
    root = tmp_path / "state"
    root.mkdir()
    index = LogIndex(LocalStore(root))

    def churn(base: int) -> None:
        for i in range(40):
            index.put({"id": f"s{i % 7}", "status": "completed", "runs": base + i, "pad": "x" * 50})

    length = _lines_of(lambda: churn(0))
    rng = random.Random(3)  # noqa: S311 - where to kill, not secrets
    for n in range(_trials(80)):
        _in_child(lambda n=n: churn(n), rng.randint(1, length))
        found = index.read()
        assert set(found) <= {f"s{i}" for i in range(7)}
        assert all(isinstance(s.get("runs"), int) for s in found.values())
        index.put({"id": "after", "status": "new"})
        assert "after" in index.read()
        index.drop("after")
    assert "after" not in index.read()
