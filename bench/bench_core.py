"""
Core speed benchmarks of resumable against baselines measured in the same run.

Run from the repository root::

    python bench/bench_core.py            # full run, a few minutes
    python bench/bench_core.py --quick    # fewer repetitions, for a smoke test
    python bench/bench_core.py --only skip,store --json results.json

Each row compares the library with a bare baseline doing the minimum the same job needs
(see bench/README.md and docs/performance.md for what each baseline does). Library and
baseline blocks alternate within every round, and a ratio is the median of the per-round
ratios, so slow drift of a noisy machine affects both sides alike.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
from benchlib import SMALL, Row, drive, fsync_dir, interleave, ms, quiet, ratios, us

from resumable import Pipeline, step

HERE = Path(__file__).resolve()
BIG_FLOATS = 12_500_000  # 100 MB of float64 (decimal MB, under the 100 MiB warning threshold)
BIG_BYTES = BIG_FLOATS * 8
MB = 1_000_000
HEAVY_MODULES = ("cloudpickle", "numpy", "pandas")


# --- the measured functions (module level: joblib and code digests need their source) -----


# The measured steps get their output as an ignored argument: a module-level value a step
# reads is part of its identity and digested at every call (that cost has a row of its own).
def small_output(x: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - x is fingerprinted
    return record


def small_output_global(x: int) -> dict[str, Any]:  # noqa: ARG001 - the argument is what is fingerprinted
    return SMALL


def small_output_keyed(i: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - i picks the slot
    return record


def big_output(i: int, array: Any) -> Any:  # noqa: ARG001 - the argument picks the slot
    # The array comes in as an ignored argument: a global the step read would be part of its
    # code identity, digested at every call (100 MB: as long as the write).
    return array


def big_a() -> Any:
    import numpy as np

    return np.random.default_rng(0).random(BIG_FLOATS)


def big_b(arr: Any) -> float:
    if os.environ.get("BENCH_EXPECT_SKIP") == "1":
        msg = "big_b ran although its output is stored: the benchmark measures a skip"
        raise RuntimeError(msg)
    return float(arr[:10].sum())


_BIG: dict[str, Any] = {}

skip_small = step(name="skip_small", ignore=("record",))(small_output)
skip_global = step(name="skip_global")(small_output_global)
store_small = step(name="store_small", key="{i}", ignore=("record",))(small_output_keyed)
skip_keyed = step(name="skip_keyed", key="{i}", ignore=("record",))(small_output_keyed)
store_big = step(name="store_big", key="{i}", ignore=("array",))(big_output)
skip_big_a = step(name="big_a")(big_a)
skip_big_b = step(name="big_b")(big_b)


# --- 1. skipping a completed step with a small argument -------------------------------------


def bench_skip(base: Path, rounds: int) -> list[Row]:
    import joblib  # type: ignore[import-untyped]

    state = base / "skip-state"
    pipe = Pipeline("bench", state_dir=state)
    memory = joblib.Memory(str(base / "joblib"), verbose=0)
    cached = memory.cache(small_output)
    cached(42)  # miss: stores the output
    cached(42)  # first hit: joblib checks the function's code once
    n_fast, n_joblib, n_slots = 2000, 200, 500
    with pipe:
        skip_small(42)  # stores the output (and computes the code digest)
        if skip_small(42) != SMALL:
            msg = "skip_small returned something else than its stored output"
            raise RuntimeError(msg)
        path = str(state / "skip_small.msgpack")

        def bare() -> float:
            t0 = time.perf_counter()
            for _ in range(n_fast):
                if not os.path.exists(path):
                    raise FileNotFoundError(path)
                with open(path, "rb") as f:
                    data = f.read()
                unpacker = msgpack.Unpacker(raw=False)
                unpacker.feed(data)
                unpacker.unpack()  # the header
                unpacker.unpack()  # the value
            return (time.perf_counter() - t0) / n_fast

        def library() -> float:
            t0 = time.perf_counter()
            for _ in range(n_fast):
                skip_small(42)
            return (time.perf_counter() - t0) / n_fast

        def joblib_hit() -> float:
            t0 = time.perf_counter()
            for _ in range(n_joblib):
                cached(42)
            return (time.perf_counter() - t0) / n_joblib

        skip_global(42)

        def library_global() -> float:
            t0 = time.perf_counter()
            for _ in range(n_fast):
                skip_global(42)
            return (time.perf_counter() - t0) / n_fast

        res = interleave(
            {"bare": bare, "library": library, "joblib": joblib_hit, "library_global": library_global}, rounds
        )
    # Keyed slots in a pipeline of their own, so that the rows above run in a one-slot pipeline.
    state = base / "skip-keyed-state"
    with Pipeline("bench", state_dir=state):
        for i in range(n_slots):
            skip_keyed(i)
        keyed_paths = [str(state / "skip_keyed" / f"{i}.msgpack") for i in range(n_slots)]

        def bare_keyed() -> float:
            t0 = time.perf_counter()
            for p in keyed_paths:
                if not os.path.exists(p):
                    raise FileNotFoundError(p)
                with open(p, "rb") as f:
                    data = f.read()
                unpacker = msgpack.Unpacker(raw=False)
                unpacker.feed(data)
                unpacker.unpack()
                unpacker.unpack()
            return (time.perf_counter() - t0) / n_slots

        def library_keyed() -> float:
            t0 = time.perf_counter()
            for i in range(n_slots):
                skip_keyed(i)
            return (time.perf_counter() - t0) / n_slots

        res |= interleave({"bare_keyed": bare_keyed, "library_keyed": library_keyed}, max(3, rounds // 2))

    def library_cold() -> float:
        # The first skip of each slot in a run: nothing verified or resolved yet in this process.
        skip_keyed.__resumable_step__._plans.clear()  # noqa: SLF001 - measure plans computed afresh
        with Pipeline("bench", state_dir=state):
            t0 = time.perf_counter()
            for i in range(n_slots):
                skip_keyed(i)
            return (time.perf_counter() - t0) / n_slots

    res |= interleave({"bare_cold": bare_keyed, "library_cold": library_cold}, max(3, rounds // 2))
    cold = ratios(res["library_cold"], res["bare_cold"])
    lib, bare_t, job = (statistics.median(res[k]) for k in ("library", "bare", "joblib"))
    keyed = ratios(res["library_keyed"], res["bare_keyed"])
    vs_bare = ratios(res["library"], res["bare"])
    vs_joblib = ratios(res["joblib"], res["library"])
    details = {k: statistics.median(v) for k, v in res.items()}
    return [
        Row(
            "skip, small argument, ~1 KB output, vs bare exists+read+unpack",
            us(lib),
            us(bare_t),
            vs_bare,
            "library / bare",
            "≤ 2.0",
            vs_bare <= 2.0,
            details,
        ),
        Row(
            "skip, small argument, ~1 KB output, vs joblib.Memory hit",
            us(lib),
            us(job),
            vs_joblib,
            "joblib / library",
            "≥ 10",
            vs_joblib >= 10.0,
            details,
        ),
        Row(
            "skip of a step that reads a ~1 KB module-level dict (digested at every call), vs bare",
            us(statistics.median(res["library_global"])),
            us(bare_t),
            ratios(res["library_global"], res["bare"]),
            "library / bare",
            "(≤ 2.0)",
            None,
            details,
        ),
        Row(
            f"first skip of each of {n_slots} slots in a new run (full verification), vs bare",
            us(statistics.median(res["library_cold"])),
            us(statistics.median(res["bare_cold"])),
            cold,
            "library / bare",
            "(≤ 2.0)",
            None,
            details,
        ),
        Row(
            f"skip, keyed step, {n_slots} distinct slots in turn, vs bare (information)",
            us(statistics.median(res["library_keyed"])),
            us(statistics.median(res["bare_keyed"])),
            keyed,
            "library / bare",
            "(≤ 2.0)",
            None,
            details,
        ),
    ]


# --- 2. storing a small output durably ------------------------------------------------------


def bare_store(directory: str, i: int, value: object) -> None:
    """msgpack.packb, write a temp file, fsync, rename over the target, fsync the directory."""
    data = msgpack.packb(value)
    target = os.path.join(directory, f"{i}.msgpack")
    tmp = os.path.join(directory, f".{i}.msgpack.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, target)
    fsync_dir(directory)


def _store_blocks(bare_dir: Path, n: int, counter: itertools.count[int]) -> dict[str, Callable[[], float]]:
    bare_dir.mkdir(parents=True, exist_ok=True)

    def bare() -> float:
        start = next(counter) * n
        t0 = time.perf_counter()
        for i in range(start, start + n):
            bare_store(str(bare_dir), i, SMALL)
        return (time.perf_counter() - t0) / n

    def library() -> float:
        start = next(counter) * n
        t0 = time.perf_counter()
        for i in range(start, start + n):
            store_small(i)
        return (time.perf_counter() - t0) / n

    return {"bare": bare, "library": library}


def bench_store(base: Path, rounds: int, *, with_scaling: bool) -> list[Row]:
    n = 40
    res: dict[str, list[float]] = {"bare": [], "library": []}
    # A fresh pipeline per round: every round stores into a pipeline holding < 100 slots.
    for r in range(rounds):
        state, bare_dir = base / f"store-{r}" / "state", base / f"store-{r}" / "bare"
        counter = itertools.count(1)
        with Pipeline("bench", state_dir=state):
            store_small(0)  # opens the slot directory, computes the code digest
            one = interleave(_store_blocks(bare_dir, n, counter), 2)
        for k, v in one.items():
            res[k].append(statistics.median(v))
        shutil.rmtree(base / f"store-{r}")
    lib, bare_t = statistics.median(res["library"]), statistics.median(res["bare"])
    ratio = ratios(res["library"], res["bare"])
    rows = [
        Row(
            "store ~1 KB output durably (fresh pipeline, < 100 slots)",
            us(lib),
            us(bare_t),
            ratio,
            "library / bare",
            "≤ 1.5",
            ratio <= 1.5,
            {k: statistics.median(v) for k, v in res.items()} | {"per_round": res},
        )
    ]
    if with_scaling:
        rows.append(bench_store_scaling(base, max(3, rounds // 3)))
    return rows


def bench_store_scaling(base: Path, rounds: int, slots: int = 1000) -> Row:
    """The same store, in a pipeline that already holds *slots* completed slots."""
    state, bare_dir = base / "store-many" / "state", base / "store-many" / "bare"
    t0 = time.perf_counter()
    with Pipeline("bench", state_dir=state, durable=False):
        for i in range(slots):
            store_small(-1 - i)
    fill = time.perf_counter() - t0
    # Blocks long enough to span a few manifest flushes (one per 0.2 s at most).
    n = 100
    with Pipeline("bench", state_dir=state):
        store_small(0)
        res = interleave(_store_blocks(bare_dir, n, itertools.count(1)), rounds)
    shutil.rmtree(base / "store-many")
    lib, bare_t = statistics.median(res["library"]), statistics.median(res["bare"])
    ratio = ratios(res["library"], res["bare"])
    return Row(
        f"store ~1 KB output durably, {slots:,} to {slots + n * rounds:,} slots already stored (information)",
        us(lib),
        us(bare_t),
        ratio,
        "library / bare",
        "(≤ 1.5)",
        None,
        {k: statistics.median(v) for k, v in res.items()} | {"fill_s": fill, "fill_per_slot_s": fill / slots},
    )


# --- 3. a 100 MB array output: durable write throughput -------------------------------------


def bench_big_write(base: Path, reps: int) -> list[Row]:
    import numpy as np

    _BIG["array"] = np.random.default_rng(1).random(BIG_FLOATS)
    raw = memoryview(_BIG["array"]).cast("B")
    state, bare_dir = base / "big-state", base / "big-bare"
    bare_dir.mkdir(parents=True)
    counter = itertools.count()

    def bare() -> float:
        path = str(bare_dir / f"{next(counter)}.bin")
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = raw
            while view:
                view = view[os.write(fd, view[: 1 << 30]) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        elapsed = time.perf_counter() - t0
        os.unlink(path)
        return elapsed

    def library() -> float:
        i = next(counter)
        t0 = time.perf_counter()
        store_big(i, _BIG["array"])
        elapsed = time.perf_counter() - t0
        path = state / "store_big" / f"{i}.msgpack"
        if path.stat().st_size < BIG_BYTES:
            msg = f"{path} is smaller than the array"
            raise RuntimeError(msg)
        path.unlink()
        return elapsed

    with Pipeline("bench", state_dir=state):
        store_big(-1, _BIG["array"])  # creates the slot directory, computes the code digest
        bare(), library()  # untimed: the first write after a while is slow for either side
        res = interleave({"bare": bare, "library": library}, reps)
    _BIG.clear()
    lib_mbs = BIG_BYTES / MB / statistics.median(res["library"])
    bare_mbs = BIG_BYTES / MB / statistics.median(res["bare"])
    ratio = ratios(res["bare"], res["library"])  # throughput ratio = inverse time ratio
    return [
        Row(
            "100 MB float64 array output, durable write throughput",
            f"{lib_mbs:,.0f} MB/s",
            f"{bare_mbs:,.0f} MB/s",
            ratio,
            "library / raw (MB/s)",
            "≥ 0.7",
            ratio >= 0.7,
            {k: statistics.median(v) for k, v in res.items()}
            | {"library_mb_s": lib_mbs, "raw_mb_s": bare_mbs, "per_round": res},
        )
    ]


# --- 4. skipping a step whose argument is a 100 MB step output, in a fresh process ----------


def child_setup_big(state: str) -> None:
    quiet()
    import numpy as np

    with Pipeline("bench", state_dir=state):
        arr = skip_big_a()
        skip_big_b(arr)
    np.save(Path(state) / "a.npy", arr)  # the np.load baseline of A's skip (not a step file)


def child_skip_big(state: str) -> None:
    quiet()
    os.environ["BENCH_EXPECT_SKIP"] = "1"
    import hashlib

    import numpy as np  # before timing, as in any script that makes arrays

    with Pipeline("bench", state_dir=state):
        t0 = time.perf_counter()
        arr = skip_big_a()
        t1 = time.perf_counter()
        skip_big_b(arr)
        t2 = time.perf_counter()
        skip_big_b(arr)
        t3 = time.perf_counter()
    t4 = time.perf_counter()
    hashlib.sha256(memoryview(arr).cast("B")).digest()
    t5 = time.perf_counter()
    t6 = time.perf_counter()
    np.load(Path(state) / "a.npy")
    t7 = time.perf_counter()
    result = {
        "a_s": t1 - t0,
        "b_first_s": t2 - t1,
        "b_again_s": t3 - t2,
        "sha256_s": t5 - t4,
        "npload_s": t7 - t6,
    }
    print(json.dumps(result))


def run_child(*args: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        check=False,
    )
    if proc.returncode != 0:
        msg = f"child {args} failed:\n{proc.stderr}"
        raise RuntimeError(msg)
    return proc.stdout


def bench_skip_big(base: Path, reps: int) -> list[Row]:
    state = base / "skipbig-state"
    run_child("setup-big", str(state), cwd=base)
    runs = [json.loads(run_child("skip-big", str(state), cwd=base)) for _ in range(reps)]
    shutil.rmtree(state)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    b = med["b_first_s"]
    # Passing an output on re-encodes and checksums it (an output changed in place must not
    # be taken for the stored one): it must never cost more than hashing the array afresh.
    ratio = b / med["sha256_s"]
    # A's own skip reads, verifies and decodes the 100 MB: information beside np.load of a .npy
    # of the same array in the same process (bench_peers.py times it against its peers).
    a_mbs = BIG_BYTES / MB / med["a_s"]
    return [
        Row(
            "fresh process: skip a step whose argument is a 100 MB step output (re-checked)",
            ms(b),
            f"sha256 of the array {ms(med['sha256_s'])}",
            ratio,
            "library / sha256",
            "≤ 1.0",
            ratio <= 1.0,
            med | {"runs": runs},
        ),
        Row(
            "fresh process: skip a step returning a 100 MB array (read + verify + decode), vs np.load",
            f"{a_mbs:,.0f} MB/s",
            f"np.load of a .npy {BIG_BYTES / MB / med['npload_s']:,.0f} MB/s",
            med["a_s"] / med["npload_s"],
            "library / np.load",
            "(≥ 2,000 MB/s)",
            None,
            {"library_mb_s": a_mbs},
        ),
    ]


# --- 5. import time -------------------------------------------------------------------------

_IMPORT_LIB = """\
import time
t0 = time.perf_counter()
import resumable
t1 = time.perf_counter()
import sys
print(t1 - t0, ",".join(m for m in {heavy!r} if m in sys.modules))
"""

_IMPORT_DEPS = """\
import time
import importlib
mods = {mods!r}
t0 = time.perf_counter()
for m in mods:
    importlib.import_module(m)
t1 = time.perf_counter()
print(t1 - t0, "")
"""

_LIST_DEPS = """\
import sys, time, importlib
before = set(sys.modules)
import resumable
print("\\n".join(m for m in sys.modules if m not in before and m != "resumable"
                 and not m.startswith("resumable.") and not m.startswith("importlib")))
"""


def python_c(code: str, *extra: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # Bytecode caches go to a private prefix (warmed by the first runs), so that neither side
    # pays for compiling, whatever PYTHONDONTWRITEBYTECODE says and however fresh the sources.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(cwd / "pycache")
    return subprocess.run(
        [sys.executable, *extra, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, check=True
    )


def bench_import(base: Path, reps: int) -> list[Row]:
    deps = python_c(_LIST_DEPS, cwd=base).stdout.split()
    lib_code = _IMPORT_LIB.format(heavy=HEAVY_MODULES)
    deps_code = _IMPORT_DEPS.format(mods=deps)
    heavy: set[str] = set()

    def lib() -> float:
        seconds, _, loaded = python_c(lib_code, cwd=base).stdout.partition(" ")
        heavy.update(filter(None, loaded.strip().split(",")))
        return float(seconds)

    def dep() -> float:
        return float(python_c(deps_code, cwd=base).stdout.split()[0])

    lib(), dep()  # warm the bytecode caches
    res = interleave({"deps": dep, "library": lib}, reps)
    own = own_import_time(base)
    ratio = ratios(res["library"], res["deps"])
    top = sorted({m.split(".")[0] for m in deps})
    return [
        Row(
            "import resumable, fresh process, vs importing its dependencies",
            ms(statistics.median(res["library"])),
            ms(statistics.median(res["deps"])),
            ratio,
            "library / dependencies",
            "≤ 1.3",
            ratio <= 1.3,
            {k: statistics.median(v) for k, v in res.items()}
            | {"dependency_modules": len(deps), "top_level": top, "own_modules_self_s": own},
        ),
        Row(
            "import resumable loads none of " + ", ".join(HEAVY_MODULES),
            ", ".join(sorted(heavy)) or "none loaded",
            "—",
            None,
            "",
            "none",
            not heavy,
            {"loaded": sorted(heavy)},
        ),
    ]


def own_import_time(base: Path, reps: int = 7) -> dict[str, float]:
    """Median self time (s) of each resumable module, from ``python -X importtime``."""
    samples: dict[str, list[float]] = {}
    for _ in range(reps):
        err = python_c("import resumable", "-X", "importtime", cwd=base).stderr
        for line in err.splitlines():
            if not line.startswith("import time:") or "|" not in line:
                continue
            self_us, _, name = (p.strip() for p in line.removeprefix("import time:").split("|"))
            if name.startswith("resumable") and self_us.isdigit():
                samples.setdefault(name, []).append(int(self_us) / 1e6)
    return {k: statistics.median(v) for k, v in samples.items()}


CHILDREN: dict[str, Callable[[str], None]] = {"setup-big": child_setup_big, "skip-big": child_skip_big}

# Each benchmark, called with the temporary directory and whether --quick was given.
BENCHES: dict[str, Callable[[Path, bool], list[Row]]] = {
    "skip": lambda base, q: bench_skip(base, 5 if q else 21),
    "store": lambda base, q: bench_store(base, 4 if q else 15, with_scaling=not q),
    "big": lambda base, q: bench_big_write(base, 2 if q else 7),
    "skipbig": lambda base, q: bench_skip_big(base, 3 if q else 9),
    "import": lambda base, q: bench_import(base, 8 if q else 40),
}


def main(argv: list[str] | None = None) -> int:
    return drive(
        argv,
        description=__doc__,
        benches=BENCHES,
        child=lambda mode, state: CHILDREN[mode](state),
        prefix="resumable-bench-",
    )


if __name__ == "__main__":
    sys.exit(main())
