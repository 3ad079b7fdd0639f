"""
Kill tests for the chunk log: batch_rows.py runs a durable batch inside a step, is SIGKILLed
half-way, and is run again on the state the kill left, or on that state with the log's tail
torn (a record cut short, as a crash during a write or a power loss leaves it) or with a
bit flipped in its last record. Every rerun must return what an uninterrupted run returns,
without running a row of a whole, undamaged record again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chunk_files import LOG, committed, log_records

pytestmark = pytest.mark.slow

PROGRAM = Path(__file__).resolve().parent / "batch_rows.py"
TIMEOUT = 60.0
ROWS = 200
EVERY = 10


def start(state: Path, side: Path) -> subprocess.Popen[bytes]:
    args = [sys.executable, str(PROGRAM), str(state), str(side), "seq", str(ROWS), str(EVERY)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def executions(side: Path) -> list[int]:
    try:
        return [int(line) for line in side.read_text().splitlines()]
    except FileNotFoundError:
        return []


def finish(state: Path, side: Path) -> tuple[object, list[int]]:
    """Run the program to its end: its result, and the rows it executed."""
    before = len(executions(side))
    proc = start(state, side)
    out, err = proc.communicate(timeout=TIMEOUT)
    assert 0 == proc.returncode, err.decode()
    lines = [line for line in out.decode().splitlines() if line.startswith("RESULT ")]
    assert 1 == len(lines), out.decode()
    return json.loads(lines[0].removeprefix("RESULT ")), executions(side)[before:]


def killed_run(where: Path, at_row: int) -> tuple[Path, Path]:
    """A state left by a run SIGKILLed once *at_row* rows have been executed."""
    state, side = where / "state", where / "side.txt"
    proc = start(state, side)
    deadline = time.monotonic() + TIMEOUT
    while len(executions(side)) < at_row:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)
    os.killpg(proc.pid, signal.SIGKILL)
    assert -signal.SIGKILL == proc.wait(TIMEOUT)
    proc.communicate()
    return state, side


def log_of(state: Path) -> Path:
    return state / ".resumable" / "batches" / "steps" / "enrich" / LOG


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> object:
    """The result of an uninterrupted run."""
    where = tmp_path_factory.mktemp("reference")
    result, rows = finish(where / "state", where / "side.txt")
    assert list(range(ROWS)) == rows
    return result


@pytest.mark.parametrize("damage", ["none", "torn tail", "flipped bit", "torn and appended garbage"])
def test_a_killed_durable_batch_resumes_from_its_log(tmp_path: Path, reference: object, damage: str) -> None:
    """SIGKILL half-way, the log's tail damaged or not: the rerun's result is an uninterrupted run's."""
    state, side = killed_run(tmp_path, ROWS // 2)
    path = log_of(state)
    records = log_records(path)
    assert len(records) >= 3, "the kill came before three commits"
    data = path.read_bytes()
    whole = records[-1].offset + records[-1].length
    assert len(data) - whole < records[-1].length + 1  # at most one record is cut short by a kill
    last = records[-1]
    spoiled = set(range(*last.header["rows"]))
    if damage == "torn tail":
        path.write_bytes(data[: last.offset + last.length // 2])
    elif damage == "flipped bit":
        flipped = bytearray(data[:whole])
        flipped[last.offset + last.length - 3] ^= 0x40
        path.write_bytes(bytes(flipped))
    elif damage == "torn and appended garbage":
        path.write_bytes(data[: last.offset + 7] + os.urandom(3000))
    else:
        spoiled = set()
        for command in ("verify", "status"):  # the CLI on the state the kill left
            done = subprocess.run(
                [sys.executable, "-m", "resumable", "--state-dir", str(state), command],
                capture_output=True,
                text=True,
                check=False,
                timeout=TIMEOUT,
            )
            assert 0 == done.returncode, done.stdout + done.stderr
    kept = {r for start, end, _ in committed(path.parent) for r in range(start, end)} - spoiled
    shutil.copytree(state, tmp_path / "before-rerun")
    result, rows = finish(state, side)
    assert reference == result
    assert set() == kept & set(rows), "a committed row ran again"
    assert not path.exists()  # the completed step removed its log
    assert set(range(ROWS)) == kept | set(rows)
    assert len(rows) == len(set(rows)), "a row ran twice in one run"


BIG_ROWS = """
import hashlib, os, sys
from resumable import Pipeline, checkpointed_map

def big(row: int) -> bytes:
    with open(sys.argv[2], "a") as f:
        f.write(f"{row}\\n")
    return hashlib.sha256(str(row).encode()).digest() * 250_000  # 8 MB a row: a long write

with Pipeline("big", state_dir=sys.argv[1]):
    out = checkpointed_map(big, range(12), every=1, name="big")
    print("RESULT", hashlib.sha256(b"".join(out)).hexdigest())
"""


def test_kills_during_long_record_writes_leave_no_damage(tmp_path: Path) -> None:
    """
    SIGKILL while 8 MB records are written (a kill can stop a write part-way): verify passes on each
    state a kill leaves, no rerun warns about damage, and the result is an uninterrupted run's.
    """
    script, state, side = tmp_path / "big.py", tmp_path / "state", tmp_path / "side.txt"
    script.write_text(BIG_ROWS)
    reference = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "reference"), str(tmp_path / "ref-side.txt")],
        capture_output=True, text=True, check=True, timeout=TIMEOUT,
    ).stdout  # fmt: skip
    for attempt in range(4):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(state), str(side)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + TIMEOUT
        while len(executions(side)) < 2 * attempt + 2 and proc.poll() is None:
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.0005)
        time.sleep(0.003 * attempt)  # somewhere in the next record's write
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert "Warning" not in err.decode(), err.decode()
        verify = subprocess.run(
            [sys.executable, "-m", "resumable", "--state-dir", str(state), "verify"],
            capture_output=True, text=True, check=False, timeout=TIMEOUT,
        )  # fmt: skip
        assert 0 == verify.returncode, verify.stdout + verify.stderr
    done = subprocess.run(
        [sys.executable, str(script), str(state), str(side)],
        capture_output=True, text=True, check=False, timeout=TIMEOUT,
    )  # fmt: skip
    assert (0, "") == (done.returncode, "Warning" if "Warning" in done.stderr else ""), done.stderr
    assert reference == done.stdout
