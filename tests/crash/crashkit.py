"""
Plumbing shared by the crash-test programs (not a test module).

Every program is run as ``python PROGRAM STATE_DIR SIDE_FILE [--small]``. It appends one
line ``<slot>`` to SIDE_FILE each time a step body starts, so the tests can count
executions, and prints ``RESULT <json>`` when it finishes. Environment variables:

- ``CRASH_AT=replace:N``: die (exit 137) at the N-th ``os.replace`` (see resumable.testing).
- ``REPLACE_LOG=PATH``: append the target of every ``os.replace`` to PATH, one per line.
- ``STALL_AT=SLOT``: inside that slot, print ``STALL <slot> <pid>`` and sleep for a minute.
- ``FAIL_AT=SLOT``: inside that slot, raise ``RuntimeError("boom in <slot>")``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

from resumable.testing import crash_from_env

STALL_SECONDS = 60.0
# The originals: crash_at() may patch os.write, and the side file must not count as a write.
_write = os.write
_replace = os.replace
_side: list[int] = []


def setup() -> bool:
    """Read the arguments, open the side file, arm CRASH_AT; True for the ``--small`` variant."""
    state_dir, side_file = sys.argv[1], sys.argv[2]
    os.environ["RESUMABLE_STATE_DIR"] = state_dir
    _side.append(os.open(side_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
    log = os.environ.get("REPLACE_LOG")
    if log:
        log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

        def logged_replace(src: Any, dst: Any, **kwargs: Any) -> None:
            _write(log_fd, f"{os.path.relpath(os.fspath(dst), state_dir)}\n".encode())
            _replace(src, dst, **kwargs)

        os.replace = logged_replace
    crash_from_env()
    return "--small" in sys.argv[3:]


def _started(slot: str) -> None:
    """Count one execution of *slot* (a single O_APPEND write: never torn by a kill)."""
    _write(_side[0], f"{slot}\n".encode())
    if os.environ.get("FAIL_AT") == slot:
        raise RuntimeError(f"boom in {slot}")


def _stalls(slot: str) -> bool:
    if os.environ.get("STALL_AT") != slot:
        return False
    print(f"STALL {slot} {os.getpid()}", flush=True)
    return True


def work(slot: str, seconds: float) -> None:
    """The body of a sync step: count the execution, then take *seconds* (or stall)."""
    _started(slot)
    time.sleep(STALL_SECONDS if _stalls(slot) else seconds)


async def awork(slot: str, seconds: float) -> None:
    """The body of an async step: count the execution, then take *seconds* (or stall)."""
    _started(slot)
    await asyncio.sleep(STALL_SECONDS if _stalls(slot) else seconds)


def result(value: object) -> None:
    """Print the program's final result for the test to compare."""
    print("RESULT " + json.dumps(value, sort_keys=True), flush=True)
