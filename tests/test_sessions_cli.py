"""The command line of sessions: --session, sessions [fork|delete], diff, status's summary, clean --sessions."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from resumable import Pipeline
from resumable._cli import main

CODE_V1 = """
from resumable import Pipeline
pipe = Pipeline("agent", state_dir={state!r})
RATE = {rate}

@pipe.step
def fetch(n: int) -> list[int]:
    return list(range(n))

@pipe.step
def price(fetch: list[int]) -> float:
    return sum(fetch) * RATE

@pipe.step
def report(price: float, title: str) -> str:
    return f"{{title}}: {{price}}"
"""


def _pipe(state: Path, rate: float) -> Pipeline:
    namespace: dict[str, object] = {}
    exec(CODE_V1.format(state=str(state), rate=rate), namespace)  # noqa: S102 - a test program
    pipe = namespace["pipe"]
    assert isinstance(pipe, Pipeline)
    return pipe


def _cli(capsys: pytest.CaptureFixture[str], state: Path, *args: str) -> tuple[int, str, str]:
    code = main(["--state-dir", str(state), *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_sessions_list_fork_delete_and_status_summary(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pipe = _pipe(state_dir, 1.0)
    for sid in ("a", "b"):
        with pipe.session(sid):
            pipe.run(n=3, title="t")
    before = sorted(os.listdir(state_dir))
    code, out, _ = _cli(capsys, state_dir, "status")
    assert code == 0
    assert "sessions: 2 (2 completed)" in out
    assert "resumable sessions" in out
    assert sorted(os.listdir(state_dir)) == before  # read-only: nothing created
    code, out, _ = _cli(capsys, state_dir, "sessions", "--json")
    assert [s["id"] for s in json.loads(out)] == ["b", "a"]
    code, out, _ = _cli(capsys, state_dir, "sessions", "--prefix", "a")
    assert "a " in out
    assert "b " not in out
    code, out, _ = _cli(capsys, state_dir, "--session", "a", "status")
    assert "report" in out
    code, out, _ = _cli(capsys, state_dir, "status", "--session", "a", "--json")
    assert json.loads(out)["completed_steps"] == ["fetch", "price", "report"]
    code, out, _ = _cli(capsys, state_dir, "sessions", "fork", "a", "c", "--at", "price")
    assert code == 0, out
    code, out, _ = _cli(capsys, state_dir, "--session", "c", "status", "--json")
    assert json.loads(out)["completed_steps"] == ["fetch"]
    code, out, _ = _cli(capsys, state_dir, "sessions", "delete", "b", "c")
    assert code == 0
    code, out, _ = _cli(capsys, state_dir, "sessions", "--json")
    assert [s["id"] for s in json.loads(out)] == ["a"]
    code, _, err = _cli(capsys, state_dir, "--session", "zzz", "status")
    assert code == 3
    assert not (state_dir / ".sessions" / "zzz").exists()
    code, _, err = _cli(capsys, state_dir, "sessions", "delete", "zzz")
    assert code == 2
    assert "no session" in err


def test_session_from_the_environment_and_reset(
    state_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pipe = _pipe(state_dir, 1.0)
    with pipe.session("job"):
        pipe.run(n=3, title="t")
    monkeypatch.setenv("RESUMABLE_SESSION", "job")
    code, out, _ = _cli(capsys, state_dir, "reset", "report")
    assert code == 0
    assert "report" in out
    monkeypatch.delenv("RESUMABLE_SESSION")
    assert pipe.session("job").status().completed_steps == ["fetch", "price"]
    assert pipe.sessions()[0].completed == 2  # the index follows the command's change


def test_diff_names_the_parameter_and_the_code_that_changed(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    v1 = _pipe(state_dir, 1.0)
    with v1.session("a"):
        v1.run(n=3, title="t")
    v1.fork("a", "b")
    v1.fork("a", "c")
    with v1.session("b"):
        v1.run(n=3, title="other")
    v2 = _pipe(state_dir, 2.0)
    with v2.session("c"):
        v2.run(n=3, title="t")
    code, out, _ = _cli(capsys, state_dir, "diff", "a", "b")
    assert code == 0
    assert "report: inputs changed (title)" in out
    assert "first divergence (completion order): report" in out
    code, out, _ = _cli(capsys, state_dir, "diff", "a", "c")
    assert "price: code changed (value RATE)" in out
    assert "1.0 -> 2.0" in out
    assert "first divergence (completion order): price" in out
    code, out, _ = _cli(capsys, state_dir, "diff", "a", "a@fetch", "--json")
    data = json.loads(out)
    verdicts = {s["slot"]: s["verdict"] for s in data["slots"]}
    assert verdicts == {"fetch": "only in a", "price": "only in a", "report": "only in a"}
    assert data["first_divergence"] == "fetch"
    code, out, _ = _cli(capsys, state_dir, "diff", "a", "a@price")
    assert "price: only in a" in out
    assert "fetch" not in out.split("\n", 1)[1].split("slot(s) the same")[0]


def test_clean_idle_sessions(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pipe = _pipe(state_dir, 1.0)
    for sid in ("old", "older"):
        with pipe.session(sid):
            pipe.run(n=1, title="t")
    code, out, _ = _cli(capsys, state_dir, "clean", "--sessions", "--idle", "1h")
    assert "no idle sessions" in out
    code, out, _ = _cli(capsys, state_dir, "clean", "--sessions", "--idle", "0s", "--dry-run")
    assert "would delete session 'old'" in out
    assert len(pipe.sessions()) == 2
    code, out, _ = _cli(capsys, state_dir, "clean", "--sessions", "--idle", "0s")
    assert code == 0
    assert pipe.sessions() == []
    assert sorted(os.listdir(state_dir / ".sessions")) == [".index.jsonl"]
    code, _, _err = _cli(capsys, state_dir, "clean", "--sessions")
    assert code == 2


def test_status_of_a_store_with_sessions_only(state_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a default state, status prints the sessions' summary alone (and --json only it)."""
    pipe = Pipeline("solo", state_dir=state_dir)
    one = pipe.step(name="one")(lambda: 1)
    with pipe.session("solo"):
        one()
    code, out, _ = _cli(capsys, state_dir, "status")
    assert (0, "sessions: 1 (1 completed); latest: 'solo'") == (code, out[: out.index(", completed ")])
    code, out, _ = _cli(capsys, state_dir, "status", "--json")
    assert (0, ["sessions"]) == (code, list(json.loads(out)))
