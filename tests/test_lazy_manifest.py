"""
Large manifests: records of completed slots are kept as their text until used, written
back as they were read, and checked when parsed (a damaged one is rebuilt from its file).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import attrs
import pytest

import resumable._journal as journal_module
from resumable import Pipeline, ResumableWarning
from resumable._manifest import Manifest, StepRecord, Steps


def _keyed(state_dir: Path, calls: list[int] | None = None) -> tuple[Pipeline, object]:
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int) -> dict[str, int]:
        if calls is not None:
            calls.append(i)
        return {"i": i}

    return pipe, item


@pytest.fixture
def lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every manifest counts as large: its completed records are parsed when used."""
    monkeypatch.setattr(journal_module, "LAZY_RECORDS", 0)


def _build(state_dir: Path, n: int = 30) -> bytes:
    pipe, item = _keyed(state_dir)
    with pipe:
        for i in range(n):
            item(i)  # type: ignore[operator]
    return (state_dir / "manifest.json").read_bytes()


def test_loads_gives_the_manifest_json_gives(state_dir: Path):
    raw = _build(state_dir)
    lazy = Manifest.loads(raw)
    assert lazy is not None
    assert all(isinstance(v, str) for v in (v for _, v in lazy.steps.texts()))  # nothing parsed yet
    assert Manifest.from_dict(json.loads(raw)) == lazy
    assert not any(isinstance(v, str) for v in (v for _, v in lazy.steps.texts()))  # comparing parsed them


def test_records_never_used_are_written_back_as_they_were_read(state_dir: Path, lazy: None):
    raw = _build(state_dir)
    record = json.loads(raw)["steps"]["item/7"]
    pipe, item = _keyed(state_dir)
    with pipe:
        item(3)  # type: ignore[operator]
        pipe.reset("item/5", downstream=False)
    after = json.loads((state_dir / "manifest.json").read_text())
    assert record == after["steps"]["item/7"]
    assert "reset" == after["steps"]["item/5"]["status"]
    assert 2 == after["runs"]
    assert 30 == len(after["steps"])
    assert [f"item/{i}" for i in range(30) if i != 5] == after["completed_steps"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda line: line.replace(
            '"status": "completed", "fingerprint": "', '"status": "completed", "fingerprint": 1'
        ),
        lambda line: line.replace('"attempts": 1', '"attempts": true'),
        lambda line: line.replace('"attempts": 1', '"surprise": 1'),
        lambda line: line.replace("}", ""),
    ],
    ids=["not json", "wrong type", "unknown field", "cut"],
)
def test_a_damaged_record_is_rebuilt_from_its_file_when_used(state_dir: Path, lazy: None, damage):
    _build(state_dir)
    path = state_dir / "manifest.json"
    lines = path.read_text().split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith('    "item/4": '))
    lines[at] = damage(lines[at])
    path.write_text("\n".join(lines))
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    with pipe:
        assert {"i": 4} == item(4)  # type: ignore[operator] - a skip reads the file, not the record
        with pytest.warns(ResumableWarning, match="the record of item/4 was damaged; rebuilt it from its"):
            pipe.status()  # the records are used: parsed, and checked
    assert [] == calls  # its output was whole: skipped
    assert "completed" == json.loads(path.read_text())["steps"]["item/4"]["status"]  # written whole again
    record = pipe.status().steps["item/4"]
    assert ("completed", json.loads(path.read_text())["steps"]["item/4"]["fingerprint"]) == (
        record.status,
        record.fingerprint,
    )
    assert record.file is not None


def test_a_damaged_record_without_its_file_is_dropped(state_dir: Path, lazy: None):
    _build(state_dir)
    path = state_dir / "manifest.json"
    path.write_text(
        path.read_text().replace(
            '"item/4": {"status": "completed", "fingerprint": "',
            '"item/4": {"status": "completed", "fingerprint": 7',
        )
    )
    (state_dir / "item" / "4.msgpack").unlink()
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    assert "item/4" not in pipe.status().completed_steps  # readers drop it too (quietly)
    with pipe:
        with pytest.warns(
            ResumableWarning, match="the record of item/4 was damaged, and so is its output file"
        ):
            pipe.status()
        assert {"i": 4} == item(4)  # type: ignore[operator]
    assert [4] == calls
    assert "completed" == pipe.status().steps["item/4"].status


def test_a_manifest_in_another_layout_is_parsed_whole(state_dir: Path, lazy: None):
    """Re-indented by hand: no shortcut."""
    raw = _build(state_dir)
    data = json.loads(raw)
    path = state_dir / "manifest.json"
    path.write_text(json.dumps(data, indent=3))
    assert Manifest.loads(path.read_bytes()) is None
    pipe, _ = _keyed(state_dir)
    assert 30 == len(pipe.status().completed_steps)


def test_a_record_under_a_key_that_is_no_slot_is_dropped_when_the_records_are_used(
    state_dir: Path, lazy: None
):
    """A slot leaving the directory is never used: dropped, with a warning, and its slot rebuilt."""
    raw = _build(state_dir)
    path = state_dir / "manifest.json"
    path.write_bytes(raw.replace(b'"item/4": {', b'"../../x": {'))
    pipe, item = _keyed(state_dir)
    assert "../../x" not in pipe.status().steps  # readers drop it quietly
    with pipe:
        assert {"i": 4} == item(4)  # type: ignore[operator] - its file is whole: a skip
        with (
            pytest.warns(ResumableWarning, match=r"dropped a record under '\.\./\.\./x', which is not"),
            pytest.warns(ResumableWarning, match="the record of item/4 was damaged; rebuilt it from its"),
        ):
            steps = pipe.status().steps
        assert "../../x" not in steps
        assert "completed" == steps["item/4"].status
    written = json.loads(path.read_text())["steps"]
    assert "../../x" not in written
    assert "completed" == written["item/4"]["status"]


def test_a_key_written_with_an_escape_is_read_one_line_at_a_time(state_dir: Path, lazy: None):
    """An escape in a key (the writer never makes one; a hand edit may) is valid JSON: nothing is lost."""
    raw = _build(state_dir)
    path = state_dir / "manifest.json"
    path.write_bytes(raw.replace(b'"item/4": {', b'"\\u0069tem/4": {'))
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing damaged, nothing dropped
        assert Manifest.from_dict(json.loads(raw)).steps == pipe.status().steps
        with pipe:
            assert {"i": 4} == item(4)  # type: ignore[operator]
            assert "completed" == pipe.status().steps["item/4"].status
    assert [] == calls


def test_steps_is_a_mapping_of_records():
    steps = Steps({"a": StepRecord(status="completed")})
    steps["b"] = StepRecord(status="new")
    assert ["a", "b"] == list(steps)
    assert steps == {"a": StepRecord(status="completed"), "b": StepRecord(status="new")}
    assert steps.get("c") is None
    del steps["a"]
    assert 1 == len(steps)
    assert "a" not in steps
    lazy = Steps.of_text({"x": '{"status": "completed"}', "y": "{broken"})
    assert StepRecord(status="completed") == lazy["x"]
    assert lazy.get("y") is None
    assert ["x"] == list(lazy)


def test_the_versions_of_completed_slots_are_read_without_parsing_records():
    """completed_files reads `file` from records kept as text and leaves them text; damage goes to `damaged`."""
    steps = Steps.of_text(
        {
            "a": '{"status": "completed", "file": "fa"}',
            "b": '{"status": "completed", "file": "fb", "attempts": true}',
            "c": '{"status": "completed"}',
        }
    )
    steps["d"] = StepRecord(status="completed", file="fd")
    steps["e"] = StepRecord(status="running", file="fe")
    steps.damaged = lambda slot: StepRecord(status="completed", file=f"rebuilt-{slot}")
    assert {"a": "fa", "b": "rebuilt-b", "d": "fd"} == steps.completed_files()
    assert isinstance(dict(steps.texts())["a"], str)  # still the text it was read as
    assert isinstance(dict(steps.texts())["b"], StepRecord)  # the damaged one was rebuilt


def _steps_text(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[raw.index(b'\n  "steps": {\n') : raw.index(b'\n  "error": ')]


def test_a_run_that_only_skips_splits_no_record_and_writes_them_back_unchanged(state_dir: Path, lazy: None):
    """Opening costs nothing per slot: the records stay one block, written back byte for byte."""
    _build(state_dir)
    path = state_dir / "manifest.json"
    before = _steps_text(path)
    for run in range(3):
        pipe, item = _keyed(state_dir)
        with pipe:
            for i in range(30):
                assert {"i": i} == item(i)  # type: ignore[operator]
            steps = pipe._session_for().journal.manifest.steps  # what the skips left
            assert steps.block() is not None  # never split
            assert steps.is_completed("item/3")
            assert not steps.is_completed("item/30")
        assert before == _steps_text(path), f"run {run + 2}"
    assert 4 == json.loads(path.read_text())["runs"]


def test_records_not_completed_in_the_block_are_parsed_when_it_is_split(
    state_dir: Path, lazy: None, monkeypatch: pytest.MonkeyPatch
):
    """A failed and a reset slot wait in the block too; they are what they were once it is split."""
    calls: list[int] = []
    monkeypatch.setenv("RESUMABLE_TEST_FAIL", "7")
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int) -> dict[str, int]:
        calls.append(i)
        if str(i) == os.environ.get("RESUMABLE_TEST_FAIL"):  # not a closure value: those are fingerprinted
            raise ValueError("seven")
        return {"i": i}

    def run_all() -> None:
        with pipe:
            for i in range(10):
                item(i)

    with pytest.raises(ValueError, match="seven"):
        run_all()
    with pipe:
        pipe.reset("item/2", downstream=False)
    calls.clear()
    monkeypatch.delenv("RESUMABLE_TEST_FAIL")
    with pipe:
        steps = pipe._session_for().journal.manifest.steps
        assert steps.block() is not None
        assert not steps.is_completed("item/7")
        assert not steps.is_completed("item/2")
        assert "failed" == steps["item/7"].status  # the first use splits the block
        assert "reset" == steps["item/2"].status
        assert steps.block() is None
    run_all()
    assert [2, 7, 8, 9] == calls
    assert all(r.status == "completed" for r in pipe.status().steps.values())


def test_verify_checks_every_record_of_a_large_manifest(
    state_dir: Path, lazy: None, capsys: pytest.CaptureFixture[str]
):
    """A run checks a large manifest's records when it uses them; `resumable verify` checks them all."""
    from resumable._cli import main

    raw = _build(state_dir)
    assert 0 == main(["--state-dir", str(state_dir), "verify"])
    capsys.readouterr()
    damaged = raw.replace(
        b'"item/4": {"status": "completed", "fingerprint": "', b'"item/4": {"status": 7, "x": "'
    )
    (state_dir / "manifest.json").write_bytes(damaged.replace(b'"item/9": {', b'"../9": {'))
    assert 1 == main(["--state-dir", str(state_dir), "verify"])
    out = capsys.readouterr().out
    assert "the record of item/4 is damaged" in out
    assert "a record under '../9' is not a slot name" in out
    assert "the record of item/9 is damaged" in out  # completed, and its line is gone
    # a run that only skips writes the records back as it read them: the hint is what mends them
    assert "delete manifest.json, and the next run rebuilds every record from events.jsonl" in out
    (state_dir / "manifest.json").unlink()
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)

    def run_all() -> None:
        with pipe:
            for i in range(30):
                item(i)  # type: ignore[operator]

    with pytest.warns(ResumableWarning, match="was missing; rebuilt it from the event log"):
        run_all()
    assert [] == calls  # every output is kept
    assert 0 == main(["--state-dir", str(state_dir), "verify"])


def test_history_of_a_large_manifest_reads_records_quietly_and_writes_nothing(state_dir: Path, lazy: None):
    """Listing history (without the lock) uses only the output versions; a damaged record is no warning."""
    from resumable._pipeline import read_checkpoints
    from resumable._stores import open_store

    raw = _build(state_dir)
    damaged = raw.replace(
        b'"item/4": {"status": "completed", "fingerprint": "', b'"item/4": {"status": 7, "x": "'
    )
    (state_dir / "manifest.json").write_bytes(damaged)
    before = {p: p.read_bytes() for p in state_dir.rglob("*") if p.is_file() and p.name != "lock"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        points = read_checkpoints(open_store(str(state_dir)), secret=None, newest=5)
    assert [26, 27, 28, 29, 30] == [c.id for c in points]
    assert "item/4" in points[-1].completed_steps  # rebuilt from its output file
    assert before == {p: p.read_bytes() for p in state_dir.rglob("*") if p.is_file() and p.name != "lock"}


def test_skips_from_threads_while_the_block_is_split(state_dir: Path, lazy: None):
    """Skips (which ask is_completed without the lock) and a first use of the records, at once."""
    import threading

    _build(state_dir, 200)
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    errors: list[BaseException] = []
    with pipe:
        steps = pipe._session_for().journal.manifest.steps
        assert steps.block() is not None
        start = threading.Barrier(5)

        def skip_all() -> None:
            try:
                start.wait()
                for i in range(200):
                    assert {"i": i} == item(i)  # type: ignore[operator]
                    assert steps.is_completed(f"item/{i}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=skip_all) for _ in range(4)]
        for thread in threads:
            thread.start()
        start.wait()
        assert "completed" == steps["item/150"].status  # splits the block meanwhile
        for thread in threads:
            thread.join()
    assert [] == errors
    assert [] == calls
    assert steps.block() is None


def test_a_signed_manifest_and_one_left_running_are_not_kept_as_a_block(state_dir: Path, lazy: None):
    """A signature covers the whole text (parsed whole); a manifest a kill left `running` has records the fold needs."""
    pipe = Pipeline(state_dir=state_dir, secret=b"k" * 32)

    @pipe.step(key="{i}")
    def item(i: int) -> int:
        return i

    with pipe:
        for i in range(5):
            item(i)
    with pipe:
        steps = pipe._session_for().journal.manifest.steps
        assert steps.block() is None
        assert 5 == item(5)
        assert 4 == item(4)
    other = state_dir.parent / "running"
    _build(other)
    path = other / "manifest.json"
    path.write_bytes(path.read_bytes().replace(b'"status": "completed",\n', b'"status": "running",\n', 1))
    manifest = Manifest.loads(path.read_bytes())
    assert manifest is not None
    assert manifest.steps.block() is None


def test_a_rollback_after_a_record_was_repaired_compares_every_slot(state_dir: Path, lazy: None):
    """A record rebuilt from its file is not in the log: a rollback then restores every record it differs in."""
    raw = _build(state_dir)
    original = json.loads(raw)["steps"]["item/4"]
    pipe, item = _keyed(state_dir)
    with pipe:
        for i in range(30, 33):
            item(i)  # type: ignore[operator] - three checkpoints to undo
    target = pipe.checkpoints()[-4]
    path = state_dir / "manifest.json"
    path.write_bytes(
        path.read_bytes().replace(
            b'"item/4": {"status": "completed", "fingerprint": "', b'"item/4": {"status": 7, "x": "'
        )
    )
    with pipe:
        with pytest.warns(ResumableWarning, match="the record of item/4 was damaged; rebuilt it"):
            assert pipe.status().steps["item/4"].reason is None  # rebuilt from the file: no reason
        pipe.rollback(target.id)
        assert original == attrs.asdict(pipe.status().steps["item/4"])  # the record at the checkpoint
        assert target.completed_steps == pipe.status().completed_steps
