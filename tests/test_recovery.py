"""
What survives a kill: outputs whose events a killed run never wrote are recovered, a
short write to the log is never ignored, and a non-idempotent step's start is durable.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import resumable._journal
from resumable._journal import Journal, read_state
from resumable._manifest import valid_event
from resumable._stores._local import LocalStore

TIMEOUT = 60
CRASH = Path(__file__).resolve().parent / "crash"
_started: list[subprocess.Popen[str]] = []

# Three steps; with DIE_AFTER_B=1 the process is killed right after b's output is stored,
# before its completion is written to the event log (the one moment a kill leaves an output
# the log does not name).
THREE_STEPS = """
import os, signal, sys
import resumable._journal
from resumable import Pipeline

record = resumable._journal.Journal.record

def dying_record(self, event, **fields):
    if event == "step_completed" and fields.get("slot") == "b" and os.environ.get("DIE_AFTER_B"):
        print("b stored", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return record(self, event, **fields)

resumable._journal.Journal.record = dying_record
pipe = Pipeline("recovery", state_dir=sys.argv[1])

def ran(name):
    with open(sys.argv[2], "a") as f:
        f.write(name + "\\n")

@pipe.step
def a() -> int:
    ran("a")
    return 1

@pipe.step
def b(a: int) -> int:
    ran("b")
    return a + 1

@pipe.step
def c(b: int) -> int:
    ran("c")
    print("c running", flush=True)
    return b * 10

print("RESULT", pipe.run().outputs["c"], flush=True)
"""


@pytest.fixture(autouse=True)
def _no_stray_programs() -> Iterator[None]:
    """A test that fails half-way leaves no stalled program behind."""
    yield
    while _started:
        popen = _started.pop()
        if popen.poll() is None:
            popen.kill()
            popen.wait(TIMEOUT)
        if popen.stdout is not None:
            popen.stdout.close()


def _kill_at(argv: list[str], marker: str, **env: str) -> None:
    """Run *argv* until it prints a line starting with *marker*, then SIGKILL it."""
    popen = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **env}
    )
    _started.append(popen)
    assert popen.stdout is not None
    for line in popen.stdout:
        if line.startswith(marker):
            break
    popen.send_signal(signal.SIGKILL)
    assert -signal.SIGKILL == popen.wait(TIMEOUT)
    popen.stdout.close()


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=TIMEOUT)


def _cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return _run([sys.executable, "-m", "resumable", "--state-dir", str(state), *args])


def _events(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]


def test_outputs_of_a_killed_run_are_recovered(tmp_path: Path):
    """
    After a SIGKILL, status lists the outputs whose events were not written yet; the rerun
    records them as recovered, so history has their checkpoints and rollback reaches them.
    """
    script, state, side = tmp_path / "three.py", tmp_path / "state", tmp_path / "ran"
    script.write_text(textwrap.dedent(THREE_STEPS))
    prog = [sys.executable, str(script), str(state), str(side)]
    _kill_at(prog, "b stored", DIE_AFTER_B="1")
    assert ["a"] == [
        e["slot"] for e in _events(state) if e["event"] == "step_completed"
    ]  # b's was never written
    status = _cli(state, "status", "--json")
    manifest = json.loads(status.stdout)
    assert (0, ["a", "b"]) == (status.returncode, manifest["completed_steps"])
    assert ["completed", "completed"] == [manifest["steps"][s]["status"] for s in ("a", "b")]
    assert 0 == _cli(state, "status").returncode

    rerun = _run(prog)
    assert (0, "c running\nRESULT 20\n") == (rerun.returncode, rerun.stdout)
    assert {"a": 1, "b": 1, "c": 1} == Counter(side.read_text().split())  # c never started before the kill
    recovered = [e["slot"] for e in _events(state) if e.get("recovered")]
    assert ["b"] == recovered
    history = _cli(state, "history", "--json")
    assert 0 == history.returncode
    assert [["a"], ["a", "b"], ["a", "b", "c"]] == [c["completed_steps"] for c in json.loads(history.stdout)]

    a_bytes = (state / "a.msgpack").read_bytes()
    back = _cli(state, "rollback", "b")
    assert (0, ["a"]) == (back.returncode, read_state(LocalStore(state)).completed_steps)
    assert (a_bytes, False) == ((state / "a.msgpack").read_bytes(), (state / "b.msgpack").exists())
    back = _cli(state, "rollback", "a")
    assert (0, []) == (back.returncode, read_state(LocalStore(state)).completed_steps)
    assert [] == sorted(p.name for p in state.glob("*.msgpack"))


def test_read_only_readers_recover_without_writing(tmp_path: Path):
    """status folds unrecorded outputs in without writing anything to the state directory."""
    script, state, side = tmp_path / "three.py", tmp_path / "state", tmp_path / "ran"
    script.write_text(textwrap.dedent(THREE_STEPS))
    _kill_at([sys.executable, str(script), str(state), str(side)], "b stored", DIE_AFTER_B="1")
    before = {p: p.read_bytes() for p in state.rglob("*") if p.is_file() and p.name != "lock"}
    assert ["a", "b"] == read_state(LocalStore(state)).completed_steps
    assert before == {p: p.read_bytes() for p in state.rglob("*") if p.is_file() and p.name != "lock"}


def test_interrupted_payment_is_not_charged_again_after_a_cut_log(tmp_path: Path):
    """
    A log cut mid-line and a manifest whose events_offset is past the end of the log (a full
    disk): the next run replays the log from the start and refuses to rerun the payment.
    """
    state, side = tmp_path / "state", tmp_path / "side"
    prog = [sys.executable, str(CRASH / "charge.py"), str(state), str(side)]
    _kill_at(prog, "STALL charge", STALL_AT="charge")
    log = state / "events.jsonl"
    with log.open("ab") as f:
        f.write(b'{"t":"2026-01-01T00:00:00.000Z","event":"step_completed","slot":"char')
    manifest_path = state / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest.update(steps={}, completed_steps=[], events_offset=log.stat().st_size + 100)
    manifest_path.write_text(json.dumps(manifest))

    refused = _run(prog)
    assert 1 == refused.returncode
    assert "StepInterruptedError" in refused.stderr
    assert "resumable reset charge" in refused.stderr
    assert {"basket": 1, "charge": 1} == Counter(side.read_text().split())
    lines = log.read_bytes().split(b"\n")
    assert b"" == lines[-1]
    assert [True] * (len(lines) - 1) == [valid_event(json.loads(line)) for line in lines[:-1]]


class _FullDisk(LocalStore):
    """A local store whose next append writes half its data, then fails like a full disk."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail = False
        self.appends: list[tuple[bytes, bool]] = []

    def append(self, key: str, data: bytes, *, durable: bool) -> None:
        self.appends.append((data, durable))
        if self.fail:
            self.fail = False
            super().append(key, data[: len(data) // 2], durable=False)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        super().append(key, data, durable=durable)


def test_short_write_to_the_log_raises_and_is_cut_off(tmp_path: Path):
    """A failed append raises naming the log; the next write drops its partial line first."""
    store = _FullDisk(tmp_path)
    journal = Journal(store, pipeline="p", secret=None)
    journal.load()
    journal.record("run_started", run=1)
    store.fail = True
    with pytest.raises(OSError, match="No space left") as info:
        journal.record("step_started", slot="a", reason="new", attempt=1)
    assert str(tmp_path / "events.jsonl") == info.value.filename
    journal.record("step_completed", slot="a", fingerprint="f")
    events = _events(tmp_path)
    assert ["run_started", "step_started", "step_completed"] == [e["event"] for e in events]
    assert (tmp_path / "events.jsonl").stat().st_size == journal.manifest.events_offset
    assert ["a"] == journal.manifest.completed_steps


class _SlowAppends(_FullDisk):
    slow_appends = True


def test_sync_record_writes_and_fsyncs_everything_before_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On a store with slow appends, record(sync=True) appends the waiting events with it, in one durable write."""
    # no rewrite of the manifest comes due in between, however slow the machine (it writes the events too)
    monkeypatch.setattr(resumable._journal, "FLUSH_INTERVAL", 3600.0)
    store = _SlowAppends(tmp_path)
    journal = Journal(store, pipeline="p", secret=None)
    journal.load()
    journal.record("run_started", run=1)
    journal.record("step_completed", slot="a")
    assert [] == store.appends
    journal.record("step_started", slot="pay", reason="new", attempt=1, sync=True)
    assert [True] == [durable for _, durable in store.appends]
    written = [json.loads(line)["event"] for line in store.appends[0][0].splitlines()]
    assert ["run_started", "step_completed", "step_started"] == written
    # the log was new: its name is made durable too (by a durable manifest write)
    assert (
        journal.manifest.events_offset
        == json.loads((tmp_path / "manifest.json").read_text())["events_offset"]
    )
