"""
Fingerprint benchmarks: big arguments and big values a step reads, against msgpack +
SHA-256 and joblib.hash of the same data, in the same run.

Run from the repository root::

    python bench/bench_fingerprint.py            # everything, several minutes
    python bench/bench_fingerprint.py --quick    # 100,000 rows instead of 1,000,000, a smoke test
    python bench/bench_fingerprint.py --only dicts,tuples --json results.json

Rows (see bench/README.md for exactly what each side does):

- dicts: the argument fingerprint of a list of 1,000,000 small dicts (target: at most twice
  msgpack.packb + SHA-256 of the same list; pickle + MD5 and joblib.hash for information);
- tuples: the same for a list of 1,000,000 tuples;
- global: a step whose code reads a module-level list of 1,000,000 dicts: a skip in the
  same process, and the first call (a skip) in a fresh process, both against msgpack +
  SHA-256 of the list (target: at most twice); storing that list as a step's output
  against msgpack + write + fsync (information);
- example: the example of docs/batches.md with 1,000,000 rows, rerun with everything
  stored, against the same script run with ``RESUMABLE_DISABLE=1`` (target: at most 0.5);
  beside it, the floor of that rerun: building the rows and decoding the output `enrich`
  returns with msgpack alone, no library.
"""

from __future__ import annotations

import collections
import hashlib
import os
import pickle
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from benchlib import Row, drive, fsync_dir, interleave, ms, quiet, ratios

import resumable
from resumable import Pipeline, step
from resumable._fingerprint import digest_parameters

HERE = Path(__file__).resolve()
# child processes import the resumable this process imported (a checkout given by PYTHONPATH too)
CODE = str(Path(resumable.__file__).resolve().parent.parent)
ROWS = 1_000_000
QUICK_ROWS = 100_000

# The example of docs/batches.md: `enrich` maps a function over the rows with row
# checkpoints, `load` inserts them into a database (SQLite in memory here).
EXAMPLE = """
import sqlite3
import sys

from resumable import checkpointed, checkpointed_map, step

db = sqlite3.connect(":memory:")
db.execute("create table customers (id integer, name text, score real, label text)")


def call_api(row: dict) -> dict:
    return {**row, "label": "high" if row["score"] > 50 else "low"}


@step
def enrich(rows: list[dict]) -> list[dict]:
    return checkpointed_map(call_api, rows, every=100)


@step
def load(rows: list[dict]) -> int:
    for row in checkpointed(rows, every=500):
        db.execute("insert into customers values (?, ?, ?, ?)", (row["id"], row["name"], row["score"], row["label"]))
    return len(rows)


rows = [{"id": i, "name": f"customer {i}", "score": (i * 37 % 1000) / 10} for i in range(int(sys.argv[1]))]
print(load(enrich(rows)))
"""


# The same two steps run by Pipeline.run (``load`` takes ``enrich``'s output by its name):
# there a skipped step's output is loaded only if a step that runs needs it.
EXAMPLE_RUN = EXAMPLE.replace(
    "from resumable import checkpointed, checkpointed_map, step",
    "from resumable import Pipeline, checkpointed, checkpointed_map\n\npipe = Pipeline()",
)
EXAMPLE_RUN = EXAMPLE_RUN.replace("@step", "@pipe.step").replace("def load(rows:", "def load(enrich:")
EXAMPLE_RUN = EXAMPLE_RUN.replace("checkpointed(rows, every=500)", "checkpointed(enrich, every=500)")
EXAMPLE_RUN = EXAMPLE_RUN.replace("return len(rows)", "return len(enrich)")
EXAMPLE_RUN = EXAMPLE_RUN.replace("print(load(enrich(rows)))", 'print(pipe.run(rows=rows).outputs["load"])')


# What the rerun cannot do without: build the rows and decode `enrich`'s stored output (the
# value a step returns), with msgpack alone, no fingerprint, no library.
FLOOR = """
import sys

import msgpack

rows = [{"id": i, "name": f"customer {i}", "score": (i * 37 % 1000) / 10} for i in range(int(sys.argv[1]))]
with open("state/enrich.msgpack", "rb") as f:
    data = f.read()
unpacker = msgpack.Unpacker(raw=False)
unpacker.feed(data[:65536])
unpacker.unpack()  # the header
print(len(msgpack.unpackb(memoryview(data)[unpacker.tell() :], strict_map_key=False)))
"""


def small_dicts(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"customer {i}", "score": i * 0.5} for i in range(n)]


def tuples(n: int) -> list[tuple[int, str, float]]:
    return [(i, f"customer {i}", i * 0.5) for i in range(n)]


# --- the steps reading a module-level value -------------------------------------------------

TABLE: list[dict[str, Any]] = []  # filled before the steps are called


def count_rows(n: int) -> int:
    return len(TABLE) + n


def keep_rows(i: int) -> list[dict[str, Any]]:  # noqa: ARG001 - i picks the slot
    return TABLE


read_table = step(name="read_table")(count_rows)
store_table = step(name="store_table", key="{i}")(keep_rows)


# --- measuring ------------------------------------------------------------------------------


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def block() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return block


def msgpack_sha256(value: object) -> bytes:
    return hashlib.sha256(msgpack.packb(value)).digest()


def pickle_md5(value: object) -> bytes:
    return hashlib.md5(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()  # noqa: S324 - a baseline


def joblib_hash(value: object) -> str:
    import joblib  # type: ignore[import-untyped]

    return str(joblib.hash(value))


def fingerprint(value: object) -> str:
    return digest_parameters("bench", {"rows": value}, frozenset())[0]


def argument_rows(label: str, data: object, rounds: int) -> list[Row]:
    res = interleave(
        {
            "library": timed(lambda: fingerprint(data)),
            "msgpack": timed(lambda: msgpack_sha256(data)),
            "pickle": timed(lambda: pickle_md5(data)),
        },
        rounds,
    )
    # joblib.hash pickles with the pure-Python pickler (to sort dicts): one round is enough
    res |= interleave(
        {"library_once": timed(lambda: fingerprint(data)), "joblib": timed(lambda: joblib_hash(data))}, 1
    )
    details = {k: statistics.median(v) for k, v in res.items()}
    lib = details["library"]
    vs_msgpack = ratios(res["library"], res["msgpack"])
    return [
        Row(
            f"fingerprint an argument: {label}, vs msgpack.packb + SHA-256",
            ms(lib),
            ms(details["msgpack"]),
            vs_msgpack,
            "library / msgpack",
            "≤ 2.0",
            vs_msgpack <= 2.0,
            details,
        ),
        Row(
            f"fingerprint an argument: {label}, vs pickle.dumps + MD5 (C pickler; dict order counts)",
            ms(lib),
            ms(details["pickle"]),
            ratios(res["library"], res["pickle"]),
            "library / pickle",
            "(information)",
            None,
            details,
        ),
        Row(
            f"fingerprint an argument: {label}, vs joblib.hash (one round)",
            ms(details["library_once"]),
            ms(details["joblib"]),
            ratios(res["library_once"], res["joblib"]),
            "library / joblib",
            "(information)",
            None,
            details,
        ),
    ]


def bench_dicts(base: Path, quick: bool) -> list[Row]:  # noqa: ARG001 - no state
    n = QUICK_ROWS if quick else ROWS
    return argument_rows(f"{n:,} small dicts", small_dicts(n), 3 if quick else 5)


def bench_tuples(base: Path, quick: bool) -> list[Row]:  # noqa: ARG001 - no state
    n = QUICK_ROWS if quick else ROWS
    return argument_rows(f"{n:,} tuples", tuples(n), 3 if quick else 5)


def bench_global(base: Path, quick: bool) -> list[Row]:
    n = QUICK_ROWS if quick else ROWS
    rounds = 3 if quick else 5
    TABLE[:] = small_dicts(n)
    state = base / "global-state"
    with Pipeline("bench", state_dir=state):
        read_table(1)  # runs once, then every call is a skip that digests TABLE
        res = interleave(
            {
                "skip": timed(lambda: read_table(1)),
                "argument": timed(lambda: fingerprint(TABLE)),
                "msgpack": timed(lambda: msgpack_sha256(TABLE)),
            },
            rounds,
        )
    # each side in a fresh process of its own, alternately (both pay for fresh memory)
    fresh = interleave(
        {"first": lambda: _child("first", state, n), "msgpack": lambda: _child("msgpack", state, n)}, rounds
    )
    # storing the list as a step's output, a fresh slot each time, against a bare durable write
    counter = iter(range(1_000_000))
    bare_dir = base / "bare"
    bare_dir.mkdir()

    def bare_store() -> None:
        path = bare_dir / f"{next(counter)}.msgpack"
        with open(path, "wb") as f:
            f.write(msgpack.packb(TABLE))
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(str(bare_dir))

    with Pipeline("bench", state_dir=base / "store-state"):
        stores = interleave(
            {"store": timed(lambda: store_table(next(counter))), "bare": timed(bare_store)},
            max(2, rounds // 2),
        )
    TABLE.clear()
    details = {k: statistics.median(v) for k, v in (res | stores).items()}
    details["fresh_first_call"] = statistics.median(fresh["first"])
    details["fresh_msgpack"] = statistics.median(fresh["msgpack"])
    skip = ratios(res["skip"], res["msgpack"])
    first = ratios(fresh["first"], fresh["msgpack"])
    return [
        Row(
            f"skip of a step reading a global list of {n:,} dicts, vs msgpack.packb + SHA-256 of it",
            ms(details["skip"]),
            ms(details["msgpack"]),
            skip,
            "library / msgpack",
            "≤ 2.0",
            skip <= 2.0,
            details,
        ),
        Row(
            "the same skip, vs fingerprinting the list as an argument",
            ms(details["skip"]),
            ms(details["argument"]),
            ratios(res["skip"], res["argument"]),
            "library / argument",
            "(≈ 1)",
            None,
            details,
        ),
        Row(
            "first call of that step in a fresh process (a skip), vs msgpack.packb + SHA-256 there",
            ms(details["fresh_first_call"]),
            ms(details["fresh_msgpack"]),
            first,
            "library / msgpack",
            "≤ 2.0",
            first <= 2.0,
            details,
        ),
        Row(
            "store that list as a step's output, durably, vs msgpack.packb + write + fsync",
            ms(details["store"]),
            ms(details["bare"]),
            ratios(stores["store"], stores["bare"]),
            "library / bare",
            "(information)",
            None,
            details,
        ),
    ]


def _child(mode: str, state: Path, n: int) -> float:
    done = subprocess.run(
        [sys.executable, str(HERE), "--child", mode, f"{state}:{n}"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": CODE},
    )
    return float(done.stdout)


def child(mode: str, arg: str) -> None:
    """In a fresh process: time the first call of read_table (a skip), or msgpack + SHA-256 of TABLE."""
    quiet()
    state, _, n = arg.rpartition(":")
    TABLE[:] = small_dicts(int(n))
    if mode == "msgpack":
        t0 = time.perf_counter()
        msgpack_sha256(TABLE)
        print(time.perf_counter() - t0)
        return
    with Pipeline("bench", state_dir=state):
        t0 = time.perf_counter()
        read_table(1)
        print(time.perf_counter() - t0)


def bench_example(base: Path, quick: bool) -> list[Row]:
    n = QUICK_ROWS if quick else ROWS
    rounds = 2 if quick else 3
    env = {**os.environ, "PYTHONPATH": CODE, "RESUMABLE_PROGRESS": "0"}
    env.pop("RESUMABLE_DISABLE", None)

    def runner(name: str, text: str) -> Callable[..., float]:
        work = base / name
        work.mkdir()
        script = work / "example.py"
        script.write_text(text)

        def run(**extra: str) -> float:
            t0, cpu0 = time.perf_counter(), _children_cpu()
            subprocess.run(
                [sys.executable, str(script), str(n)],
                cwd=work,
                env={**env, **extra},
                check=True,
                capture_output=True,
            )
            # the child's CPU time too: on a shared machine it moves less than the wall clock
            cpu[name, "disabled" if extra else "cached"].append(_children_cpu() - cpu0)
            return time.perf_counter() - t0

        run()  # computes and stores everything
        return run

    cpu: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    script, piped = runner("script", EXAMPLE), runner("piped", EXAMPLE_RUN)
    floor_script = base / "script" / "floor.py"
    floor_script.write_text(FLOOR)

    def floor() -> float:
        t0, cpu0 = time.perf_counter(), _children_cpu()
        subprocess.run(
            [sys.executable, str(floor_script), str(n)], cwd=base / "script", check=True, capture_output=True
        )
        cpu["floor", "cached"].append(_children_cpu() - cpu0)
        return time.perf_counter() - t0

    cpu.clear()  # not the first runs
    res = interleave(
        {
            "cached": script,
            "disabled": lambda: script(RESUMABLE_DISABLE="1"),
            "run_cached": piped,
            "run_disabled": lambda: piped(RESUMABLE_DISABLE="1"),
            "floor": floor,
        },
        rounds,
    )
    details = {k: statistics.median(v) for k, v in res.items()}
    ratio = ratios(res["cached"], res["disabled"])
    run_ratio = ratios(res["run_cached"], res["run_disabled"])
    floor_ratio = ratios(res["floor"], res["disabled"])
    details["cpu_s"] = {f"{a}_{b}": statistics.median(v) for (a, b), v in cpu.items()}
    details["cpu_ratio"] = ratios(cpu["script", "cached"], cpu["script", "disabled"])
    details["run_cpu_ratio"] = ratios(cpu["piped", "cached"], cpu["piped", "disabled"])
    details["floor_cpu_ratio"] = ratios(cpu["floor", "cached"], cpu["script", "disabled"])
    return [
        Row(
            f"docs/batches.md example, {n:,} rows, rerun with everything stored, vs RESUMABLE_DISABLE=1",
            f"{details['cached']:.2f} s",
            f"{details['disabled']:.2f} s",
            ratio,
            f"cached / disabled; CPU time {details['cpu_ratio']:.2f}",
            "≤ 0.5",
            ratio <= 0.5,
            details,
        ),
        Row(
            "its floor: build the rows and msgpack.unpackb enrich's stored output, no library, vs RESUMABLE_DISABLE=1",
            f"{details['floor']:.2f} s",
            f"{details['disabled']:.2f} s",
            floor_ratio,
            f"floor / disabled; CPU time {details['floor_cpu_ratio']:.2f}",
            "(information)",
            None,
            details,
        ),
        Row(
            "the same two steps run by Pipeline.run (a skipped output is not loaded), vs RESUMABLE_DISABLE=1",
            f"{details['run_cached']:.2f} s",
            f"{details['run_disabled']:.2f} s",
            run_ratio,
            f"cached / disabled; CPU time {details['run_cpu_ratio']:.2f}",
            "(information)",
            None,
            details,
        ),
    ]


def _children_cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def main(argv: list[str] | None = None) -> int:
    return drive(
        argv,
        description=__doc__,
        benches={
            "dicts": bench_dicts,
            "tuples": bench_tuples,
            "global": bench_global,
            "example": bench_example,
        },
        child=child,
        prefix="resumable-bench-fp-",
    )


if __name__ == "__main__":
    sys.exit(main())
