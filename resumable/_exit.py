"""How runs opened in script mode end: at interpreter exit, after Ctrl-C or SIGTERM."""

from __future__ import annotations

import atexit
import signal
import sys
import threading
from types import TracebackType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._pipeline import Pipeline


def status_for(exc: BaseException | None) -> str:
    """How a run ends, given the exception leaving it (if any)."""
    if exc is None:
        return "completed"
    if isinstance(exc, SystemExit) and exc.code in {None, 0}:
        return "completed"
    if not isinstance(exc, Exception):  # Ctrl-C, SIGTERM, a cancelled task ...
        return "interrupted"
    return "failed"


class _ExitHooks:
    """Closes runs opened in script mode when the interpreter exits."""

    def __init__(self) -> None:
        self._pipelines: list[Pipeline] = []
        self._installed = False
        self._error: BaseException | None = None
        self._terminated = False

    def watch(self, pipe: Pipeline) -> None:
        if pipe not in self._pipelines:
            self._pipelines.append(pipe)
        if not self._installed:
            self._installed = True
            atexit.register(self._at_exit)
            previous = sys.excepthook

            def excepthook(tp: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
                self._error = value
                previous(tp, value, tb)

            sys.excepthook = excepthook
            main = threading.current_thread() is threading.main_thread()
            if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def forget(self, pipe: Pipeline) -> None:
        if pipe in self._pipelines:
            self._pipelines.remove(pipe)

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        # Unwind like Ctrl-C does, so the run (and a running step) is recorded as interrupted.
        self._terminated = True
        raise SystemExit(128 + signum)

    def _at_exit(self) -> None:
        error = self._error
        status = "interrupted" if self._terminated else status_for(error)
        for pipe in list(self._pipelines):
            run = pipe._run  # noqa: SLF001
            ended = status
            if ended == "completed" and run is not None and run.last_outcome == "interrupted":
                ended = "interrupted"  # Ctrl-C in a step, caught by the script, which then exited
            try:
                pipe._close(ended, error)  # noqa: SLF001
            except Exception as exc:  # noqa: BLE001 - report, and close the other pipelines
                print(f"resumable: could not close {pipe!r} cleanly: {exc}", file=sys.stderr)  # noqa: T201
        self._pipelines.clear()


_exit_hooks = _ExitHooks()
