"""
resumable: make long Python scripts resumable.

Decorate the expensive functions of a script with :func:`step`; run it again after a
crash and completed steps return their stored outputs instantly.
"""

import importlib as _importlib
import typing as _typing

from ._codec import load
from ._manifest import BatchRecord, ErrorRecord, Manifest, StepRecord
from ._pipeline import Pipeline
from ._runner import Run
from ._step import Step, by_arguments, step
from ._stores import Store, StoreLock
from .exceptions import (
    DamagedStateError,
    FingerprintError,
    InputChangedError,
    ResumableError,
    ResumableWarning,
    SerializationError,
    SessionBusyError,
    StateDirectoryError,
    StateFormatError,
    StateLockedError,
    StepChangedError,
    StepDefinitionError,
    StepInterruptedError,
    UsageError,
)

if _typing.TYPE_CHECKING:
    from ._batch import Checkpointed, RowFailure, checkpointed, checkpointed_map
    from ._history import Checkpoint
    from ._sessions import SessionInfo
    from ._why import Change, Decision

__version__ = "0.1.0"
# Imported on first use: most scripts never need them, and together they would add more than
# half again to the time `import resumable` spends in the package's own modules.
_LAZY = {
    "Change": "._why",
    "Checkpoint": "._history",
    "Checkpointed": "._batch",
    "Decision": "._why",
    "RowFailure": "._batch",
    "SessionInfo": "._sessions",
    "checkpointed": "._batch",
    "checkpointed_map": "._batch",
}

__all__ = [
    "BatchRecord",
    "Change",
    "Checkpoint",
    "Checkpointed",
    "DamagedStateError",
    "Decision",
    "ErrorRecord",
    "FingerprintError",
    "InputChangedError",
    "Manifest",
    "Pipeline",
    "ResumableError",
    "ResumableWarning",
    "RowFailure",
    "Run",
    "SerializationError",
    "SessionBusyError",
    "SessionInfo",
    "StateDirectoryError",
    "StateFormatError",
    "StateLockedError",
    "Step",
    "StepChangedError",
    "StepDefinitionError",
    "StepInterruptedError",
    "StepRecord",
    "Store",
    "StoreLock",
    "UsageError",
    "by_arguments",
    "checkpointed",
    "checkpointed_map",
    "load",
    "step",
]


def __getattr__(name: str) -> _typing.Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    msg = f"module {__name__!r} has no attribute {name!r}"
    raise AttributeError(msg)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
