"""
Remote state across processes: a run killed on one "machine" resumes on another that shares
no local files with it; a kill during a large upload leaves the previous state readable; the
command line works against an s3:// URL. Every process gets the server only through the
standard AWS environment variables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resumable import Pipeline
from resumable._stores._fsspec import FsspecStore
from resumable._stores._lease import LEASE_KEY

TIMEOUT = 60
LEASE_TTL = 3.0

PARTS = """
import logging, os, sys, time
from resumable import Pipeline

logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
pipe = Pipeline("parts", store=sys.argv[1])


@pipe.step(key="{i}")
def part(i: int) -> dict:
    with open(os.environ["SIDE_FILE"], "a") as side:  # the test's own record of executions
        side.write(f"{i}\\n")
    if i == int(os.environ.get("STALL_AT", "-1")):
        print(f"STALL {i}", flush=True)
        time.sleep(60)
    return {"i": i, "square": i * i, "payload": "x" * 2000}


with pipe:
    total = 0
    for i in range(6):
        total += part(i)["square"]
        print(f"DONE {i}", flush=True)
print("RESULT", total, flush=True)
"""

UPLOAD = """
import os, sys
from resumable import Pipeline
from resumable._stores import open_store

SIZE = 64 * 1024 * 1024
store = open_store(sys.argv[1])
real_pipe_file = store.fs.pipe_file


def announcing(path, data, **kwargs):
    if len(data) > 1_000_000:
        print("UPLOAD STARTED", flush=True)
    return real_pipe_file(path, data, **kwargs)


store.fs.pipe_file = announcing
pipe = Pipeline("upload", store=store)


@pipe.step
def blob(version: int) -> bytes:
    return bytes([version]) * SIZE


with pipe:
    data = blob(int(sys.argv[2]))
print("RESULT", data[0], len(data), flush=True)
"""


def _env(s3, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RESUMABLE_"))}
    return {**env, **s3.env(), "RESUMABLE_LEASE_TTL": str(LEASE_TTL), "PYTHONUNBUFFERED": "1", **extra}


def _program(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / "programs" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def _run(program: Path, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(program), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def _run_until(
    program: Path, cwd: Path, env: dict[str, str], marker: str, *args: str
) -> tuple[int, str, float]:
    """Start *program*, SIGKILL it once *marker* is printed (after *delay* from env); its pid, output, kill time."""
    delay = float(env.get("KILL_DELAY", "0"))
    with subprocess.Popen(
        [sys.executable, str(program), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith(marker):
                time.sleep(delay)
                proc.send_signal(signal.SIGKILL)
                break
        killed_at = time.time()
        assert -signal.SIGKILL == proc.wait(TIMEOUT)
        return proc.pid, "".join(seen), killed_at


def _wait_for_lease_expiry(store: FsspecStore) -> None:
    """Sleep until the lease in *store* (left by a killed run) has expired."""
    lease = json.loads(store.fs.cat_file(store._path(LEASE_KEY)))
    time.sleep(max(0.0, lease["expires_at"] - time.time()) + 0.1)


def test_run_killed_on_one_machine_resumes_on_another(s3, tmp_path):
    """Killed mid-run in one empty directory, the run resumes in another: completed parts are skipped."""
    url = s3.url("etl")
    program = _program(tmp_path, "parts", PARTS)
    side = tmp_path / "executions.txt"
    machine_a, machine_b = tmp_path / "machine-a", tmp_path / "machine-b"
    machine_a.mkdir()
    machine_b.mkdir()

    pid_a, out_a, _ = _run_until(
        program, machine_a, _env(s3, SIDE_FILE=str(side), STALL_AT="3"), "STALL 3", url
    )
    assert ["DONE 0", "DONE 1", "DONE 2"] == [line for line in out_a.splitlines() if line.startswith("DONE")]

    # B starts while A's lease is still valid: refused, naming A and the lease's expiry
    lease = json.loads(FsspecStore(url).fs.cat_file(FsspecStore(url)._path(LEASE_KEY)))
    assert pid_a == lease["pid"]
    resumed = _run(program, machine_b, _env(s3, SIDE_FILE=str(side)), url)
    if time.time() < lease["expires_at"]:  # B tried (and ended) before the lease expired
        assert 1 == resumed.returncode
    if resumed.returncode != 0:  # refused: A's lease was still valid when B looked
        assert "StateLockedError" in resumed.stderr
        assert f"pid {pid_a}" in resumed.stderr
        assert "lease expires at" in resumed.stderr
        _wait_for_lease_expiry(FsspecStore(url))
        resumed = _run(program, machine_b, _env(s3, SIDE_FILE=str(side)), url)
    # else: on a loaded machine B started after A's lease expired, and took it over at once
    assert 0 == resumed.returncode, resumed.stderr
    assert f"RESULT {sum(i * i for i in range(6))}" in resumed.stdout
    skipped = [f"part/{i}" for i in range(3)]
    assert all(f"step '{slot}' skipped" in resumed.stdout for slot in skipped), (
        resumed.stdout + resumed.stderr
    )
    assert all(f"step 'part/{i}' running" in resumed.stdout for i in (3, 4, 5))
    assert f"took over the expired lease of pid {pid_a}" in resumed.stdout
    # part 3 ran in A (killed inside it) and again in B; nothing completed ran twice
    assert ["0", "1", "2", "3", "3", "4", "5"] == side.read_text().split()
    assert ([], []) == (list(machine_a.iterdir()), list(machine_b.iterdir()))
    state = Pipeline("parts", store=url).status()
    assert ("completed", 2) == (state.status, state.runs)
    assert [f"part/{i}" for i in range(6)] == state.completed_steps


def test_kill_during_upload_keeps_previous_state(s3, tmp_path):
    """SIGKILL while a 64 MB output uploads: the previous output stays, verifies, and is used."""
    url = s3.url("upload")
    program = _program(tmp_path, "upload", UPLOAD)
    first = _run(program, tmp_path, _env(s3), url, "1")
    assert 0 == first.returncode, first.stderr
    assert f"RESULT 1 {64 * 1024 * 1024}" in first.stdout

    _, out, _ = _run_until(program, tmp_path, _env(s3, KILL_DELAY="0.05"), "UPLOAD STARTED", url, "2")
    assert "RESULT" not in out
    verify = _run_cli(s3, tmp_path, url, "verify")
    assert 0 == verify.returncode, verify.stdout + verify.stderr
    store = FsspecStore(url)
    kept = [k for k in store.list() if not k.startswith(".resumable/")]  # history keeps versions there
    assert ["blob.msgpack", "events.jsonl", "manifest.json"] == kept

    _wait_for_lease_expiry(store)
    again = _run(program, tmp_path, _env(s3), url, "1")  # the old output, skipped
    assert 0 == again.returncode, again.stderr
    assert f"RESULT 1 {64 * 1024 * 1024}" in again.stdout
    state = Pipeline("upload", store=url).status()
    assert ("completed", 3, ["blob"]) == (state.status, state.runs, state.completed_steps)


def _run_cli(s3, cwd: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", url, *args],
        cwd=cwd,
        env=_env(s3),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def test_cli_status_and_verify_on_s3(s3, tmp_path):
    """`--state-dir s3://...` status and verify read the remote state; damage makes verify exit 1."""
    url = s3.url("cli")
    pipe = Pipeline("cli", store=url)

    @pipe.step(key="{i}")
    def part(i: int) -> list[int]:
        return list(range(i))

    with pipe:
        for i in range(3):
            part(i)
    status = _run_cli(s3, tmp_path, url, "status", "--json")
    assert 0 == status.returncode, status.stderr
    manifest = json.loads(status.stdout)
    assert ("completed", ["part/0", "part/1", "part/2"]) == (manifest["status"], manifest["completed_steps"])
    text = _run_cli(s3, tmp_path, url, "status")
    assert f"pipeline 'cli' in {url}: completed" in text.stdout
    ok = _run_cli(s3, tmp_path, url, "verify")
    assert (0, True) == (ok.returncode, "ok:" in ok.stdout)

    store = FsspecStore(url)
    data = bytearray(store.read("part/2.msgpack"))
    data[-1] ^= 0xFF
    store.write("part/2.msgpack", [data], durable=True)
    damaged = _run_cli(s3, tmp_path, url, "verify")
    assert 1 == damaged.returncode
    assert f"DAMAGED {url}/part/2.msgpack" in damaged.stdout


@pytest.mark.parametrize("command", [["reset", "--all"]])
def test_cli_refuses_changes_while_a_run_holds_the_lease(s3, tmp_path, command):
    """A command that changes state fails while another run holds the lease, naming it."""
    url = s3.url("busy")
    pipe = Pipeline("busy", store=url)

    @pipe.step
    def one() -> int:
        return 1

    with pipe:
        one()
        refused = _run_cli(s3, tmp_path, url, *command)
    assert 1 == refused.returncode
    assert f"pid {os.getpid()}" in refused.stderr
    assert "lease expires at" in refused.stderr
    assert ["one"] == Pipeline("busy", store=url).status().completed_steps
