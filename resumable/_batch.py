"""
Rows committed in chunks: ``checkpointed`` and ``checkpointed_map``. Which rows are
committed is :mod:`resumable._batch_ledger`'s; running them, :mod:`resumable._batch_exec`'s.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, overload

from ._batch_exec import (
    DEFAULT_CONCURRENCY,
    Checkpointed,
    Job,
    Progress,
    run_async,
    run_executor,
    run_sequential,
    workers_of,
)
from ._batch_input import Source
from ._batch_ledger import DamagedChunksError, Ledger, RowFailure, Where, ledger_for
from ._context import current_pipeline, disabled
from ._session import current_execution
from ._slots import batch_dir, check_name
from .exceptions import ResumableError, StepDefinitionError, UsageError

__all__ = ["Checkpointed", "RowFailure", "checkpointed", "checkpointed_map"]

T = TypeVar("T")
R = TypeVar("R")


def checkpointed(
    items: Iterable[T],
    *,
    every: int = 100,
    name: str | None = None,
    progress: bool | None = None,
    state: dict[str, Any] | None = None,
) -> Checkpointed[T]:
    """
    Iterate over the items not done yet, committing progress every *every* items.

    An item is done when the loop body has finished with it (when the loop asks for the
    next one). Progress is also committed at the end, and when the loop is left by an
    exception, ``break`` or Ctrl-C; the item the loop was on then counts as not done. For
    loops with side effects (writing to a database, sending requests)::

        for row in checkpointed(rows, every=500):
            db.insert(row)

    Items done by an earlier run never reach the loop body again, so anything the body
    accumulates (a counter, a total) must live in *state*: a dict committed with every
    chunk and restored on resume, as ``.state`` of the returned iterator::

        loop = checkpointed(rows, every=500, state={"sent": 0, "errors": 0})
        for row in loop:
            ...
            loop.state["sent"] += 1

    Its values must be storable without pickle where pickle is off (numbers, strings,
    lists, dicts ...); keep it small: it is written with every chunk.

    Inside a step the batch belongs to the step; outside, pass *name*. A progress bar is
    shown on a terminal (see :func:`checkpointed_map` for *progress*).

    Raises:
        ResumableError: outside a step without *name*, or *name* is not a valid name.
        UsageError: *every* is not a positive int, or *state* is not a dict.
        InputChangedError: the items differ from those of the run being resumed.
    """
    _check_positive("every", every, "rows per chunk")
    if state is None:
        state = {}
    elif not isinstance(state, dict):
        msg = f"checkpointed(state=...) must be a dict, got {type(state).__name__}"
        raise UsageError(msg)
    source = Source(items)
    where = _locate(name, "checkpointed", items)
    ledger = ledger_for(where, kind="each", every=every, total=source.total)
    execution = current_execution.get()
    owner = None if where is None else execution.loops if execution is not None else where.run.loops
    return Checkpointed(ledger, source, progress, state, owner)


@overload
def checkpointed_map(  # type: ignore[overload-overlap] # an async fn returns an awaitable
    fn: Callable[[T], Awaitable[R]],
    items: Iterable[T],
    *,
    every: int = 100,
    name: str | None = None,
    executor: None = None,
    concurrency: int | None = None,
    on_error: Literal["raise"] = "raise",
    progress: bool | None = None,
) -> Coroutine[Any, Any, list[R]]: ...
@overload
def checkpointed_map(  # type: ignore[overload-overlap] # an async fn returns an awaitable
    fn: Callable[[T], Awaitable[R]],
    items: Iterable[T],
    *,
    every: int = 100,
    name: str | None = None,
    executor: None = None,
    concurrency: int | None = None,
    on_error: Literal["record"],
    progress: bool | None = None,
) -> Coroutine[Any, Any, list[R | RowFailure]]: ...
@overload
def checkpointed_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    every: int = 100,
    name: str | None = None,
    executor: Executor | None = None,
    concurrency: int | None = None,
    on_error: Literal["raise"] = "raise",
    progress: bool | None = None,
) -> list[R]: ...
@overload
def checkpointed_map(
    fn: Callable[[T], R],
    items: Iterable[T],
    *,
    every: int = 100,
    name: str | None = None,
    executor: Executor | None = None,
    concurrency: int | None = None,
    on_error: Literal["record"],
    progress: bool | None = None,
) -> list[R | RowFailure]: ...
def checkpointed_map(  # noqa: PLR0913 - the documented options
    fn: Callable[[Any], Any],
    items: Iterable[Any],
    *,
    every: int = 100,
    name: str | None = None,
    executor: Executor | None = None,
    concurrency: int | None = None,
    on_error: Literal["raise", "record"] = "raise",
    progress: bool | None = None,
) -> Any:
    """
    Apply *fn* to every item, committing results every *every* rows.

    A rerun after a crash skips the committed rows and returns the same list an
    uninterrupted run would have: after a kill, at most the rows since the last commit
    are processed again. Results are stored as append-only chunks of *every* rows, so a
    commit writes only its own rows.

    - Inside a step the batch belongs to the step's slot, and its chunks are removed when
      the step completes. Outside a step, *name* is required.
    - *executor*: any :class:`concurrent.futures.Executor` (a process pool; a Dask client's
      ``get_executor()``). Pieces of *every* rows run on it in parallel and each is
      committed as it finishes, in any order; only the calling process writes state.
      *concurrency* then caps the pieces submitted at once (default: twice its workers).
    - An ``async def`` *fn* makes this return an awaitable that keeps at most
      *concurrency* calls in flight (default 16). A sync *fn* with *concurrency* > 1 and
      no executor runs on that many threads.
    - *on_error*: ``"raise"`` commits the rows finished so far and re-raises the row's
      exception; ``"record"`` puts a :class:`RowFailure` in the failed row's place, goes
      on, and counts failures in the manifest.
    - *progress*: a progress bar on stderr (total, rate, ETA, rows resumed). By default
      shown only on a terminal; ``True`` forces it, ``False`` hides it, and
      ``RESUMABLE_PROGRESS=0`` turns it off everywhere.

    Raises:
        ResumableError: outside a step without *name*, or *name* is not a valid name.
        InputChangedError: *items* differ from those of the run being resumed.
        SerializationError: a result cannot be stored.
    """
    _check_positive("every", every, "rows per chunk")
    if concurrency is not None:
        _check_positive("concurrency", concurrency, "or None")
    if on_error not in {"raise", "record"}:
        msg = f"on_error must be 'raise' or 'record', got {on_error!r}"
        raise UsageError(msg)
    if executor is not None and _is_async(fn):
        msg = (
            "checkpointed_map(): an async fn runs on the event loop, so executor= cannot be "
            "used with it; use concurrency= to run calls concurrently"
        )
        raise UsageError(msg)
    record = on_error == "record"
    source = Source(items)
    where = _locate(name, "checkpointed_map", items)  # after every usage check: it may open a run
    if _is_async(fn):
        job = Job(fn, record=record, progress=progress, concurrency=concurrency or DEFAULT_CONCURRENCY)
        return _map_async(job, where, source, every)
    window = 0  # pieces submitted to an executor at once
    with contextlib.ExitStack() as stack:
        if executor is not None:
            executor = _as_executor(executor)
            window = concurrency or 2 * workers_of(executor)
        elif concurrency is not None and concurrency > 1:
            executor = stack.enter_context(
                ThreadPoolExecutor(concurrency, thread_name_prefix="resumable-batch")
            )
            window = 2 * concurrency
        job = Job(fn, record=record, progress=progress, executor=executor, window=window)
        return _map(job, where, source, every)


def _map(job: Job, where: Where | None, source: Source, every: int) -> list[Any]:
    runner = run_sequential if job.executor is None else run_executor
    for attempt in range(3):
        ledger = _ledger(job, where, source, every, keep_open=True)  # one at a time per thread (async: many)
        try:
            with contextlib.closing(ledger):  # open() and assemble() may append to the log
                ledger.open()
                with Progress(job.progress, ledger) as bar:
                    runner(ledger, source, job, bar)
                ledger.finish()
                return ledger.assemble()
        except DamagedChunksError:
            source = _again(source, ledger, attempt)
    raise AssertionError  # pragma: no cover - _again raises on the last attempt


async def _map_async(job: Job, where: Where | None, source: Source, every: int) -> list[Any]:
    for attempt in range(3):
        ledger = _ledger(job, where, source, every)
        ledger.open()
        with Progress(job.progress, ledger) as bar:
            await run_async(ledger, source, job, bar)
        ledger.finish()
        try:
            return ledger.assemble()
        except DamagedChunksError:
            source = _again(source, ledger, attempt)
    raise AssertionError  # pragma: no cover - _again raises on the last attempt


def _ledger(job: Job, where: Where | None, source: Source, every: int, *, keep_open: bool = False) -> Ledger:
    return ledger_for(
        where, kind="map", every=every, total=source.total, record_failures=job.record, keep_open=keep_open
    )


def _again(source: Source, ledger: Ledger, attempt: int) -> Source:
    """The input again, to redo the rows of damaged chunks (they have been deleted)."""
    if not source.rereadable:
        msg = (
            f"batch {ledger.display!r}: damaged chunks were deleted, but the input is a one-shot "
            "iterator, so their rows cannot be done again now: run again to redo them."
        )
        raise ResumableError(msg)
    if attempt >= 2:
        msg = f"batch {ledger.display!r}: chunks were damaged again and again; check the disk."
        raise ResumableError(msg)
    return Source(source.items)


def _locate(name: str | None, api: str, items: object) -> Where | None:
    """Where the batch lives: the running step's slot, or the current pipeline under *name*."""
    if disabled():
        return None  # RESUMABLE_DISABLE=1: nothing is read or written
    execution = current_execution.get()
    if name is not None:
        _check_name(name, in_step=execution is not None)
    if execution is None:
        if name is None:
            msg = (
                f"{api}() outside a step needs a name for its batch: pass name='...' (its rows "
                f"are stored under that name), or call {api}() inside a @step function."
            )
            raise ResumableError(msg)
        run = current_pipeline()._session_for(None)  # noqa: SLF001 - the Host protocol
        directory = batch_dir(None, name)
        remedy = f"To start it over, reset it: resumable reset {name} (or pipe.reset({name!r}))."
        return Where(run=run, directory=directory, label=name, display=name, remedy=remedy)
    plan = execution.plan
    if name is None:
        n = next(execution.batches)
        sub, display = ("", plan.slot) if n == 0 else (f"{n + 1}/", f"{plan.slot}#{n + 1}")
    else:
        sub, display = f"{name}/", f"{plan.slot}:{name}"
    remedy = f"To start it over, reset the step: resumable reset {plan.slot} (or pipe.reset({plan.slot!r}))."
    return Where(
        run=execution.run,
        directory=batch_dir(plan.slot) + sub,
        label=plan.slot,
        display=display,
        remedy=remedy,
        identity=plan.identity.identity,
        args=plan.args,
        params=plan.params,
        items_params=frozenset(p for p, v in (plan.bound or {}).items() if v is items),
    )


def _check_name(name: object, *, in_step: bool) -> None:
    try:
        check_name(name)
    except StepDefinitionError:
        msg = (
            f"{name!r} cannot be a batch name: batch names are directory names in the state "
            "directory (at most 100 characters; no '/', '\\', ':', '*', '?', '\"', '<', '>', '|' "
            "or control characters; not starting with '.' or '-'). Pass another name=."
        )
        raise ResumableError(msg) from None
    if in_step and str(name).isdigit():
        msg = (
            f"batch name {name!r}: inside a step, names made of digits only are reserved for "
            "the step's unnamed batches. Pass another name=."
        )
        raise ResumableError(msg)


def _check_positive(name: str, value: object, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        msg = f"{name} must be an int >= 1 ({hint}), got {value!r}"
        raise UsageError(msg)


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def _as_executor(executor: Any) -> Executor:
    """*executor*, or the executor of a Dask ``Client`` given instead."""
    if not isinstance(executor, Executor) and callable(getattr(executor, "get_executor", None)):
        return executor.get_executor()  # type: ignore[no-any-return]
    return executor  # type: ignore[no-any-return]
