"""The resumable command line: status and verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resumable import Pipeline
from resumable._cli import main


@pytest.fixture
def filled(pipe: Pipeline, state_dir: Path) -> Path:
    """A state directory with two completed steps and one failed one."""

    @pipe.step
    def fetch() -> str:
        return "x" * 2000

    @pipe.step(key="{n}")
    def page(n: int) -> int:
        return n

    @pipe.step
    def broken() -> None:
        raise ValueError("no luck")

    with pipe:
        fetch()
        page(1)
        with pytest.raises(ValueError, match="no luck"):
            broken()
    return state_dir


def test_status_table(filled: Path, capsys: pytest.CaptureFixture[str]):
    """status shows each slot's state, why it ran, duration and size, and the last error."""
    assert 0 == main(["--state-dir", str(filled), "status"])
    out = capsys.readouterr().out
    assert "pipeline 'test'" in out
    assert ": completed (run 1" in out
    lines = {line.split()[0]: line.split() for line in out.splitlines()[2:] if line[:1].isalpha()}
    assert ["fetch", "completed", "new"] == lines["fetch"][:3]
    assert "page/1" in lines
    assert ["broken", "failed", "new"] == lines["broken"][:3]
    assert "last error in step 'broken': ValueError: no luck" in out
    assert 'raise ValueError("no luck")' in out


def test_status_json(filled: Path, capsys: pytest.CaptureFixture[str]):
    """status --json prints the manifest."""
    assert 0 == main(["--state-dir", str(filled), "status", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert ["fetch", "page/1"] == data["completed_steps"]
    assert data["current_step"] is None  # the run went on and completed after the failure
    assert "broken" == data["error"]["step"]


def test_status_uses_environment(
    filled: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    """Without --state-dir, $RESUMABLE_STATE_DIR is used."""
    monkeypatch.setenv("RESUMABLE_STATE_DIR", str(filled))
    assert 0 == main(["status"])
    assert str(filled) in capsys.readouterr().out


def test_status_of_empty_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """An empty state directory has no steps yet."""
    assert 0 == main(["--state-dir", str(tmp_path), "status"])
    assert "no steps yet" in capsys.readouterr().out


def test_verify_clean_and_damaged(filled: Path, capsys: pytest.CaptureFixture[str]):
    """verify exits 0 on a clean directory, 1 naming each damaged file."""
    assert 0 == main(["--state-dir", str(filled), "verify"])
    assert "ok: 4 file(s) checked" in capsys.readouterr().out
    target = filled / "page" / "1.msgpack"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    (filled / "fetch.msgpack").write_bytes(b"\x00garbage")
    assert 1 == main(["--state-dir", str(filled), "verify"])
    out = capsys.readouterr().out
    assert f"DAMAGED {target}: checksum mismatch" in out
    assert f"DAMAGED {filled / 'fetch.msgpack'}" in out
    assert "2 damaged of 4 file(s)" in out


def test_verify_damaged_manifest_and_events(filled: Path, capsys: pytest.CaptureFixture[str]):
    """A damaged manifest or log line is reported too."""
    (filled / "manifest.json").write_text("{")
    with (filled / "events.jsonl").open("a") as f:
        f.write("garbage\n")
    assert 1 == main(["--state-dir", str(filled), "verify"])
    out = capsys.readouterr().out
    assert "manifest.json: damaged" in out
    assert "events.jsonl: line" in out


def test_verify_newer_manifest(filled: Path, capsys: pytest.CaptureFixture[str]):
    """A manifest from a newer version counts as a problem for verify."""
    path = filled / "manifest.json"
    path.write_text(path.read_text().replace('"format": 1', '"format": 7'))
    assert 1 == main(["--state-dir", str(filled), "verify"])
    assert "format 7" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]):
    """Unknown commands and missing commands are usage errors (exit 2)."""
    for argv in ([], ["frobnicate"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert 2 == info.value.code
    assert "usage: resumable" in capsys.readouterr().err


def test_bad_store_url_exits_1(capsys: pytest.CaptureFixture[str]):
    """An unusable --state-dir is reported on stderr with exit 1."""
    assert 1 == main(["--state-dir", "nosuch://x", "status"])
    assert "resumable: cannot open store" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["resumable"], [sys.executable, "-m", "resumable"]])
def test_as_a_user_types_it(filled: Path, command: list[str]):
    """The console script and python -m resumable both work."""
    done = subprocess.run(
        [*command, "--state-dir", str(filled), "verify"], capture_output=True, text=True, check=False
    )
    assert (0, "") == (done.returncode, done.stderr)
    assert "ok: 4 file(s) checked" in done.stdout
