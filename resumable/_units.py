"""Quantities as people read them."""

from __future__ import annotations


def human_size(n: float | None) -> str:
    """``1.2 MB`` style sizes."""
    if n is None:
        return ""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover - the loop always returns


__all__ = ["human_size"]
