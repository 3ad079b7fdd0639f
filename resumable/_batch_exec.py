"""
Running a batch's rows: in this thread, on an executor, or on the event loop. Each runner
commits every finished piece as one chunk; when an exception (Ctrl-C, a cancellation)
stops it, the rows already finished are committed before the exception goes on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

import attrs

from ._batch_input import Source
from ._batch_ledger import Ledger, RowFailure

if TYPE_CHECKING:
    import asyncio
    from concurrent.futures import Executor, Future

    from ._session import Loops

log = logging.getLogger("resumable")

T = TypeVar("T")

DEFAULT_CONCURRENCY = 16  # async calls in flight when concurrency= is not given
_OFF = frozenset({"0", "false", "no", "off"})
_ON = frozenset({"1", "true", "yes", "on"})
_PENDING: Any = object()  # a row not finished yet (its result may be None)


@attrs.define(kw_only=True)
class Job:
    """What one ``checkpointed_map`` call runs, and how."""

    fn: Callable[[Any], Any] = attrs.field(kw_only=False)
    record: bool  # on_error="record"
    progress: bool | None
    executor: Executor | None = None
    window: int = 0  # pieces submitted to the executor at once
    concurrency: int = 0  # async calls in flight


class Progress:
    """A tqdm bar on stderr, or nothing: see :func:`wanted`."""

    def __init__(self, setting: bool | None, ledger: Ledger) -> None:
        self.bar: Any = None
        if not wanted(setting):
            return
        from tqdm import tqdm  # type: ignore[import-untyped] # noqa: PLC0415 - only when a bar is shown; slow to import

        self._resumed = ledger.resumed
        self._failed = ledger.failures
        self.bar = tqdm(
            total=ledger.total,
            initial=ledger.resumed,
            desc=f"batch {ledger.display}",
            unit="row",
            dynamic_ncols=True,
            smoothing=0.1,
            file=sys.stderr,
            postfix=self._text(),
        )

    def _text(self) -> str | None:
        parts = [f"resumed {self._resumed:,}"] if self._resumed else []
        parts += [f"failed {self._failed:,}"] if self._failed else []
        return ", ".join(parts) or None

    def advance(self, rows: int, failed: int = 0) -> None:
        if self.bar is None:
            return
        if failed:
            self._failed += failed
            self.bar.set_postfix_str(self._text(), refresh=False)
        self.bar.update(rows)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()


def wanted(setting: bool | None) -> bool:
    """Whether to show a bar: ``RESUMABLE_PROGRESS=0`` wins, then *setting*, then ``=1`` or a terminal."""
    env = os.environ.get("RESUMABLE_PROGRESS", "").strip().lower()
    if env in _OFF:
        return False
    if setting is not None:
        return bool(setting)
    if env in _ON:
        return True
    stream = sys.stderr
    return stream is not None and stream.isatty()


_watching: list[int] = []  # the pid whose parent this worker process watches (set once)


def _exit_with_parent() -> None:
    """In a process pool's worker, exit once the run that started it died (checked every second)."""
    if _watching and _watching[0] == os.getpid():
        return
    parent = multiprocessing.parent_process()
    if parent is None or parent.pid is None:
        return  # not a multiprocessing child: nothing to watch
    _watching[:] = [os.getpid()]
    expected = parent.pid

    def watch() -> None:
        while os.getppid() == expected:
            time.sleep(1.0)
        os._exit(1)  # orphaned: the run that wanted these rows is gone

    threading.Thread(target=watch, name="resumable-parent-watch", daemon=True).start()


def run_chunk(fn: Callable[[Any], Any], rows: list[Any], start: int, record: bool) -> list[Any]:
    """Apply *fn* to a piece of rows (on an executor's worker)."""
    _exit_with_parent()
    if not record:
        return [fn(row) for row in rows]
    out = []
    for index, row in enumerate(rows, start):
        try:
            out.append(fn(row))
        except Exception as exc:  # noqa: BLE001 - on_error="record": every failure becomes a value
            out.append(RowFailure.of(index, exc))
    return out


# sequential --------------------------------------------------------------------------------


def run_sequential(ledger: Ledger, source: Source, job: Job, progress: Progress) -> None:
    """Apply the job's function row after row, committing every piece."""
    fn, record, bar = job.fn, job.record, progress.bar
    for start, rows in ledger.pieces(source):
        results: list[Any] = []
        append = results.append
        try:
            for row in rows:
                try:
                    append(fn(row))
                except Exception as exc:
                    if not record:
                        raise
                    append(RowFailure.of(start + len(results), exc))
                    progress.advance(0, failed=1)
                if bar is not None:
                    bar.update(1)
        except BaseException:
            ledger.salvage(start, rows[: len(results)], results)
            raise
        ledger.commit(start, rows, results)


class Checkpointed(Generic[T]):
    """
    What :func:`~resumable.checkpointed` returns: an iterator over the items not yet done,
    and :attr:`state`, the loop's own state, committed with every chunk and restored on resume.
    """

    __slots__ = ("__weakref__", "_owner", "_rows", "state")

    def __init__(
        self, ledger: Ledger, source: Source, setting: bool | None, state: dict[str, Any], owner: Loops | None
    ) -> None:
        ledger.open()
        ledger.restore_state(state)
        #: the loop state: as committed with the last finished row, then as the loop changes it
        self.state = state
        self._rows = _each(ledger, source, setting, state)
        self._owner = owner  # closes the loop if an exception leaves its step (or run)
        if owner is not None:
            owner.add(self)

    def __iter__(self) -> Checkpointed[T]:
        return self

    def __next__(self) -> T:
        try:
            row: T = next(self._rows)
        except StopIteration:
            self._done()
            raise
        return row

    def close(self) -> None:
        """Leave the loop: the rows finished so far are committed (as when it is left by ``break``)."""
        self._rows.close()
        self._done()

    def _done(self) -> None:
        if self._owner is not None:
            self._owner.discard(self)
            self._owner = None


def _each(
    ledger: Ledger, source: Source, setting: bool | None, state: dict[str, Any]
) -> Generator[Any, None, None]:
    """Yield the rows still to do; a row is done when the consumer asks for the next one."""
    with Progress(setting, ledger) as progress:
        for start, rows in ledger.pieces(source):
            done = 0
            try:
                for row in rows:
                    yield row
                    done += 1
                    progress.advance(1)
            except BaseException:  # the loop was left (GeneratorExit), or an exception thrown in
                ledger.salvage(start, rows[:done], state)
                raise
            ledger.commit(start, rows, state)
        ledger.finish()


# executors ---------------------------------------------------------------------------------


def workers_of(executor: Executor) -> int:
    """How many tasks *executor* runs at once (a guess for executors that do not say)."""
    count = getattr(executor, "_max_workers", None)
    if isinstance(count, int) and count > 0:
        return count
    client = getattr(executor, "_client", None)  # a dask.distributed ClientExecutor
    if client is not None:
        try:
            return max(1, int(sum(client.nthreads().values())))
        except Exception as exc:  # noqa: BLE001 - only a sizing hint
            log.debug("cannot count the workers of %r: %s", executor, exc)
    return os.cpu_count() or 1


def run_executor(ledger: Ledger, source: Source, job: Job, progress: Progress) -> None:
    """Run pieces on the job's executor, committing each as it finishes, in any order."""
    executor = job.executor
    assert executor is not None  # noqa: S101 - the caller chose this runner for it
    pending: dict[Future[list[Any]], tuple[int, list[Any]]] = {}
    try:
        for start, rows in ledger.pieces(source):
            pending[executor.submit(run_chunk, job.fn, rows, start, job.record)] = (start, rows)
            if len(pending) >= job.window:
                _drain(pending, ledger, job, progress)
        while pending:
            _drain(pending, ledger, job, progress)
    except BaseException as exc:
        for future in pending:
            future.cancel()
        if isinstance(exc, Exception):  # a row's error: pieces already running cannot be stopped,
            wait(list(pending))  # so their rows are kept (on Ctrl-C nothing is waited for)
        for future, (start, rows) in pending.items():
            if future.done() and not future.cancelled() and future.exception() is None:
                ledger.salvage(start, rows, future.result())
        ledger.report(force=True)
        raise


def _drain(
    pending: dict[Future[list[Any]], tuple[int, list[Any]]], ledger: Ledger, job: Job, progress: Progress
) -> None:
    """Wait for at least one piece; commit every piece that finished; raise a row's error."""
    done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
    failed = None
    for future in done:
        if future.exception() is not None:
            failed = failed or future
            continue
        start, rows = pending.pop(future)
        results = future.result()
        ledger.commit(start, rows, results)
        if progress.bar is not None:
            progress.advance(len(rows), sum(type(r) is RowFailure for r in results) if job.record else 0)
    if failed is not None:
        pending.pop(failed)
        failed.result()  # raises the row's exception


# async -------------------------------------------------------------------------------------


async def run_async(ledger: Ledger, source: Source, job: Job, progress: Progress) -> None:  # noqa: C901 - one scheduler and the two coroutines it runs
    """At most ``job.concurrency`` calls in flight over a few pieces; each piece committed when done."""
    import asyncio  # noqa: PLC0415 - only async steps need it; it takes longer to import than this package

    fn, record = job.fn, job.record
    in_flight = asyncio.Semaphore(job.concurrency)
    max_open = max(2, -(-job.concurrency // ledger.every) + 1)
    open_: dict[int, tuple[list[Any], list[Any]]] = {}  # start -> (rows, results so far)

    async def worker(start: int, rows: list[Any], results: list[Any], todo: Iterator[int]) -> None:
        for i in todo:
            async with in_flight:
                try:
                    results[i] = await fn(rows[i])
                except Exception as exc:
                    if not record:
                        raise
                    results[i] = RowFailure.of(start + i, exc)
                    progress.advance(0, failed=1)
            progress.advance(1)

    async def piece(start: int, rows: list[Any]) -> None:
        results = [_PENDING] * len(rows)
        open_[start] = (rows, results)
        todo = iter(range(len(rows)))
        workers = min(job.concurrency, len(rows))  # each takes the next row when its call ends
        calls = [asyncio.ensure_future(worker(start, rows, results, todo)) for _ in range(workers)]
        try:
            await asyncio.gather(*calls)
        finally:
            for task in calls:
                task.cancel()  # the others, when one failed
        del open_[start]
        await _commit(ledger, start, rows, results)

    running: set[asyncio.Future[None]] = set()

    async def settle(limit: int) -> None:
        nonlocal running
        while len(running) > limit:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            if (error := _first_error(done)) is not None:
                raise error

    try:
        for start, rows in ledger.pieces(source):
            await settle(max_open - 1)
            running.add(asyncio.ensure_future(piece(start, rows)))
        await settle(0)
    except BaseException:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running)
            _first_error(running)
        for start, (rows, results) in open_.items():
            for run_start, run_rows, run_results in _finished_runs(start, rows, results):
                ledger.salvage(run_start, run_rows, run_results)
        ledger.report(force=True)
        raise


async def _commit(ledger: Ledger, start: int, rows: list[Any], results: list[Any]) -> None:
    """Commit a finished piece; a durable commit (an fsync) off the event loop, finished even if cancelled."""
    import asyncio  # noqa: PLC0415 - see run_async

    if not ledger.durable:
        ledger.commit(start, rows, results)
        return
    commit = asyncio.ensure_future(asyncio.to_thread(ledger.commit, start, rows, results))
    try:
        await asyncio.shield(commit)
    except asyncio.CancelledError:
        await asyncio.wait([commit])
        _first_error({commit})  # rows it could not commit are done again next time
        raise


def _first_error(tasks: set[asyncio.Future[Any]]) -> BaseException | None:
    """The exception of one of *tasks* (each one's retrieved, so that asyncio does not log it)."""
    errors = [task.exception() for task in tasks if not task.cancelled()]
    return next((error for error in errors if error is not None), None)


def _finished_runs(
    start: int, rows: list[Any], results: list[Any]
) -> Iterator[tuple[int, list[Any], list[Any]]]:
    """Each run of consecutive finished rows of a piece: (its start, its rows, their results)."""
    i, n = 0, len(rows)
    while i < n:
        j = i
        while j < n and results[j] is not _PENDING:
            j += 1
        if j > i:
            yield start + i, rows[i:j], results[i:j]
        i = j + 1
