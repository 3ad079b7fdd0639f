"""Quantities as people read them."""

from __future__ import annotations


def human_size(n: float | None) -> str:
    """``1.2 MB`` style sizes."""
    if n is None:
        return ""
    if n < 1000:
        return f"{n:.0f} B"
    for unit in ("KB", "MB"):
        n /= 1000
        if n < 1000:
            return f"{n:.1f} {unit}"
    return f"{n / 1000:.1f} GB"
