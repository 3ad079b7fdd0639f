"""The examples run as documented: crash or kill them, run them again, they resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
TIMEOUT = 60
STEP_LOG = re.compile(r"step '([^']+)' (running|skipped)")


def _env(cwd: Path) -> dict[str, str]:
    return {**os.environ, "RESUMABLE_STATE_DIR": str(cwd / "state"), "PYTHONUNBUFFERED": "1"}


def run_example(name: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run examples/<name>.py in *cwd* with its state in cwd/state."""
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        cwd=cwd,
        env=_env(cwd),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )


def step_log(output: str) -> dict[str, str]:
    """Slot -> "running" or "skipped", from the INFO lines of the resumable logger."""
    return dict(STEP_LOG.findall(output))


def manifest(cwd: Path) -> dict[str, Any]:
    return json.loads((cwd / "state" / "manifest.json").read_text())


def test_quickstart_crash_then_resume(tmp_path):
    """--crash fails in the third step; the next run skips the first two and finishes."""
    crashed = run_example("quickstart", tmp_path, "--crash")
    assert 1 == crashed.returncode
    assert "RuntimeError: simulated crash in summarize" in crashed.stderr
    state = manifest(tmp_path)
    assert "failed" == state["status"]
    assert ["fetch", "clean"] == state["completed_steps"]
    assert ["clean.msgpack", "fetch.msgpack"] == sorted(
        p.name for p in (tmp_path / "state").glob("*.msgpack")
    )

    resumed = run_example("quickstart", tmp_path)
    assert 0 == resumed.returncode, resumed.stderr
    assert {"fetch": "skipped", "clean": "skipped", "summarize": "running"} == step_log(resumed.stdout)
    assert "done: {'reviews': 9, 'great': 6, 'meh': 3}" in resumed.stdout.splitlines()
    state = manifest(tmp_path)
    assert ("completed", ["fetch", "clean", "summarize"]) == (state["status"], state["completed_steps"])


def test_quickstart_fresh_starts_over(tmp_path):
    """After a full run everything is replayed, --crash included; --fresh runs every step again."""
    assert 0 == run_example("quickstart", tmp_path).returncode

    replayed = run_example("quickstart", tmp_path, "--crash")
    assert 0 == replayed.returncode, replayed.stderr
    assert {"fetch": "skipped", "clean": "skipped", "summarize": "skipped"} == step_log(replayed.stdout)
    assert "nothing crashed" in replayed.stdout

    fresh = run_example("quickstart", tmp_path, "--fresh")
    assert 0 == fresh.returncode, fresh.stderr
    assert "--fresh: forgot 3 stored output(s)" in fresh.stdout.splitlines()
    assert {"fetch": "running", "clean": "running", "summarize": "running"} == step_log(fresh.stdout)
    assert 3 == fresh.stdout.count("running: reset")


def _transcript(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(("user:", "assistant", "tool:"))]


def _run_until_killed(cwd: Path, marker: str) -> tuple[int, str]:
    """Start agent_loop in *cwd*, SIGKILL it once *marker* is printed; its exit code and output."""
    cwd.mkdir(parents=True)
    seen: list[str] = []
    with subprocess.Popen(
        [sys.executable, str(EXAMPLES / "agent_loop.py")],
        cwd=cwd,
        env=_env(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if marker in line:
                proc.send_signal(signal.SIGKILL)
                break
        code = proc.wait(timeout=TIMEOUT)
    return code, "".join(seen)


def test_agent_loop_resumes_after_kill(tmp_path):
    """Killed during turn 3, the rerun replays turns 1-2 and ends with the uninterrupted transcript."""
    full = run_example("agent_loop", tmp_path / "full")
    assert 0 == full.returncode, full.stderr
    expected = _transcript(full.stdout)
    assert "assistant: Lisbon is warmer." in expected
    assert 5 == full.stdout.count("calling the model")

    code, before = _run_until_killed(tmp_path / "killed", "(turn 3: calling the model)")
    assert -signal.SIGKILL == code
    assert 3 == before.count("calling the model")

    rerun = run_example("agent_loop", tmp_path / "killed")
    assert 0 == rerun.returncode, rerun.stderr
    assert expected == _transcript(rerun.stdout)
    assert {
        "agent_turn/1": "skipped",
        "agent_turn/2": "skipped",
        "agent_turn/3": "running",
        "agent_turn/4": "running",
        "agent_turn/5": "running",
    } == step_log(rerun.stdout)
    # the model is called only for the turns the kill did not let finish
    assert ["3", "4", "5"] == re.findall(r"\(turn (\d+): calling the model\)", rerun.stdout)


def _executed_skipped(output: str) -> tuple[str, str]:
    lines = output.splitlines()
    executed = next(line for line in lines if line.startswith("executed:"))
    skipped = next(line for line in lines if line.startswith("skipped:"))
    return executed.split(":", 1)[1].strip(), skipped.split(":", 1)[1].strip()


def _table(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.fullmatch(r"\s*\w+\s+\d+\.\d\d", line)]


def test_etl_reruns_only_what_changed(tmp_path):
    """A second run skips every step; a changed --by reruns aggregate alone."""
    first = run_example("etl", tmp_path)
    assert 0 == first.returncode, first.stderr
    assert ("download, parse, aggregate", "-") == _executed_skipped(first.stdout)
    by_region = _table(first.stdout)
    assert ["east", "north", "south", "west"] == [line.split()[0] for line in by_region]

    second = run_example("etl", tmp_path)
    assert 0 == second.returncode, second.stderr
    assert ("-", "download, parse, aggregate") == _executed_skipped(second.stdout)
    assert by_region == _table(second.stdout)

    regrouped = run_example("etl", tmp_path, "--by", "product")
    assert 0 == regrouped.returncode, regrouped.stderr
    assert ("aggregate", "download, parse") == _executed_skipped(regrouped.stdout)
    assert "step 'aggregate' running: inputs changed" in regrouped.stdout
    by_product = _table(regrouped.stdout)
    assert ["apples", "pears", "plums"] == [line.split()[0] for line in by_product]
    # the same rows, grouped another way: the grand totals agree
    grand_total = sum(float(line.split()[1]) for line in by_region)
    assert pytest.approx(grand_total, abs=0.05) == sum(float(line.split()[1]) for line in by_product)


def test_rollback_example(tmp_path):
    """rollback.py: v1, then v2 compared with v1, then a rollback restores v1 without model calls."""
    first = run_example("rollback", tmp_path)
    assert 0 == first.returncode, first.stderr
    assert "model calls this run: 3" in first.stdout
    second = run_example("rollback", tmp_path, "--prompt", "v2")
    assert "was: A checkpoint: the short answer." in second.stdout
    back = run_example("rollback", tmp_path, "--rollback")
    assert 0 == back.returncode, back.stderr
    assert "rolled back to checkpoint 3 (answers-v1)" in back.stdout
    again = run_example("rollback", tmp_path)
    assert "model calls this run: 0" in again.stdout
    assert "What is a checkpoint? -> A checkpoint: the short answer." in again.stdout


def test_s3_resume_on_another_machine(tmp_path, s3):
    """--crash on one machine leaves pages 1-3 in S3; a run in another empty directory skips them."""
    store = s3.url("example")
    crashed = run_example("s3_resume", tmp_path / "machine-a", "--store", store, "--crash")
    assert 1 == crashed.returncode
    assert "RuntimeError: simulated crash fetching page 4" in crashed.stderr

    resumed = run_example("s3_resume", tmp_path / "machine-b", "--store", store)
    assert 0 == resumed.returncode, resumed.stderr
    expected = {f"fetch_page/{page}": "skipped" if page <= 3 else "running" for page in range(1, 7)}
    assert {**expected, "total": "running"} == step_log(resumed.stdout)
    assert "total: 1125.0" in resumed.stdout.splitlines()
    # nothing of the state is on either machine's disk
    assert ([], []) == (list((tmp_path / "machine-a").iterdir()), list((tmp_path / "machine-b").iterdir()))


def _summary(output: str, prefix: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(prefix))


def test_batch_rows_resumes_at_the_row_it_was_killed(tmp_path):
    """Killed at row 140,000 of 200,000, the rerun processes only the last 60,000 rows and ends identical."""
    full = run_example("batch_rows", tmp_path / "full", "--rows", "200000")
    assert 0 == full.returncode, full.stderr
    expected = _summary(full.stdout, "rows:").rpartition("checksum: ")[2]

    killed = run_example("batch_rows", tmp_path / "killed", "--rows", "200000", "--kill-at", "140000")
    assert -signal.SIGKILL == killed.returncode
    rerun = run_example("batch_rows", tmp_path / "killed", "--rows", "200000")
    assert 0 == rerun.returncode, rerun.stderr
    assert f"rows: 200,000; processed in this run: 60,000; checksum: {expected}" == _summary(
        rerun.stdout, "rows:"
    )
    assert "resuming batch 'enrich' at row 140,000 of 200,000" in rerun.stderr
    assert not list((tmp_path / "killed" / "state" / ".resumable" / "batches").rglob("*.msgpack"))


def test_async_llm_batch_records_failures_and_resumes(tmp_path):
    """Killed after 300 answers, the rerun asks only the rest, with the failures of an uninterrupted run."""
    full = run_example("async_llm_batch", tmp_path / "full", "--prompts", "600")
    assert 0 == full.returncode, full.stderr
    expected = _summary(full.stdout, "answers:")
    assert "failed: 0;" not in expected
    assert "RateLimitedError: 429 Too Many Requests" in full.stdout

    killed = run_example("async_llm_batch", tmp_path / "killed", "--prompts", "600", "--kill-after", "300")
    assert -signal.SIGKILL == killed.returncode
    batch = manifest(tmp_path / "killed")["batches"]["summarize"]
    assert (600, 100) == (batch["total"], batch["every"])
    assert batch["done"] > 0
    rerun = run_example("async_llm_batch", tmp_path / "killed", "--prompts", "600")
    assert 0 == rerun.returncode, rerun.stderr
    assert expected == _summary(rerun.stdout, "answers:")
    answered = int(_summary(rerun.stdout, "API calls").rpartition(" ")[2])
    # 600 prompts minus the ~12 refused ones: the first run's answers were not asked again,
    # except those of the two pieces that were still open when it died
    assert answered <= 600 - 300 + 2 * 100


def test_report_example_crashes_resumes_and_writes_its_report(tmp_path):
    """--crash fails in the last step; the rerun skips the rest, and both write report.html."""
    crashed = run_example("report", tmp_path, "--crash")
    assert 1 == crashed.returncode
    assert "ConnectionError: the publishing service is down" in crashed.stderr
    assert (tmp_path / "report.html").is_file()

    resumed = run_example("report", tmp_path)
    assert 0 == resumed.returncode, resumed.stderr
    assert "{'reviews': 200, 'mean': " in resumed.stdout
    page = (tmp_path / "report.html").read_text()
    assert 'data-run="2"' in page
    assert "resumed: skipped 5 slot(s) computed in run(s) 1" in page
    assert "ConnectionError" in page
    assert "row 13: ValueError: review 13 has no text" in page
    state = manifest(tmp_path)
    assert ("completed", 2) == (state["status"], state["runs"])
