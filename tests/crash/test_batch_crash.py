"""
Kill tests for batches: batch_rows.py is SIGKILLed (with its worker processes) at random
moments and run again on the same state directory, in each mode (sequential, side-effect
loop, process pool, async, Dask).

After every kill the rows committed so far are read from the chunk logs (as any msgpack
reader would read them). The
rerun must never execute a committed row again; the rows a kill makes run again must be
at most the rows that were in flight (an open piece of ``every`` rows, or the pieces an
executor or the event loop holds); and the final result must be that of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from chunk_files import committed

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "batch_rows.py"
TIMEOUT = 60.0
ROWS = 300
EVERY = 10
KILLS = 8  # random SIGKILLs per mode
# Rows that may be in flight (executed, not yet committed) when the process dies.
IN_FLIGHT = {
    "seq": EVERY,  # the open piece
    "each": EVERY,
    "pool": 4 * EVERY,  # twice the two workers' pieces are submitted at once
    "async": 2 * EVERY,  # concurrency 8 keeps at most two pieces open
    "dask": 4 * EVERY,
}


@dataclass
class Attempt:
    """One run: the rows it executed, the rows committed when it ended, whether it was killed."""

    executed: list[int]
    committed: set[int]
    killed: bool


class Case:
    def __init__(self, where: Path, mode: str) -> None:
        where.mkdir(parents=True, exist_ok=True)
        self.where = where
        self.mode = mode
        self.state = where / "state"
        self.side = where / "side.txt"
        self.runs = 0

    def start(self) -> subprocess.Popen[bytes]:
        self.runs += 1
        args = [
            sys.executable,
            str(PROGRAM),
            str(self.state),
            str(self.side),
            self.mode,
            str(ROWS),
            str(EVERY),
        ]
        out = (self.where / f"run{self.runs}.out").open("wb")
        err = (self.where / f"run{self.runs}.err").open("wb")
        # a session of its own: the kill takes the worker processes down with it, as a crash would
        with out, err:
            return subprocess.Popen(args, stdout=out, stderr=err, start_new_session=True)

    def output(self) -> tuple[str, str]:
        return (
            (self.where / f"run{self.runs}.out").read_text(),
            (self.where / f"run{self.runs}.err").read_text(),
        )

    def executions(self) -> list[int]:
        try:
            return [int(line) for line in self.side.read_text().splitlines()]
        except FileNotFoundError:
            return []

    def committed(self) -> set[int]:
        """Rows in the chunks of every batch directory (records of whole logs, chunk files)."""
        rows: set[int] = set()
        for path in (self.state / ".resumable" / "batches").rglob("batch.msgpack"):
            for start, end, _ in committed(path.parent):
                rows.update(range(start, end))
        return rows


def result_of(stdout: str) -> Any:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert 1 == len(lines), stdout
    return json.loads(lines[0].removeprefix("RESULT "))


def wait_until(condition: Any, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The result of an uninterrupted run (the same for every mode but `each`)."""
    case = Case(tmp_path_factory.mktemp("batch-reference"), "seq")
    proc = case.start()
    assert 0 == proc.wait(TIMEOUT), case.output()
    assert sorted(case.executions()) == list(range(ROWS))
    return {"map": result_of(case.output()[0])}


def kill_until_done(case: Case, rng: random.Random, kills: int) -> tuple[list[Attempt], str]:
    """Start the program and kill it after a random number of row executions, until a run finishes."""
    attempts: list[Attempt] = []
    while True:
        before = len(case.executions())
        proc = case.start()
        if sum(a.killed for a in attempts) < kills:
            target = before + rng.randint(1, ROWS // 3)
            wait_until(lambda: proc.poll() is not None or len(case.executions()) >= target)
            time.sleep(rng.uniform(0.0, 0.01))
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait(TIMEOUT)
        executed = case.executions()[before:]
        if code == 0:
            attempts.append(Attempt(executed, set(), killed=False))
            return attempts, case.output()[0]
        assert -signal.SIGKILL == code, case.output()
        attempts.append(Attempt(executed, case.committed(), killed=True))


@pytest.mark.parametrize("mode", ["seq", "each", "pool", "async", "dask"])
def test_random_kills_lose_only_rows_in_flight(mode: str, tmp_path: Path, reference: dict[str, Any]) -> None:
    """Killed at random and rerun: the result of an uninterrupted run, no committed row redone."""
    if mode == "dask":
        pytest.importorskip("distributed")
    rng = random.Random(f"batch-kills-{mode}")  # noqa: S311 - reproducible kill times, not security
    kills = trials = redone_total = 0
    while kills < KILLS:
        trials += 1
        case = Case(tmp_path / f"trial{trials}", mode)
        attempts, stdout = kill_until_done(case, rng, KILLS - kills)
        kills += sum(a.killed for a in attempts)
        expected = [6, hashlib.sha256(b'"sent"').hexdigest()] if mode == "each" else reference["map"]
        assert expected == result_of(stdout)
        # within one run no row runs twice; every row ran
        assert [{}] * len(attempts) == [
            {r: n for r, n in Counter(a.executed).items() if n > 1} for a in attempts
        ]
        assert set(range(ROWS)) == {r for a in attempts for r in a.executed}
        for before, after in itertools.pairwise(attempts):
            assert set() == before.committed & set(after.executed), "a committed row ran again"
            redone = set(before.executed) & set(after.executed)
            assert len(redone) <= IN_FLIGHT[mode], f"one kill made {len(redone)} rows run again"
        total = sum(len(a.executed) for a in attempts) - ROWS
        assert total <= IN_FLIGHT[mode] * sum(a.killed for a in attempts)
        redone_total += total
    print(f"{mode}: {kills} kills in {trials} trial(s), {redone_total} rows run again")
