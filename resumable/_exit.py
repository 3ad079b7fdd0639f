"""How runs opened in script mode end: at interpreter exit, after Ctrl-C or SIGTERM."""

from __future__ import annotations

import atexit
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

# closes one pipeline's run: (status, the exception that ended the script or None)
Closer = Callable[[str, "BaseException | None"], None]


def status_for(exc: BaseException | None) -> str:
    """How a run ends, given the exception leaving it (if any)."""
    if exc is None or (isinstance(exc, SystemExit) and exc.code in {None, 0}):
        return "completed"
    return "failed" if isinstance(exc, Exception) else "interrupted"  # Ctrl-C, SIGTERM, a cancelled task


class _ExitHooks:
    """Closes runs opened in script mode when the interpreter exits."""

    def __init__(self) -> None:
        # held weakly: a pipeline dropped before exit closes its run itself (Pipeline._session_for)
        self._watched: weakref.WeakKeyDictionary[Any, weakref.WeakMethod[Closer]] = (
            weakref.WeakKeyDictionary()
        )
        self._installed = False
        self._error: BaseException | None = None
        self._terminated = False

    def watch(self, owner: object, close: Closer) -> None:
        """Call *close*, a method of *owner*, at interpreter exit (unless *owner* is forgotten or gone)."""
        self._watched.setdefault(owner, weakref.WeakMethod(close))
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

    def forget(self, owner: object) -> None:
        self._watched.pop(owner, None)

    def _on_sigterm(self, signum: int, _frame: object) -> None:
        # Unwind like Ctrl-C does, so the run (and a running step) is recorded as interrupted.
        self._terminated = True
        raise SystemExit(128 + signum)

    def _at_exit(self) -> None:
        error = self._error
        status = "interrupted" if self._terminated else status_for(error)
        for owner, method in list(self._watched.items()):
            close = method()
            if close is None:
                continue
            try:
                close(status, error)
            except Exception as exc:  # noqa: BLE001 - report, and close the other pipelines
                print(f"resumable: could not close {owner!r} cleanly: {exc}", file=sys.stderr)  # noqa: T201
        self._watched.clear()


exit_hooks = _ExitHooks()
