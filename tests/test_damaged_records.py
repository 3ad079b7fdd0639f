"""Malformed records in a state directory: skipped or rebuilt, reported by verify, never fatal."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable import Pipeline, ResumableWarning
from resumable._journal import read_state
from resumable._manifest import EVENT_SCHEMA, _fits, valid_event
from resumable._stores._local import LocalStore
from resumable._verify import find_damage

BAD_EVENTS = [
    {"event": "step_completed"},  # no slot
    {"event": "step_completed", "slot": 3},
    {"event": "step_completed", "slot": "../outside"},
    {"event": "step_started", "slot": "a", "attempt": "1"},
    {"event": "step_failed", "slot": "a", "error": "boom"},
    {"event": "run_finished", "status": "exploded"},
    {"event": "batch", "batch": "b", "progress": {"done": "1", "every": 2}},
    {"event": "rollback", "to": 1},  # no changes
    {"event": "rollback", "state": {"steps": {}, "completed_steps": []}},
    {"event": "steps_reset", "slots": ["a", "b\nc"]},
    {"event": "no_such_event", "slot": "a"},
    {"slot": "a"},
    [1, 2, 3],
    "step_completed",
]


def _two_steps(pipe: Pipeline) -> list[str]:
    calls: list[str] = []

    @pipe.step
    def a() -> int:
        calls.append("a")
        return 1

    @pipe.step
    def b(a: int) -> int:
        calls.append("b")
        return a + 1

    return calls


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", str(state), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _append_lines(state: Path, lines: list[Any]) -> None:
    with (state / "events.jsonl").open("a") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def _resumable_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, ResumableWarning)]


@pytest.mark.parametrize("event", BAD_EVENTS, ids=lambda e: json.dumps(e)[:40])
def test_bad_events_are_not_valid(event: object):
    """Each malformed record is rejected by the event table (a KeyError before the fix)."""
    assert False is valid_event(event)


def test_good_events_are_valid():
    """The events a run writes pass the table, with and without optional fields."""
    good = [
        {"t": "2026-01-01T00:00:00.000Z", "event": "run_started", "run": 2, "pipeline": "p"},
        {"event": "step_started", "slot": "page/%41", "reason": "new", "detail": None, "attempt": 1},
        {"event": "step_completed", "slot": "a", "fingerprint": "f", "bytes": 9, "duration_s": 0.5},
        {"event": "step_completed", "slot": "a", "recovered": True, "file": "h", "code": {"a": "x"}},
        {"event": "step_failed", "slot": "a", "error": {"type": "E", "message": "m", "traceback": "t"}},
        {"event": "steps_reset", "slots": ["a", "b/1"]},
        {"event": "batch", "batch": "a", "progress": {"done": 1, "every": 2, "total": None, "failures": 0}},
    ]
    assert [True] * len(good) == [valid_event(e) for e in good]


def test_malformed_events_are_skipped_with_one_warning(pipe: Pipeline, state_dir: Path):
    """A run over a log with malformed lines warns once, counting them, and skips its steps."""
    calls = _two_steps(pipe)
    pipe.run()
    _append_lines(state_dir, BAD_EVENTS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = pipe.run()
    assert [f"skipped {len(BAD_EVENTS)} line(s)"] == [
        m[m.index("skipped") : m.index(" line(s)") + 8] for m in _resumable_warnings(caught)
    ]
    assert (["a", "b"], ["a", "b"]) == (calls, run.skipped)
    assert ["a", "b"] == pipe.status().completed_steps


def test_cli_works_on_a_malformed_event(pipe: Pipeline, state_dir: Path, tmp_path: Path):
    """status, history, export, import, reset --all and verify all work after a bad line."""
    _two_steps(pipe)
    pipe.run()
    _append_lines(state_dir, [{"event": "step_completed"}])
    bad_line = len((state_dir / "events.jsonl").read_text().splitlines())
    status = _cli(state_dir, "status", "--json")
    assert (0, ["a", "b"]) == (status.returncode, json.loads(status.stdout)["completed_steps"])
    history = _cli(state_dir, "history", "--json")
    assert (0, ["a", "b"]) == (history.returncode, [c["slot"] for c in json.loads(history.stdout)])
    verify = _cli(state_dir, "verify")
    assert 1 == verify.returncode
    assert f"DAMAGED {state_dir / 'events.jsonl'}: line {bad_line} is not a valid event" in verify.stdout
    exported = tmp_path / "export"
    assert 0 == _cli(state_dir, "export", "-o", str(exported)).returncode
    other = tmp_path / "other"
    assert 0 == _cli(other, "import", str(exported)).returncode
    assert ["a", "b"] == read_state(LocalStore(other)).completed_steps
    reset = _cli(state_dir, "reset", "--all")
    assert (0, "forgot 2 slot(s): a, b\n") == (reset.returncode, reset.stdout)
    assert [] == read_state(LocalStore(state_dir)).completed_steps


MANIFEST_DAMAGE: list[tuple[str, Any]] = [
    ("steps", []),
    ("runs", "3"),
    ("runs", True),
    ("code", []),
    ("code", {"a": ["x"]}),
    ("events_offset", -5),
    ("events_offset", 10**9),
    ("events_offset", "12"),
    ("completed_steps", "a"),
    ("completed_steps", [1]),
    ("status", "exploded"),
    ("error", {"type": 1}),
    ("batches", {"x": {"done": "many", "every": 2}}),
    ("steps", {"a": {"status": "completed", "attempts": "2"}}),
    ("steps", {"a": {"status": "completed", "bytes": [1]}}),
    ("steps", {"a": {"status": 1}}),
    ("steps", {"../up": {"status": "completed"}}),
]


@pytest.mark.parametrize(("field", "value"), MANIFEST_DAMAGE, ids=lambda v: str(v)[:30])
def test_malformed_manifest_field_is_rebuilt(pipe: Pipeline, state_dir: Path, field: str, value: Any):
    """A manifest field of the wrong type is reported by verify and rebuilt by the next run."""
    calls = _two_steps(pipe)
    pipe.run()
    path = state_dir / "manifest.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    _, problems = find_damage(LocalStore(state_dir), secret=None)
    assert [str(path)] == [where for where, _ in problems]
    assert ["a", "b"] == read_state(LocalStore(state_dir)).completed_steps
    with pytest.warns(ResumableWarning, match="manifest.json was .*rebuilt it"):
        run = pipe.run()
    assert (["a", "b"], ["a", "b"]) == (calls, run.skipped)
    status = pipe.status()
    assert (["a", "b"], 2) == (status.completed_steps, status.runs)
    assert [] == find_damage(LocalStore(state_dir), secret=None)[1]


def test_offset_in_the_middle_of_a_line_is_rebuilt(pipe: Pipeline, state_dir: Path):
    """An events_offset that is not a line end is detected: the manifest is replayed from 0."""
    calls = _two_steps(pipe)
    pipe.run()
    path = state_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["events_offset"] -= 3
    data["steps"], data["completed_steps"] = {}, []
    path.write_text(json.dumps(data))
    assert ["a", "b"] == read_state(LocalStore(state_dir)).completed_steps
    with pytest.warns(ResumableWarning, match="out of step with the event log"):
        run = pipe.run()
    assert (["a", "b"], ["a", "b"]) == (calls, run.skipped)


def test_torn_last_line_fails_nothing(pipe: Pipeline, state_dir: Path):
    """A last line without its newline: verify is ok, readers ignore it, the next run cuts it."""
    calls = _two_steps(pipe)
    pipe.run()
    log = state_dir / "events.jsonl"
    complete = log.read_bytes()
    with log.open("ab") as f:
        f.write(b'{"t":"2026-01-01T00:00:00.000Z","event":"step_comp')
    assert [] == find_damage(LocalStore(state_dir), secret=None)[1]
    status = _cli(state_dir, "status", "--json")
    assert (0, ["a", "b"]) == (status.returncode, json.loads(status.stdout)["completed_steps"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = pipe.run()
    assert ([], ["a", "b"], ["a", "b"]) == (_resumable_warnings(caught), calls, run.skipped)
    after = log.read_bytes()
    assert complete == after[: len(complete)]
    assert [True] * after.count(b"\n") == [valid_event(json.loads(x)) for x in after.splitlines()]
    assert [] == find_damage(LocalStore(state_dir), secret=None)[1]


def _valid_by_the_table(event: object) -> bool:
    """The event table read plainly: its required fields present, each field it checks fitting."""
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        return False
    schema = EVENT_SCHEMA.get(event["event"])
    if schema is None or type(event.get("t", "")) is not str:
        return False
    required, checks = schema
    return all(key in event for key in required) and all(
        _fits(check, event[key]) for key, check in checks.items() if key in event
    )


_ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-2, 3),
    st.floats(allow_nan=False),
    st.sampled_from(["a", "b/1", "../x", "", "completed"]),
    st.lists(st.sampled_from(["a", "b/1", ".x"]), max_size=3),
    st.dictionaries(st.sampled_from(["type", "message", "traceback", "x"]), st.text(max_size=3), max_size=4),
)


@given(
    st.sampled_from(
        [*sorted(__import__("resumable._manifest", fromlist=["EVENT_SCHEMA"]).EVENT_SCHEMA), "nope"]
    ),
    st.dictionaries(
        st.sampled_from(
            [
                "t",
                "slot",
                "reason",
                "fingerprint",
                "attempt",
                "bytes",
                "file",
                "status",
                "slots",
                "error",
                "duration_s",
                "attempts",
                "run",
                "pipeline",
                "label",
                "batch",
                "code",
                "recovered",
                "extra",
            ]
        ),
        _ANY_VALUE,
        max_size=8,
    ),
)
def test_valid_event_is_the_event_table(name: str, fields: dict[str, Any]):
    """The one-pass check gives what the table says, for any mix of fields and values."""
    event = {"event": name, **fields}
    assert _valid_by_the_table(event) is valid_event(event)
