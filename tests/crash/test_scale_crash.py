"""
Kill tests at scale: a state directory of 100,000 keyed slots survives SIGKILL at any moment
of a run that adds to it (while its 30 MB manifest may be being rewritten), and the next run
ends with the result of an uninterrupted one, having run no stored slot again.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "many_slots.py"
BUILT = 100_000
GROWN = 120_000
TIMEOUT = 600


def _run(state: Path, side: Path, n: int, *, kill_after: float | None = None) -> str | None:
    """Run the program over *n* items; with *kill_after*, SIGKILL it that long after it starts storing."""
    argv = [sys.executable, str(PROGRAM), str(state), str(side), str(n)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=HERE)
    try:
        if kill_after is None:
            out, err = proc.communicate(timeout=TIMEOUT)
            assert 0 == proc.returncode, err.decode()
            return out.decode()
        before = side.stat().st_size if side.exists() else 0
        deadline = time.monotonic() + TIMEOUT
        while (not side.exists() or side.stat().st_size == before) and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=TIMEOUT)
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _result(out: str | None) -> object:
    assert out is not None
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert 1 == len(lines), out
    return json.loads(lines[0].removeprefix("RESULT "))


@pytest.mark.slow
def test_a_run_killed_on_top_of_100k_slots_resumes_without_rerunning_them(tmp_path: Path) -> None:
    state, side = tmp_path / "state", tmp_path / "side.txt"
    built = _result(_run(state, side, BUILT))
    assert {"total": sum(i * i % 1009 for i in range(BUILT)), "slots": BUILT + 1} == built

    rng = random.Random(os.environ.get("PYTEST_XDIST_WORKER", "seed"))  # noqa: S311 - not crypto
    kills = 0
    for _ in range(2):  # two kills while the run adds the 20,000 new slots
        if _run(state, side, GROWN, kill_after=rng.uniform(0.2, 1.5)) is None:
            kills += 1
    assert 2 == kills
    grown = _result(_run(state, side, GROWN))
    # the same result as an uninterrupted run over the same items (the sums are the program's)
    assert {"total": sum(i * i % 1009 for i in range(GROWN)), "slots": GROWN + 1} == grown

    runs = Counter(side.read_text().split())
    assert set(runs) == {f"doc/{i}" for i in range(GROWN)} | {"total"}
    # a slot stored before a kill is never run again; only the one in flight may be
    twice = [slot for slot, n in runs.items() if n > 1 and slot != "total"]
    assert len(twice) <= kills, twice
    assert all(slot.startswith("doc/") and int(slot[4:]) >= BUILT for slot in twice)

    status = subprocess.run(
        [sys.executable, "-m", "resumable", "status", "--json", "--state-dir", str(state)],
        capture_output=True, text=True, timeout=TIMEOUT, check=True,
    )  # fmt: skip
    manifest = json.loads(status.stdout)
    assert "completed" == manifest["status"]
    assert GROWN + 1 == len(manifest["completed_steps"])
