"""
resumable side by side with its peers, measured in the same run.

Run from the repository root (the peers are in the ``bench`` extra: ``pip install -e '.[bench]'``)::

    python bench/bench_peers.py                 # everything, three to five minutes
    python bench/bench_peers.py --quick         # smaller sizes, fewer rounds: a smoke test
    python bench/bench_peers.py --only skip,store --json peers.json
    python bench/bench_peers.py --strict        # exit with status 1 when a target is missed

Without ``--strict`` the script exits with status 0 whatever the results: it is a measurement.

Benchmarks (``--only``):

- skip: a stored ~1 KB step skipped again and again in one run, against LangGraph's
  ``SqliteSaver.get_tuple``, a naive exists + read + msgpack load, a ``joblib.Memory`` hit
  and a DBOS step replayed from a SQLite system database;
- firstskip: the same, but the first call in a fresh process;
- store: a new ~1 KB step output stored durably, against ``SqliteSaver.put`` (WAL,
  synchronous=FULL), an atomic replace with two fsyncs and a DBOS step;
- lazystore: the same with ``durable=False``, against a msgpack write + rename and
  ``diskcache.Cache.set``;
- bigskip: a step returning a 100 MB float64 array, skipped in a fresh process, against a
  ``joblib.Memory`` hit and ``np.load`` of a .npy file;
- dicts: a step returning 1,000,000 small dicts, stored durably, then skipped in a fresh
  process, against msgpack.packb + write + fsync and read + msgpack.unpackb;
- batch: ``checkpointed_map`` over 100,000 and 1,000,000 rows, every=100, durable=False,
  against hand-written msgpack chunks appended to one file;
- batchdurable: the same over 1,000,000 rows, durable, against fsynced chunks.

A peer that is not installed, or cannot run here, gets a row saying so. Library and peer
blocks alternate within every round (the order flips each round), and a ratio is the median
of the per-round ratios. See bench/README.md and bench/results/peers.md.

The store benchmarks delete nothing while they measure (each round's directory stays until
the run's temporary directory is deleted at its end). On ext4 without a journal, creating a
file costs several times more for a while after files were deleted: the kernel passes over
the inodes freed in the last minute (five, while their inode table is not yet written back),
reading each one's table block. Deleting a round's files would charge the sides that create
a file per output with the cleanup of the round before; and a run started right after
another one (whose cleanup deleted thousands of files) measures that too: run ``sync`` and
wait a minute between runs. The "create an empty file" row of lazystore shows the cost.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib
import importlib.metadata
import importlib.util
import itertools
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import benchlib
import msgpack
from benchlib import SMALL, Row, drive, fsync_dir, fsync_dir_shared, interleave, ms, quiet, ratios, us

from resumable import Pipeline, checkpointed_map, step

HERE = Path(__file__).resolve()
BIG_FLOATS = 12_500_000  # 100 MB of float64 (decimal MB, under the 100 MiB warning threshold)
MB = 1_000_000
EVERY = 100  # rows per commit in the batch rows
CHILD_TIMEOUT = 300  # seconds: a child process that takes longer is stuck

# What each peer is installed as, for the "not installed" rows.
DISTRIBUTIONS = {
    "langgraph": "langgraph-checkpoint-sqlite",
    "joblib": "joblib",
    "dbos": "dbos",
    "diskcache": "diskcache",
    "numpy": "numpy",
}

# Per-round seconds of one side, or why that side has none ("not installed ...").
Samples = list[float] | str


# --- the measured functions (module level: joblib and code digests need their source) -----


# The measured steps get their output as an ignored argument, as in bench_core.py: a
# module-level value a step reads is part of its identity and digested at every call.
def small_output(x: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - x is fingerprinted
    return record


def small_output_other(x: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - as above
    return record


def small_output_keyed(i: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - i picks the slot
    return record


def big_array(n: int) -> Any:
    if os.environ.get("BENCH_EXPECT_SKIP") == "1":
        msg = "big_array ran although its output is stored: the benchmark measures a skip"
        raise RuntimeError(msg)
    import numpy as np

    return np.random.default_rng(0).random(n)


def rows_output(i: int, rows: Any) -> Any:  # noqa: ARG001 - i picks the slot
    return rows


def make_rows(n: int) -> list[dict[str, Any]]:
    return [{"id": i, "name": f"n{i}", "score": i * 0.5} for i in range(n)]


def inc(x: int) -> int:
    return x + 1


skip_small = step(name="skip_small", ignore=("record",))(small_output)
skip_other = step(name="skip_other", ignore=("record",))(small_output_other)
store_small = step(name="store_small", key="{i}", ignore=("record",))(small_output_keyed)
big_step = step(name="big_array")(big_array)
rows_step = step(name="rows", key="{i}", ignore=("rows",))(rows_output)


# --- peers: imported on demand, with their warnings silenced ------------------------------


def load_peer(name: str) -> Any:
    """The module *name* (imported with its warnings silenced), or None if it is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError:
        return None


def installed(name: str) -> bool:
    """Whether *name* can be imported, without importing it (DBOS runs in child processes only)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def not_installed(name: str) -> str:
    return f"not installed (pip install {DISTRIBUTIONS[name]})"


def peer_block(block: Callable[[], float]) -> Callable[[], float]:
    """*block* with warnings ignored: the driver turns warnings into errors for the library only."""

    def run() -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return block()

    return run


def peer_versions() -> dict[str, str]:
    versions = {}
    for dist in (
        "langgraph-checkpoint-sqlite",
        "langgraph-checkpoint",
        "joblib",
        "numpy",
        "diskcache",
        "dbos",
    ):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    versions["sqlite"] = sqlite3.sqlite_version
    return versions


def peers_environment(base: Path) -> dict[str, str]:
    """The driver's environment line, with the versions of the peers."""
    return benchlib.environment(
        ("filesystem", benchlib.filesystem(base)),
        {"msgpack": ".".join(map(str, msgpack.version)), **peer_versions()},
    )


# --- LangGraph: SqliteSaver on a file, WAL, synchronous=FULL --------------------------------


def langgraph_saver(path: Path) -> Any:
    from langgraph.checkpoint.sqlite import SqliteSaver

    conn = sqlite3.connect(str(path), check_same_thread=False)
    saver = SqliteSaver(conn)
    saver.setup()  # PRAGMA journal_mode=WAL and the tables
    conn.execute("PRAGMA synchronous=FULL")  # sqlite3's default, made explicit: an fsync per commit
    mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
    sync = conn.execute("PRAGMA synchronous").fetchone()[0]
    if (mode, sync) != ("wal", 2):
        msg = f"SqliteSaver runs with journal_mode={mode}, synchronous={sync}"
        raise RuntimeError(msg)
    return saver


def langgraph_checkpoints(n: int) -> list[Any]:
    """*n* checkpoints each holding the ~1 KB output, with increasing ids, as a graph makes them."""
    from langgraph.checkpoint.base import empty_checkpoint

    checkpoints: list[Any] = []
    for _ in range(n):
        checkpoint = empty_checkpoint()
        checkpoint["channel_values"] = {"output": SMALL}
        checkpoint["channel_versions"] = {"output": 1}
        checkpoints.append(checkpoint)
    return checkpoints


def langgraph_put(saver: Any, checkpoints: list[Any], thread: str) -> None:
    config: dict[str, Any] = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    for i, checkpoint in enumerate(checkpoints):
        config = saver.put(config, checkpoint, {"source": "loop", "step": i}, {"output": 1})


def langgraph_get(saver: Any, thread: str = "t42") -> dict[str, Any]:
    config = {"configurable": {"thread_id": thread, "checkpoint_ns": ""}}
    return saver.get_tuple(config).checkpoint["channel_values"]["output"]  # type: ignore[no-any-return]


# --- naive files ----------------------------------------------------------------------------


def write_file(path: str, data: bytes, *, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_store(directory: str, i: int, value: object, *, durable: bool) -> None:
    """msgpack.packb, write a temp file (+ fsync), rename over the target (+ fsync the directory)."""
    target = os.path.join(directory, f"{i}.msgpack")
    tmp = target + ".tmp"
    write_file(tmp, msgpack.packb(value), fsync=durable)
    os.replace(tmp, target)
    if durable:
        fsync_dir(directory)


def atomic_store_grouped(directory: str, i: int, value: object) -> None:
    """atomic_store's fsyncs as resumable makes them: the directory's shared with the next 0.1 s."""
    target = os.path.join(directory, f"{i}.msgpack")
    tmp = target + ".tmp"
    write_file(tmp, msgpack.packb(value), fsync=True)
    os.replace(tmp, target)
    fsync_dir_shared(directory)


def naive_load(path: str) -> Any:
    """os.path.exists, read, msgpack load: the hand-written skip."""
    if not os.path.exists(path):
        raise FileNotFoundError(path)
    with open(path, "rb") as f:
        return msgpack.unpackb(f.read())


def naive_chunks(n: int, path: str, every: int, *, durable: bool) -> list[int]:
    """The hand-written batch: every *every* rows, msgpack-append the results to one file."""
    results: list[int] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    try:
        if durable:
            fsync_dir(os.path.dirname(path))  # the new file's name
        chunk: list[int] = []
        for x in range(n):
            chunk.append(inc(x))
            if len(chunk) == every:
                os.write(fd, msgpack.packb(chunk))
                if durable:
                    os.fsync(fd)
                results += chunk
                chunk = []
        if chunk:
            os.write(fd, msgpack.packb(chunk))
            if durable:
                os.fsync(fd)
            results += chunk
    finally:
        os.close(fd)
    return results


# --- DBOS: steps of a workflow, on a SQLite system database, in a child process -------------


class DbosApp:
    """DBOS launched on the SQLite system database *db*, with one workflow of *n* small steps."""

    def __init__(self, db: str) -> None:
        from dbos import DBOS, SetWorkflowID

        self.dbos, self.set_id = DBOS, SetWorkflowID
        self.executed = 0
        t0 = time.perf_counter()
        DBOS(config={"name": "bench-peers", "system_database_url": f"sqlite:///{db}", "log_level": "WARNING"})

        @DBOS.step(name="small_step")
        def small_step(i: int) -> dict[str, Any]:  # noqa: ARG001 - a step is identified by its position
            self.executed += 1
            return SMALL

        @DBOS.workflow(name="steps_wf")
        def steps_wf(n: int) -> tuple[list[float], int]:
            # Timed inside the workflow: only the steps, not starting or forking the workflow.
            before = self.executed
            times = []
            for i in range(n):
                t0 = time.perf_counter()
                small_step(i)
                times.append(time.perf_counter() - t0)
            return times, self.executed - before

        self.steps_wf = steps_wf
        DBOS.launch()
        self.launch_s = time.perf_counter() - t0

    def store(self, n: int, workflow_id: str | None = None) -> list[float]:
        """Run *n* new steps (each records its output); the seconds of each step."""
        with self.set_id(workflow_id or f"store-{uuid.uuid4()}"):
            times, executed = self.steps_wf(n)
        if executed != n:
            msg = f"DBOS ran {executed} of {n} new steps"
            raise RuntimeError(msg)
        return times

    def replay(self, source: str, n: int) -> list[float]:
        """Fork the finished workflow *source* of *n* steps from step n+1: all *n* steps replay."""
        times, executed = self.dbos.fork_workflow(source, n + 1).get_result()
        if executed != 0:
            msg = f"DBOS ran {executed} of {n} steps it should have replayed"
            raise RuntimeError(msg)
        return times  # type: ignore[no-any-return]


def reply(value: dict[str, Any]) -> None:
    print("@@ " + json.dumps(value), flush=True)


def child_dbos_server(db: str) -> None:
    """Serve "store N" and "replay N" over stdin, one "@@ {json}" line each on stdout."""
    faulthandler.dump_traceback_later(CHILD_TIMEOUT, exit=True)  # a stuck child tells why, and exits
    app = DbosApp(db)
    faulthandler.cancel_dump_traceback_later()
    reply({"launch_s": app.launch_s})
    sources: set[int] = set()
    for line in sys.stdin:
        command, *rest = line.split()
        if command == "quit":
            break
        faulthandler.dump_traceback_later(CHILD_TIMEOUT, exit=True)
        n = int(rest[0])
        if command == "store":
            reply({"per_step_s": statistics.fmean(app.store(n))})
        elif command == "replay":
            if n not in sources:
                app.store(n, f"replay-source-{n}")
                sources.add(n)
            reply({"per_step_s": statistics.fmean(app.replay(f"replay-source-{n}", n))})
        faulthandler.cancel_dump_traceback_later()
    app.dbos.destroy()


def child_dbos_setup(db: str) -> None:
    DbosApp(db).store(2, "first-source")
    reply({})
    os._exit(0)  # everything is committed: skip DBOS's shutdown, which waits for its threads


def child_dbos_first(db: str) -> None:
    app = DbosApp(db)
    first, other = app.replay("first-source", 2)
    reply({"first_s": first, "other_s": other, "open_s": app.launch_s})
    os._exit(0)


class DbosChild:
    """A long-lived child process running DBOS, driven line by line; *error* says why it stopped."""

    def __init__(self, db: Path) -> None:
        self.log_path = db.with_suffix(".log")
        self.error: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        self.launch_s = float("nan")
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE), "--child", "dbos-server", str(db)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=db.parent,
            )
        self.launch_s = self.call(None).get("launch_s", float("nan"))

    def call(self, command: str | None) -> dict[str, Any]:
        if self.error is not None or self.proc is None:
            return {}
        stdin, stdout = self.proc.stdin, self.proc.stdout
        assert stdin is not None  # noqa: S101 - Popen(stdin=PIPE)
        assert stdout is not None  # noqa: S101 - Popen(stdout=PIPE)
        try:
            if command is not None:
                stdin.write(command + "\n")
                stdin.flush()
            for line in stdout:
                if line.startswith("@@ "):
                    return json.loads(line[3:])  # type: ignore[no-any-return]
        except OSError as e:
            self.error = f"not measured: {e}"
            return {}
        self.proc.wait()
        self.error = f"not measured: the DBOS process failed ({last_line(self.log_path)})"
        return {}

    def block(self, command: str) -> Callable[[], float]:
        def run() -> float:
            return float(self.call(command).get("per_step_s", float("nan")))

        return run

    def samples(self, values: list[float]) -> Samples:
        return self.error if self.error is not None else values

    def close(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(OSError):
            if self.error is None and self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def last_line(path: Path) -> str:
    lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1][:200] if lines else "no output"


@contextmanager
def dbos_child(db: Path) -> Iterator[DbosChild | str]:
    """A running DBOS child, or why there is none."""
    if not installed("dbos"):
        yield not_installed("dbos")
        return
    child = DbosChild(db)
    try:
        yield child.error if child.error is not None else child
    finally:
        child.close()


# --- child processes ------------------------------------------------------------------------


def run_child(mode: str, arg: str, *, cwd: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``--child MODE ARG`` in a fresh interpreter; its last "@@ {json}" line."""
    proc = subprocess.run(
        [sys.executable, str(HERE), "--child", mode, arg],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=False,
        timeout=CHILD_TIMEOUT,
    )
    replies = [line for line in proc.stdout.splitlines() if line.startswith("@@ ")]
    if proc.returncode != 0 or not replies:
        msg = f"child {mode} {arg} failed:\n{proc.stderr[-3000:]}"
        raise RuntimeError(msg)
    return json.loads(replies[-1][3:])  # type: ignore[no-any-return]


def try_child(mode: str, arg: str, *, cwd: Path) -> dict[str, Any] | str:
    """run_child, or why it failed (for peers that may not run here)."""
    try:
        return run_child(mode, arg, cwd=cwd)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        lines = [line for line in str(e).splitlines() if line.strip()]
        return f"not measured: {lines[-1][:200] if lines else e}"


def timed_first(call: Callable[[], Any], other: Callable[[], Any], open_s: float) -> None:
    """
    Time, in a fresh process, the first *call* (once-per-process costs included), the second
    one, and the first call of *other*, another stored step; reply.
    """
    t0 = time.perf_counter()
    first = call()
    t1 = time.perf_counter()
    second = call()
    t2 = time.perf_counter()
    third = other()
    t3 = time.perf_counter()
    if first != SMALL or second != SMALL or third != SMALL:
        msg = "the first skip returned something else than the stored output"
        raise RuntimeError(msg)
    reply({"first_s": t1 - t0, "second_s": t2 - t1, "other_s": t3 - t2, "open_s": open_s})


def child_first_library(directory: str) -> None:
    quiet()
    t0 = time.perf_counter()
    with Pipeline("bench", state_dir=Path(directory) / "first-state"):
        timed_first(lambda: skip_small(42), lambda: skip_other(42), time.perf_counter() - t0)


def child_first_naive(directory: str) -> None:
    path, other = (str(Path(directory) / f"naive-{k}.msgpack") for k in ("small", "other"))
    timed_first(lambda: naive_load(path), lambda: naive_load(other), 0.0)


def child_first_langgraph(directory: str) -> None:
    load_peer("langgraph.checkpoint.sqlite")
    t0 = time.perf_counter()
    saver = langgraph_saver(Path(directory) / "first-langgraph.sqlite")
    timed_first(lambda: langgraph_get(saver), lambda: langgraph_get(saver, "t43"), time.perf_counter() - t0)


def child_first_joblib(directory: str) -> None:
    import joblib  # type: ignore[import-untyped]

    t0 = time.perf_counter()
    memory = joblib.Memory(str(Path(directory) / "first-joblib"), verbose=0)
    cached = memory.cache(small_output, ignore=["record"])
    cached_other = memory.cache(small_output_other, ignore=["record"])
    timed_first(lambda: cached(42), lambda: cached_other(42), time.perf_counter() - t0)


def params(directory: str) -> dict[str, Any]:
    return json.loads((Path(directory) / "params.json").read_text())  # type: ignore[no-any-return]


def check_big(arr: Any, n: int) -> None:
    import numpy as np

    if arr.shape != (n,) or not np.array_equal(arr[:4], np.random.default_rng(0).random(4)):
        msg = "the 100 MB skip returned another array"
        raise RuntimeError(msg)


def child_big_setup(directory: str) -> None:
    quiet()
    import numpy as np

    n, base = params(directory)["floats"], Path(directory)
    with Pipeline("bench", state_dir=base / "big-state"):
        arr = big_step(n)
    np.save(base / "big.npy", arr)
    joblib = load_peer("joblib")
    if joblib is not None:
        joblib.Memory(str(base / "big-joblib"), verbose=0).cache(big_array)(n)
    reply({})


def child_big_library(directory: str) -> None:
    quiet()
    import numpy as np  # noqa: F401 - imported before timing, as in any script that makes arrays

    n = params(directory)["floats"]
    with Pipeline("bench", state_dir=Path(directory) / "big-state"):
        t0 = time.perf_counter()
        arr = big_step(n)
        seconds = time.perf_counter() - t0
    check_big(arr, n)
    reply({"seconds": seconds})


def child_big_joblib(directory: str) -> None:
    import joblib
    import numpy as np  # noqa: F401 - as above

    n = params(directory)["floats"]
    cached = joblib.Memory(str(Path(directory) / "big-joblib"), verbose=0).cache(big_array)
    t0 = time.perf_counter()
    arr = cached(n)
    seconds = time.perf_counter() - t0
    check_big(arr, n)
    reply({"seconds": seconds})


def child_big_npload(directory: str) -> None:
    import numpy as np

    n = params(directory)["floats"]
    t0 = time.perf_counter()
    arr = np.load(Path(directory) / "big.npy")
    seconds = time.perf_counter() - t0
    check_big(arr, n)
    reply({"seconds": seconds})


def check_rows(rows: Any, n: int) -> None:
    if len(rows) != n or rows[n // 2] != {"id": n // 2, "name": f"n{n // 2}", "score": n // 2 * 0.5}:
        msg = "the read returned other rows"
        raise RuntimeError(msg)


def child_rows_library(directory: str) -> None:
    quiet()
    n = params(directory)["rows"]
    with Pipeline("bench", state_dir=Path(directory) / "dicts-state"):
        t0 = time.perf_counter()
        rows = rows_step(-1, None)  # the rows argument is ignored: the stored slot -1
        seconds = time.perf_counter() - t0
    check_rows(rows, n)
    reply({"seconds": seconds})


def child_rows_naive(directory: str) -> None:
    n = params(directory)["rows"]
    path = Path(directory) / "dicts.msgpack"
    t0 = time.perf_counter()
    with path.open("rb") as f:
        rows = msgpack.unpackb(f.read())
    seconds = time.perf_counter() - t0
    check_rows(rows, n)
    reply({"seconds": seconds})


CHILDREN: dict[str, Callable[[str], None]] = {
    "dbos-server": child_dbos_server,
    "dbos-setup": child_dbos_setup,
    "dbos-first": child_dbos_first,
    "first-library": child_first_library,
    "first-naive": child_first_naive,
    "first-langgraph": child_first_langgraph,
    "first-joblib": child_first_joblib,
    "big-setup": child_big_setup,
    "big-library": child_big_library,
    "big-joblib": child_big_joblib,
    "big-npload": child_big_npload,
    "rows-library": child_rows_library,
    "rows-naive": child_rows_naive,
}


# --- rows of the table ----------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values)


def best_peer(peers: dict[str, Samples]) -> str | None:
    measured = {k: med(v) for k, v in peers.items() if not isinstance(v, str)}
    return min(measured, key=measured.__getitem__) if measured else None


def versus(  # noqa: PLR0913 - the parts of a row
    name: str,
    library: list[float],
    label: str,
    peer: Samples,
    *,
    target: str = "—",
    check: Callable[[float], bool] | None = None,
    fmt: Callable[[float], str] = us,
    short: str = "",
    best: bool = False,
    details: dict[str, Any] | None = None,
) -> Row:
    """A row comparing *library* with *peer* (per-round seconds); the ratio is library / peer."""
    full = f"{name} — vs {label}" + (" (best peer)" if best else "")
    short = short or label.split(" ", 1)[0]
    if isinstance(peer, str):
        return Row(full, fmt(med(library)), peer, None, "", target, None, details or {})
    ratio = ratios(library, peer)
    return Row(
        full,
        fmt(med(library)),
        fmt(med(peer)),
        ratio,
        f"resumable / {short}",
        target,
        None if check is None else check(ratio),
        details or {},
    )


def count(n: int) -> str:
    """1,000,000 as "1M", 100,000 as "100k"."""
    return f"{n // 1_000_000:,}M" if n % 1_000_000 == 0 else f"{n // 1000:,}k" if n % 1000 == 0 else f"{n:,}"


def medians(res: dict[str, Samples]) -> dict[str, Any]:
    return {k: v if isinstance(v, str) else med(v) for k, v in res.items()}


# --- 1. skipping a stored small step, repeated in one run -----------------------------------


def skip_rows(name: str, res: dict[str, Samples], details: dict[str, Any]) -> list[Row]:
    library = res["library"]
    assert not isinstance(library, str)  # noqa: S101 - the library is always measured
    peers = {k: res[k] for k in ("langgraph", "joblib", "dbos")}
    best = best_peer(peers)
    return [
        versus(
            name,
            library,
            "LangGraph SqliteSaver.get_tuple",
            res["langgraph"],
            target="≤ 1.0",
            check=lambda r: r <= 1.0,
            best=best == "langgraph",
            details=details,
        ),
        versus(
            name,
            library,
            "naive exists + read + msgpack load",
            res["naive"],
            target="≤ 1.3",
            check=lambda r: r <= 1.3,
            details=details,
        ),
        versus(
            name,
            library,
            "joblib.Memory hit",
            res["joblib"],
            short="joblib",
            best=best == "joblib",
            details=details,
        ),
        versus(name, library, "DBOS step replay (SQLite)", res["dbos"], best=best == "dbos", details=details),
    ]


def bench_skip(base: Path, rounds: int) -> list[Row]:
    n_fast, n_slow = 2000, 200
    naive_path = str(base / "naive-small.msgpack")
    write_file(naive_path, msgpack.packb(SMALL), fsync=False)
    blocks: dict[str, Callable[[], float]] = {}
    res: dict[str, Samples] = {}

    def loop(call: Callable[[], Any], n: int) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            return (time.perf_counter() - t0) / n

        return run

    saver = None
    if load_peer("langgraph.checkpoint.sqlite") is None:
        res["langgraph"] = not_installed("langgraph")
    else:
        saver = langgraph_saver(base / "skip-langgraph.sqlite")
        langgraph_put(saver, langgraph_checkpoints(1), "t42")
        if langgraph_get(saver) != SMALL:
            msg = "get_tuple returned something else than the stored checkpoint"
            raise RuntimeError(msg)
        blocks["langgraph"] = peer_block(loop(lambda: langgraph_get(saver), n_fast))
    joblib = load_peer("joblib")
    if joblib is None:
        res["joblib"] = not_installed("joblib")
    else:
        cached = joblib.Memory(str(base / "skip-joblib"), verbose=0).cache(small_output, ignore=["record"])
        cached(42)  # miss: stores the output
        cached(42)  # first hit: joblib checks the function's code once
        blocks["joblib"] = peer_block(loop(lambda: cached(42), n_slow))
    blocks["naive"] = loop(lambda: naive_load(naive_path), n_fast)
    with dbos_child(base / "skip-dbos.sqlite") as dbos, Pipeline("bench", state_dir=base / "skip-state"):
        if isinstance(dbos, str):
            res["dbos"] = dbos
        else:
            dbos.call(f"replay {n_slow}")  # records the source workflow, replays it once
            blocks["dbos"] = dbos.block(f"replay {n_slow}")
        skip_small(42)  # stores the output
        if skip_small(42) != SMALL:
            msg = "skip_small returned something else than its stored output"
            raise RuntimeError(msg)
        blocks["library"] = loop(lambda: skip_small(42), n_fast)
        measured = interleave(blocks, rounds)
        if not isinstance(dbos, str):
            res["dbos"] = dbos.samples(measured.pop("dbos"))
    if saver is not None:
        saver.conn.close()
    res |= measured
    details = medians(res) | {"calls_per_block": {"fast": n_fast, "joblib_dbos": n_slow}}
    return skip_rows("skip a stored ~1 KB step, repeated in one run", res, details)


# --- 2. the first skip in a fresh process ---------------------------------------------------


def bench_first_skip(base: Path, rounds: int) -> list[Row]:
    for k in ("small", "other"):
        write_file(str(base / f"naive-{k}.msgpack"), msgpack.packb(SMALL), fsync=False)
    with Pipeline("bench", state_dir=base / "first-state"):
        skip_small(42)
        skip_other(42)
    modes = {"library": "first-library", "naive": "first-naive"}
    res: dict[str, Samples] = {}
    if load_peer("langgraph.checkpoint.sqlite") is None:
        res["langgraph"] = not_installed("langgraph")
    else:
        saver = langgraph_saver(base / "first-langgraph.sqlite")
        langgraph_put(saver, langgraph_checkpoints(1), "t42")
        langgraph_put(saver, langgraph_checkpoints(1), "t43")
        saver.conn.close()
        modes["langgraph"] = "first-langgraph"
    joblib = load_peer("joblib")
    if joblib is None:
        res["joblib"] = not_installed("joblib")
    else:
        memory = joblib.Memory(str(base / "first-joblib"), verbose=0)
        memory.cache(small_output, ignore=["record"])(42)
        memory.cache(small_output_other, ignore=["record"])(42)
        modes["joblib"] = "first-joblib"
    if not installed("dbos"):
        res["dbos"] = not_installed("dbos")
    else:
        setup = try_child("dbos-setup", str(base / "first-dbos.sqlite"), cwd=base)
        if isinstance(setup, str):
            res["dbos"] = setup
        else:
            modes["dbos"] = "dbos-first"
    args = {k: str(base / "first-dbos.sqlite") if k == "dbos" else str(base) for k in modes}
    replies: dict[str, list[dict[str, Any]]] = {k: [] for k in modes}

    def child(side: str) -> Callable[[], float]:
        def run() -> float:
            out = run_child(modes[side], args[side], cwd=base)
            replies[side].append(out)
            return float(out["first_s"])

        return run

    for side, mode in modes.items():  # warm the page cache and the bytecode caches
        run_child(mode, args[side], cwd=base)
    res |= interleave({side: child(side) for side in modes}, rounds)
    opens = {k: med([r["open_s"] for r in v]) for k, v in replies.items()}
    seconds = {k: med([r["second_s"] for r in v]) for k, v in replies.items() if "second_s" in v[0]}
    others = {k: [float(r["other_s"]) for r in v] for k, v in replies.items()}
    details = medians(res) | {
        "open_s": opens,
        "second_call_s": seconds,
        "other_step_first_s": {k: med(v) for k, v in others.items()},
    }
    rows = skip_rows("first skip of a stored ~1 KB step in a fresh process", res, details)
    labels = {"langgraph": "LangGraph", "naive": "naive", "joblib": "joblib", "dbos": "DBOS"}
    rows += [
        Row(
            "first skip of a second stored step in that process (once-per-process costs paid)",
            us(med(others["library"])),
            "; ".join(f"{label} {us(med(others[k]))}" for k, label in labels.items() if k in others),
            ratios(others["library"], others["naive"]),
            "resumable / naive",
            "—",
            None,
            details,
        ),
        Row(
            "open in that fresh process (once per process, not per step; in no row above)",
            f"Pipeline open {ms(opens['library'])}",
            "; ".join(
                f"{label} {ms(opens[k])}"
                for k, label in (
                    ("langgraph", "LangGraph connect + setup"),
                    ("joblib", "joblib.Memory + cache"),
                    ("dbos", "DBOS launch"),
                )
                if k in opens
            )
            or "—",
            None,
            "",
            "—",
            None,
            details,
        ),
    ]
    return rows


# --- 3. storing a small output durably ------------------------------------------------------


def bench_store(base: Path, rounds: int) -> list[Row]:
    n = 40
    langgraph = load_peer("langgraph.checkpoint.sqlite")
    res: dict[str, Samples] = {"library": [], "atomic": [], "grouped": [], "langgraph": [], "dbos": []}
    if langgraph is None:
        res["langgraph"] = not_installed("langgraph")
    with dbos_child(base / "store-dbos.sqlite") as dbos:
        if isinstance(dbos, str):
            res["dbos"] = dbos
        else:
            dbos.call(f"store {n}")  # creates the tables' first pages
        for r in range(rounds):
            # Fresh state each round, for every side: each stores into a store holding < 100 outputs.
            root = base / f"store-{r}"
            (root / "atomic").mkdir(parents=True)
            (root / "grouped").mkdir()
            counter = itertools.count(1)
            blocks: dict[str, Callable[[], float]] = {}

            def atomic(directory: str = str(root / "atomic"), counter: Iterator[int] = counter) -> float:
                start = next(counter) * n
                t0 = time.perf_counter()
                for i in range(start, start + n):
                    atomic_store(directory, i, SMALL, durable=True)
                return (time.perf_counter() - t0) / n

            def library(counter: Iterator[int] = counter) -> float:
                start = next(counter) * n
                t0 = time.perf_counter()
                for i in range(start, start + n):
                    store_small(i)
                return (time.perf_counter() - t0) / n

            def grouped(directory: str = str(root / "grouped"), counter: Iterator[int] = counter) -> float:
                start = next(counter) * n
                t0 = time.perf_counter()
                for i in range(start, start + n):
                    atomic_store_grouped(directory, i, SMALL)
                return (time.perf_counter() - t0) / n

            blocks |= {"library": library, "atomic": atomic, "grouped": grouped}
            if langgraph is not None:
                saver = langgraph_saver(root / "langgraph.sqlite")
                langgraph_put(saver, langgraph_checkpoints(1), "warm")
                checkpoints = langgraph_checkpoints(n)

                def put(saver: Any = saver, checkpoints: list[Any] = checkpoints) -> float:
                    t0 = time.perf_counter()
                    langgraph_put(saver, checkpoints, "t42")
                    return (time.perf_counter() - t0) / n

                blocks["langgraph"] = peer_block(put)
            if not isinstance(dbos, str):
                blocks["dbos"] = dbos.block(f"store {n}")
            with Pipeline("bench", state_dir=root / "state"):
                store_small(0)  # opens the slot directory, computes the code digest
                one = interleave(blocks, 1, first=r)
            if langgraph is not None:
                saver.conn.close()
            for k, v in one.items():
                res[k] += v  # type: ignore[operator] # a list when measured
            # root stays until the run ends: see "delete nothing while they measure" above
        if not isinstance(dbos, str):
            res["dbos"] = dbos.samples(res["dbos"])  # type: ignore[arg-type] # measured
    library_s = res["library"]
    assert not isinstance(library_s, str)  # noqa: S101
    best = best_peer({k: res[k] for k in ("langgraph", "dbos")})
    details = medians(res) | {"stores_per_block": n}
    name = "durable store of a new ~1 KB step output"
    return [
        versus(
            name,
            library_s,
            "LangGraph SqliteSaver.put (WAL, synchronous=FULL)",
            res["langgraph"],
            target="≤ 1.5",
            check=lambda r: r <= 1.5,
            best=best == "langgraph",
            details=details,
        ),
        versus(
            name,
            library_s,
            "atomic replace with the same fsyncs (write, fsync, rename; the directory fsync shared for 0.1 s)",
            res["grouped"],
            target="≤ 1.1",
            check=lambda r: r <= 1.1,
            details=details,
        ),
        versus(
            name,
            library_s,
            "atomic replace, fsyncing its directory every time",
            res["atomic"],
            details=details,
        ),
        versus(name, library_s, "DBOS step (SQLite)", res["dbos"], best=best == "dbos", details=details),
    ]


# --- 4. storing a small output with durable=False -------------------------------------------


def bench_lazy_store(base: Path, rounds: int) -> list[Row]:
    n = 200
    diskcache = load_peer("diskcache")
    res: dict[str, Samples] = {"library": [], "naive": [], "diskcache": [], "create": []}
    if diskcache is None:
        res["diskcache"] = not_installed("diskcache")
    for r in range(rounds):
        root = base / f"lazy-{r}"
        (root / "naive").mkdir(parents=True)
        (root / "create").mkdir()
        counter = itertools.count(1)

        def create(directory: str = str(root / "create"), counter: Iterator[int] = counter) -> float:
            # The floor of any store that writes a file per output: creating an empty file.
            start = next(counter) * n
            t0 = time.perf_counter()
            for i in range(start, start + n):
                os.close(
                    os.open(os.path.join(directory, str(i)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                )
            return (time.perf_counter() - t0) / n

        def naive(directory: str = str(root / "naive"), counter: Iterator[int] = counter) -> float:
            start = next(counter) * n
            t0 = time.perf_counter()
            for i in range(start, start + n):
                atomic_store(directory, i, SMALL, durable=False)
            return (time.perf_counter() - t0) / n

        def library(counter: Iterator[int] = counter) -> float:
            start = next(counter) * n
            t0 = time.perf_counter()
            for i in range(start, start + n):
                store_small(i)
            return (time.perf_counter() - t0) / n

        blocks: dict[str, Callable[[], float]] = {"library": library, "naive": naive, "create": create}
        cache = None
        if diskcache is not None:
            cache = diskcache.Cache(str(root / "diskcache"))
            cache.set("warm", SMALL)

            def cache_set(cache: Any = cache, counter: Iterator[int] = counter) -> float:
                start = next(counter) * n
                t0 = time.perf_counter()
                for i in range(start, start + n):
                    cache.set(i, SMALL)
                return (time.perf_counter() - t0) / n

            blocks["diskcache"] = peer_block(cache_set)
        with Pipeline("bench", state_dir=root / "state", durable=False):
            store_small(0)
            one = interleave(blocks, 1, first=r)
        if cache is not None:
            cache.close()
        for k, v in one.items():
            res[k] += v  # type: ignore[operator] # a list when measured
        # root stays until the run ends: see "delete nothing while they measure" above
    library_s = res["library"]
    assert not isinstance(library_s, str)  # noqa: S101
    details = medians(res) | {"stores_per_block": n}
    name = "store a new ~1 KB step output, durable=False"
    # The target (issue "A simple core"): at most 3x the naive write, which is always measured.
    return [
        versus(
            name,
            library_s,
            "diskcache Cache.set",
            res["diskcache"],
            best=not isinstance(res["diskcache"], str),
            details=details,
        ),
        versus(
            name,
            library_s,
            "naive msgpack write + rename (no fsync)",
            res["naive"],
            target="≤ 3.0",
            check=lambda ratio: ratio <= 3.0,
            details=details,
        ),
        Row(
            "(for scale) create an empty file in the same file system, no write, no fsync",
            "—",
            us(med(res["create"])),  # type: ignore[arg-type] # always measured
            None,
            "",
            "—",
            None,
            details,
        ),
    ]


# --- 5. skipping a step that returns a 100 MB array, in a fresh process ---------------------


def bench_big_skip(base: Path, floats: int, rounds: int) -> list[Row]:
    if load_peer("numpy") is None:
        return [Row("100 MB array skip", "—", not_installed("numpy"), None, "", "≥ 2,000 MB/s", None, {})]
    (base / "params.json").write_text(json.dumps({"floats": floats}))
    run_child("big-setup", str(base), cwd=base)
    modes = {"library": "big-library", "npload": "big-npload"}
    res: dict[str, Samples] = {}
    if load_peer("joblib") is None:
        res["joblib"] = not_installed("joblib")
    else:
        modes["joblib"] = "big-joblib"
    env = {"BENCH_EXPECT_SKIP": "1"}

    def child(mode: str) -> Callable[[], float]:
        return lambda: float(run_child(mode, str(base), cwd=base, env=env)["seconds"])

    for mode in modes.values():  # untimed: the page cache and the bytecode caches
        run_child(mode, str(base), cwd=base, env=env)
    res |= interleave({k: child(m) for k, m in modes.items()}, rounds)
    shutil.rmtree(base / "big-state")
    shutil.rmtree(base / "big-joblib", ignore_errors=True)
    (base / "big.npy").unlink()
    size = floats * 8

    def mbs(seconds: float) -> str:
        return f"{size / MB / seconds:,.0f} MB/s"

    library_s = res["library"]
    assert not isinstance(library_s, str)  # noqa: S101
    lib_mbs = size / MB / med(library_s)
    details = medians(res) | {"bytes": size, "library_mb_s": lib_mbs}
    name = (
        f"skip a step returning a {size / MB:,.0f} MB float64 array, fresh process (read + verify + decode)"
    )
    best = best_peer({k: res[k] for k in ("joblib",)})
    return [
        versus(
            name,
            library_s,
            "np.load of a .npy file (page cache)",
            res["npload"],
            target="≥ 2,000 MB/s",
            check=lambda _: lib_mbs >= 2000,
            fmt=mbs,
            details=details,
        ),
        versus(
            name,
            library_s,
            "joblib.Memory hit",
            res["joblib"],
            fmt=mbs,
            short="joblib",
            best=best == "joblib",
            details=details,
        ),
    ]


# --- 6. a step returning 1,000,000 small dicts: durable write, then a fresh-process read ----


def bench_dicts(base: Path, n: int, rounds: int) -> list[Row]:
    (base / "params.json").write_text(json.dumps({"rows": n}))
    rows = make_rows(n)
    naive_dir = base / "dicts-naive"
    naive_dir.mkdir()
    counter = itertools.count()
    write_file(str(base / "dicts.msgpack"), msgpack.packb(rows), fsync=True)  # what rows-naive reads

    def naive() -> float:
        path = str(naive_dir / f"{next(counter)}.msgpack")
        t0 = time.perf_counter()
        write_file(path, msgpack.packb(rows), fsync=True)
        seconds = time.perf_counter() - t0
        os.unlink(path)
        return seconds

    def library() -> float:
        i = next(counter)
        t0 = time.perf_counter()
        rows_step(i, rows)
        return time.perf_counter() - t0

    with Pipeline("bench", state_dir=base / "dicts-state"):
        rows_step(-1, rows)  # the slot rows-library skips
        write = interleave({"library": library, "naive": naive}, rounds)

    def child(mode: str) -> Callable[[], float]:
        return lambda: float(run_child(mode, str(base), cwd=base)["seconds"])

    for mode in ("rows-library", "rows-naive"):  # untimed: the page cache and the bytecode caches
        run_child(mode, str(base), cwd=base)
    read = interleave({"library": child("rows-library"), "naive": child("rows-naive")}, rounds)
    shutil.rmtree(base / "dicts-state")
    details = {"write": medians(dict(write)), "read": medians(dict(read)), "rows": n}
    return [
        versus(
            f"write a step output of {n:,} small dicts, durable",
            write["library"],
            "msgpack.packb + write + fsync",
            write["naive"],
            short="msgpack",
            target="≤ 1.2",
            check=lambda r: r <= 1.2,
            fmt=ms,
            details=details,
        ),
        versus(
            f"read it back: skip in a fresh process ({n:,} small dicts)",
            read["library"],
            "read + msgpack.unpackb (fresh process)",
            read["naive"],
            short="msgpack",
            target="≤ 1.1",
            check=lambda r: r <= 1.1,
            fmt=ms,
            details=details,
        ),
    ]


# --- 7 and 8. checkpointed_map against hand-written append-only chunks ----------------------


def batch_blocks(naive_dir: Path, sizes: dict[str, int], *, durable: bool) -> dict[str, Callable[[], float]]:
    names = itertools.count()

    def library(n: int) -> Callable[[], float]:
        def run() -> float:
            t0 = time.perf_counter()
            out = checkpointed_map(inc, range(n), every=EVERY, name=f"batch{next(names)}")
            seconds = time.perf_counter() - t0
            if len(out) != n or out[-1] != n:
                msg = "checkpointed_map returned another list"
                raise RuntimeError(msg)
            return seconds

        return run

    def naive(n: int) -> Callable[[], float]:
        def run() -> float:
            path = str(naive_dir / f"{next(names)}.chunks")
            t0 = time.perf_counter()
            naive_chunks(n, path, EVERY, durable=durable)
            seconds = time.perf_counter() - t0
            os.unlink(path)
            return seconds

        return run

    blocks: dict[str, Callable[[], float]] = {}
    for label, n in sizes.items():
        blocks[f"library_{label}"] = library(n)
        blocks[f"naive_{label}"] = naive(n)
    return blocks


def bench_batch(base: Path, small: int, large: int, rounds: int) -> list[Row]:
    state, naive_dir = base / "batch-state", base / "batch-naive"
    naive_dir.mkdir()
    with Pipeline("bench", state_dir=state, durable=False):
        blocks = batch_blocks(naive_dir, {"small": small, "large": large}, durable=False)
        res = interleave(blocks, rounds)
    shutil.rmtree(state)
    growth = ratios(res["library_large"], res["library_small"])
    naive_growth = ratios(res["naive_large"], res["naive_small"])
    details = medians(dict(res)) | {"library_growth": growth, "naive_growth": naive_growth}
    what = f"checkpointed_map, every={EVERY}, durable=False"
    label = "hand-written msgpack chunks appended to one file (no fsync)"
    return [
        versus(
            f"{what}, {small:,} rows",
            res["library_small"],
            label,
            res["naive_small"],
            fmt=ms,
            details=details,
        ),
        versus(
            f"{what}, {large:,} rows",
            res["library_large"],
            label,
            res["naive_large"],
            fmt=ms,
            details=details,
        ),
        Row(
            f"{what}: {large:,} rows vs {small:,} rows (linear growth)",
            f"{ms(med(res['library_large']))} / {ms(med(res['library_small']))}",
            f"hand-written: {naive_growth:.2f} ({large // small}x the rows)",
            growth,
            f"{count(large)} / {count(small)}",
            f"≤ {large / small * 1.1:g}",
            growth <= large / small * 1.1,
            details,
        ),
    ]


def bench_batch_durable(base: Path, n: int, rounds: int) -> list[Row]:
    state, naive_dir = base / "batchd-state", base / "batchd-naive"
    naive_dir.mkdir()
    with Pipeline("bench", state_dir=state):
        res = interleave(batch_blocks(naive_dir, {"n": n}, durable=True), rounds)
    shutil.rmtree(state)
    return [
        versus(
            f"checkpointed_map, every={EVERY}, durable, {n:,} rows",
            res["library_n"],
            "hand-written msgpack chunks appended to one file, fsync per chunk",
            res["naive_n"],
            fmt=ms,
            details=medians(dict(res)) | {"commits": -(-n // EVERY)},
        )
    ]


# --- the driver -----------------------------------------------------------------------------

# Each benchmark, called with the temporary directory and whether --quick was given.
BENCHES: dict[str, Callable[[Path, bool], list[Row]]] = {
    "skip": lambda base, q: bench_skip(base, 3 if q else 15),
    "firstskip": lambda base, q: bench_first_skip(base, 2 if q else 9),
    "store": lambda base, q: bench_store(base, 3 if q else 11),
    "lazystore": lambda base, q: bench_lazy_store(base, 3 if q else 11),
    "bigskip": lambda base, q: bench_big_skip(base, BIG_FLOATS // 4 if q else BIG_FLOATS, 2 if q else 7),
    "dicts": lambda base, q: bench_dicts(base, 100_000 if q else 1_000_000, 2 if q else 7),
    "batch": lambda base, q: bench_batch(
        base, 10_000 if q else 100_000, 100_000 if q else 1_000_000, 2 if q else 7
    ),
    "batchdurable": lambda base, q: bench_batch_durable(base, 10_000 if q else 1_000_000, 1 if q else 3),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    strict = "--strict" in args
    args = [a for a in args if a != "--strict"]
    # The driver's environment line, with the peers' versions (benchlib is not changed).
    benchlib.local_environment = peers_environment
    status = drive(
        args,
        description=__doc__,
        benches=BENCHES,
        child=lambda mode, arg: CHILDREN[mode](arg),
        prefix="resumable-peers-",
    )
    return status if strict else 0


if __name__ == "__main__":
    sys.exit(main())
