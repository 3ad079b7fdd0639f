"""The manifest and the event log: replay, rebuild, formats, invariants."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable._manifest as manifest_module
from resumable import Manifest, Pipeline, ResumableWarning, StateDirectoryError, StateFormatError
from resumable._journal import Journal, read_state
from resumable._manifest import Fold
from resumable._stores._local import LocalStore
from resumable._stores._memory import MemoryStore


def _three_steps(pipe: Pipeline) -> list[str]:
    calls: list[str] = []

    @pipe.step
    def a() -> int:
        calls.append("a")
        return 1

    @pipe.step
    def b(a: int) -> int:
        calls.append("b")
        return a + 1

    @pipe.step(key="{n}")
    def c(b: int, n: int = 0) -> int:
        calls.append("c")
        return b + n

    return calls


def test_manifest_lags_but_events_replay(pipe: Pipeline, state_dir: Path):
    """A manifest.json older than the event log is brought up to date on load."""
    _three_steps(pipe)
    with pipe:
        stale = (state_dir / "manifest.json").read_text()  # written when the run opened
        pipe.run()
    assert [] == json.loads(stale)["completed_steps"]
    (state_dir / "manifest.json").write_text(stale)
    status = pipe.status()
    assert ["a", "b", "c/0"] == status.completed_steps
    assert "completed" == status.status


def test_deleted_manifest_is_rebuilt(pipe: Pipeline, state_dir: Path):
    """Without manifest.json, the next run rebuilds it (warning) and skips every step."""
    calls = _three_steps(pipe)
    pipe.run()
    (state_dir / "manifest.json").unlink()
    with pytest.warns(ResumableWarning, match="manifest.json was missing"):
        run = pipe.run()
    assert ["a", "b", "c/0"] == run.skipped
    assert ["a", "b", "c"] == calls
    assert ["a", "b", "c/0"] == json.loads((state_dir / "manifest.json").read_text())["completed_steps"]


def test_damaged_manifest_and_log_rebuilt_from_files(pipe: Pipeline, state_dir: Path):
    """With manifest and log damaged, the step files alone restore the completed slots."""
    _three_steps(pipe)
    pipe.run()
    (state_dir / "manifest.json").write_text("{not json")
    (state_dir / "events.jsonl").unlink()
    with pytest.warns(ResumableWarning, match=r"damaged; rebuilt it .* 3 step file"):
        run = pipe.run()
    assert ["a", "b", "c/0"] == run.skipped
    assert {"a", "b", "c/0"} == set(pipe.status().completed_steps)


def test_newer_manifest_format_is_refused(pipe: Pipeline, state_dir: Path):
    """A manifest from a newer version raises StateFormatError and is left untouched."""
    _three_steps(pipe)
    pipe.run()
    text = (state_dir / "manifest.json").read_text().replace('"format": 2', '"format": 99')
    (state_dir / "manifest.json").write_text(text)
    with pytest.raises(StateFormatError, match=r"format 99.*Upgrade resumable"):
        pipe.run()
    assert text == (state_dir / "manifest.json").read_text()
    with pytest.raises(StateFormatError, match=r"format 99.*Upgrade resumable"):
        Manifest.from_dict(json.loads(text))  # public: the same error as a run gets


def test_cut_short_log_line(pipe: Pipeline, state_dir: Path):
    """A log line cut short (a kill mid-append) is dropped by the next run, never glued to."""
    _three_steps(pipe)
    pipe.run()
    (state_dir / "manifest.json").unlink()
    complete = (state_dir / "events.jsonl").read_text()
    with (state_dir / "events.jsonl").open("a") as f:
        f.write('{"t":"2026-01-01T00:00:00Z","event":"step_sta')
    assert ["a", "b", "c/0"] == read_state(LocalStore(state_dir)).completed_steps  # readers ignore it
    with pytest.warns(ResumableWarning, match="manifest.json was missing"):
        pipe.run()
    text = (state_dir / "events.jsonl").read_text()
    assert complete == text[: len(complete)]
    assert [] == [line for line in text.splitlines() if not (line.startswith("{") and line.endswith("}"))]


def test_crashed_run_is_marked_interrupted(state_dir: Path):
    """A run that died while 'running' is recorded as interrupted by the next one."""
    store = LocalStore(state_dir)
    journal = Journal(store, pipeline="p", secret=None)
    journal.load()
    journal.record("run_started", run=1)
    journal.flush(durable=False)
    journal.record("step_started", slot="s", reason="new", attempt=1)
    assert "running" == read_state(store).status  # the process "dies" here
    pipe = Pipeline(state_dir=state_dir)
    with pipe:
        status = pipe.status()
    assert "interrupted" == status.steps["s"].status
    events = [json.loads(line) for line in (state_dir / "events.jsonl").read_text().splitlines()]
    assert {"event": "run_finished", "status": "interrupted", "detected": "next run"} == {
        k: events[2][k] for k in ("event", "status", "detected")
    }


def test_manifest_follows_the_events_of_the_caller(state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """
    During a run, manifest.json is rewritten by the step that records an event once it is
    older than its interval (here none): no thread of its own.
    """
    import threading

    import resumable._journal as journal_module

    monkeypatch.setattr(journal_module, "FLUSH_INTERVAL", 0.0)
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step
    def quick() -> int:
        return 1

    @pipe.step
    def after(quick: int) -> int:
        return quick + 1

    threads = threading.active_count()
    with pipe:
        assert threads == threading.active_count()
        after(quick())
        data = json.loads((state_dir / "manifest.json").read_text())
        assert (["quick", "after"], "running") == (data["completed_steps"], data["status"])
    assert "completed" == json.loads((state_dir / "manifest.json").read_text())["status"]


_slot = st.sampled_from(["a", "b", "c/1", "c/2"])
_event = st.one_of(
    st.builds(lambda s: {"event": "step_started", "slot": s, "reason": "new", "attempt": 1}, _slot),
    st.builds(lambda s: {"event": "step_completed", "slot": s, "bytes": 10, "duration_s": 0.1}, _slot),
    st.builds(
        lambda s: {
            "event": "step_failed",
            "slot": s,
            "error": {"type": "E", "message": "m", "traceback": "t"},
        },
        _slot,
    ),
    st.builds(lambda s: {"event": "step_interrupted", "slot": s}, _slot),
    st.builds(lambda s: {"event": "step_skipped", "slot": s, "fingerprint": "f"}, _slot),
    st.builds(
        lambda ss: {"event": "steps_skipped", "skips": [[s, "f", 3, None, None] for s in ss]},
        st.lists(_slot, max_size=3),
    ),
    st.builds(lambda ss: {"event": "steps_reset", "slots": ss}, st.lists(_slot, max_size=3)),
    st.just({"event": "run_started", "run": 1}),
    st.sampled_from([{"event": "run_finished", "status": s} for s in ("completed", "failed", "interrupted")]),
)


@given(st.lists(_event, max_size=40))
def test_fold_invariants(events: list[dict]):
    """Any event sequence leaves a valid manifest that survives a JSON round trip."""
    fold = Fold(Manifest(workflow_id="w", pipeline="p"))
    for i, event in enumerate(events):
        fold.apply({"t": f"2026-01-01T00:00:{i:02d}Z", **event})
        m = fold.manifest
        assert len(set(m.completed_steps)) == len(m.completed_steps)
        assert all(m.steps[s].status == "completed" for s in m.completed_steps if s in m.steps)
        assert m.current_step is None or m.current_step in m.steps
    data = json.loads(json.dumps(fold.manifest.to_dict()))
    assert fold.manifest == Manifest.from_dict(data)


def test_read_state_of_empty_store():
    """An empty store reads as a fresh manifest with no steps."""
    manifest = read_state(MemoryStore())
    assert ([], 0, {}) == (manifest.completed_steps, manifest.runs, manifest.steps)


def test_temp_files_of_a_dead_run_are_removed(state_dir: Path):
    """Opening after a run that died removes the temporary files it was writing."""
    store = LocalStore(state_dir)
    journal = Journal(store, pipeline="p", secret=None)
    journal.load()
    journal.record("run_started", run=1)
    journal.flush(durable=False)
    (state_dir / "step").mkdir()
    leftover = state_dir / "step" / ".3.msgpack.999-1-0.tmp"
    leftover.write_bytes(b"partial")
    kept = state_dir / "step" / "3.msgpack.tmp.txt"
    kept.write_bytes(b"not ours")
    with Pipeline(state_dir=state_dir):
        pass
    assert not leftover.exists()
    assert kept.exists()


def test_sync_event_is_written_at_once_even_where_appends_are_batched(monkeypatch: pytest.MonkeyPatch):
    """On a store with slow appends, a sync event is in the log when record returns."""
    # no rewrite of the manifest comes due in between, however slow the machine (it writes the events too)
    import resumable._journal as journal_module

    monkeypatch.setattr(journal_module, "FLUSH_INTERVAL", 3600.0)

    class SlowAppends(MemoryStore):
        slow_appends = True
        durable_appends: list[bool] = []

        def append(self, key: str, data: bytes, *, durable: bool) -> None:
            self.durable_appends.append(durable)
            super().append(key, data, durable=durable)

    store = SlowAppends()
    journal = Journal(store, pipeline="p", secret=None, durable=False)
    journal.load()
    journal.record("run_started", run=1)
    assert ([], []) == (store.durable_appends, _logged(store))
    journal.record("step_started", slot="pay", reason="new", attempt=1, sync=True)
    assert ([False], ["run_started", "step_started"]) == (store.durable_appends, _logged(store))


def _logged(store: MemoryStore) -> list[str]:
    try:
        log = bytes(store.read("events.jsonl"))
    except FileNotFoundError:
        return []
    return [json.loads(line)["event"] for line in log.splitlines()]


def test_a_large_manifest_is_not_rewritten_when_a_run_opens(state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """
    Over LARGE_MANIFEST bytes, opening a run appends run_started to the log instead of
    rewriting manifest.json; readers fold the log, so they see the run running at once.
    """
    import resumable._journal as journal_module

    pipe = Pipeline(state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int) -> int:
        return i

    with pipe:
        for i in range(20):
            item(i)
    written = (state_dir / "manifest.json").read_bytes()
    monkeypatch.setattr(journal_module, "LARGE_MANIFEST", len(written) - 1)
    with pipe:
        item(0)
        assert written == (state_dir / "manifest.json").read_bytes()  # not rewritten at open
        assert "running" == read_state(LocalStore(state_dir)).status
        assert 2 == pipe.status().runs
    after = json.loads((state_dir / "manifest.json").read_text())
    assert ("completed", 2) == (after["status"], after["runs"])  # the close writes it
    # a small one still says "running" the moment the run opens (test_with_block_scopes_one_run)
    monkeypatch.setattr(journal_module, "LARGE_MANIFEST", len(written) * 10)
    with pipe:
        assert "running" == json.loads((state_dir / "manifest.json").read_text())["status"]


def test_record_validation_checks_every_field_of_a_full_record():
    """The one-lookup path for records with every field rejects what the field checks reject."""
    full = {
        "status": "completed",
        "fingerprint": "f",
        "reason": "new",
        "started_at": "2026-01-01T00:00:00Z",
        "finished_at": None,
        "duration_s": 1,
        "attempts": 1,
        "bytes": None,
        "file": "x",
    }
    check = manifest_module._STEP_RECORD
    assert check(full)
    assert check({**full, "duration_s": 0.5})
    assert check({"status": "new"})  # the optional fields may be left out
    for field, bad in [("attempts", True), ("attempts", None), ("status", None), ("bytes", 1.5), ("file", 3)]:
        assert not check({**full, field: bad}), field
    assert not check({**full, "extra": 1})
    assert not check({k: v for k, v in full.items() if k != "status"})


def test_manifest_json_is_the_same_whichever_encoder_writes_it():
    """Records are encoded by a C encoder made once: the text is what json.dumps gives."""
    record = {"status": "failed", "reason": 'é "quoted"\n\ttab \u2028', "duration_s": 1e-05, "bytes": None}
    data = {"format": 2, "steps": {"s": record}, "batches": {}}
    text = manifest_module.dumps(data).decode()
    assert data == json.loads(text)
    assert json.dumps(record, ensure_ascii=False, separators=(", ", ": ")) in text


def test_only_the_skips_of_the_slots_completed_last_are_logged(state_dir: Path):
    """
    A run logs the skips of the 32 slots completed last, not of older ones (a conversation
    replayed turn after turn keeps a log that grows with its length); `why` says so.
    """
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int) -> int:
        return i

    with pipe:
        for i in range(2500):
            item(i)
    log = state_dir / "events.jsonl"
    size = log.stat().st_size
    with pipe:
        for i in range(2500):
            item(i)
    lines = log.read_bytes()[size:].decode().splitlines()
    skips = [json.loads(line)["slot"] for line in lines if '"step_skipped"' in line]
    assert [f"item/{i}" for i in range(2468, 2500)] == sorted(skips)
    decisions = {d.slot: (d.outcome, d.run) for d in pipe.why("item")}
    assert {("skipped", 2)} == {decisions[f"item/{i}"] for i in range(2468, 2500)}
    assert {("not called", 1)} == {decisions[f"item/{i}"] for i in range(2468)}
    # a skip row of the wrong shape makes its line invalid: skipped with a warning, nothing applied
    for row in (["item/1", "f", "3", None, None], ["../up", "f", 3, None, None]):
        with log.open("a") as f:
            f.write(json.dumps({"t": "x", "event": "steps_skipped", "skips": [row]}) + "\n")
    with pytest.warns(ResumableWarning, match="skipped 2 line"), pipe:
        item(0)


def test_looking_at_the_state_does_not_rewrite_the_manifest(state_dir: Path):
    """clean --dry-run, checkpoints() and why() take the lock but leave manifest.json as it is."""
    from resumable._cli import main

    pipe = Pipeline(state_dir=state_dir)
    _three_steps(pipe)
    pipe.run()
    manifest = state_dir / "manifest.json"
    before = (manifest.stat().st_ino, manifest.stat().st_mtime_ns, manifest.read_bytes())
    assert 0 == main(["clean", "--dry-run", "--state-dir", str(state_dir)])
    pipe.checkpoints()
    pipe.why("a")
    assert before == (manifest.stat().st_ino, manifest.stat().st_mtime_ns, manifest.read_bytes())
    pipe.reset("c")  # a change is written
    assert {"reset": 1} == json.loads(manifest.read_text())["keyed"]["c"]["status"]


# --- state files that are not what they should be -------------------------------------------

_DEEP = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError on it


def _ran_once(state_dir: Path) -> tuple[Pipeline, list[str]]:
    pipe = Pipeline(state_dir=state_dir)
    calls = _three_steps(pipe)
    pipe.run()
    return pipe, calls


def test_deeply_nested_json_is_damage(state_dir: Path):
    """Nesting too deep to parse in manifest.json or a log line is damage: rebuilt or skipped, warned."""
    from resumable._cli import main

    pipe, calls = _ran_once(state_dir)
    (state_dir / "manifest.json").write_bytes(_DEEP)
    with (state_dir / "events.jsonl").open("ab") as f:
        f.write(_DEEP + b"\n")
    for code in (state_dir / ".resumable" / "code").iterdir():
        code.write_bytes(b'{"components": ' + _DEEP + b"}")
    with pytest.warns(ResumableWarning) as warned:
        assert ["a", "b", "c/0"] == pipe.run().skipped
    messages = " ".join(str(w.message) for w in warned)
    assert "manifest.json was damaged" in messages
    assert "skipped 1 line(s): 1 damaged" in messages
    assert ["a", "b", "c"] == calls
    assert {"skipped"} == {d.outcome for d in pipe.why("a")}
    with (state_dir / "events.jsonl").open("ab") as f:
        f.write(_DEEP + b"\n")
    assert 1 == main(["verify", "--state-dir", str(state_dir)])  # lists the line, does not crash


@pytest.mark.parametrize("name", ["manifest.json", "events.jsonl"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_state_file_that_is_not_a_file_is_refused_at_once(tmp_path: Path, name: str, kind: str):
    """A FIFO or a directory in place of the manifest or the log never blocks: a clear error names it."""
    import os
    import subprocess
    import sys

    state_dir = tmp_path / "state"
    _ran_once(state_dir)
    path = state_dir / name
    path.unlink()
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    with pytest.raises(StateDirectoryError, match=f"{name} is not a plain file"):
        _ran_once(state_dir)
    for command in ("status", "verify"):
        done = subprocess.run(
            [sys.executable, "-m", "resumable", "--state-dir", str(state_dir), command],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert 1 == done.returncode, done.stderr
        assert f"{name}" in done.stdout + done.stderr
        assert "Traceback" not in done.stderr


def test_a_read_only_state_file_is_a_state_directory_error(state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """An EROFS (a read-only mount) writing the manifest or the log names the file, with no traceback of its own."""
    import errno

    pipe, _ = _ran_once(state_dir)

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(LocalStore, "append", read_only)
    with pytest.raises(StateDirectoryError, match=r"events\.jsonl cannot be used \(Read-only"):
        pipe.run()
    monkeypatch.undo()
    monkeypatch.setattr(LocalStore, "write", read_only)
    with pytest.raises(StateDirectoryError, match=r"manifest\.json cannot be used \(Read-only"):
        pipe.run()


def test_skips_of_completed_slots_do_not_make_the_manifest_due(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """A logged skip changes nothing manifest.json says: however long the run, it is not rewritten for skips."""
    import resumable._journal as journal_module

    pipe = Pipeline(state_dir=state_dir)

    @pipe.step(key="{i}")
    def f(i: int) -> int:
        return i

    with pipe:
        for i in range(3):
            f(i)
    monkeypatch.setattr(journal_module, "FLUSH_INTERVAL", 0.0)  # any change makes it due at once
    with pipe:
        written = (state_dir / "manifest.json").stat().st_ino
        for i in range(3):
            f(i)  # skips of the slots completed last: logged
        assert written == (state_dir / "manifest.json").stat().st_ino
    logged = (state_dir / "events.jsonl").read_text().splitlines()
    assert 3 == sum(json.loads(line)["event"] == "step_skipped" for line in logged)


def test_the_skip_of_a_slot_the_manifest_did_not_know_is_logged(tmp_path: Path):
    """An output file the manifest has no record of (copied in) is logged as skipped when a run uses it."""

    def item_step(pipe: Pipeline) -> Any:
        return pipe.step(name="item", key="{i}")(lambda i: [i])

    a, b = Pipeline(state_dir=tmp_path / "a"), Pipeline(state_dir=tmp_path / "b")
    item_a, item_b = item_step(a), item_step(b)
    with a:
        for i in range(3):
            item_a(i)
    with b:
        item_b(0)
    shutil.copy(tmp_path / "a" / "item" / "1.msgpack", tmp_path / "b" / "item" / "1.msgpack")
    with b:
        assert [1] == item_b(1)
    logged = [json.loads(line) for line in (tmp_path / "b" / "events.jsonl").read_text().splitlines()]
    assert ["item/1"] == [e["slot"] for e in logged if e["event"] == "step_skipped"]
