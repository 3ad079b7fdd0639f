"""
Which pipeline a step runs in, and which steps exist.

Steps decorated with the module-level ``step`` run in the pipeline of the innermost ``with``
block (of this context, else of any thread), else in the default pipeline of script mode.
Step names are unique per pipeline (and among the unbound steps).
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from .exceptions import StepDefinitionError

_DISABLE = "RESUMABLE_DISABLE"


def disabled() -> bool:
    """True if ``RESUMABLE_DISABLE`` is set to anything but "" or "0": steps just run, nothing is stored."""
    return os.environ.get(_DISABLE, "") not in {"", "0"}


class Registered(Protocol):
    """A step as the registry knows it (a ``StepSpec`` is one)."""

    name: str
    qualname: str
    pipeline: Any


class Host(Protocol):
    """A pipeline as steps know it (a ``Pipeline`` is one)."""

    _steps: dict[str, Any]  # its own steps by name (they hold it too: a cycle the GC frees)

    def _session_for(self, spec: Any) -> Any: ...  # the open RunState (opened if needed)
    def _has_output(self, plan: Any) -> bool: ...
    def reset(self, *steps: str, downstream: bool = True) -> list[str]: ...


_lock = threading.RLock()
_unbound: dict[str, Any] = {}
_current: contextvars.ContextVar[Any] = contextvars.ContextVar("resumable_pipeline", default=None)
# the named sessions entered in this context, innermost first (each (session, pipeline) pair)
_sessions: contextvars.ContextVar[tuple[tuple[Any, Any], ...]] = contextvars.ContextVar(
    "resumable_sessions", default=()
)
# Pipelines entered by `with`, for threads started inside the block (threads do not
# inherit context variables).
_entered: list[Any] = []
_default: Any = None
_default_factory: Callable[[], Any]  # the Pipeline class, set as the package is imported


def unbound_steps() -> dict[str, Any]:
    """A copy of the steps decorated with the module-level ``step``."""
    with _lock:
        return dict(_unbound)


def register(spec: Registered) -> None:
    """Add a step to its pipeline's registry, refusing a second function with its name."""
    with _lock:
        registry = _unbound if spec.pipeline is None else spec.pipeline._steps  # noqa: SLF001 - the Host protocol
        existing = registry.get(spec.name)
        if existing is not None and existing.qualname != spec.qualname:
            msg = (
                f"step name {spec.name!r} is already used by {existing.qualname}; "
                f"{spec.qualname} needs another one: pass name='...' to @step."
            )
            raise StepDefinitionError(msg, step=spec.name)
        for other in registry:
            if other != spec.name and other.lower() == spec.name.lower():
                msg = (
                    f"step names {other!r} and {spec.name!r} differ only by case, so their files "
                    "would collide on case-insensitive file systems; rename one with name=."
                )
                raise StepDefinitionError(msg, step=spec.name)
        # re-running a definition (a notebook cell, a reload) replaces it in place
        registry[spec.name] = spec


def enter(pipeline: object) -> contextvars.Token[Any]:
    """*pipeline*'s ``with`` block begins: unbound steps run in it."""
    with _lock:
        _entered.append(pipeline)
    return _current.set(pipeline)


def leave(pipeline: object, token: contextvars.Token[Any]) -> None:
    """*pipeline*'s innermost ``with`` block ends."""
    _current.reset(token)
    with _lock:
        for i in range(len(_entered) - 1, -1, -1):
            if _entered[i] is pipeline:
                del _entered[i]
                break


def set_default_factory(factory: Callable[[], Any]) -> None:
    """How to make the pipeline of script mode (the pipeline class gives itself when defined)."""
    global _default_factory  # noqa: PLW0603 - set once, by the pipeline module
    _default_factory = factory


def default_pipeline() -> Any:
    """The pipeline of script mode (state in ``$RESUMABLE_STATE_DIR`` or ``./state``)."""
    global _default  # noqa: PLW0603 - created on first use, so importing stays cheap
    with _lock:
        if _default is None:
            _default = _default_factory()
        return _default


def current_pipeline() -> Any:
    """The pipeline unbound steps run in: the innermost ``with`` block's, else the default."""
    pipe = _current.get()
    if pipe is not None:
        return pipe
    if _entered:
        return _entered[-1]
    return default_pipeline()


def enter_session(session: object, pipeline: object) -> tuple[contextvars.Token[Any], contextvars.Token[Any]]:
    """*pipeline*'s named *session* begins in this context (thread or asyncio task) only."""
    return _current.set(session), _sessions.set(((session, pipeline), *_sessions.get()))


def leave_session(tokens: tuple[contextvars.Token[Any], contextvars.Token[Any]]) -> None:
    """The innermost named session of this context ends."""
    _sessions.reset(tokens[1])
    _current.reset(tokens[0])


def session_of(pipeline: object) -> Any:
    """The innermost named session of *pipeline* entered in this context, or None."""
    return next((session for session, owner in _sessions.get() if owner is pipeline), None)
