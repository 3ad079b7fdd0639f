"""
resumable: make long Python scripts resumable.

Decorate the expensive functions of a script with :func:`step`; run it again after a
crash and completed steps return their stored outputs instantly.
"""

from ._batch import RowFailure, checkpointed, checkpointed_map
from ._codec import load
from ._history import Checkpoint
from ._manifest import BatchRecord, ErrorRecord, Manifest, StepRecord
from ._pipeline import Pipeline
from ._runner import Run
from ._step import Step, step
from ._stores import Store, StoreLock
from .exceptions import (
    DamagedStateError,
    FingerprintError,
    InputChangedError,
    ResumableError,
    ResumableWarning,
    SerializationError,
    StateFormatError,
    StateLockedError,
    StepDefinitionError,
    StepInterruptedError,
)

__version__ = "0.1.0"

__all__ = [
    "BatchRecord",
    "Checkpoint",
    "DamagedStateError",
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
    "StateFormatError",
    "StateLockedError",
    "Step",
    "StepDefinitionError",
    "StepInterruptedError",
    "StepRecord",
    "Store",
    "StoreLock",
    "checkpointed",
    "checkpointed_map",
    "load",
    "step",
]
