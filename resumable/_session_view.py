"""
What ``pipe.session(id)`` returns: the pipeline's state methods, for one named session.

Entering it (``with`` or ``async with``) takes the session's lock (waiting up to ``wait=``
seconds, on an event loop without blocking it) and opens a run; inside the block the
pipeline's steps and the module-level steps run in the session, in this thread or asyncio
task only (a context variable). Leaving it closes the run and releases the lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, Self

from . import _context, _sessions
from ._exit import status_for
from ._pipeline import Pipeline
from ._stores import Store
from .exceptions import SessionBusyError, UsageError

_POLL = 0.02  # seconds between two attempts at a busy session's lock (up to _POLL_MAX)
_POLL_MAX = 0.5


class Session(Pipeline):
    """
    A named session of a pipeline (``pipe.session(id)``): use it as ``with`` or ``async
    with``. It has the pipeline's per-state methods (``status``, ``checkpoints``,
    ``snapshot``, ``rollback``, ``reset``, ``why``, ``save_state``, ``load_state``, ``run``)
    for this session, and :meth:`outputs`.
    """

    def __init__(
        self, parent: Pipeline, session: str, *, wait: float | None, metadata: Mapping[str, Any] | None
    ) -> None:
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0):
            msg = f"wait must be a number of seconds >= 0 or None, got {wait!r}"
            raise UsageError(msg)
        if metadata is not None and not isinstance(metadata, Mapping):
            msg = f"metadata must be a mapping (JSON values), got {type(metadata).__name__}"
            raise UsageError(msg)
        super().__init__(
            parent._name,  # noqa: SLF001 - the parent's options
            store=parent._root_store,  # noqa: SLF001
            durable=parent.durable,
            allow_pickle=parent.allow_pickle,
            secret=parent._secret_arg,  # noqa: SLF001
            keep_checkpoints=parent.keep_checkpoints,
            session=session,
        )
        self._root = parent._root_store  # noqa: SLF001
        self._steps = parent._steps  # noqa: SLF001 - the same step definitions
        self._parent = parent
        self._wait = wait
        self._metadata = dict(metadata) if metadata is not None else None
        self._session_tokens: list[Any] = []

    def __repr__(self) -> str:
        return f"Session({self.id!r}, pipeline={self.name!r}, store={self._root_store.location!r})"

    @property
    def id(self) -> str:
        """The session's id."""
        assert self._session_id is not None  # noqa: S101 - a Session is always named
        return self._session_id

    @property
    def name(self) -> str:
        """The pipeline's name."""
        return self._parent.name

    # entering ----------------------------------------------------------------------------

    def _try_open(self) -> SessionBusyError | None:
        """Open the run if the lock is free; else the error naming who holds it."""
        with self._lock:
            if self._run is None:
                try:
                    self._run = self._new_run(maintenance=False)
                except SessionBusyError as exc:
                    return exc
            return None

    def _opened(self) -> Self:
        with self._lock:
            self._depth += 1
        self._session_tokens.append(_context.enter_session(self, self._parent))
        return self

    def __enter__(self) -> Self:
        if _context.disabled():
            return self._opened()
        deadline = None if self._wait is None else time.monotonic() + self._wait
        delay = _POLL
        while (busy := self._try_open()) is not None:
            left = 0.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise busy
            time.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)
        return self._opened()

    async def __aenter__(self) -> Self:
        import asyncio  # noqa: PLC0415 - only async users need it

        if _context.disabled():
            return self._opened()
        deadline = None if self._wait is None else time.monotonic() + self._wait
        delay = _POLL
        remote = self._root_store.slow_appends  # a round trip or more: off the event loop
        while (busy := (await asyncio.to_thread(self._try_open) if remote else self._try_open())) is not None:
            left = 0.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise busy
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 2, _POLL_MAX)
        return self._opened()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _context.leave_session(self._session_tokens.pop())
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._close(status_for(exc), exc)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    # reading -----------------------------------------------------------------------------

    def outputs(self, step: str) -> Mapping[str, Any]:
        """
        The completed outputs of keyed step *step* in this session: an ordered mapping key →
        value (completion order), each value read when it is used. A service reads a
        conversation this way without replaying it.
        """
        return _sessions.outputs(self, step)

    def info(self) -> _sessions.SessionInfo | None:
        """This session as ``pipe.sessions()`` lists it (None if it was never opened)."""
        return next((s for s in self._parent.sessions(prefix=self.id) if s.id == self.id), None)

    # forking into it ---------------------------------------------------------------------

    def _fork_into(self, fill: Callable[[Store], None], at: int | str | None) -> None:
        from . import _history  # noqa: PLC0415 - imported when history is first used

        store = self.store
        with self._lock:
            run = self._new_run(maintenance=True, prepare=lambda: fill(store))
            try:
                if at is not None:
                    _history.rollback(run, at)
                # complete: from here the session is dst's (a failure above leaves the marker,
                # and whoever opens the session next empties it)
                store.delete(_sessions.INCOMPLETE, durable=True)
            finally:
                run.close("completed")
            self._session_meta = _sessions.read_meta(store)
            self._index_session(run)
