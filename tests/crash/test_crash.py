"""
Kill tests: real programs (five_steps.py, five_steps_async.py, charge.py) are killed and run
again on the same state directory; see crashkit.py for what the programs do, and
crash_threads.py for the check of the crash helper itself.

After every kill, what a reader can see must be whole (the manifest parses, every output
file loads, temporary files are hidden); the rerun must end with the result of an
uninterrupted run and must not execute again any slot that was completed before the kill.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import pytest

import resumable

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROGRAMS = {"sync": HERE / "five_steps.py", "async": HERE / "five_steps_async.py"}
CHARGE = HERE / "charge.py"
CRASH_THREADS = HERE / "crash_threads.py"
TIMEOUT = 60.0
KILLS_PER_VARIANT = 24  # random SIGKILLs per program variant, over as many trials as needed
MAX_KILLS_PER_TRIAL = 30  # then the trial's last run is left to finish
INTERNAL = ".resumable"
KILLED = -signal.SIGKILL
CRASHED = 137  # resumable.testing.CRASH_EXIT_CODE
_started: list[subprocess.Popen[bytes]] = []


@pytest.fixture(autouse=True)
def _no_stray_programs() -> Iterator[None]:
    """A test that fails half-way does not leave a stalled program behind."""
    yield
    while _started:
        popen = _started.pop()
        if popen.poll() is None:
            popen.kill()
            popen.wait(TIMEOUT)


# running the programs ------------------------------------------------------------------


class Proc:
    """A started program, its output going to files."""

    def __init__(self, popen: subprocess.Popen[bytes], out: Path, err: Path) -> None:
        self.popen = popen
        self.out = out
        self.err = err

    @property
    def pid(self) -> int:
        return self.popen.pid

    def wait(self, timeout: float = TIMEOUT) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> int:
        self.popen.kill()  # a no-op if it has already been reaped
        return self.wait()

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()

    def result(self) -> Any:
        lines = [line for line in self.stdout().splitlines() if line.startswith("RESULT ")]
        assert 1 == len(lines), self.stdout() + self.stderr()
        return json.loads(lines[0].removeprefix("RESULT "))

    def wait_for(self, marker: str) -> None:
        """Wait until *marker* appears on the program's stdout."""
        wait_until(lambda: marker in self.stdout() or self.popen.poll() is not None)
        assert marker in self.stdout(), self.stderr()


@dataclass
class Attempt:
    """One run of a program: the slots it started, and what was completed when it ended."""

    executed: list[str]
    completed: set[str]
    killed: bool


class Case:
    """A program with its own state directory and side file."""

    def __init__(self, where: Path, program: Path, *, small: bool = False) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self.where = where
        self.program = program
        self.small = small
        self.state = where / "state"
        self.side = where / "side.txt"
        self._runs = 0

    def start(self, **env: str) -> Proc:
        self._runs += 1
        out, err = self.where / f"run{self._runs}.out", self.where / f"run{self._runs}.err"
        args = [sys.executable, str(self.program), str(self.state), str(self.side)]
        args += ["--small"] if self.small else []
        # a program dying of a signal of its own (not our SIGKILL) shows where on stderr
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", **env}
        with out.open("wb") as stdout, err.open("wb") as stderr:
            popen = subprocess.Popen(args, stdout=stdout, stderr=stderr, env=env)
        _started.append(popen)
        return Proc(popen, out, err)

    def run(self, **env: str) -> Proc:
        proc = self.start(**env)
        proc.wait()
        return proc

    def executions(self) -> list[str]:
        """Every slot execution so far, in order (one side-file line each)."""
        try:
            return self.side.read_text().splitlines()
        except FileNotFoundError:
            return []

    def manifest(self) -> dict[str, Any]:
        """manifest.json, with keyed steps' records (in ``<step>.records``, a list per field) under steps."""
        data: dict[str, Any] = json.loads((self.state / "manifest.json").read_text())
        for step in data.get("keyed", {}):
            columns = msgpack.unpackb((self.state / f"{step}.records").read_bytes())
            slots = columns.pop("slots")
            data["steps"].update(
                {s: dict(zip(columns, v, strict=True)) for s, *v in zip(slots, *columns.values())}
            )
        return data

    def files(self) -> dict[str, bytes]:
        """The bytes of every file outside the internal directory."""
        return {
            path.relative_to(self.state).as_posix(): path.read_bytes()
            for path in self.state.rglob("*")
            if path.is_file() and path.relative_to(self.state).parts[0] != INTERNAL
        }


def wait_until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.0005)


def cli(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "resumable", "--state-dir", str(state), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)


# what a kill may leave behind ----------------------------------------------------------


def output_files(state: Path) -> dict[str, Path]:
    """Output files by slot (``fetch/3`` for ``state/fetch/3.msgpack``)."""
    found = {}
    for path in state.rglob("*.msgpack"):
        parts = path.relative_to(state).parts
        if parts[0] != INTERNAL and not any(p.startswith(".") for p in parts):
            found[path.relative_to(state).as_posix().removesuffix(".msgpack")] = path
    return found


def completed_events(state: Path) -> set[str]:
    """Slots with a ``step_completed`` event in the event log."""
    try:
        text = (state / "events.jsonl").read_text()
    except FileNotFoundError:
        return set()
    # only whole lines: the running process may be in the middle of appending one
    lines = text[: text.rfind("\n") + 1].splitlines()
    events = [json.loads(line) for line in lines if line.strip()]
    return {e["slot"] for e in events if e["event"] == "step_completed"}


def check_state(state: Path) -> set[str]:
    """
    Check that a reader of *state* sees only whole files after a kill; return the slots
    completed (a ``step_completed`` event was logged, or the output file exists).
    """
    if not state.exists():
        return set()
    outputs = output_files(state)
    unexpected = []
    for path in state.rglob("*"):
        rel = path.relative_to(state)
        if path.is_dir() or rel.parts[0] == INTERNAL:
            continue
        hidden_tmp = path.name.startswith(".") and path.name.endswith(".tmp")
        known = (
            rel.as_posix() in {"manifest.json", "events.jsonl", ".gitignore"}
            or path in outputs.values()
            or (len(rel.parts) == 1 and path.suffix == ".records")  # a keyed step's records
        )
        if not (hidden_tmp or known):
            unexpected.append(rel.as_posix())
    assert [] == unexpected
    if (state / "manifest.json").exists():
        manifest = json.loads((state / "manifest.json").read_text())
        assert manifest["status"] in {"running", "completed", "failed", "interrupted"}
    loaded = {slot: resumable.load(path) is not None for slot, path in outputs.items()}
    assert dict.fromkeys(outputs, True) == loaded
    return set(outputs) | completed_events(state)


def check_executions(attempts: list[Attempt], slots: Iterable[str]) -> None:
    """No slot ran twice in a run, or after it was completed; each ran at most once per kill."""
    twice = [{s: n for s, n in Counter(a.executed).items() if n > 1} for a in attempts]
    assert [{}] * len(attempts) == twice
    done: set[str] = set()
    redone = []
    for attempt in attempts:
        redone.append(sorted(done & set(attempt.executed)))
        done |= attempt.completed
    assert [[]] * len(attempts) == redone
    counts = Counter(s for a in attempts for s in a.executed)
    cut_short = Counter(s for a in attempts if a.killed for s in set(a.executed) - a.completed)
    assert {} == {s: n for s, n in counts.items() if n > 1 + cut_short[s]}
    assert sorted(slots) == sorted(counts)


# references ------------------------------------------------------------------------------


@dataclass
class Reference:
    """An uninterrupted run: its result, the slots it ran, its duration, its renames."""

    result: Any
    slots: list[str]
    seconds: float
    replaces: list[str]


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, bool], Reference]:
    """The reference run of a program variant in a fresh state directory (computed once)."""
    cache: dict[tuple[str, bool], Reference] = {}

    def get(variant: str, small: bool) -> Reference:
        if (variant, small) not in cache:
            where = tmp_path_factory.mktemp(f"reference-{variant}-{'small' if small else 'full'}")
            case = Case(where, PROGRAMS[variant], small=small)
            log = where / "replaces.txt"
            started = time.perf_counter()
            proc = case.run(REPLACE_LOG=str(log))
            seconds = time.perf_counter() - started
            assert 0 == proc.popen.returncode, proc.stderr()
            slots = case.executions()
            assert sorted(set(slots)) == sorted(slots)
            cache[variant, small] = Reference(proc.result(), slots, seconds, log.read_text().splitlines())
        return cache[variant, small]

    return get


@pytest.fixture
def finished(tmp_path: Path, reference: Callable[[str, bool], Reference]) -> Case:
    """five_steps.py --small, run to completion once."""
    case = Case(tmp_path, PROGRAMS["sync"], small=True)
    proc = case.run()
    assert reference("sync", True).result == proc.result()
    return case


# 1. kills --------------------------------------------------------------------------------


def kill_until_done(case: Case, rng: random.Random, seconds: float) -> tuple[list[Attempt], Proc]:
    """
    Start the program and SIGKILL it, again and again, until a run finishes. Each kill comes
    after a random delay, or a few milliseconds after a random number of step executions.
    """
    attempts: list[Attempt] = []
    while True:
        before = len(case.executions())
        proc = case.start()
        if len(attempts) >= MAX_KILLS_PER_TRIAL:
            proc.wait()
        elif rng.random() < 0.4:
            try:
                proc.wait(timeout=rng.uniform(0.0, seconds))
            except subprocess.TimeoutExpired:
                pass
        else:
            target = before + rng.randint(1, 8)
            wait_until(lambda: proc.popen.poll() is not None or len(case.executions()) >= target)
            time.sleep(rng.uniform(0.0, 0.02))
        code = proc.kill()
        executed = case.executions()[before:]
        if code == 0:
            attempts.append(Attempt(executed, set(), killed=False))
            return attempts, proc
        assert KILLED == code, proc.stderr()
        attempts.append(Attempt(executed, check_state(case.state), killed=True))


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_random_kills_end_with_the_reference_result(
    variant: str, tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """SIGKILLed at random moments and rerun, a program ends as an uninterrupted run, redoing nothing."""
    ref = reference(variant, False)
    rng = random.Random(f"kills-{variant}")  # noqa: S311 - reproducible kill times, not security
    kills = trials = 0
    while kills < KILLS_PER_VARIANT:
        trials += 1
        case = Case(tmp_path / f"trial{trials}", PROGRAMS[variant])
        attempts, final = kill_until_done(case, rng, ref.seconds)
        kills += sum(a.killed for a in attempts)
        assert ref.result == final.result()
        assert "Traceback" not in final.stderr()
        manifest = case.manifest()
        assert ("completed", sorted(ref.slots)) == (manifest["status"], sorted(manifest["completed_steps"]))
        check_state(case.state)
        check_executions(attempts, ref.slots)
        verify = cli(case.state, "verify")
        assert 0 == verify.returncode, verify.stdout
    print(f"{variant}: {kills} kills in {trials} trial(s)")


def test_both_variants_compute_the_same_result(reference: Callable[[str, bool], Reference]) -> None:
    """The sync and async programs are the same computation (so one reference checks both)."""
    assert reference("sync", True).result == reference("async", True).result


def crash_and_resume(case: Case, spec: str, ref: Reference, *, must_crash: bool) -> None:
    """Run with ``CRASH_AT=spec``, check what is left, rerun, check the rerun redid nothing done."""
    crashed = case.run(CRASH_AT=spec)
    code = crashed.popen.returncode
    assert code == CRASHED if must_crash else code in {0, CRASHED}, crashed.stderr()
    first = Attempt(case.executions(), check_state(case.state), killed=code == CRASHED)
    resumed = case.run()
    assert ref.result == resumed.result()
    assert "Traceback" not in resumed.stderr()
    assert "completed" == case.manifest()["status"]
    check_state(case.state)
    rest = Attempt(case.executions()[len(first.executed) :], set(), killed=False)
    check_executions([first, rest], ref.slots)


@pytest.mark.parametrize("variant", ["sync", "async"])
def test_crash_at_each_rename_leaves_whole_files_and_resumes(
    variant: str, tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """Dying at the N-th os.replace, for every N of a run, leaves no partial file; the rerun finishes the work."""
    ref = reference(variant, True)
    outputs = {f"{slot}.msgpack" for slot in ref.slots}
    assert set() == (outputs | {"manifest.json"}) - set(ref.replaces)
    for n in range(1, len(ref.replaces) + 1):
        case = Case(tmp_path / f"replace{n}", PROGRAMS[variant], small=True)
        # outputs, the manifest when the run opens and when it closes: at least that many renames
        crash_and_resume(case, f"replace:{n}", ref, must_crash=n <= len(outputs) + 2)


@pytest.mark.parametrize(("operation", "most"), [("write", 50), ("fsync", 26)])
def test_crash_at_sampled_writes_and_fsyncs_resumes(
    operation: str, most: int, tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """Dying at a sample of os.write / os.fsync calls (log appends, output bytes, syncs) also resumes cleanly."""
    ref = reference("sync", True)
    rng = random.Random(operation)  # noqa: S311 - a reproducible sample, not security
    for n in sorted(rng.sample(range(1, most + 1), 8)):
        case = Case(tmp_path / f"{operation}{n}", PROGRAMS["sync"], small=True)
        # an output is written and fsynced, plus a log line, per slot: more calls than slots
        crash_and_resume(case, f"{operation}:{n}", ref, must_crash=n <= len(ref.slots))


def test_crash_at_dies_once_when_threads_reach_it_together(tmp_path: Path) -> None:
    """When several threads reach crash_at's point at once, the process starts dying once and renames nothing."""
    command = [sys.executable, str(CRASH_THREADS), str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert (CRASHED, "EXIT 137\n") == (proc.returncode, proc.stdout)
    assert [] == sorted(p.name for p in tmp_path.glob("*.done"))


@pytest.mark.parametrize(
    ("operation", "calls"),
    [("fsync", "os.fsync(fd); os.fdatasync(fd)"), ("write", "os.write(fd, b'a'); os.pwrite(fd, b'b', 1)")],
)
def test_crash_at_counts_each_way_of_doing_the_operation(operation: str, calls: str, tmp_path: Path) -> None:
    """A sync is an fsync or an fdatasync, a write a write or a pwrite."""
    program = (
        "import os, sys\n"
        "from resumable.testing import crash_at\n"
        f"fd = os.open({str(tmp_path / 'f')!r}, os.O_RDWR | os.O_CREAT)\n"
        f"crash_at({operation!r}, 2)\n"
        f"{calls}\n"
        "print('survived')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=TIMEOUT, check=False
    )
    assert (CRASHED, "") == (proc.returncode, proc.stdout), proc.stderr


# 2. damaged files ------------------------------------------------------------------------


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[24] ^= 0x01
    path.write_bytes(bytes(data))


def cut_in_half(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize(
    ("damage", "slot"),
    [
        (flip_last_byte, "fetch/2"),
        (cut_in_half, "transform"),
        (flip_last_byte, "summarize"),
        (cut_in_half, "score/1"),
        (flip_header_byte, "fetch/3"),
    ],
)
def test_damaged_output_is_reported_and_recomputed_alone(
    damage: Callable[[Path], None], slot: str, finished: Case, reference: Callable[[str, bool], Reference]
) -> None:
    """A damaged output file fails `resumable verify`, and the rerun recomputes that slot only, with a warning."""
    assert 0 == cli(finished.state, "verify").returncode
    path = finished.state / f"{slot}.msgpack"
    damage(path)
    verify = cli(finished.state, "verify")
    assert (1, True) == (verify.returncode, f"DAMAGED {path}" in verify.stdout)
    before = len(finished.executions())
    rerun = finished.run()
    assert reference("sync", True).result == rerun.result()
    assert [slot] == finished.executions()[before:]
    assert "ResumableWarning" in rerun.stderr()
    assert str(path) in rerun.stderr()
    assert "corrupt" == finished.manifest()["steps"][slot]["reason"]
    assert 0 == cli(finished.state, "verify").returncode


@pytest.mark.parametrize(
    ("spoil", "problem"),
    [
        ({"manifest.json": None}, "missing"),
        ({"manifest.json": None, "events.jsonl": None}, "missing"),
        ({"manifest.json": b'{"format": 1, "status": "comp'}, "damaged"),
    ],
    ids=["manifest-lost", "manifest-and-log-lost", "manifest-cut"],
)
def test_lost_or_damaged_manifest_is_rebuilt_with_a_warning(
    spoil: dict[str, bytes | None], problem: str, finished: Case, reference: Callable[[str, bool], Reference]
) -> None:
    """Without a usable manifest.json (even without the event log) the rerun rebuilds it, warns, and skips every step."""
    for name, content in spoil.items():
        if content is None:
            (finished.state / name).unlink()
        else:
            (finished.state / name).write_bytes(content)
    before = len(finished.executions())
    rerun = finished.run()
    ref = reference("sync", True)
    assert ref.result == rerun.result()
    assert [] == finished.executions()[before:]
    assert "ResumableWarning" in rerun.stderr()
    assert f"{finished.state / 'manifest.json'} was {problem}" in rerun.stderr()
    manifest = finished.manifest()
    assert ("completed", sorted(ref.slots)) == (manifest["status"], sorted(manifest["completed_steps"]))
    assert dict.fromkeys(ref.slots, "completed") == {s: r["status"] for s, r in manifest["steps"].items()}


def test_manifest_from_a_newer_version_is_refused_and_left_alone(finished: Case) -> None:
    """A manifest with format 999 makes the run fail with StateFormatError, overwriting nothing."""
    manifest = finished.manifest()
    manifest["format"] = 999
    (finished.state / "manifest.json").write_text(json.dumps(manifest))
    files = finished.files()
    before = len(finished.executions())
    rerun = finished.run()
    assert 0 != rerun.popen.returncode
    assert "resumable.exceptions.StateFormatError" in rerun.stderr()
    assert "999" in rerun.stderr()
    assert files == finished.files()
    assert [] == finished.executions()[before:]


# 3. two processes ------------------------------------------------------------------------


def test_second_process_is_locked_out_until_the_holder_dies(
    tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """A second run on a busy state directory fails naming the holder; once the holder is killed, a run proceeds."""
    case = Case(tmp_path, PROGRAMS["sync"], small=True)
    holder = case.start(STALL_AT="transform")
    holder.wait_for("STALL transform")
    second = case.run()
    assert 0 != second.popen.returncode
    message = second.stderr()
    assert "StateLockedError" in message
    assert f"pid {holder.pid} on host {socket.gethostname()} since " in message
    assert KILLED == holder.kill()
    first = Attempt(case.executions(), check_state(case.state), killed=True)
    third = case.run()
    assert reference("sync", True).result == third.result()
    assert "completed" == case.manifest()["status"]
    second_and_third = Attempt(case.executions()[len(first.executed) :], set(), killed=False)
    check_executions([first, second_and_third], reference("sync", True).slots)
    assert 2 == case.executions().count("transform")


# 4. signals and failures in script mode -------------------------------------------------


@pytest.mark.parametrize("variant", ["sync", "async"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_inside_a_step_records_an_interrupted_run(
    signum: signal.Signals, variant: str, tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """SIGTERM or Ctrl-C inside a step leaves the run and the slot `interrupted`; the rerun completes."""
    case = Case(tmp_path, PROGRAMS[variant], small=True)
    proc = case.start(STALL_AT="score/1")
    proc.wait_for("STALL score/1")
    # (async: the other score slots run alongside; let them finish first)
    wait_until(lambda: set(case.executions()) - {"score/1"} <= completed_events(case.state))
    proc.popen.send_signal(signum)
    assert proc.wait() in {128 + signum, -signum}, proc.stderr()
    manifest = case.manifest()
    assert ("interrupted", "interrupted") == (manifest["status"], manifest["steps"]["score/1"]["status"])
    assert "score/1" not in manifest["completed_steps"]
    rerun = case.run()
    assert reference(variant, True).result == rerun.result()
    assert "completed" == case.manifest()["status"]
    expected = Counter(reference(variant, True).slots) + Counter(["score/1"])
    assert expected == Counter(case.executions())


def test_exception_in_a_step_records_a_failed_run(
    tmp_path: Path, reference: Callable[[str, bool], Reference]
) -> None:
    """An exception escaping a step leaves status `failed` with the error and the failed slot; the rerun completes."""
    case = Case(tmp_path, PROGRAMS["sync"], small=True)
    failed = case.run(FAIL_AT="score/1")
    assert 1 == failed.popen.returncode
    assert "RuntimeError: boom in score/1" in failed.stderr()
    manifest = case.manifest()
    error = manifest["error"]
    expected = ("failed", "score/1", "score/1", "RuntimeError", "boom in score/1", "failed")
    actual = (
        manifest["status"],
        manifest["current_step"],
        error["step"],
        error["type"],
        error["message"],
        manifest["steps"]["score/1"]["status"],
    )
    assert expected == actual
    assert "RuntimeError: boom in score/1" in error["traceback"]
    assert "five_steps.py" in error["traceback"]
    rerun = case.run()
    assert reference("sync", True).result == rerun.result()
    assert "completed" == case.manifest()["status"]
    assert Counter(reference("sync", True).slots) + Counter(["score/1"]) == Counter(case.executions())


# 5. a step that must not run twice silently ---------------------------------------------


def test_killed_non_idempotent_step_needs_a_reset(tmp_path: Path) -> None:
    """A SIGKILLed idempotent=False step refuses to rerun with StepInterruptedError until it is reset."""
    case = Case(tmp_path, CHARGE)
    proc = case.start(STALL_AT="charge")
    proc.wait_for("STALL charge")
    assert KILLED == proc.kill()
    refused = case.run()
    assert 0 != refused.popen.returncode
    assert "resumable.exceptions.StepInterruptedError" in refused.stderr()
    assert "resumable reset charge" in refused.stderr()
    assert ["basket", "charge"] == case.executions()
    confirmed = case.run(RESET_CHARGE="1")
    assert {"receipt": "paid 162"} == confirmed.result()
    assert "RESET charge\n" in confirmed.stdout()
    assert "reset" == case.manifest()["steps"]["charge"]["reason"]
    assert {"basket": 1, "charge": 2, "receipt": 1} == Counter(case.executions())
    again = case.run()
    assert {"receipt": "paid 162"} == again.result()
    assert {"basket": 1, "charge": 2, "receipt": 1} == Counter(case.executions())
    assert "completed" == case.manifest()["status"]
