"""
How resumable scales with the number of stored slots and of runs, with SQLite as the baseline.

Run from the repository root::

    python bench/bench_scale.py                 # 100,000 slots, 10,000 runs: six to eight minutes
    python bench/bench_scale.py --quick         # 10,000 slots and 1,000 runs, about a minute
    python bench/bench_scale.py --big           # also open a state of 1,000,000 slots (long to build)
    python bench/bench_scale.py --only open,cli --json scale.json
    python bench/bench_scale.py --strict        # exit with status 1 when a target is missed

Without ``--strict`` the script exits with status 0 whatever the results: it is a measurement
of where the current code stands, and the targets are printed as PASS/FAIL for reading.

The state is built once per invocation: a keyed step ``doc`` storing a small dict per slot
(``{"i": i, "name": f"doc-{i}", "tags": ["a", "b"]}``) under ``Pipeline(durable=False)``, in one
process; rows that change the state work on a copy. The baseline is a SQLite file holding the
same values, one row each (``kv(key TEXT PRIMARY KEY, value BLOB)``, msgpack-packed, WAL).

Benchmarks (``--only``), in the order they run:

- runs: 10,000 runs of a one-step script in one process: per-run time of runs 1-20 vs the
  last 20 (target: at most 1.2), vs a SQLite "run" (connect, get, insert a run row, commit);
  first, so that its fsyncs are timed on a quiet disk;
- build: building the state (information; the SQLite file is filled row by row alongside);
- open: ``with Pipeline(...)`` + the first call of the keyed step in a fresh process
  (target: 100 ms at 100,000 slots, 1 s at 1,000,000 with ``--big``), vs SQLite connect + first get;
- skip: the mean cost of skipping every slot in a fresh process, at 100 slots and at 100,000
  (target: the ratio at most 1.5), vs SQLite get + msgpack unpack;
- disk: allocated bytes per slot (target 1,000) and manifest + event log bytes per slot
  (target 300), vs the SQLite file's size per row;
- rss: peak RSS of a fresh process skipping every slot (target 150 MB), vs SQLite reading every row;
- cli: ``resumable history``, ``resumable clean --dry-run`` and ``resumable rollback`` in a
  child (each at most 2 s and 300 MB; the child has a time limit and a memory cap and the row
  says "timeout" or "out of memory" when it hits one), and the close of a run that prunes.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import benchlib
import msgpack
from benchlib import Row, drive, interleave, ms, quiet, us

from resumable import Pipeline, step

HERE = Path(__file__).resolve()
MB = 1_000_000
SMALL_SLOTS = 100  # the small state of the skip and CLI rows
BIG_SLOTS = 1_000_000  # --big
PRUNE_RERUNS = 50  # slots the pruning run stores again (kept versions to prune)
CLI_TIMEOUT = 120.0  # seconds: a CLI child that takes longer is reported as "timeout"
CLI_MEMORY_CAP = 3 * 1024**3  # RLIMIT_AS of a CLI child
CHILD_TIMEOUT = 3600.0  # any other child: it is stuck


@dataclass
class Options:
    slots: int = 100_000
    runs: int = 10_000
    big: bool = False
    quick: bool = False


OPTIONS = Options()


# --- the measured steps (module level: the children define the very same code) -------------


def make_doc(i: int, rev: int = 0) -> dict[str, Any]:  # noqa: ARG001 - rev is fingerprinted: a new rev reruns the slot
    if os.environ.get("BENCH_EXPECT_SKIP") == "1":
        msg = "doc ran although its output is stored: the benchmark measures a skip"
        raise RuntimeError(msg)
    return {"i": i, "name": f"doc-{i}", "tags": ["a", "b"]}


def one_output(x: int) -> dict[str, Any]:
    if os.environ.get("BENCH_EXPECT_SKIP") == "1":
        msg = "one ran although its output is stored: the benchmark measures a skip"
        raise RuntimeError(msg)
    return {"x": x, "name": "one"}


doc = step(name="doc", key="{i}")(make_doc)
one = step(name="one")(one_output)


def sql_value(i: int) -> bytes:
    """The same value as ``make_doc(i)``, packed for the SQLite baseline."""
    return msgpack.packb({"i": i, "name": f"doc-{i}", "tags": ["a", "b"]})


# --- child processes ------------------------------------------------------------------------


@dataclass
class Child:
    status: str  # "ok", "timeout", "out of memory" or "failed (...)"
    wall_s: float  # from spawning to reaping: interpreter start and imports included
    maxrss: int  # peak RSS in bytes (ru_maxrss of the child)
    out: dict[str, Any] = field(default_factory=dict)  # the child's JSON line, if it printed one
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def spawn(
    argv: list[str], *, cwd: Path, timeout: float = CHILD_TIMEOUT, memory_cap: int | None = None
) -> Child:
    """
    Run *argv* to completion; its wall time, its peak RSS (from ``wait4``) and its last JSON
    line. A child still running after *timeout* seconds is killed; *memory_cap* is its RLIMIT_AS.
    """

    def limit() -> None:  # in the child, before exec
        if memory_cap is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_cap, memory_cap))

    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=out, stderr=err, preexec_fn=limit)  # noqa: PLW1509 - setrlimit only
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        try:
            _, wstatus, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(wstatus)  # reaped here: Popen must not wait
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode(errors="replace")
        stderr = err.read().decode(errors="replace")
    maxrss = usage.ru_maxrss * 1024  # KiB on Linux
    parsed: dict[str, Any] = {}
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            parsed = json.loads(line)
            break
    if killed.is_set():
        status = "timeout"
    elif proc.returncode != 0:
        memory = "MemoryError" in stderr or "out of memory" in stderr.lower() or "Cannot allocate" in stderr
        # under a memory cap, an allocation failing in C code can end the child with a signal
        memory = memory or (memory_cap is not None and -proc.returncode in {signal.SIGSEGV, signal.SIGABRT})
        last = (stderr.strip().splitlines() or ["no message"])[-1][:200]
        status = "out of memory" if memory else f"failed (exit {proc.returncode}: {last})"
    else:
        status = "ok"
    return Child(status, wall, maxrss, parsed, stderr)


def run_child(mode: str, target: Path | str, *, cwd: Path) -> Child:
    """Run this script's *mode* child on *target*; raise if it fails."""
    child = spawn([sys.executable, str(HERE), "--child", mode, str(target)], cwd=cwd)
    if not child.ok:
        msg = f"child {mode} {target}: {child.status}\n{child.stderr}"
        raise RuntimeError(msg)
    return child


def cli(args: list[str], state: Path, *, cwd: Path) -> Child:
    """``python -m resumable ARGS --state-dir STATE`` under the time limit and memory cap."""
    return spawn(
        [sys.executable, "-m", "resumable", *args, "--state-dir", str(state)],
        cwd=cwd,
        timeout=CLI_TIMEOUT,
        memory_cap=CLI_MEMORY_CAP,
    )


def emit(result: dict[str, Any]) -> None:
    result["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(result))


def child_build(n: int, state: str) -> None:
    t0 = time.perf_counter()
    with Pipeline("scale", state_dir=state, durable=False):
        for i in range(n):
            doc(i)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    emit({"store_s": t1 - t0, "close_s": t2 - t1, "total_s": t2 - t0})


def child_open(_: int, state: str) -> None:
    os.environ["BENCH_EXPECT_SKIP"] = "1"
    t0 = time.perf_counter()
    with Pipeline("scale", state_dir=state):
        doc(0)
        t1 = time.perf_counter()
    t2 = time.perf_counter()
    emit({"open_s": t1 - t0, "close_s": t2 - t1})


def child_skipall(n: int, state: str) -> None:
    os.environ["BENCH_EXPECT_SKIP"] = "1"
    t0 = time.perf_counter()
    with Pipeline("scale", state_dir=state):
        doc(0)
        t1 = time.perf_counter()
        for i in range(1, n):
            doc(i)
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    emit({"open_s": t1 - t0, "per_call_s": (t2 - t1) / (n - 1), "close_s": t3 - t2})


def child_prune(n: int, state: str) -> None:
    # A run with the default keep_checkpoints=20 that stores n slots again (new argument):
    # n kept versions and n checkpoints more, so that its close prunes versions and folds history.
    pipe = Pipeline("scale", state_dir=state, keep_checkpoints=20)
    t0 = time.perf_counter()
    with pipe:
        doc(0, rev=1)
        t1 = time.perf_counter()
        for i in range(1, n):
            doc(i, rev=1)
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    objects = Path(state) / ".resumable" / "objects"
    kept = len(os.listdir(objects)) if objects.is_dir() else 0
    emit({"open_s": t1 - t0, "store_s": t2 - t1, "close_s": t3 - t2, "kept_versions": kept})


def sqlite_connect(path: str) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def child_sqlite_open(_: int, path: str) -> None:
    t0 = time.perf_counter()
    conn = sqlite_connect(path)
    row = conn.execute("SELECT value FROM kv WHERE key = ?", ("doc/0",)).fetchone()
    msgpack.unpackb(row[0])
    t1 = time.perf_counter()
    conn.close()
    emit({"open_s": t1 - t0})


def child_sqlite_skipall(n: int, path: str) -> None:
    t0 = time.perf_counter()
    conn = sqlite_connect(path)
    msgpack.unpackb(conn.execute("SELECT value FROM kv WHERE key = ?", ("doc/0",)).fetchone()[0])
    t1 = time.perf_counter()
    for i in range(1, n):
        row = conn.execute("SELECT value FROM kv WHERE key = ?", (f"doc/{i}",)).fetchone()
        msgpack.unpackb(row[0])
    t2 = time.perf_counter()
    conn.close()
    emit({"open_s": t1 - t0, "per_call_s": (t2 - t1) / (n - 1)})


def child_runs(n: int, directory: str) -> None:
    """
    n runs of a one-step script in this one process, each timed, alternating with n SQLite
    "runs" (connect, get the value, insert a run row, commit durably, close).
    """
    state, db = Path(directory) / "state", str(Path(directory) / "runs.db")
    pipe = Pipeline("runs", state_dir=state)
    with pipe:
        value = one(1)  # run 0 stores the output; every timed run skips it
    os.environ["BENCH_EXPECT_SKIP"] = "1"
    conn = sqlite_connect(db)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB)")
    conn.execute("CREATE TABLE runs (id INTEGER PRIMARY KEY, started REAL, finished REAL)")
    conn.execute("INSERT INTO kv VALUES (?, ?)", ("one", msgpack.packb(value)))
    conn.close()

    cpu: list[float] = []  # the process's CPU time per library run: no fsync wait in it

    def library() -> float:
        c0, t0 = time.process_time(), time.perf_counter()
        with pipe:
            one(1)
        t1 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        return t1 - t0

    def sqlite_run() -> float:
        t0 = time.perf_counter()
        c = sqlite_connect(db)
        msgpack.unpackb(c.execute("SELECT value FROM kv WHERE key = ?", ("one",)).fetchone()[0])
        c.execute("BEGIN")
        c.execute("INSERT INTO runs (started, finished) VALUES (?, ?)", (t0, time.time()))
        c.execute("COMMIT")
        c.close()
        return time.perf_counter() - t0

    lib: list[float] = []
    base: list[float] = []
    t_all = time.perf_counter()
    for r in range(1, n + 1):
        if r % 2:
            lib.append(library())
            base.append(sqlite_run())
        else:
            base.append(sqlite_run())
            lib.append(library())
    total = time.perf_counter() - t_all
    sizes = {
        name: os.path.getsize(state / name)
        for name in ("events.jsonl", "manifest.json")
        if (state / name).exists()
    }
    history_base = state / ".resumable" / "history-base.msgpack"
    emit(
        {
            "library": lib,
            "library_cpu": cpu,
            "sqlite": base,
            "total_s": total,
            "sizes": sizes,
            "history_base_bytes": history_base.stat().st_size if history_base.exists() else 0,
            "sqlite_bytes": sum(os.path.getsize(p) for p in (db, db + "-wal") if os.path.exists(p)),
        }
    )


CHILDREN: dict[str, Callable[[int, str], None]] = {
    "build": child_build,
    "open": child_open,
    "skipall": child_skipall,
    "prune": child_prune,
    "sqlite-open": child_sqlite_open,
    "sqlite-skipall": child_sqlite_skipall,
    "runs": child_runs,
}


def child(mode: str, target: str) -> None:
    """``--child NAME:N TARGET``: one of :data:`CHILDREN` with its size."""
    quiet()
    name, _, n = mode.partition(":")
    CHILDREN[name](int(n or 0), target)


# --- the states, built once per invocation --------------------------------------------------


def allocated(path: Path) -> tuple[int, int]:
    """Bytes allocated (st_blocks * 512) under *path*, directories included, and the file count."""
    total, files = os.lstat(path).st_blocks * 512, 0
    for root, dirs, names in os.walk(path):
        for name in dirs + names:
            total += os.lstat(os.path.join(root, name)).st_blocks * 512
        files += len(names)
    return total, files


@dataclass
class Built:
    n: int
    state: Path  # never changed after the build: copies are made from it
    db: Path  # the SQLite baseline, n rows
    build: dict[str, Any]
    sqlite_build_s: float
    disk: dict[str, Any]
    copies: int = 0


_BUILT: dict[int, Built] = {}
_WORK: dict[int, Path] = {}  # per size, a copy that the open and skip children use


def build_sqlite(path: Path, n: int) -> float:
    """Fill a SQLite file with the n values, one committed row each (WAL, synchronous=NORMAL)."""
    t0 = time.perf_counter()
    conn = sqlite_connect(str(path))
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")  # no fsync per commit: as durable=False
    conn.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, value BLOB)")
    for i in range(n):
        conn.execute("INSERT INTO kv VALUES (?, ?)", (f"doc/{i}", sql_value(i)))
    elapsed = time.perf_counter() - t0
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return elapsed


def built(base: Path, n: int) -> Built:
    """The state of n slots (and its SQLite twin), built at the first call."""
    if n in _BUILT:
        return _BUILT[n]
    state, db = base / f"state-{n}", base / f"sqlite-{n}.db"
    print(f"      building {n:,} slots ...", file=sys.stderr, flush=True)
    result = run_child(f"build:{n}", state, cwd=base).out
    sqlite_s = build_sqlite(db, n)
    blocks, files = allocated(state)
    sizes = {
        name: (state / name).stat().st_size
        for name in ("manifest.json", "events.jsonl", ".resumable/history-base.msgpack")
        if (state / name).exists()
    }
    doc_dir = state / "doc"
    outputs = [e.stat().st_size for e in os.scandir(doc_dir)]
    disk = {
        "allocated_bytes": blocks,
        "files": files,
        "sizes": sizes,
        "doc_dir_entry_bytes": doc_dir.stat().st_blocks * 512,
        "output_file_mean_bytes": statistics.fmean(outputs),
        "sqlite_bytes": db.stat().st_size,
    }
    print(
        f"      built {n:,} slots in {result['total_s']:.1f} s (close {result['close_s']:.1f} s)",
        file=sys.stderr,
        flush=True,
    )
    _BUILT[n] = Built(n, state, db, result, sqlite_s, disk)
    return _BUILT[n]


def settle() -> None:
    """Write back dirty pages first (copies, removals), so that no timed fsync waits for them."""
    os.sync()


def copy_of(base: Path, n: int, label: str) -> tuple[Path, float]:
    """A fresh copy of the n-slot state, and the seconds the copy took (written back before returning)."""
    b = built(base, n)
    b.copies += 1
    target = base / f"{label}-{n}-{b.copies}"
    t0 = time.perf_counter()
    shutil.copytree(b.state, target, symlinks=True)
    elapsed = time.perf_counter() - t0
    settle()
    return target, elapsed


def work_state(base: Path, n: int) -> Path:
    """The copy the open and skip children use (each skip run logs a skip event per slot)."""
    if n >= BIG_SLOTS:  # no copy of a million files: the open children add a few events to it
        return built(base, n).state
    if n not in _WORK:
        _WORK[n] = copy_of(base, n, "work")[0]
    return _WORK[n]


def slots_label(n: int) -> str:
    return f"{n:,} slots"


def mb(n: float) -> str:
    return f"{n / MB:,.0f} MB"


def seconds(s: float) -> str:
    return f"{s:,.2f} s"


def median(values: list[float]) -> float:
    return statistics.median(values)


# --- build ----------------------------------------------------------------------------------


def bench_build(base: Path) -> list[Row]:
    sizes = [OPTIONS.slots] + ([BIG_SLOTS] if OPTIONS.big else [])
    rows = []
    for n in sizes:
        b = built(base, n)
        total = b.build["total_s"]
        rows.append(
            Row(
                f"build: {n:,} slots of a keyed step (small dicts), durable=False, one process",
                f"{seconds(total)} ({us(b.build['store_s'] / n)}/slot + close {seconds(b.build['close_s'])})",
                f"SQLite, a committed INSERT per row: {seconds(b.sqlite_build_s)}",
                total / b.sqlite_build_s,
                "library / SQLite",
                "—",
                None,
                b.build | {"sqlite_s": b.sqlite_build_s},
            )
        )
    return rows


# --- 1. open --------------------------------------------------------------------------------


def bench_open(base: Path) -> list[Row]:
    rounds = 3 if OPTIONS.quick else 5
    targets = [(OPTIONS.slots, 0.1 if OPTIONS.slots >= 100_000 else None)]
    if OPTIONS.big:
        targets.append((BIG_SLOTS, 1.0))
    rows = []
    for n, target in targets:
        b = built(base, n)
        state = work_state(base, n)
        closes: list[float] = []

        def library(state: Path = state, closes: list[float] = closes) -> float:
            out = run_child("open", state, cwd=base).out
            closes.append(out["close_s"])
            return out["open_s"]

        def sqlite(db: Path = b.db) -> float:
            return run_child("sqlite-open", db, cwd=base).out["open_s"]

        settle()
        library(), sqlite()  # untimed: the page cache
        res = interleave({"library": library, "sqlite": sqlite}, 2 if n >= BIG_SLOTS else rounds)
        lib, bare = median(res["library"]), median(res["sqlite"])
        if target is None:  # --quick: the targets are for 100,000 and 1,000,000 slots
            target_label, passed = "(≤ 100 ms at 100,000)", None
        else:
            target_label, passed = f"≤ {ms(target)}", lib <= target
        rows.append(
            Row(
                f"open: `with Pipeline` + first keyed call, fresh process, {slots_label(n)}",
                f"{ms(lib)} (then close {ms(median(closes))})",
                f"SQLite connect + first get: {ms(bare)}",
                lib / bare,
                "library / SQLite",
                target_label,
                passed,
                {"library_s": res["library"], "sqlite_s": res["sqlite"], "close_s": closes},
            )
        )
    return rows


# --- 2. skip cost per call, and 5. peak RSS -------------------------------------------------

_SKIPALL: dict[int, dict[str, list[Any]]] = {}


def skipall(base: Path, n: int, rounds: int) -> dict[str, list[Any]]:
    """Fresh processes skipping every slot of the n-slot state, alternating with SQLite reading every row."""
    if n in _SKIPALL:
        return _SKIPALL[n]
    b = built(base, n)
    state = work_state(base, n)
    res: dict[str, list[Any]] = {"library": [], "sqlite": [], "library_rss": [], "sqlite_rss": [], "lib": []}

    def library() -> float:
        c = run_child(f"skipall:{n}", state, cwd=base)
        res["library_rss"].append(c.maxrss)
        res["lib"].append(c.out)
        return c.out["per_call_s"]

    def sqlite() -> float:
        c = run_child(f"sqlite-skipall:{n}", b.db, cwd=base)
        res["sqlite_rss"].append(c.maxrss)
        return c.out["per_call_s"]

    settle()
    interleave({"library": library, "sqlite": sqlite}, rounds, out=res)
    _SKIPALL[n] = res
    return res


def bench_skip(base: Path) -> list[Row]:
    small = skipall(base, SMALL_SLOTS, 9 if OPTIONS.quick else 21)  # short loops: more rounds
    large = skipall(base, OPTIONS.slots, 2 if OPTIONS.quick else 3)
    lib_s, lib_l = median(small["library"]), median(large["library"])
    sql_s, sql_l = median(small["sqlite"]), median(large["sqlite"])
    ratio = lib_l / lib_s
    n = OPTIONS.slots
    details = {
        "library_small_s": small["library"],
        "library_large_s": large["library"],
        "sqlite_small_s": small["sqlite"],
        "sqlite_large_s": large["sqlite"],
        "library_large_children": large["lib"],
    }
    return [
        Row(
            f"skip cost per call flat: mean skip of every slot in a fresh process, {n:,} vs {SMALL_SLOTS} slots",
            f"{us(lib_l)} vs {us(lib_s)}",
            f"SQLite get + unpack: {us(sql_l)} vs {us(sql_s)} ({sql_l / sql_s:.2f}x)",
            ratio,
            f"{n:,} / {SMALL_SLOTS}",
            "≤ 1.5" if n >= 100_000 else "(≤ 1.5 at 100,000)",
            ratio <= 1.5 if n >= 100_000 else None,
            details,
        ),
        Row(
            f"skip per call at {n:,} slots (fresh process, every slot once), vs SQLite get + unpack",
            us(lib_l),
            us(sql_l),
            lib_l / sql_l,
            "library / SQLite",
            "—",
            None,
            details,
        ),
    ]


def bench_rss(base: Path) -> list[Row]:
    n = OPTIONS.slots
    res = skipall(base, n, 1 if OPTIONS.quick else 3)
    # The floor: an interpreter that imports resumable and opens nothing.
    floor = spawn([sys.executable, "-c", "import resumable"], cwd=base).maxrss
    lib, bare = max(res["library_rss"]), max(res["sqlite_rss"])
    target = 150 * MB
    return [
        Row(
            f"peak RSS of a fresh process skipping all {n:,} slots",
            mb(lib),
            f"SQLite reading every row: {mb(bare)} (python + import resumable: {mb(floor)})",
            lib / bare,
            "library / SQLite",
            f"≤ {mb(target)}" + ("" if n >= 100_000 else " (at 100,000)"),
            lib <= target if n >= 100_000 else None,
            {"library_rss": res["library_rss"], "sqlite_rss": res["sqlite_rss"], "import_rss": floor},
        )
    ]


# --- 3. and 4. bytes on disk ----------------------------------------------------------------


def bench_disk(base: Path) -> list[Row]:
    n = OPTIONS.slots
    b = built(base, n)
    d = b.disk
    per_slot = d["allocated_bytes"] / n
    sqlite_per_row = d["sqlite_bytes"] / n
    log = d["sizes"].get("manifest.json", 0) + d["sizes"].get("events.jsonl", 0)
    judged = n >= 100_000
    return [
        Row(
            f"bytes on disk per small slot (allocated blocks of the state directory / slots), {slots_label(n)}",
            f"{per_slot:,.0f} B ({d['files']:,} files, {mb(d['allocated_bytes'])})",
            f"SQLite file / rows: {sqlite_per_row:,.0f} B",
            per_slot / sqlite_per_row,
            "library / SQLite",
            "≤ 1,000 B",
            per_slot <= 1000 if judged else None,
            d,
        ),
        Row(
            f"manifest.json + events.jsonl bytes per slot, {slots_label(n)}",
            f"{log / n:,.0f} B (manifest {mb(d['sizes'].get('manifest.json', 0))}, "
            f"log {mb(d['sizes'].get('events.jsonl', 0))})",
            f"SQLite file / rows: {sqlite_per_row:,.0f} B",
            (log / n) / sqlite_per_row,
            "library / SQLite",
            "≤ 300 B",
            log / n <= 300 if judged else None,
            d,
        ),
    ]


# --- 6. the command line at scale, and the close of a pruning run ---------------------------


def cli_row(name: str, runs: list[Child], floor: list[Child], target_s: float, target_rss: int) -> Row:
    """A row for a CLI command: median time and highest peak RSS, vs the same at 100 slots."""
    done = [c for c in runs if c.ok]
    details: dict[str, Any] = {
        "wall_s": [c.wall_s for c in runs],
        "maxrss": [c.maxrss for c in runs],
        "status": [c.status for c in runs],
        "small_wall_s": [c.wall_s for c in floor],
        "small_maxrss": [c.maxrss for c in floor],
    }
    small_t = median([c.wall_s for c in floor]) if floor else float("nan")
    small_rss = max((c.maxrss for c in floor), default=0)
    baseline = f"the same at {SMALL_SLOTS} slots: {seconds(small_t)}, {mb(small_rss)}"
    target = f"≤ {target_s:g} s, ≤ {mb(target_rss)}"
    judged = OPTIONS.slots >= 100_000
    if not done:
        failure = runs[0].status
        if failure == "timeout":
            failure = f"timeout (> {CLI_TIMEOUT:g} s)"
        elif failure == "out of memory":
            failure = f"out of memory (> {CLI_MEMORY_CAP / 1024**3:g} GiB address space)"
        return Row(name, failure, baseline, None, "", target, False if judged else None, details)
    t, rss = median([c.wall_s for c in done]), max(c.maxrss for c in done)
    return Row(
        name,
        f"{seconds(t)}, {mb(rss)}",
        baseline,
        t / small_t,
        f"time, {OPTIONS.slots:,} / {SMALL_SLOTS} slots",
        target if judged else f"({target} at 100,000)",
        (t <= target_s and rss <= target_rss) if judged else None,
        details,
    )


def repeat_cli(args: list[str], state: Path, reps: int, *, cwd: Path) -> list[Child]:
    runs = []
    for _ in range(reps):
        runs.append(cli(args, state, cwd=cwd))
        if not runs[-1].ok:  # a timeout or out of memory: once is enough
            break
    return runs


def latest_checkpoint(state: Path) -> int:
    with open(state / "manifest.json", "rb") as f:
        return int(json.load(f)["checkpoints"])


def bench_cli(base: Path) -> list[Row]:
    n = OPTIONS.slots
    reps = 2 if OPTIONS.quick else 3
    large, small = built(base, n), built(base, SMALL_SLOTS)
    settle()
    rows = []
    for args, label in (
        (["history"], "resumable history"),
        (["clean", "--dry-run"], "resumable clean --dry-run"),
    ):
        floor = repeat_cli(args, small.state, reps, cwd=base)
        runs = repeat_cli(args, large.state, reps, cwd=base)
        rows.append(cli_row(f"`{label}` (CLI child), {slots_label(n)}", runs, floor, 2.0, 300 * MB))

    # rollback: each on a fresh copy, to the checkpoint 10 completions back (inside the kept 20)
    def rollback(b: Built) -> tuple[Child, float]:
        state, copy_s = copy_of(base, b.n, "rollback")
        target = latest_checkpoint(state) - 10
        c = cli(["rollback", str(target)], state, cwd=base)
        c.out["copy_s"] = copy_s
        c.out["events_bytes_after"] = (state / "events.jsonl").stat().st_size
        shutil.rmtree(state)
        return c, copy_s

    # One run at the large size (each needs a fresh copy of every file), three at 100 slots.
    floor = [rollback(small)[0] for _ in range(3)]
    runs = [rollback(large)[0]]
    row = cli_row(
        f"`resumable rollback <latest - 10>` (CLI child, on a copy), {slots_label(n)}",
        runs,
        floor,
        2.0,
        300 * MB,
    )
    row.details["children_out"] = [c.out for c in runs]
    rows.append(row)

    # the close of a run that prunes: PRUNE_RERUNS slots stored again, keep_checkpoints=20
    def prune(b: Built) -> dict[str, Any]:
        state, copy_s = copy_of(base, b.n, "prune")
        out = run_child(f"prune:{PRUNE_RERUNS}", state, cwd=base).out
        shutil.rmtree(state)
        return out | {"copy_s": copy_s}

    small_p = [prune(small) for _ in range(3)]
    large_p = [prune(large)]
    lib, bare = median([p["close_s"] for p in large_p]), median([p["close_s"] for p in small_p])
    rows.append(
        Row(
            f"close of a run that stored {PRUNE_RERUNS} slots again and prunes (keep_checkpoints=20), "
            f"{slots_label(n)}",
            f"{seconds(lib)} (open {seconds(median([p['open_s'] for p in large_p]))})",
            f"the same at {SMALL_SLOTS} slots: {seconds(bare)}",
            lib / bare,
            f"{n:,} / {SMALL_SLOTS} slots",
            "(≤ 2 s)",
            None,
            {"large": large_p, "small": small_p},
        )
    )
    return rows


# --- 7. many runs of a one-step script ------------------------------------------------------


def bench_runs(base: Path) -> list[Row]:
    n = OPTIONS.runs
    directory = base / f"runs-{n}"
    directory.mkdir()
    settle()
    c = run_child(f"runs:{n}", directory, cwd=base)
    shutil.rmtree(directory)
    lib, sql, cpu = c.out["library"], c.out["sqlite"], c.out["library_cpu"]
    w = 20
    early_l, late_l = median(lib[:w]), median(lib[-w:])
    early_s, late_s = median(sql[:w]), median(sql[-w:])
    early_c, late_c = median(cpu[:w]), median(cpu[-w:])
    ratio = late_l / early_l
    sizes = c.out["sizes"]
    windows = {
        f"runs {i + 1}-{i + w}": {
            "library_s": median(lib[i : i + w]),
            "library_cpu_s": median(cpu[i : i + w]),
            "sqlite_s": median(sql[i : i + w]),
        }
        for i in range(0, n - w + 1, max(w, n // 10))
    }
    details = {
        "windows": windows,
        "total_s": c.out["total_s"],
        "sizes": sizes,
        "history_base_bytes": c.out["history_base_bytes"],
        "sqlite_bytes": c.out["sqlite_bytes"],
        "maxrss": c.maxrss,
    }
    return [
        Row(
            f"{n:,} runs of a one-step script in one process: per-run time, runs {n - w + 1:,}-{n:,} vs runs 1-{w}",
            f"{ms(late_l)} vs {ms(early_l)}",
            f"SQLite run (connect, get, insert, commit): {ms(late_s)} vs {ms(early_s)}",
            ratio,
            f"run {n:,} / run 10",
            "≤ 1.2" if n >= 10_000 else "(≤ 1.2 at 10,000)",
            ratio <= 1.2 if n >= 10_000 else None,
            details,
        ),
        Row(
            f"the same, CPU time of the process per run (no fsync wait): runs {n - w + 1:,}-{n:,} vs runs 1-{w}",
            f"{ms(late_c)} vs {ms(early_c)}",
            f"SQLite wall time, last / first: {late_s / early_s:.2f}",
            late_c / early_c,
            f"run {n:,} / run 10",
            "—",
            None,
            details,
        ),
        Row(
            f"after {n:,} runs: events.jsonl and manifest.json sizes; peak RSS of the process",
            f"log {sizes.get('events.jsonl', 0) / 1000:,.0f} KB ({sizes.get('events.jsonl', 0) / (n + 1):,.0f} B/run), "
            f"manifest {sizes.get('manifest.json', 0) / 1000:,.0f} KB, RSS {mb(c.maxrss)}",
            f"SQLite file with a row per run: {c.out['sqlite_bytes'] / 1000:,.0f} KB",
            None,
            "",
            "—",
            None,
            details,
        ),
    ]


# --- the driver -----------------------------------------------------------------------------

# In this order: the runs first, timed on a quiet disk, before the large state is written.
BENCHES: dict[str, Callable[[Path, bool], list[Row]]] = {
    "runs": lambda base, _: bench_runs(base),
    "build": lambda base, _: bench_build(base),
    "open": lambda base, _: bench_open(base),
    "skip": lambda base, _: bench_skip(base),
    "disk": lambda base, _: bench_disk(base),
    "rss": lambda base, _: bench_rss(base),
    "cli": lambda base, _: bench_cli(base),
}


def scale_environment(
    base: Path, local: Callable[[Path], dict[str, str]] = benchlib.local_environment
) -> dict[str, str]:
    return local(base) | {"sqlite": sqlite3.sqlite_version}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    strict = "--strict" in args
    OPTIONS.big = "--big" in args
    args = [a for a in args if a not in {"--strict", "--big"}]
    if "--quick" in args:
        OPTIONS.quick, OPTIONS.slots, OPTIONS.runs = True, 10_000, 1_000
    # The driver's environment line, with SQLite's version (benchlib is not changed).
    benchlib.local_environment = scale_environment
    status = drive(args, description=__doc__, benches=BENCHES, child=child, prefix="resumable-scale-")
    return status if strict else 0


if __name__ == "__main__":
    sys.exit(main())
