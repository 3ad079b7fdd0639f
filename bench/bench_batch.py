"""
Batch benchmarks: checkpointed_map against baselines measured in the same run.

Run from the repository root::

    python bench/bench_batch.py                 # everything, a few minutes
    python bench/bench_batch.py --quick         # fewer repetitions, a smoke test
    python bench/bench_batch.py --only naive,resume --json results.json

Rows (see bench/README.md for exactly what each baseline does):

- naive: 30,000 rows, a commit every 100 rows, durable, against re-dumping the whole
  result list as JSON at every checkpoint (target: at least 20 times faster);
- linear: 1,000,000 rows at every=1000 against 100,000 rows (target: at most 12 times the time);
- overhead: 1,000,000 trivial rows at every=1000, durable, against a bare list
  comprehension (target: at most 2 µs per row);
- resume: a fresh process resuming a 1,000,000-row batch that died at row 900,000: from
  the call to the first new row (target: at most 100 ms);
- pool: a CPU-bound function on a 2-process pool against the sequential map (target: at
  least 1.7 times the throughput);
- async: 2,000 calls of 5 ms at concurrency 32 against a bare semaphore-bounded gather (information);
- floor: 200,000 trivial rows, every=100, durable: checkpointed_map against hand-written
  fsynced chunks (msgpack of each chunk's results, one write, one fsync; target: at most 1.3
  times) and against a floor that also does what a chunk record needs besides (a digest of
  the input rows, a checksum of the results, a small header, one writev, one fsync).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import blake3
import msgpack
from benchlib import Row, drive, fsync_dir, interleave, ms, quiet, ratios, us

from resumable import Pipeline, checkpointed_map, step

HERE = Path(__file__).resolve()
CITIES = ("Lisbon", "Porto", "Madrid", "Paris", "Berlin", "Vienna", "Prague")
RESUME_ROWS = 1_000_000
RESUME_DIED_AT = 900_000


# --- the row functions (module level: process pools pickle them by reference) ---------------


def customer(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "name": f"customer {i}",
        "email": f"customer{i}@example.org",
        "city": CITIES[i % len(CITIES)],
        "score": (i * 37 % 1000) / 10,
        "active": i % 3 != 0,
        "tags": ["retail", "newsletter"] if i % 2 else ["wholesale"],
    }


def enrich_row(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "label": "high" if row["score"] > 50 else "low", "name_length": len(row["name"])}


def inc(x: int) -> int:
    return x + 1


def burn(x: int) -> int:
    """About a millisecond of pure-Python work."""
    total = 0
    for i in range(25_000):
        total += (i * x) % 7
    return total


async def call_api(x: int) -> int:
    await asyncio.sleep(0.005)
    return x + 1


# --- 1. against the naive JSON re-dump ------------------------------------------------------


def naive_json(rows: list[dict[str, Any]], path: str, every: int) -> list[dict[str, Any]]:
    """The hand-written pattern: re-dump all results so far as JSON, durably, every *every* rows."""
    results: list[dict[str, Any]] = []
    directory = os.path.dirname(path)
    for i, row in enumerate(rows, 1):
        results.append(enrich_row(row))
        if i % every == 0 or i == len(rows):
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(json.dumps(results))  # one write: much faster than json.dump's many
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_dir(directory)
    return results


def bench_naive(base: Path, rounds: int, n: int = 30_000, every: int = 100) -> list[Row]:
    rows = [customer(i) for i in range(n)]
    names = itertools.count()
    naive_dir = base / "naive"
    naive_dir.mkdir()
    expected = [enrich_row(r) for r in rows]
    with Pipeline("bench", state_dir=base / "naive-state"):

        def library() -> float:
            t0 = time.perf_counter()
            out = checkpointed_map(enrich_row, rows, every=every, name=f"naive{next(names)}")
            seconds = time.perf_counter() - t0
            if out != expected:
                msg = "checkpointed_map returned another list"
                raise RuntimeError(msg)
            return seconds

        def naive() -> float:
            t0 = time.perf_counter()
            naive_json(rows, str(naive_dir / "results.json"), every)
            return time.perf_counter() - t0

        res = interleave({"library": library, "naive": naive}, rounds)
    ratio = ratios(res["naive"], res["library"])
    return [
        Row(
            f"{n:,} rows, a commit every {every}, durable, vs re-dumping all results as JSON",
            ms(statistics.median(res["library"])),
            ms(statistics.median(res["naive"])),
            ratio,
            "naive / library",
            "≥ 20",
            ratio >= 20,
            {k: statistics.median(v) for k, v in res.items()},
        )
    ]


# --- 2 and 3. linear growth, and overhead over a bare list comprehension --------------------


def bench_linear(base: Path, rounds: int) -> list[Row]:
    small, large, every = 100_000, 1_000_000, 1000
    rows_small, rows_large = list(range(small)), list(range(large))
    names = itertools.count()
    with Pipeline("bench", state_dir=base / "linear-state"):

        def lib(rows: list[int]) -> Callable[[], float]:
            def run() -> float:
                t0 = time.perf_counter()
                checkpointed_map(inc, rows, every=every, name=f"linear{next(names)}")
                return time.perf_counter() - t0

            return run

        def bare() -> float:
            t0 = time.perf_counter()
            [inc(x) for x in rows_large]
            return time.perf_counter() - t0

        res = interleave({"bare": bare, "small": lib(rows_small), "large": lib(rows_large)}, rounds)
    growth = ratios(res["large"], res["small"])
    per_row = statistics.median(
        (lib_s - bare_s) / large for lib_s, bare_s in zip(res["large"], res["bare"], strict=True)
    )
    return [
        Row(
            f"{large:,} rows vs {small:,} rows, every={every}, durable (linear growth)",
            ms(statistics.median(res["large"])),
            ms(statistics.median(res["small"])),
            growth,
            "1M / 100k",
            "≤ 12",
            growth <= 12,
            {k: statistics.median(v) for k, v in res.items()},
        ),
        Row(
            f"overhead per row over a bare list comprehension, {large:,} trivial rows, every={every}, durable",
            us(per_row),
            f"bare: {ms(statistics.median(res['bare']))} in all",
            None,
            "",
            "≤ 2 µs",
            per_row <= 2e-6,
            {"per_row_s": per_row, "library_s": statistics.median(res["large"])},
        ),
    ]


# --- 4. resuming in a fresh process ---------------------------------------------------------


def resume_row(x: int) -> int:
    if os.environ.get("BENCH_DIE_AT") == str(x):
        os._exit(137)  # a kill at this row: everything before it is committed
    started = os.environ.get("BENCH_FIRST_ROW")
    if started is not None:
        first = time.perf_counter()
        print(json.dumps({"call_to_first_row": first - _CALLED[0], "wall": time.time()}), flush=True)
        os._exit(0)
    return x + 1


_CALLED = [0.0]


@step(name="resume_batch")
def resume_batch(n: int) -> list[int]:
    _CALLED[0] = time.perf_counter()
    return checkpointed_map(resume_row, range(n), every=1000)


def child_resume(state: str) -> None:
    os.environ["RESUMABLE_STATE_DIR"] = state
    quiet()
    resume_batch(RESUME_ROWS)


def bench_resume(base: Path, reps: int) -> list[Row]:
    state = base / "resume-state"
    env = {**os.environ, "BENCH_DIE_AT": str(RESUME_DIED_AT), "RESUMABLE_PROGRESS": "0"}
    died = subprocess.run(
        [sys.executable, str(HERE), "--child", "resume", str(state)],
        env=env,
        capture_output=True,
        check=False,
    )
    if died.returncode != 137:
        msg = f"the batch was to die at row {RESUME_DIED_AT:,}: {died.stderr.decode()[-2000:]}"
        raise RuntimeError(msg)
    env = {**os.environ, "BENCH_FIRST_ROW": "1", "RESUMABLE_PROGRESS": "0"}
    call, start = [], []
    for _ in range(reps):
        spawned = time.time()
        out = subprocess.run(
            [sys.executable, str(HERE), "--child", "resume", str(state)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        data = json.loads(out.strip().splitlines()[-1])
        call.append(data["call_to_first_row"])
        start.append(data["wall"] - spawned)
    median = statistics.median(call)
    return [
        Row(
            f"resume a {RESUME_ROWS:,}-row batch that died at row {RESUME_DIED_AT:,}, fresh process: "
            "call to first new row",
            ms(median),
            "—",
            None,
            "",
            "≤ 100 ms",
            median <= 0.1,
            {"call_to_first_row_s": call, "process_start_to_first_row_s": start},
        ),
        Row(
            "the same, from starting the interpreter (imports and opening the run included)",
            ms(statistics.median(start)),
            "—",
            None,
            "",
            "—",
            None,
            {},
        ),
    ]


# --- 5. a process pool ----------------------------------------------------------------------


def bench_pool(base: Path, rounds: int, n: int = 600, every: int = 25) -> list[Row]:
    rows = list(range(n))
    names = itertools.count()
    with Pipeline("bench", state_dir=base / "pool-state"), ProcessPoolExecutor(2) as pool:
        list(pool.map(inc, range(4)))  # start the workers

        def sequential() -> float:
            t0 = time.perf_counter()
            checkpointed_map(burn, rows, every=every, name=f"seq{next(names)}")
            return time.perf_counter() - t0

        def parallel() -> float:
            t0 = time.perf_counter()
            checkpointed_map(burn, rows, every=every, name=f"pool{next(names)}", executor=pool)
            return time.perf_counter() - t0

        def bare() -> float:
            t0 = time.perf_counter()
            list(pool.map(burn, rows, chunksize=every))
            return time.perf_counter() - t0

        res = interleave({"sequential": sequential, "pool": parallel, "bare": bare}, rounds)
    speedup = ratios(res["sequential"], res["pool"])
    bare_speedup = ratios(res["sequential"], res["bare"])
    return [
        Row(
            f"CPU-bound fn (~1 ms a row), {n} rows, every={every}: 2-process pool vs sequential",
            ms(statistics.median(res["pool"])),
            ms(statistics.median(res["sequential"])),
            speedup,
            "sequential / pool",
            "≥ 1.7",
            speedup >= 1.7,
            {k: statistics.median(v) for k, v in res.items()},
        ),
        Row(
            f"the same work with a bare pool.map(chunksize={every}), vs the sequential map (the machine's ceiling)",
            ms(statistics.median(res["bare"])),
            ms(statistics.median(res["sequential"])),
            bare_speedup,
            "sequential / bare pool",
            "—",
            None,
            {},
        ),
    ]


# --- 6. async -------------------------------------------------------------------------------


def bench_async(base: Path, rounds: int, n: int = 2000, concurrency: int = 32) -> list[Row]:
    names = itertools.count()

    async def bare_gather() -> list[int]:
        limit = asyncio.Semaphore(concurrency)

        async def one(x: int) -> int:
            async with limit:
                return await call_api(x)

        return await asyncio.gather(*(one(x) for x in range(n)))

    with Pipeline("bench", state_dir=base / "async-state"):

        def library() -> float:
            t0 = time.perf_counter()
            asyncio.run(
                checkpointed_map(
                    call_api, range(n), every=100, concurrency=concurrency, name=f"a{next(names)}"
                )
            )
            return time.perf_counter() - t0

        def bare() -> float:
            t0 = time.perf_counter()
            asyncio.run(bare_gather())
            return time.perf_counter() - t0

        res = interleave({"library": library, "bare": bare}, rounds)
    ratio = ratios(res["library"], res["bare"])
    return [
        Row(
            f"async: {n:,} calls of 5 ms, concurrency {concurrency}, every=100, vs a semaphore-bounded gather",
            ms(statistics.median(res["library"])),
            ms(statistics.median(res["bare"])),
            ratio,
            "library / bare",
            "—",
            None,
            {k: statistics.median(v) for k, v in res.items()},
        )
    ]


# --- 7. durable commits: the library against hand-written chunks and a floor ---------------


def chunks_by_hand(n: int, path: str, every: int, *, record: bool) -> list[int]:
    """
    Every *every* rows, append their results to *path* and fsync (as bench_peers' naive_chunks
    does); with *record*, framed like a chunk record: a digest of the input rows, a checksum of
    the results and a small header, written with one writev.
    """
    results: list[int] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        rows: list[int] = []
        chunk: list[int] = []
        for x in range(n):
            rows.append(x)
            chunk.append(inc(x))
            if len(chunk) == every or x == n - 1:
                body = msgpack.packb(chunk)
                if record:
                    head = {
                        "rows": [x + 1 - len(rows), x + 1],
                        "digest": blake3.blake3(msgpack.packb(rows)).hexdigest(),
                        "checksum": blake3.blake3(body).hexdigest(),
                        "failures": 0,
                    }
                    os.writev(fd, [msgpack.packb(head), body])
                else:
                    os.write(fd, body)
                os.fsync(fd)
                results += chunk
                rows, chunk = [], []
    finally:
        os.close(fd)
    return results


def bench_floor(base: Path, rounds: int, n: int = 200_000, every: int = 100) -> list[Row]:
    names = itertools.count()
    hand_dir = base / "floor-hand"
    hand_dir.mkdir()

    def by_hand(*, record: bool) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            chunks_by_hand(n, str(hand_dir / str(next(names))), every, record=record)
            return time.perf_counter() - t0

        return run

    def library() -> float:
        t0 = time.perf_counter()
        checkpointed_map(inc, range(n), every=every, name=f"floor{next(names)}")
        return time.perf_counter() - t0

    with Pipeline("bench", state_dir=base / "floor-state"):
        res = interleave(
            {"hand": by_hand(record=False), "floor": by_hand(record=True), "library": library}, rounds
        )
    per_commit = {k: statistics.median(v) / -(-n // every) for k, v in res.items()}
    rows = []
    for a, b, target in (("library", "hand", 1.3), ("floor", "hand", None), ("library", "floor", None)):
        per_round = [round(x / y, 3) for x, y in zip(res[a], res[b], strict=True)]
        rows.append(
            Row(
                f"{n:,} rows, every={every}, durable: {a} vs {b} (per commit)",
                us(per_commit[a]),
                us(per_commit[b]),
                statistics.median(per_round),
                f"{a} / {b}",
                "—" if target is None else f"≤ {target}",
                None if target is None else statistics.median(per_round) <= target,
                {"per_round": per_round, "per_commit_s": per_commit},
            )
        )
    return rows


# Each benchmark, called with the temporary directory and whether --quick was given.
BENCHES: dict[str, Callable[[Path, bool], list[Row]]] = {
    "naive": lambda base, q: bench_naive(base, 1 if q else 3),
    "linear": lambda base, q: bench_linear(base, 2 if q else 7),
    "resume": lambda base, q: bench_resume(base, 3 if q else 9),
    "pool": lambda base, q: bench_pool(base, 2 if q else 7),
    "async": lambda base, q: bench_async(base, 2 if q else 7),
    "floor": lambda base, q: bench_floor(base, 2 if q else 7, 20_000 if q else 200_000),
}


def main(argv: list[str] | None = None) -> int:
    os.environ["RESUMABLE_PROGRESS"] = "0"  # no progress lines between the results
    return drive(
        argv,
        description=__doc__,
        benches=BENCHES,
        child=lambda _mode, state: child_resume(state),
        prefix="resumable-bench-batch-",
    )


if __name__ == "__main__":
    sys.exit(main())
