"""
How long `resumable report` takes and how big its file is, by the number of keyed slots.

Baseline, measured in the same run on the same state: reading what any report must read, the
manifest (`read_state`, as `resumable status` does) and every event of the log. The ratio is the
report's time over that baseline. Targets: the file is at most 200 KB for 100 slots and 2 MB for
100,000 (the browser side, interactive within 1 s, is measured by tests/test_report.py).

    python bench/bench_report.py            # 100, 10,000 and 100,000 slots (about two minutes)
    python bench/bench_report.py --quick    # 100 and 10,000
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

from resumable import Pipeline
from resumable._history import events
from resumable._journal import read_state
from resumable._report import render
from resumable._report_data import collect

TARGETS = {100: 200_000, 100_000: 2_000_000}


def _state(n: int) -> Pipeline:
    pipe = Pipeline("bench", store=f"memory://bench-report-{uuid.uuid4().hex}", durable=False)

    @pipe.step(key=str)
    def item(i: int) -> int:
        return i

    for _ in range(2):  # a run that computes every slot, and one that skips them all
        with pipe:
            for i in range(n):
                item(i)
    return pipe


def _best(fn: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [100, 10_000] if args.quick else [100, 10_000, 100_000]
    rows = [
        "| slots | baseline (manifest + log) | report | ratio | file | target | result |",
        "|" + " --- |" * 7,
    ]
    failed = False
    for n in sizes:
        pipe = _state(n)
        store = pipe.store
        repeat = 5 if n <= 10_000 else 2

        def baseline(store: object = store) -> None:
            read_state(store, secret=None)  # type: ignore[arg-type]
            for _ in events(store, None):  # type: ignore[arg-type]
                pass

        def report(store: object = store) -> str:
            return render(collect(store, None))  # type: ignore[arg-type]

        base = _best(baseline, repeat)
        took = _best(report, repeat)
        size = len(report().encode())
        target = TARGETS.get(n)
        ok = target is None or size <= target
        failed |= not ok
        with tempfile.TemporaryDirectory() as tmp:  # the file is also written once, as a user would
            pipe.report(os.path.join(tmp, "r.html"))
        rows.append(
            f"| {n:,} | {base * 1000:,.0f} ms | {took * 1000:,.0f} ms | {took / base:.2f} | {size / 1000:,.0f} KB "
            f"| {'≤ ' + format(target // 1000, ',') + ' KB' if target else ''} | {'PASS' if ok else 'FAIL'} |"
        )
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
