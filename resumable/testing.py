"""
Helpers for testing code that uses resumable.

- :func:`temporary_pipeline`: a pipeline in a fresh temporary directory, entered for a block.
- :func:`crash_at` / :func:`crash_from_env`: make the process die abruptly at the N-th
  file operation, to test what a real crash leaves behind.
- :class:`StoreConformance`: the guarantees of a :class:`~resumable.Store` (every method) as a
  pytest suite, for custom stores (every built-in store passes it).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ._conformance import StoreConformance
from ._pipeline import Pipeline

__all__ = ["CRASH_EXIT_CODE", "StoreConformance", "crash_at", "crash_from_env", "temporary_pipeline"]

CRASH_EXIT_CODE = 137  # what a shell reports for a process killed by SIGKILL
_OPERATIONS = {"replace": ("replace",), "write": ("write", "pwrite"), "fsync": ("fsync", "fdatasync")}
_dying = threading.Lock()


@contextmanager
def temporary_pipeline(name: str = "test", **options: Any) -> Iterator[Pipeline]:
    """Yield an entered :class:`Pipeline` whose state lives in a temporary directory."""
    with (
        tempfile.TemporaryDirectory(prefix="resumable-") as directory,
        Pipeline(name, state_dir=directory, **options) as pipe,
    ):
        yield pipe


def crash_at(operation: str, n: int) -> None:
    """
    Kill this process (``os._exit(137)``, no cleanup at all) at the *n*-th call of
    ``os.replace``, ``os.write`` (or ``os.pwrite``) or ``os.fsync`` (or ``os.fdatasync``)
    from now on, counted across all threads.

    Raises:
        ValueError: *operation* is not one of ``replace``, ``write``, ``fsync``.
    """
    if operation not in _OPERATIONS:
        msg = f"crash_at: operation must be one of {', '.join(_OPERATIONS)}, not {operation!r}"
        raise ValueError(msg)
    if n < 1:
        msg = f"crash_at: n must be >= 1, not {n}"
        raise ValueError(msg)
    calls = 0
    counting = threading.Lock()

    def crashing(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            with counting:
                calls += 1
                reached = calls >= n
            if reached:
                # Exactly one thread exits; any other thread reaching this point stops here
                # for good, so nothing more happens after the "crash", as with a real SIGKILL.
                if _dying.acquire(blocking=False):
                    os._exit(CRASH_EXIT_CODE)
                threading.Event().wait()
            return original(*args, **kwargs)

        return call

    for name in _OPERATIONS[operation]:
        if hasattr(os, name):  # (macOS has no fdatasync)
            setattr(os, name, crashing(getattr(os, name)))


def crash_from_env(variable: str = "CRASH_AT") -> None:
    """Call :func:`crash_at` from an environment variable such as ``CRASH_AT=replace:2``."""
    spec = os.environ.get(variable)
    if spec:
        operation, _, n = spec.partition(":")
        crash_at(operation, int(n or "1"))
