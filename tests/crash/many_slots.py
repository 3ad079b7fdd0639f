"""
A keyed step over N items, then one step that sums them: the state grows to N slots.

Usage: ``python many_slots.py STATE_DIR SIDE_FILE N`` (see crashkit.py). Each execution of a
slot is counted in SIDE_FILE; the program prints ``RESULT <json>`` when it finishes, and the
result depends only on N, however often it was killed and run again.
"""

from __future__ import annotations

import sys

import crashkit

from resumable import Pipeline

crashkit.setup()
N = int(sys.argv[3])
# durable=False: what a kill must not lose is in the page cache, and a build of 100,000
# durable files would take minutes of fsyncs
pipe = Pipeline("many", durable=False)


@pipe.step(key="{i}")
def doc(i: int) -> dict[str, object]:
    crashkit.work(f"doc/{i}", 0)
    return {"i": i, "name": f"doc-{i}", "square": i * i % 1009}


@pipe.step
def total(squares: list[int]) -> int:
    crashkit.work("total", 0)
    return sum(squares)


with pipe:
    squares = [int(doc(i)["square"]) for i in range(N)]  # type: ignore[call-overload]
    crashkit.result({"total": total(squares), "slots": len(pipe.status().completed_steps)})
