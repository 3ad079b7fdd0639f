"""
Which pipeline a step runs in, and which steps exist.

Steps decorated with the module-level ``step`` belong to no pipeline in particular: they
run in the pipeline of the innermost ``with`` block (of this context, else of any thread),
else in the default pipeline of script mode. Step names are unique per pipeline (and
among the unbound steps).
"""

from __future__ import annotations

import contextvars
import threading
from typing import TYPE_CHECKING, Any

from .exceptions import StepDefinitionError

if TYPE_CHECKING:
    from ._pipeline import Pipeline
    from ._step import StepSpec


_unbound: dict[str, StepSpec[Any, Any]] = {}
_registry_lock = threading.RLock()
_current: contextvars.ContextVar[Pipeline | None] = contextvars.ContextVar("resumable_pipeline", default=None)
# Pipelines entered by `with`, for threads started inside the block (threads do not
# inherit context variables).
_entered: list[Pipeline] = []
_default: Pipeline | None = None


def register(spec: StepSpec[Any, Any]) -> None:
    """Add a step to its pipeline's registry, refusing a second function with its name."""
    registry = spec.pipeline._steps if spec.pipeline is not None else _unbound  # noqa: SLF001
    with _registry_lock:
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


def default_pipeline() -> Pipeline:
    """The pipeline of script mode (state in ``$RESUMABLE_STATE_DIR`` or ``./state``)."""
    global _default  # noqa: PLW0603 - created on first use, so importing stays cheap
    with _registry_lock:
        if _default is None:
            from ._pipeline import Pipeline  # noqa: PLC0415 - circular at import time

            _default = Pipeline()
        return _default


def current_pipeline() -> Pipeline:
    """The pipeline unbound steps run in: the innermost ``with`` block's, else the default."""
    pipe = _current.get()
    if pipe is not None:
        return pipe
    if _entered:
        return _entered[-1]
    return default_pipeline()
