"""Checkpoints, rollback, and the whole state as data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from resumable import (
    Checkpoint,
    DamagedStateError,
    Pipeline,
    ResumableError,
    ResumableWarning,
    StateFormatError,
    StateLockedError,
    UsageError,
)
from resumable._cli import main
from resumable._codec import parse_header
from resumable._diff import side_at
from resumable._stores._local import LocalStore


def _prompt_pipeline(state_dir: Path, calls: list[str] | None = None, **options) -> Pipeline:
    """prompt -> answer -> score, like iterating on an agent's prompt."""
    pipe = Pipeline("agent", state_dir=state_dir, **options)
    calls = calls if calls is not None else []

    @pipe.step
    def prompt(text: str) -> str:
        calls.append("prompt")
        return f"You are helpful. {text}"

    @pipe.step
    def answer(prompt: str) -> str:
        calls.append("answer")
        return prompt.upper() * 50

    @pipe.step
    def score(answer: str) -> int:
        calls.append("score")
        return len(answer)

    return pipe


def _files(state_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in state_dir.glob("*.msgpack")}


def test_a_checkpoint_per_completed_step(state_dir: Path):
    """Each completed step makes a checkpoint with the slots completed by then."""
    pipe = _prompt_pipeline(state_dir)
    pipe.run(text="v1")
    points = pipe.checkpoints()
    assert [1, 2, 3] == [c.id for c in points]
    assert ["prompt", "answer", "score"] == [c.slot for c in points]
    assert [["prompt"], ["prompt", "answer"], ["prompt", "answer", "score"]] == [
        c.completed_steps for c in points
    ]
    assert all(isinstance(c, Checkpoint) and c.created_at for c in points)


def test_rollback_by_step_restores_overwritten_outputs_byte_for_byte(state_dir: Path):
    """Rolling back before a step's last run brings its earlier output back, exactly."""
    calls: list[str] = []
    pipe = _prompt_pipeline(state_dir, calls)
    pipe.run(text="v1")
    before = _files(state_dir)
    pipe.run(text="v2")
    assert before["answer.msgpack"] != (state_dir / "answer.msgpack").read_bytes()
    restored = pipe.rollback("prompt")
    assert 3 == restored.id
    assert before == _files(state_dir)
    run = pipe.run(text="v1")
    assert ([], ["prompt", "answer", "score"]) == (run.executed, run.skipped)
    assert 50 * len("YOU ARE HELPFUL. V1") == run.outputs["score"]
    assert ["prompt", "answer", "score"] * 2 == calls


def test_rollback_by_id_and_label(state_dir: Path):
    """A checkpoint id or a snapshot label names the state to restore."""
    pipe = _prompt_pipeline(state_dir)
    pipe.run(text="v1")
    label = pipe.snapshot("before-prompt-change")
    assert (4, "before-prompt-change", None) == (label.id, label.label, label.slot)
    v1 = _files(state_dir)
    pipe.run(text="v2")
    v2 = _files(state_dir)
    assert v1 == _files_after(pipe.rollback("before-prompt-change"), state_dir)
    assert v2 == _files_after(pipe.rollback(7), state_dir)
    assert v1 == _files_after(pipe.rollback("4"), state_dir)
    assert {} == _files_after(pipe.rollback(0), state_dir)
    assert [] == pipe.status().completed_steps


def _files_after(_checkpoint: Checkpoint, state_dir: Path) -> dict[str, bytes]:
    return _files(state_dir)


def test_rollback_errors(state_dir: Path):
    """Unknown or pruned targets are clear errors and change nothing."""
    pipe = _prompt_pipeline(state_dir, keep_checkpoints=2)
    pipe.run(text="v1")
    pipe.run(text="v2")
    before = _files(state_dir)
    with pytest.raises(UsageError, match="no checkpoint, snapshot label or step 'nope'"):
        pipe.rollback("nope")
    with pytest.raises(ResumableError, match=r"checkpoint 1 can no longer be restored.*keep_checkpoints"):
        pipe.rollback(1)  # prompt's v1 output was pruned: only the two newest checkpoints are kept
    with pytest.raises(ResumableError, match="checkpoint 9 does not exist"):
        pipe.rollback(9)
    assert [5, 6] == [c.id for c in pipe.checkpoints()]
    with pytest.raises(ResumableError, match="label"):
        pipe.snapshot("")
    assert before == _files(state_dir)


def test_a_step_named_after_a_rollback_whose_checkpoint_is_gone_is_an_error(state_dir: Path):
    """
    "Before step y" is the checkpoint a rollback restored just before y ran: once the history's
    base has passed it, rollback and diff say it is no longer kept, never use the base instead.
    """
    pipe = Pipeline("p", state_dir=state_dir, keep_checkpoints=56)

    @pipe.step(key="{i}")
    def s(i: int) -> int:
        return i

    @pipe.step
    def y() -> str:
        return "y"

    with pipe:
        for i in range(1, 61):
            s(i)
    pipe.rollback(5)
    with pipe:
        y()
        for i in range(61, 110):
            s(i)
    with pytest.raises(UsageError, match="checkpoint 5 does not exist or is no longer kept"):
        pipe.rollback("y")
    with pytest.raises(UsageError, match="checkpoint 5 does not exist or is no longer kept"):
        side_at(".", pipe.store, None, "y")


def test_keep_checkpoints_prunes_old_versions(state_dir: Path):
    """Versions only pruned checkpoints needed are deleted when a run closes."""
    pipe = _prompt_pipeline(state_dir, keep_checkpoints=3)
    for i in range(6):
        pipe.run(text=f"v{i}")
    objects = state_dir / ".resumable" / "objects"
    assert 3 == len(pipe.checkpoints())
    # The three newest checkpoints are the last run's. The first of them (prompt v5 done)
    # still has answer and score of v4: those two versions stay, the other twelve went.
    assert 2 == len(list(objects.glob("*.msgpack")))
    pipe.rollback(pipe.checkpoints()[0].id)
    assert "You are helpful. v5" == pipe.run(text="v5").outputs["prompt"]


def test_checkpoints_share_unchanged_outputs(state_dir: Path):
    """50 checkpoints of a pipeline with a 100 MB unchanged output add less than 1% disk."""
    pipe = Pipeline("big", state_dir=state_dir, keep_checkpoints=100, durable=False)
    array = np.arange(100 * 1024 * 1024 // 8, dtype=np.float64)

    @pipe.step
    def big() -> np.ndarray:
        return array

    @pipe.step
    def small(n: int) -> int:
        return n

    with pipe:
        big()

    def disk() -> int:
        return sum(p.stat().st_blocks * 512 for p in state_dir.rglob("*") if p.is_file())

    first = disk()
    for n in range(50):
        with pipe:
            big()
            small(n)
    assert 50 <= len(pipe.checkpoints())
    assert disk() - first < first / 100


def test_reset_keeps_the_version_for_rollback(state_dir: Path):
    """A reset output can be brought back by rolling back."""
    pipe = _prompt_pipeline(state_dir)
    pipe.run(text="v1")
    before = _files(state_dir)
    pipe.reset("answer")
    assert {"prompt.msgpack"} == set(_files(state_dir))
    pipe.rollback(3)
    assert before == _files(state_dir)


def test_save_and_load_state_between_directories(tmp_path: Path):
    """save_state is plain data; load_state elsewhere resumes with every step skipped."""
    calls: list[str] = []
    source = _prompt_pipeline(tmp_path / "a", calls)
    source.run(text="v1")
    state = source.save_state()
    data = msgpack.unpackb(msgpack.packb(state), raw=False)  # survives msgpack as is
    target = _prompt_pipeline(tmp_path / "b", calls)
    target.load_state(data)
    run = target.run(text="v1")
    assert ([], ["prompt", "answer", "score"]) == (run.executed, run.skipped)
    assert ["prompt", "answer", "score"] == calls
    assert [c.id for c in source.checkpoints()] == [c.id for c in target.checkpoints()]


def test_load_state_refuses_damaged_data_and_changes_nothing(tmp_path: Path):
    """A truncated or damaged state is refused; the current state stays as it was."""
    source = _prompt_pipeline(tmp_path / "a")
    source.run(text="v1")
    state = source.save_state()
    target = _prompt_pipeline(tmp_path / "b")
    target.run(text="other")
    before = _files(tmp_path / "b")
    damaged = dict(state, files=dict(state["files"]))
    answer = bytearray(damaged["files"]["answer.msgpack"])
    answer[-3] ^= 0xFF
    damaged["files"]["answer.msgpack"] = bytes(answer)
    truncated = dict(state, files=dict(state["files"]))
    truncated["files"]["prompt.msgpack"] = truncated["files"]["prompt.msgpack"][:40]
    for bad, match in [
        (damaged, "answer.msgpack: checksum mismatch"),
        (truncated, "prompt.msgpack"),
        ({"files": {}}, "not resumable state data"),
        ("nonsense", "not resumable state data"),
        (dict(state, files={"../escape.msgpack": b"x"}), "not a valid state file name"),
    ]:
        with pytest.raises(DamagedStateError, match=match):
            target.load_state(bad)
        assert before == _files(tmp_path / "b")
    with pytest.raises(StateFormatError):
        target.load_state(dict(state, format=99))


def test_load_state_with_another_secret_is_refused(tmp_path: Path):
    """State signed with one secret does not load into a pipeline with another."""
    source = _prompt_pipeline(tmp_path / "a", secret="one")
    source.run(text="v1")
    target = _prompt_pipeline(tmp_path / "b", secret="two")
    with pytest.raises(DamagedStateError, match="authentication failed"):
        target.load_state(source.save_state())


def test_history_operations_refuse_while_another_run_holds_the_lock(state_dir: Path):
    """rollback, snapshot, save_state and load_state need the lock, which another process holds."""
    pipe = _prompt_pipeline(state_dir)
    pipe.run(text="v1")
    script = (
        "import sys\nfrom resumable import Pipeline\n"
        f"with Pipeline('agent', state_dir={str(state_dir)!r}):\n"
        "    print('holding', flush=True)\n    sys.stdin.readline()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    holder = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None
        assert "holding\n" == holder.stdout.readline()
        for call in (
            lambda: pipe.rollback(1),
            lambda: pipe.snapshot("x"),
            lambda: pipe.save_state(),
            lambda: pipe.checkpoints(),
        ):
            with pytest.raises(StateLockedError, match=f"pid {holder.pid}"):
                call()
    finally:
        holder.communicate("\n", timeout=60)


def test_rollback_inside_an_open_run(state_dir: Path):
    """Inside a with block the run's own lock is used, and later calls see the rolled-back state."""
    calls: list[str] = []
    pipe = _prompt_pipeline(state_dir, calls)
    with pipe:
        pipe.run(text="v1")
        pipe.run(text="v2")
        pipe.rollback("prompt")
        run = pipe.run(text="v1")
    assert [] == run.executed


def _all_files(root: Path) -> dict[str, bytes]:
    """Every file under *root* (internal files too, the lock aside), by relative path."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file() and p.name != "lock"
    }


@pytest.mark.parametrize(
    ("damage", "named"),
    [("answer.msgpack", "answer.msgpack"), ("manifest.json", "manifest.json"), ("steps=[]", "manifest.json")],
)
def test_import_of_a_damaged_archive_changes_nothing(tmp_path: Path, damage: str, named: str):
    """`resumable import` of an archive with one bad file fails naming it; no byte changes."""
    source = _prompt_pipeline(tmp_path / "a")
    source.run(text="v1")
    exported = tmp_path / "export"
    assert 0 == main(["--state-dir", str(tmp_path / "a"), "export", "-o", str(exported)])
    state = msgpack.unpackb(exported.read_bytes(), raw=False)
    files = state["files"]
    if damage == "steps=[]":
        files["manifest.json"] = files["manifest.json"].replace(b'"steps": {', b'"steps": [], "x": {')
    else:
        data = bytearray(files[damage])
        data[-3] ^= 0xFF
        files[damage] = bytes(data)
    exported.write_bytes(msgpack.packb(state, use_bin_type=True))
    target = _prompt_pipeline(tmp_path / "b")
    target.run(text="other")
    before = _all_files(tmp_path / "b")
    with pytest.raises(DamagedStateError, match=named):
        target.load_state(state)
    assert 1 == main(["--state-dir", str(tmp_path / "b"), "import", str(exported)])
    assert before == _all_files(tmp_path / "b")


def test_import_that_fails_half_way_puts_everything_back(tmp_path: Path):
    """A write failing in the middle of load_state (a full disk) restores the previous files."""

    class FailingStore(LocalStore):
        writes = 0

        def write(self, key: str, chunks, *, durable: bool) -> None:  # type: ignore[no-untyped-def]
            FailingStore.writes += 1
            if FailingStore.writes == 3:
                raise OSError(28, "No space left on device", self.path(key))
            super().write(key, chunks, durable=durable)

    source = _prompt_pipeline(tmp_path / "a")
    source.run(text="v1")
    state = source.save_state()
    target = _prompt_pipeline(tmp_path / "b")
    target.run(text="other")
    before = _all_files(tmp_path / "b")
    failing = Pipeline("agent", store=FailingStore(tmp_path / "b"))
    with pytest.raises(OSError, match="No space left"):
        failing.load_state(state)
    assert 3 <= FailingStore.writes
    assert before == _all_files(tmp_path / "b")


def test_old_history_folds_into_a_base_and_nothing_retained_changes(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """After many runs, history older than the retained checkpoints is a base: same listing, same rollbacks."""
    from resumable import _history

    monkeypatch.setattr(_history, "BASE_AFTER", 5)
    pipe = _prompt_pipeline(state_dir, keep_checkpoints=3)
    for i in range(8):
        pipe.run(text=f"v{i}")
    base = state_dir / ".resumable" / "history-base.msgpack"
    assert base.exists()
    assert [22, 23, 24] == [c.id for c in pipe.checkpoints()]  # 8 runs x 3 steps: the newest three
    points = _history.replay(LocalStore(state_dir), None)
    assert points[0].checkpoint.id > 1  # the replay starts at the base, not at the first checkpoint
    with pytest.raises(
        UsageError, match=r"checkpoint 2 does not exist or is no longer kept \(the latest is 24\)"
    ):
        pipe.rollback(2)
    before_rollback = pipe.rollback("answer")  # the state just before answer last completed
    assert 22 == before_rollback.id
    assert "You are helpful. v7" == pipe.run(text="v7").outputs["prompt"]
    # the base's checkpoint is in its header: a close decodes the base once (to replay), not twice
    header, _ = parse_header(base.read_bytes())
    assert _history.replay(LocalStore(state_dir), None)[0].checkpoint.id == header["checkpoint"]
    decoded = []
    replay_start = _history._replay_start

    def counted(*args: Any) -> Any:
        decoded.append(1)
        return replay_start(*args)

    with monkeypatch.context() as patch:
        patch.setattr(_history, "_replay_start", counted)
        pipe.run(text="v7")
    assert 1 == len(decoded)
    # a damaged base is not trusted: the whole log is replayed, and the listing is the same
    expected = [(c.id, c.slot, c.completed_steps) for c in pipe.checkpoints()]
    data = bytearray(base.read_bytes())
    data[-1] ^= 1
    base.write_bytes(bytes(data))
    assert expected == [(c.id, c.slot, c.completed_steps) for c in pipe.checkpoints()]


def test_a_rollback_logs_what_it_changed_and_replays_to_the_same_state(state_dir: Path):
    """Rolling back a few checkpoints in a state of many slots logs a few records, not all of them."""
    pipe = Pipeline("many", state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int, v: int = 1) -> int:
        return i * v

    with pipe:
        for i in range(300):
            item(i)
        for i in range(3):
            item(i, 2)  # three slots rerun: three checkpoints to undo
    log = state_dir / "events.jsonl"
    size = log.stat().st_size
    target = pipe.checkpoints()[-4]
    pipe.rollback(target.id)
    events = [json.loads(line) for line in log.read_bytes()[size:].splitlines()]
    rollback = next(e for e in events if e["event"] == "rollback")
    assert "state" not in rollback
    assert {f"item/{i}" for i in range(3)} == set(rollback["changes"]["steps"])
    assert len(rollback["changes"]["drop"]) <= 3
    assert len(rollback["changes"]["insert"]) <= 3
    after = pipe.status()
    assert target.completed_steps == after.completed_steps
    # the log alone gives the same state: the manifest rebuilt from it agrees
    (state_dir / "manifest.json").unlink()
    with pytest.warns(ResumableWarning, match="manifest.json was missing"), pipe:
        pass
    rebuilt = pipe.status()
    assert (after.completed_steps, after.steps) == (rebuilt.completed_steps, rebuilt.steps)
    with pipe:
        assert [0, 1, 2] == [item(i) for i in range(3)]  # the rolled-back outputs, skipped


@given(
    st.lists(st.sampled_from([f"s{i}" for i in range(12)]), unique=True),
    st.lists(st.sampled_from([f"s{i}" for i in range(12)]), unique=True),
)
def test_the_reorder_a_rollback_logs_gives_the_list_rolled_back_to(before: list[str], after: list[str]):
    from resumable import _history

    drop, insert = _history._reorder(before, after)
    dropped = set(drop)
    result = [slot for slot in before if slot not in dropped]
    for index, slot in insert:
        result.insert(index, slot)
    assert after == result
    assert len(insert) <= len(after)
    if before[: len(after)] == after:  # only later completions to undo: nothing moves
        assert [] == insert


def test_replays_read_the_log_in_pieces_and_stop_after_the_last_checkpoint(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """Lines longer than a piece, pieces cut mid-line, and skips after the last checkpoint: the same history."""
    from resumable import _history

    pipe = _prompt_pipeline(state_dir)
    for i in range(3):
        pipe.run(text=f"v{i}")
    for _ in range(3):
        pipe.run(text="v2")  # skip runs: log lines after the last checkpoint
    expected = [(c.id, c.slot, c.completed_steps) for c in pipe.checkpoints()]
    monkeypatch.setattr(_history, "_LOG_PIECE", 37)  # every line crosses pieces
    read: list[int] = []
    events_from = _history._events_from

    def counted(store: Any, secret: Any, start: int) -> Any:
        for offset, event in events_from(store, secret, start):
            read.append(offset)
            yield offset, event

    monkeypatch.setattr(_history, "_events_from", counted)
    assert expected == [(c.id, c.slot, c.completed_steps) for c in pipe.checkpoints()]
    log_size = (state_dir / "events.jsonl").stat().st_size
    assert max(read) < log_size  # the skip runs at the end were not read
    assert "You are helpful. v1" == pipe.run(text="v1").outputs["prompt"]
    pipe.rollback(expected[-1][0])
    assert "You are helpful. v2" == pipe.run(text="v2").outputs["prompt"]


def _random_history(state_dir: Path, seed: int) -> Pipeline:
    """A state with a random history: stores, reruns, resets, failures, snapshots and rollbacks."""
    import random

    rng = random.Random(seed)  # noqa: S311 - a reproducible history, not a secret
    pipe = Pipeline("mixed", state_dir=state_dir)

    @pipe.step(key="{i}")
    def item(i: int, v: int = 1) -> int:
        if os.environ.get("RESUMABLE_TEST_FAIL") == str(i):  # not a closure value: those are fingerprinted
            raise ValueError(i)
        return i * v

    for _ in range(14):
        op = rng.choice(["run", "run", "run", "reset", "fail", "snapshot", "rollback"])
        if op == "run":
            with pipe:
                for _ in range(rng.randint(1, 6)):
                    item(rng.randrange(8), rng.choice([1, 2, 3]))
        elif op == "reset" and pipe.status().completed_steps:
            pipe.reset(rng.choice(pipe.status().completed_steps), downstream=False)
        elif op == "fail":
            i = rng.randrange(8)
            os.environ["RESUMABLE_TEST_FAIL"] = str(i)
            try:
                with pytest.raises(ValueError), pipe:
                    item(i, 5)
            finally:
                del os.environ["RESUMABLE_TEST_FAIL"]
        elif op == "snapshot":
            pipe.snapshot(f"s{rng.randrange(100)}")
        elif pipe.checkpoints():
            pipe.rollback(rng.choice(pipe.checkpoints()).id)
    return pipe


def test_a_replay_of_the_checkpoints_asked_for_gives_them_their_state(tmp_path: Path):
    """Listing, pruning and a new history base replay the checkpoints asked for: their versions, their base."""
    import random

    from resumable import _history

    def fields(p: Any) -> tuple[Any, ...]:
        c = p.checkpoint
        return c.id, c.created_at, c.slot, c.label, p.after_rollback

    for seed in range(10):
        state = tmp_path / f"s{seed}"
        _random_history(state, seed)
        store = LocalStore(str(state))
        whole = {p.checkpoint.id: p for p in _history.replay(store, None)}
        rng = random.Random(seed)  # noqa: S311 - which checkpoints to ask for, reproducibly
        for _ in range(4):
            want = set(rng.sample(sorted(whole), min(len(whole), rng.randint(1, 5))))
            base_at = rng.choice([None, *whole])
            points = _history.replay(store, None, want, base_at=base_at)
            assert want | ({base_at} - {None}) == {p.checkpoint.id for p in points}, (seed, want, base_at)
            assert [fields(whole[p.checkpoint.id]) for p in points] == [fields(p) for p in points]
            for point, versions in _history._each_versions(points):  # the versions the records say
                restored = _history._state_at(store, None, point.checkpoint.id)
                steps = restored.steps or {}
                assert {s: r.file for s, r in steps.items() if r.status == "completed"} == versions
                assert restored.checkpoint.completed_steps == point.checkpoint.completed_steps
            for point in points:
                assert (point.base is not None) == (point.checkpoint.id == base_at)
                if point.base is not None:
                    offset, manifest = point.base
                    assert (b"\n", base_at) == (
                        store.read("events.jsonl", offset - 1, offset),
                        manifest["checkpoints"],
                    )
