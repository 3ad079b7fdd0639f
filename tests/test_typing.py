"""Users' type checkers see precise types for decorated steps."""

from __future__ import annotations

from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")


def test_typing_usage_type_checks():
    """mypy --strict accepts tests/typing_usage.py (assert_type lines included)."""
    path = Path(__file__).with_name("typing_usage.py")
    out, err, status = mypy_api.run(["--strict", "--no-incremental", str(path)])
    assert (0, "") == (status, err), out
