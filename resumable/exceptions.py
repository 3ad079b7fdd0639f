"""
Errors raised by resumable.

Every error names the step, slot or file involved and says what to do next.
Each class also subclasses the built-in exception that fits it, so code that
already catches ``TypeError`` or ``RuntimeError`` keeps working::

    ResumableError(Exception)
    ├── StepDefinitionError(ResumableError, TypeError)     bad @step use, raised when decorating
    ├── FingerprintError(ResumableError, TypeError)        an argument with no stable digest
    ├── SerializationError(ResumableError, TypeError)      an output that cannot be stored
    ├── StateFormatError(ResumableError, ValueError)       state written by a newer version
    ├── DamagedStateError(ResumableError, ValueError)      state data to import is damaged
    ├── StateLockedError(ResumableError, RuntimeError)     another run holds the state directory
    │   └── SessionBusyError(StateLockedError)             another run holds that session
    ├── StateDirectoryError(ResumableError, OSError)       the state directory cannot be used
    ├── InputChangedError(ResumableError, ValueError)      a batch's input changed under a resume
    ├── StepInterruptedError(ResumableError, RuntimeError) a non-idempotent step died mid-run
    ├── StepChangedError(ResumableError, RuntimeError)     a completed non-idempotent step changed
    └── UsageError(ResumableError, ValueError)             a bad argument to a resumable function
    ResumableWarning(UserWarning)                           e.g. a damaged file was recomputed

An exception raised inside a step is never wrapped: it propagates unchanged and
the manifest records it.
"""

from __future__ import annotations

import sys
import sysconfig
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DamagedStateError",
    "FingerprintError",
    "InputChangedError",
    "ResumableError",
    "ResumableWarning",
    "SerializationError",
    "SessionBusyError",
    "StateDirectoryError",
    "StateFormatError",
    "StateLockedError",
    "StepChangedError",
    "StepDefinitionError",
    "StepInterruptedError",
    "UsageError",
]


class ResumableError(Exception):
    """Base class of every error raised by resumable itself."""


class ResumableWarning(UserWarning):
    """Something was recovered automatically, e.g. a damaged file was recomputed."""


class StepDefinitionError(ResumableError, TypeError):
    """A step is defined or used in a way that cannot work (bad name, key or option)."""

    def __init__(self, message: str, *, step: str | None = None) -> None:
        self.step = step
        super().__init__(message)


class FingerprintError(ResumableError, TypeError):
    """An argument of a step has no stable digest, so its cached output cannot be matched."""

    def __init__(self, step: str, param: str, where: str, type_name: str, detail: str = "") -> None:
        self.step = step
        self.param = param
        self.where = where
        self.type_name = type_name
        extra = f" ({detail})" if detail else ""
        super().__init__(
            f"step {step!r}: cannot fingerprint argument {param!r}: {where} is a {type_name}{extra}. "
            + _fingerprint_hint(param, type_name)
        )


# Types of code rather than data: functions, methods, classes, modules (and metaclasses: *Meta).
_CODE_TYPES = frozenset(
    {
        "function",
        "builtin_function_or_method",
        "method",
        "method-wrapper",
        "method_descriptor",
        "wrapper_descriptor",
        "classmethod_descriptor",
        "classmethod",
        "staticmethod",
        "functools.partial",
        "module",
        "type",
        "enum.EnumType",
        "code",
        "cell",
    }
)
_ITERATOR_ENDINGS = ("iterator", "generator", "coroutine", "_iter")


def _fingerprint_hint(param: str, type_name: str) -> str:
    """Advice that works for a value of *type_name* passed as *param*."""
    ignore = f"pass ignore=({param!r},) to @step"
    if type_name in _CODE_TYPES or type_name.endswith("Meta"):
        return (
            f"If it does not affect the output, {ignore}. If it does (one function or another), "
            "pass something that names it instead (its name as a str, looked up inside the step), "
            f"or {ignore} and give the step a version= that you change when it should recompute."
        )
    if type_name.endswith(_ITERATOR_ENDINGS):
        return f"Pass a list or tuple of its items instead, or, if it does not affect the output, {ignore}."
    if _user_class(type_name):
        return (
            f"If it does not affect the output, {ignore}; otherwise give {type_name} a "
            "__resumable_fingerprint__() method returning a stable value (e.g. the values it was "
            "made from), or make it a dataclass or attrs class of supported values."
        )
    return (
        f"If it does not affect the output (a client, a connection, a lock ...), {ignore}; "
        "otherwise pass the values that decide the output (a URL, a model name, a path ...) as "
        "arguments of their own."
    )


def _user_class(type_name: str) -> bool:
    """True if *type_name* is a class of the user's code (not built in, stdlib or installed)."""
    parts = type_name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = sys.modules.get(".".join(parts[:end]))
        if module is None:
            continue
        if module.__name__ == "__main__":
            return True
        file = getattr(module, "__file__", None)
        if not isinstance(file, str):
            return False  # built into the interpreter
        paths = sysconfig.get_paths()
        installed = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
        return not any(file.startswith(p + "/") for p in installed)
    return False


class SerializationError(ResumableError, TypeError):
    """A value cannot be stored (or a stored value cannot be read back) as requested."""

    def __init__(
        self,
        message: str,
        *,
        step: str | None = None,
        where: str | None = None,
        type_name: str | None = None,
    ) -> None:
        self.step = step
        self.where = where
        self.type_name = type_name
        super().__init__(message)


class StateFormatError(ResumableError, ValueError):
    """The state was written by a newer version of resumable than this one."""

    def __init__(self, path: str, found: object, supported: int) -> None:
        self.path = path
        self.found = found
        self.supported = supported
        super().__init__(
            f"{path} has format {found!r}, but this version of resumable understands format "
            f"{supported} at most. Upgrade resumable (pip install -U resumable) to read it, or "
            "point the pipeline at another state directory."
        )


class DamagedStateError(ResumableError, ValueError):
    """State data given to ``load_state`` (or ``resumable import``) is damaged or not state data."""


def _holder(holder: Mapping[str, Any]) -> str:
    if not holder:
        return "another process"
    return f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')} since {holder.get('since', '?')}"


class StateLockedError(ResumableError, RuntimeError):
    """Another run holds the state directory."""

    def __init__(self, location: str, holder: Mapping[str, Any] | None) -> None:
        self.location = location
        self.holder = dict(holder or {})
        super().__init__(
            f"{location} is in use by a run of {_holder(self.holder)}. Only one run "
            "at a time may use a state directory: wait for it to finish, stop it, or use another "
            "state directory (state_dir= or $RESUMABLE_STATE_DIR)."
        )


class SessionBusyError(StateLockedError):
    """Another run holds the session (``pipe.session(id)`` without ``wait=``, or after it)."""

    def __init__(self, session: str, location: str, holder: Mapping[str, Any] | None) -> None:
        super().__init__(location, holder)
        self.session = session
        message = (
            f"session {session!r} is in use by a run of {_holder(self.holder)}. A "
            "session has one run at a time: retry later, or pass wait=SECONDS to pipe.session() "
            "to wait for it."
        )
        self.args = (message,)


class InputChangedError(ResumableError, ValueError):
    """A batch's input differs from the input of the run that is being resumed."""

    def __init__(self, batch: str, detail: str, remedy: str = "") -> None:
        self.batch = batch
        self.detail = detail
        super().__init__(
            f"batch {batch!r}: the input changed since the interrupted run ({detail}), so the "
            "committed rows cannot be reused. "
            + (remedy or f"Reset it to start over: resumable reset {batch}.")
        )


class StepInterruptedError(ResumableError, RuntimeError):
    """A step marked ``idempotent=False`` died while running and may have partly run."""

    def __init__(self, slot: str, started_at: str | None, step: str | None = None) -> None:
        self.slot = slot
        self.step = step or slot.split("/", 1)[0]
        self.started_at = started_at
        since = f" (started {started_at})" if started_at else ""
        super().__init__(
            f"step {slot!r} is marked idempotent=False and a run died while it was running{since}: "
            "its side effects may have partly happened. Check them, then confirm the rerun with "
            f"`resumable reset {slot}` or pipe.reset({slot!r})."
        )


class StepChangedError(ResumableError, RuntimeError):
    """
    A completed ``idempotent=False`` step was called with a different fingerprint (its code, a
    constant, its version or its arguments changed): running it again would repeat its side
    effects, so it is not done without a confirmation.
    """

    def __init__(self, slot: str, changed: str, ran_at: str | None, step: str | None = None) -> None:
        self.slot = slot
        self.step = step or slot.split("/", 1)[0]
        self.changed = changed
        self.ran_at = ran_at
        when = f" on {ran_at}" if ran_at else ""
        super().__init__(
            f"step {slot!r} is marked idempotent=False and already ran{when}; since then {changed}. "
            "Running it again would repeat its side effects, so it is not run again by itself. "
            f"To run it again, confirm with `resumable reset {slot}` or pipe.reset({slot!r}); "
            "to keep its stored output instead, undo that change."
        )


class UsageError(ResumableError, ValueError):
    """A resumable function or command was given an argument it cannot use."""


class StateDirectoryError(ResumableError, OSError):
    """The state directory cannot be used: it is read-only, a file, or not accessible."""

    def __init__(self, path: str, problem: str, *, errno: int | None = None) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"cannot use state directory {path}: {problem}. Point the pipeline at a directory "
            "it can write (state_dir= or $RESUMABLE_STATE_DIR), or set RESUMABLE_DISABLE=1 "
            "to run the steps without storing any state."
        )
        # Set after __init__: OSError given one argument keeps errno/filename unset.
        self.errno = errno
        self.filename = path

    def __str__(self) -> str:
        # OSError.__str__ would print "[Errno ...]" once errno is set; the message says more.
        return str(self.args[0])
