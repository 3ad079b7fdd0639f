"""Warnings that point at the user's line: the first frame outside resumable."""

from __future__ import annotations

import sys
import warnings

from .exceptions import ResumableWarning


def warn(message: str) -> None:
    """Issue a :class:`ResumableWarning` attributed to the user's code that led here."""
    frame = sys._getframe(1)  # noqa: SLF001 - the caller, inside resumable
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "resumable":
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    warnings.warn(ResumableWarning(message), stacklevel=level - 1 if frame is None else level)
