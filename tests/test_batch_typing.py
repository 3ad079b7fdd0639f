"""Users' type checkers see precise result types for checkpointed_map and checkpointed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

mypy_api = pytest.importorskip("mypy.api")

USAGE = """
from collections.abc import Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, assert_type

from resumable import Checkpointed, RowFailure, checkpointed, checkpointed_map


def label(x: int) -> str:
    return str(x)


async def ask(x: int) -> str:
    return str(x)


assert_type(checkpointed_map(label, [1, 2], every=10, name="a"), list[str])
assert_type(checkpointed_map(label, range(3), name="b", on_error="record"), list[str | RowFailure])
with ThreadPoolExecutor(2) as pool:
    assert_type(checkpointed_map(label, [1], name="c", executor=pool), list[str])
pending = checkpointed_map(ask, [1, 2], name="d")
_ = assert_type(pending, Coroutine[Any, Any, list[str]])
pending.close()
recorded = checkpointed_map(ask, [1], name="e", on_error="record")
__ = assert_type(recorded, Coroutine[Any, Any, list[str | RowFailure]])
recorded.close()
assert_type(checkpointed(["x", "y"], every=5, name="f"), Checkpointed[str])
loop = checkpointed(range(3), name="g", state={"n": 0})
assert_type(loop.state, dict[str, Any])
for i in loop:
    assert_type(i, int)


async def main() -> None:
    answers = await checkpointed_map(ask, range(3), name="g", concurrency=4)
    assert_type(answers, list[str])
    failure = RowFailure(0, "ValueError", "bad")
    assert_type(failure.index, int)
"""


def test_batch_helpers_type_check(tmp_path: Path):
    """mypy --strict accepts typical calls, with the result types their assert_type lines state."""
    path = tmp_path / "batch_usage.py"
    path.write_text(USAGE)
    limit = sys.getrecursionlimit()
    try:
        out, err, status = mypy_api.run(
            ["--strict", "--no-incremental", "--cache-dir", str(tmp_path / "cache"), str(path)]
        )
    finally:
        sys.setrecursionlimit(limit)  # mypy raises it for the whole process
    assert (0, "") == (status, err), out
