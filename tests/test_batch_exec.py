"""Batch helpers on executors, threads and the event loop; the progress bar."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import json
import sys
import threading
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from test_batch import change_chunk, chunks, flip_last_byte

from resumable import (
    BatchRecord,
    Pipeline,
    ResumableError,
    ResumableWarning,
    RowFailure,
    UsageError,
    checkpointed,
    checkpointed_map,
)
from resumable._batch_chunks import ChunkStore
from resumable._batch_exec import wanted, workers_of
from resumable._session import RunState


def square(x: int) -> int:
    """A module-level row function (process pools pickle it by reference)."""
    if x == 13:
        raise ValueError("thirteen")
    return x * x


class Rows:
    """A row function that counts its calls (thread-safe) and can fail at one row."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.calls: list[int] = []
        self.fail_at = fail_at
        self.delay = delay
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, x: int) -> int:
        with self._lock:
            self.threads.add(threading.current_thread().name)
            if x == self.fail_at:
                raise RuntimeError(f"boom at {x}")
            self.calls.append(x)
        time.sleep(self.delay)
        return -x


# executors -----------------------------------------------------------------------------


def test_thread_pool_commits_pieces_and_resumes(pipe: Pipeline, state_dir: Path):
    """On an executor, finished pieces are committed; an error propagates; the rerun does the rest."""
    fn = Rows(fail_at=42)
    with pipe, ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="boom at 42"):
        checkpointed_map(fn, range(100), every=10, name="t", executor=pool, concurrency=2)
    committed = {r for start, end, _ in chunks(state_dir, "named/t") for r in range(start, end)}
    assert set(range(40)) <= committed
    assert 42 not in committed
    fn.fail_at = None
    fn.calls.clear()
    with pipe, ThreadPoolExecutor(2) as pool:
        assert [-x for x in range(100)] == checkpointed_map(fn, range(100), every=10, name="t", executor=pool)
    assert set() == committed & set(fn.calls)
    assert set(range(100)) == committed | set(fn.calls)


def test_a_piece_still_running_when_another_fails_is_kept(pipe: Pipeline, state_dir: Path):
    """A row's error waits for the pieces already running on the executor: their paid work is committed."""
    failed = threading.Event()

    def fn(x: int) -> int:
        if x == 12:
            failed.set()
            raise RuntimeError("boom at 12")
        if x == 5:  # piece 0 is still running when piece 1 fails
            assert failed.wait(10)
            time.sleep(0.2)
        return -x

    with pipe, ThreadPoolExecutor(2) as pool, pytest.raises(RuntimeError, match="boom at 12"):
        checkpointed_map(fn, range(30), every=10, name="t", executor=pool, concurrency=2)
    committed = {r for start, end, _ in chunks(state_dir, "named/t") for r in range(start, end)}
    assert set(range(10)) == committed


def test_ctrl_c_does_not_wait_for_the_pieces_running(pipe: Pipeline, state_dir: Path):
    """A KeyboardInterrupt propagates at once: a piece still running is not waited for, nor committed."""
    interrupted = threading.Event()

    def fn(x: int) -> int:
        if x == 12:
            interrupted.set()
            raise KeyboardInterrupt
        if x == 5:  # piece 0 is still running when piece 1 is interrupted
            assert interrupted.wait(10)
            time.sleep(0.5)
        return -x

    with pipe, ThreadPoolExecutor(2) as pool, pytest.raises(KeyboardInterrupt):
        checkpointed_map(fn, range(30), every=10, name="t", executor=pool, concurrency=2)
    assert [] == chunks(state_dir, "named/t")


def test_process_pool_records_failures_from_workers(pipe: Pipeline):
    """A process pool runs pieces in other processes; RowFailure values come back from them."""
    with pipe, ProcessPoolExecutor(2) as pool:
        out = checkpointed_map(square, range(30), every=7, name="p", executor=pool, on_error="record")
    assert [RowFailure(13, "ValueError", "thirteen")] == [r for r in out if isinstance(r, RowFailure)]
    assert [x * x for x in range(30) if x != 13] == [r for r in out if not isinstance(r, RowFailure)]
    assert BatchRecord(done=30, every=7, total=30, failures=1) == pipe.status().batches["p"]


def test_concurrency_without_executor_uses_threads(pipe: Pipeline):
    """A sync fn with concurrency > 1 runs on that many threads, results in input order."""
    fn = Rows(delay=0.002)
    with pipe:
        assert [-x for x in range(50)] == checkpointed_map(fn, range(50), every=5, name="c", concurrency=3)
    assert all(name.startswith("resumable-batch") for name in fn.threads)
    assert 1 < len(fn.threads) <= 3


def test_interrupt_while_waiting_commits_finished_pieces(pipe: Pipeline, state_dir: Path):
    """Ctrl-C while waiting for an executor commits the pieces that finished, then propagates."""
    release = threading.Event()

    def slow(x: int) -> int:
        if x >= 10:
            release.wait(5)
        return x

    class Interrupting(ThreadPoolExecutor):
        submitted = 0

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            self.submitted += 1
            if self.submitted == 4:
                raise KeyboardInterrupt
            return super().submit(fn, *args, **kwargs)

    with pipe, Interrupting(2) as pool:
        try:
            with pytest.raises(KeyboardInterrupt):
                checkpointed_map(slow, range(40), every=5, name="k", executor=pool, concurrency=8)
        finally:
            release.set()
    assert [0, 5] == [start for start, _, _ in chunks(state_dir, "named/k")]


def test_workers_of_executors():
    """The default window follows the executor's workers, or the CPU count when it does not say."""

    class Bare(Executor):
        pass

    class Broken(Executor):
        class _client:  # noqa: N801 - mimics a Dask ClientExecutor's attribute
            @staticmethod
            def nthreads() -> dict[str, int]:
                raise OSError("scheduler gone")

    with ThreadPoolExecutor(3) as pool:
        assert 3 == workers_of(pool)
    assert workers_of(Bare()) >= 1
    assert workers_of(Broken()) >= 1


# async ---------------------------------------------------------------------------------


class AsyncRows:
    """An async row function that tracks the calls in flight."""

    def __init__(self, fail_at: int | None = None, delay: float = 0.001) -> None:
        self.calls: list[int] = []
        self.in_flight = 0
        self.most = 0
        self.fail_at = fail_at
        self.delay = delay
        self.target = 0
        self.event = asyncio.Event()

    async def reached(self, n: int) -> None:
        """Wait until *n* calls have finished."""
        self.target = n
        await self.event.wait()

    async def __call__(self, x: int) -> int:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await asyncio.sleep(self.delay * (1 + x % 3))
            if x == self.fail_at:
                raise RuntimeError(f"async boom at {x}")
            self.calls.append(x)
            if len(self.calls) == self.target:
                self.event.set()
            return x + 1000
        finally:
            self.in_flight -= 1


def test_async_keeps_at_most_concurrency_calls_in_flight(pipe: Pipeline):
    """An async fn returns an awaitable; results come in input order; at most `concurrency` in flight."""
    fn = AsyncRows()
    with pipe:
        result = asyncio.run(checkpointed_map(fn, range(200), every=10, name="a", concurrency=7))
    assert [x + 1000 for x in range(200)] == result
    assert 7 == fn.most
    assert sorted(fn.calls) == list(range(200))


def test_async_tasks_grow_with_concurrency_not_with_every(pipe: Pipeline):
    """A piece of 1,000 rows runs its calls from `concurrency` tasks, not a task per row waiting its turn."""
    most = 0

    async def fn(x: int) -> int:
        nonlocal most
        most = max(most, len(asyncio.all_tasks()))
        await asyncio.sleep(0)
        return x

    with pipe:
        assert list(range(3000)) == asyncio.run(
            checkpointed_map(fn, range(3000), every=1000, name="wide", concurrency=4)
        )
    assert most <= 1 + 2 * (1 + 4)  # the main task, and at most two open pieces with their calls


def test_async_error_commits_finished_rows_and_resumes(pipe: Pipeline, state_dir: Path):
    """A failing call commits every finished row (also inside open pieces); the rerun does the rest."""
    fn = AsyncRows(fail_at=57)
    with pipe, pytest.raises(RuntimeError, match="async boom at 57"):
        asyncio.run(checkpointed_map(fn, range(100), every=10, name="a", concurrency=8))
    committed = {r for start, end, _ in chunks(state_dir, "named/a") for r in range(start, end)}
    assert set(fn.calls) == committed
    assert 57 not in committed
    first = list(fn.calls)
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        assert [x + 1000 for x in range(100)] == asyncio.run(
            checkpointed_map(fn, range(100), every=10, name="a", concurrency=8)
        )
    assert set() == set(first) & set(fn.calls)
    assert set(range(100)) == set(first) | set(fn.calls)


def test_async_cancellation_commits_finished_rows(pipe: Pipeline, state_dir: Path):
    """Cancelling the awaiting task (as Ctrl-C does in asyncio.run) commits what finished."""
    fn = AsyncRows(delay=0.002)

    async def main() -> None:
        task = asyncio.ensure_future(checkpointed_map(fn, range(1000), every=10, name="c", concurrency=5))
        await fn.reached(40)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with pipe:
        asyncio.run(main())
    committed = {r for start, end, _ in chunks(state_dir, "named/c") for r in range(start, end)}
    assert set(fn.calls) == committed
    assert len(committed) >= 40


def test_async_map_awaited_after_its_run_closed_writes_nothing(pipe: Pipeline, state_dir: Path):
    """A batch made in `with pipe:` and awaited after the block refuses: its run holds no lock."""
    fn = AsyncRows()
    with pipe:
        pending = checkpointed_map(fn, range(10), every=3, name="late")
    events = (state_dir / "events.jsonl").read_bytes()
    with pytest.raises(ResumableError, match=r"batch 'late': its run has already ended .*inside the block"):
        asyncio.run(pending)
    assert [] == fn.calls
    assert events == (state_dir / "events.jsonl").read_bytes()
    assert not list(state_dir.glob(".resumable/batches/**/*.log"))


def test_async_map_whose_run_closes_while_it_runs_stops_writing(pipe: Pipeline, state_dir: Path):
    """A run closed while a batch task is in flight: its next commit refuses, nothing is written after."""
    fn = AsyncRows(delay=0.002)

    async def main() -> None:
        with pipe:
            task = asyncio.ensure_future(checkpointed_map(fn, range(1000), every=10, name="c", concurrency=5))
            await fn.reached(20)
        with pytest.raises(ResumableError, match="its run has already ended"):
            await task

    asyncio.run(main())
    finished = (state_dir / "events.jsonl").read_text().splitlines()[-1]
    assert '"run_finished"' in finished


def test_close_waits_for_a_batch_commit_under_way(
    pipe: Pipeline, state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """A run closing while another thread commits a chunk waits for it; the next commit raises."""
    entered, release = threading.Event(), threading.Event()
    add = ChunkStore.add

    def held_add(self: ChunkStore, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait(10)
        return add(self, *args, **kwargs)

    monkeypatch.setattr(ChunkStore, "add", held_add)
    errors: list[BaseException] = []

    def batch() -> None:
        try:
            checkpointed_map(square, range(12, 100), every=10, name="t", on_error="record")
        except ResumableError as exc:
            errors.append(exc)

    closing: list[RunState] = []
    close = RunState.close

    def noted_close(self: RunState, *args: Any, **kwargs: Any) -> None:
        closing.append(self)
        close(self, *args, **kwargs)

    monkeypatch.setattr(RunState, "close", noted_close)
    released: list[float] = []

    def let_go() -> None:  # once the close has begun, and had time to end if it did not wait
        deadline = time.monotonic() + 10
        while not (closing and closing[0].closing) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        released.append(time.monotonic())
        monkeypatch.setattr(ChunkStore, "add", add)
        release.set()

    with pipe:
        worker = threading.Thread(target=contextvars.copy_context().run, args=(batch,))
        worker.start()
        assert entered.wait(10)
        threading.Thread(target=let_go).start()
    closed = time.monotonic()
    worker.join(10)
    assert len(released) == 1
    assert released[0] <= closed  # the close waited for the commit under way
    assert ["its run has already ended"] == [str(e).partition(": ")[2][:25] for e in errors]
    events = [json.loads(line)["event"] for line in (state_dir / "events.jsonl").read_text().splitlines()]
    assert "run_finished" == events[-1]
    assert 1 == len(chunks(state_dir, "named/t"))  # the commit under way, and none after the close


def test_a_batch_write_goes_on_within_itself_while_its_run_closes(pipe: Pipeline):
    """A thread already writing for a batch may nest more writes while the close waits for it."""
    inside, closing_began, nested = threading.Event(), threading.Event(), []
    with pipe:
        run = pipe._session_for(None)  # the run a batch writes through

        def batch() -> None:
            with run.writing("batch 'b'"):
                inside.set()
                closing_began.wait(10)
                with run.writing("batch 'b'"):  # as a commit reporting its progress does
                    nested.append(run.closing)

        def once_closing() -> None:
            deadline = time.monotonic() + 10
            while not run.closing and time.monotonic() < deadline:
                time.sleep(0.01)
            closing_began.set()

        worker = threading.Thread(target=batch)
        worker.start()
        assert inside.wait(10)
        threading.Thread(target=once_closing).start()
    worker.join(10)
    assert [True] == nested


def test_a_write_left_counted_on_the_closing_thread_does_not_hang_the_close(pipe: Pipeline, state_dir: Path):
    """A batch write never counted off on this thread (Ctrl-C at the wrong instant) is not waited for."""

    after: list[BaseException] = []

    def leave_one() -> None:
        with pipe:
            run = pipe._session_for(None)
            run.writing("batch 'b'").__enter__()  # and no __exit__
        try:
            with run.writing("batch 'b'"):  # the run has given its lock up: no write gets through
                pass
        except ResumableError as exc:
            after.append(exc)

    closer = threading.Thread(target=contextvars.copy_context().run, args=(leave_one,), daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive()
    assert 1 == len(after)
    assert '"run_finished"' in (state_dir / "events.jsonl").read_text().splitlines()[-1]


def test_async_record_and_callable_objects(pipe: Pipeline):
    """on_error="record" in async mode; an object with an async __call__ counts as async."""
    fn = AsyncRows(fail_at=3)
    with pipe:
        out = asyncio.run(checkpointed_map(fn, range(6), every=4, name="r", on_error="record"))
    assert [1000, 1001, 1002, RowFailure(3, "RuntimeError", "async boom at 3"), 1004, 1005] == out
    assert 1 == pipe.status().batches["r"].failures


def test_async_failures_in_several_pieces_raise_one_and_log_none(
    pipe: Pipeline, caplog: pytest.LogCaptureFixture
):
    """Rows failing at once in several open pieces: one error is raised; asyncio logs no unretrieved one."""

    async def fn(x: int) -> int:
        await asyncio.sleep(0.01)
        if x % 10 == 3:
            raise ValueError(f"bad {x}")
        return x

    async def main() -> None:
        with pytest.raises(ValueError, match="bad"):
            await checkpointed_map(fn, range(100), every=10, name="f", concurrency=40)
        gc.collect()
        await asyncio.sleep(0.05)

    with pipe, caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert [] == [r.getMessage() for r in caplog.records if r.name == "asyncio"]


def test_async_fn_with_executor_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """An async fn runs on the event loop: executor= is refused, before any state is opened."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RESUMABLE_STATE_DIR", raising=False)

    async def fn(x: int) -> int:
        return x

    with ThreadPoolExecutor(1) as pool:
        for name in ("x", None):
            with pytest.raises(UsageError, match="executor="):
                checkpointed_map(fn, [1], name=name, executor=pool)
    assert [] == list(tmp_path.iterdir())


def test_async_step_batch_is_removed_at_completion(pipe: Pipeline, state_dir: Path):
    """Inside an async step, the batch belongs to the step and goes when it completes."""
    fn = AsyncRows(fail_at=15)

    @pipe.step
    async def enrich(n: int) -> list[int]:
        return await checkpointed_map(fn, range(n), every=4, concurrency=3)

    with pipe, pytest.raises(RuntimeError):
        asyncio.run(enrich(30))
    assert chunks(state_dir, "steps/enrich")
    fn.fail_at = None
    with pipe:
        assert [x + 1000 for x in range(30)] == asyncio.run(enrich(30))
    assert [] == [p for p in (state_dir / ".resumable" / "batches").rglob("*") if p.is_file()]


def test_async_not_durable_commits_on_the_loop(tmp_path: Path):
    """With durable=False, chunks are written directly from the event loop."""
    with Pipeline("nd", state_dir=tmp_path, durable=False):
        assert [1000, 1001] == asyncio.run(checkpointed_map(AsyncRows(), range(2), name="n"))


# progress ------------------------------------------------------------------------------


def test_progress_bar_shows_total_and_resumed_rows(
    pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """progress=True draws a bar on stderr with the total, the rows resumed and failures."""
    monkeypatch.delenv("RESUMABLE_PROGRESS")
    fail = Rows(fail_at=25)
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(fail, range(60), every=10, name="bar", progress=True)
    capsys.readouterr()
    with pipe:
        checkpointed_map(
            lambda x: 1 // (x - 30), range(60), every=10, name="bar", progress=True, on_error="record"
        )
    err = capsys.readouterr().err
    assert "batch bar" in err
    assert "60/60" in err
    assert "resumed 25" in err
    assert "failed 1" in err


@pytest.mark.parametrize(
    ("env", "setting", "tty", "expected"),
    [
        ("0", True, True, False),
        ("", None, True, True),
        ("", None, False, False),
        ("", True, False, True),
        ("", False, True, False),
        ("1", None, False, True),
    ],
)
def test_when_a_bar_is_shown(
    monkeypatch: pytest.MonkeyPatch, env: str, setting: bool | None, tty: bool, expected: bool
):
    """RESUMABLE_PROGRESS=0 always wins; then progress=; then RESUMABLE_PROGRESS=1 or a terminal."""
    monkeypatch.setenv("RESUMABLE_PROGRESS", env)

    class Stream:
        def isatty(self) -> bool:
            return tty

    monkeypatch.setattr(sys, "stderr", Stream())
    assert expected == wanted(setting)


def test_each_and_thread_pool_bars(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, capsys):
    """checkpointed and executor runs draw bars too."""
    monkeypatch.delenv("RESUMABLE_PROGRESS")
    with pipe, ThreadPoolExecutor(2) as pool:
        assert [0, 1, 2] == list(checkpointed(range(3), name="e", progress=True))
        checkpointed_map(
            square, range(20), every=5, name="x", executor=pool, progress=True, on_error="record"
        )
        asyncio.run(
            checkpointed_map(AsyncRows(fail_at=2), range(4), name="y", progress=True, on_error="record")
        )
    err = capsys.readouterr().err
    assert "batch e" in err
    assert "batch x" in err
    assert "batch y" in err
    assert "failed 1" in err


def test_async_damaged_chunk_is_redone(pipe: Pipeline, state_dir: Path):
    """Async batches redo the rows of a damaged chunk too."""
    fn = AsyncRows()
    with pipe:
        asyncio.run(checkpointed_map(fn, range(8), every=4, name="d"))
    change_chunk(state_dir / ".resumable" / "batches" / "named" / "d", 4, flip_last_byte)
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="damaged"):
        assert [x + 1000 for x in range(8)] == asyncio.run(checkpointed_map(fn, range(8), every=4, name="d"))
    assert [4, 5, 6, 7] == sorted(fn.calls)
