"""
Large manifests: records of completed slots are kept as their text until used, written
back as they were read, and checked when parsed (a damaged one is rebuilt from its file).
"""

from __future__ import annotations

import json
from pathlib import Path

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
    """Re-indented by hand, or a key with an escape, or a slot leaving the directory: no shortcut."""
    raw = _build(state_dir)
    data = json.loads(raw)
    path = state_dir / "manifest.json"
    path.write_text(json.dumps(data, indent=3))
    assert Manifest.loads(path.read_bytes()) is None
    pipe, _ = _keyed(state_dir)
    assert 30 == len(pipe.status().completed_steps)
    hostile = raw.decode().replace('"item/4": {', '"../../x": {')
    assert Manifest.loads(hostile.encode()) is None
    path.write_text(hostile)
    assert "../../x" not in pipe.status().steps
    with pytest.warns(ResumableWarning, match="manifest.json was damaged"), pipe:
        pass
    assert "../../x" not in pipe.status().steps


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
