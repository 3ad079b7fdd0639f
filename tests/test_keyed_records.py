"""
Keyed steps' records live in ``<step>.records`` beside the step's outputs, read when one of
them is first used; ``manifest.json`` keeps a summary of them. A damaged records file is
rebuilt from the output files; a 0.1.0 manifest (records inline) still opens.
"""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path
from typing import Any

import msgpack
import pytest

from resumable import DamagedStateError, Pipeline, ResumableWarning
from resumable._cli import main
from resumable._journal import read_state
from resumable._stores import LocalStore


def _keyed(state_dir: Path, calls: list[int] | None = None, **options: Any) -> tuple[Pipeline, Any]:
    pipe = Pipeline(state_dir=state_dir, **options)

    @pipe.step(key="{i}")
    def item(i: int) -> dict[str, int]:
        if calls is not None:
            calls.append(i)
        return {"i": i}

    return pipe, item


def _build(state_dir: Path, n: int = 30, **options: Any) -> None:
    pipe, item = _keyed(state_dir, **options)
    with pipe:
        for i in range(n):
            item(i)


def _records(state_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = msgpack.unpackb((state_dir / "item.records").read_bytes())
    return data


def test_the_layout(state_dir: Path):
    """manifest.json: every completed slot, unkeyed records, a summary per keyed step; the records beside."""
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step
    def load() -> int:
        return 3

    @pipe.step(key="{i}")
    def item(i: int) -> int:
        return i * load()

    with pipe:
        for i in range(3):
            item(i)
    manifest = json.loads((state_dir / "manifest.json").read_text())
    assert ["load", "item/0", "item/1", "item/2"] == manifest["completed_steps"]
    assert ["load"] == list(manifest["steps"])
    summary = manifest["keyed"]["item"]
    assert {"status": {"completed": 3}, "last_completed": "item/2"} == {
        k: v for k, v in summary.items() if k != "bytes"
    }
    records = _records(state_dir)
    assert ["item/0", "item/1", "item/2"] == records["slots"]
    assert ["completed"] * 3 == records["status"]
    assert sum(records["bytes"]) == summary["bytes"]
    status = pipe.status()
    assert records["fingerprint"][1] == status.steps["item/1"].fingerprint
    assert 4 == len(status.steps)


@pytest.mark.parametrize("kept", [False, True], ids=["", "with-a-kept-version"])
def test_a_run_that_only_skips_does_not_read_or_write_the_records(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, kept: bool
):
    """Opening a state and skipping its keyed slots reads no records file; the file is left as it is."""
    _build(state_dir)
    if kept:  # other outputs, then these again: history keeps the replaced ones, which a close may prune
        other = Pipeline(state_dir=state_dir)

        @other.step(key="{i}", name="item", version="other")
        def item_other(i: int) -> dict[str, int]:
            return {"i": -i}

        with other:
            for i in range(30):
                item_other(i)
        _build(state_dir)
        assert list((state_dir / ".resumable" / "objects").iterdir())
    runs = json.loads((state_dir / "manifest.json").read_text())["runs"]
    path = state_dir / "item.records"
    before = (path.stat().st_ino, path.read_bytes())
    reads: list[str] = []
    read = LocalStore.read

    def counted(self: LocalStore, key: str, *args: Any, **kwargs: Any) -> Any:
        reads.append(key)
        return read(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "read", counted)
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    with pipe:
        for i in range(30):
            assert {"i": i} == item(i)
    assert [] == calls
    assert "item.records" not in reads
    assert before == (path.stat().st_ino, path.read_bytes())
    assert runs + 1 == json.loads((state_dir / "manifest.json").read_text())["runs"]


def test_a_new_slot_adds_to_the_records(state_dir: Path):
    _build(state_dir)
    pipe, item = _keyed(state_dir)
    with pipe:
        item(30)
        pipe.reset("item/5", downstream=False)
    records = _records(state_dir)
    assert [f"item/{i}" for i in range(31)] == records["slots"]
    assert "reset" == records["status"][5]
    summary = json.loads((state_dir / "manifest.json").read_text())["keyed"]["item"]
    assert {"completed": 30, "reset": 1} == summary["status"]
    assert "item/30" == summary["last_completed"]


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: b"\xc1 not msgpack",
        lambda data: msgpack.packb({**data, "attempts": [True] * len(data["slots"])}),
        lambda data: msgpack.packb({**data, "surprise": 1}),
        lambda data: msgpack.packb({**data, "slots": ["other/0", *data["slots"][1:]]}),
        lambda data: msgpack.packb({**data, "slots": ["item/../../x", *data["slots"][1:]]}),
        lambda data: msgpack.packb({**data, "status": data["status"][1:]}),
        lambda data: msgpack.packb([[[[]]]] * 3),
        lambda data: b"\x91" * 100_000,  # nested deeper than msgpack allows
        lambda data: None,
    ],
    ids=[
        "not msgpack",
        "wrong type",
        "unknown field",
        "other step",
        "not a slot",
        "short",
        "list",
        "deep",
        "gone",
    ],
)
def test_a_damaged_records_file_is_rebuilt_from_the_outputs(state_dir: Path, damage: Any):
    _build(state_dir)
    path = state_dir / "item.records"
    damaged = damage(_records(state_dir))
    if damaged is None:
        path.unlink()
    else:
        path.write_bytes(damaged)
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    with pipe:
        assert {"i": 4} == item(4)  # a skip reads the output, not the record
        with pytest.warns(
            ResumableWarning, match=r"item.records was .*; rebuilt the records of 30 completed"
        ):
            record = pipe.status().steps["item/4"]
        assert {"i": 31} == item(31)
    assert [31] == calls
    assert ("completed", record.file) == (
        pipe.status().steps["item/4"].status,
        _records(state_dir)["file"][4],
    )
    assert 31 == len(_records(state_dir)["slots"])  # written whole again


def test_a_damaged_records_file_and_a_lost_output(state_dir: Path):
    """A completed slot with neither a record nor its output runs again."""
    _build(state_dir)
    (state_dir / "item.records").write_bytes(b"")
    (state_dir / "item" / "4.msgpack").unlink()
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    assert "item/4" not in pipe.status().completed_steps  # readers drop it too (quietly)
    with pipe:
        with pytest.warns(ResumableWarning, match="rebuilt the records of 29 completed"):
            assert "item/4" not in pipe.status().completed_steps
        assert {"i": 4} == item(4)
    assert [4] == calls


def test_verify_checks_the_records_files(state_dir: Path, capsys: pytest.CaptureFixture[str]):
    _build(state_dir)
    assert 0 == main(["--state-dir", str(state_dir), "verify"])
    (state_dir / "item.records").write_bytes(msgpack.packb({"slots": 3}))
    capsys.readouterr()
    assert 1 == main(["--state-dir", str(state_dir), "verify"])
    out = capsys.readouterr().out
    assert "item.records: damaged (a missing or wrong field)" in out
    pipe, _ = _keyed(state_dir)
    with pytest.warns(ResumableWarning, match="rebuilt the records"), pipe:
        pipe.status()
    assert 0 == main(["--state-dir", str(state_dir), "verify"])


def test_signed_records(state_dir: Path):
    """With a secret the records file carries a mac; one written without it is rebuilt."""
    secret = b"k" * 32
    _build(state_dir, secret=secret)
    data = _records(state_dir)
    assert isinstance(data.pop("mac"), str)
    (state_dir / "item.records").write_bytes(msgpack.packb({**data, "bytes": [1] * 30}))
    pipe, _ = _keyed(state_dir, secret=secret)
    with pipe, pytest.warns(ResumableWarning, match="was not authentic"):
        assert 30 == sum(r.status == "completed" for r in pipe.status().steps.values())
    assert 1 != _records(state_dir)["bytes"][0]


def test_a_0_1_0_manifest_opens_and_is_written_in_the_new_layout(state_dir: Path):
    """0.1.0 kept every record in manifest.json (format 1): read as it is, written out at the next write."""
    _build(state_dir, 5)
    manifest = state_dir / "manifest.json"
    data = read_state(LocalStore(state_dir)).to_dict()  # the records inline, as 0.1.0 wrote them
    old = {**data, "format": 1}
    manifest.write_text(json.dumps(old, indent=2))
    (state_dir / "item.records").unlink()
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert data["steps"] == pipe.status().to_dict()["steps"]
        with pipe:
            for i in range(6):
                item(i)
    assert [5] == calls
    written = json.loads(manifest.read_text())
    assert (2, {}) == (written["format"], written["steps"])
    assert {"completed": 6} == written["keyed"]["item"]["status"]
    assert [f"item/{i}" for i in range(6)] == _records(state_dir)["slots"]


def test_a_state_left_running_reads_the_records_at_once(state_dir: Path):
    """A killed run's manifest says running: its running slots' records are what the next run needs."""
    _build(state_dir, 5)
    manifest = state_dir / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "status": "running"}))
    records = _records(state_dir)
    records["status"][2] = "running"
    (state_dir / "item.records").write_bytes(msgpack.packb(records))
    pipe, item = _keyed(state_dir)
    with pipe:
        assert "interrupted" == pipe.status().steps["item/2"].status
        item(2)
    assert "completed" == pipe.status().steps["item/2"].status


def test_records_read_by_one_thread_while_others_skip(state_dir: Path):
    """Skips (which ask is_completed without the lock) and a first use of the records, at once."""
    _build(state_dir, 200)
    calls: list[int] = []
    pipe, item = _keyed(state_dir, calls)
    errors: list[BaseException] = []
    with pipe:
        steps = pipe._session_for().journal.manifest.steps
        assert ["item"] == list(steps.deferred())
        start = threading.Barrier(5)

        def skip_all() -> None:
            try:
                start.wait()
                for i in range(200):
                    assert {"i": i} == item(i)
                    assert steps.is_completed(f"item/{i}")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=skip_all) for _ in range(4)]
        for thread in threads:
            thread.start()
        start.wait()
        assert "completed" == steps["item/150"].status  # reads the records meanwhile
        for thread in threads:
            thread.join()
    assert [] == errors
    assert [] == calls
    assert {} == steps.deferred()


def test_clean_removes_the_records_of_a_removed_step(state_dir: Path):
    _build(state_dir, 3)
    pipe = Pipeline(state_dir=state_dir)

    @pipe.step
    def other() -> int:
        return 1

    with pipe:
        other()
    assert 0 == main(["--state-dir", str(state_dir), "clean", "--older-than", "0s"])
    assert not (state_dir / "item.records").exists()
    assert "item" not in json.loads((state_dir / "manifest.json").read_text()).get("keyed", {})


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_load_state_refuses_a_damaged_or_forged_records_file(tmp_path: Path, secret: str | None):
    """docs/history.md: every file of the state data is checked before anything changes, records files too."""
    _build(tmp_path / "a", 5, secret=secret)
    pipe, _item = _keyed(tmp_path / "a", secret=secret)
    state = pipe.save_state()
    assert "item.records" in state["files"]
    target, _ = _keyed(tmp_path / "b", secret=secret)
    _build(tmp_path / "b", 2, secret=secret)
    before = (tmp_path / "b" / "item.records").read_bytes()
    forged = msgpack.unpackb(state["files"]["item.records"])
    forged["status"][0] = "failed"
    cases = [(b"\xc1garbage", "not msgpack")]
    if secret is not None:  # without a secret a well-formed file cannot be told from a real one
        cases.append((msgpack.packb(forged), "not authentic"))
    for bad, problem in cases:
        files = dict(state["files"], **{"item.records": bad})
        with pytest.raises(DamagedStateError, match=f"item.records: .*{problem}"):
            target.load_state(dict(state, files=files))
        assert before == (tmp_path / "b" / "item.records").read_bytes()


def test_a_manifest_naming_a_records_file_outside_the_state_is_damage(state_dir: Path):
    """A damaged manifest.json whose `keyed` names no step (a path, a NUL): `resumable export` still works."""
    _build(state_dir, 3)
    path = state_dir / "manifest.json"
    data = json.loads(path.read_text())
    data["keyed"]["../../outside"] = data["keyed"]["item"]
    data["keyed"]["nul\x00"] = data["keyed"]["item"]
    path.write_text(json.dumps(data))
    out = state_dir.parent / "export.msgpack"
    assert 0 == main(["--state-dir", str(state_dir), "export", "-o", str(out)])
    files = msgpack.unpackb(out.read_bytes())["files"]
    assert {"item.records", "manifest.json"} <= set(files)
    assert not any("outside" in key or "\x00" in key for key in files)
