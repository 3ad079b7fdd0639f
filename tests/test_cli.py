"""The resumable command line: status and verify."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from resumable import Pipeline, load
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


# --- the whole command line, as a user types it ---------------------------------------


def _cli(state: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", str(state), *args],
        capture_output=True,
        text=True,
        check=False,
        cwd=cwd,
    )


AGENT = """
import sys
from resumable import Pipeline, step

pipe = Pipeline("agent", state_dir=sys.argv[1])

class Verdict:  # only this script knows this class: `show` must cope without it
    def __init__(self, ok):
        self.ok = ok

@pipe.step
def prompt(text: str) -> str:
    return "Be brief. " + text

@step(key="{n}")  # not one of the pipeline's own steps: run() leaves it alone
def page(n: int) -> dict:
    return {"n": n, "items": list(range(100))}

@pipe.step
def answer(prompt: str) -> str:
    return prompt.upper()

@pipe.step
def verdict(answer: str) -> object:
    return Verdict(len(answer) > 3)

with pipe:
    page(1)
pipe.run(text=sys.argv[2])
"""


@pytest.fixture
def agent(tmp_path: Path) -> tuple[Path, Path]:
    """A state directory filled by a script run twice (v1, then v2)."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    state = tmp_path / "state"
    for text in ("v1", "v2"):
        subprocess.run([sys.executable, str(script), str(state), text], check=True)
    return script, state


def test_show(agent: tuple[Path, Path]):
    """show prints a stored value, summarised; --json prints JSON; --key picks a slot."""
    _, state = agent
    done = _cli(state, "show", "answer")
    assert 0 == done.returncode
    assert done.stdout.startswith("answer: stored 20")
    assert "'BE BRIEF. V2'" in done.stdout
    done = _cli(state, "show", "page", "--key", "1", "--json")
    data = json.loads(done.stdout)
    assert 1 == data["n"]
    assert "… 80 more items" == data["items"][-1]
    done = _cli(state, "show", "verdict")
    assert "__pickled__" in done.stdout  # never unpickled unless asked
    done = _cli(state, "show", "verdict", "--allow-pickle")
    assert (0, "") == (done.returncode, done.stderr)
    assert "Verdict object" in done.stdout  # loaded: the class comes with the pickle
    done = _cli(state, "show", "nope")
    assert (1, "") == (done.returncode, done.stdout)
    assert "no stored output for 'nope'" in done.stderr


def test_history_and_rollback(agent: tuple[Path, Path]):
    """history lists checkpoints; rollback STEP restores the earlier outputs."""
    _, state = agent
    done = _cli(state, "history")
    assert 0 == done.returncode
    assert "snapshot" not in done.stdout
    assert "step prompt" in done.stdout
    ids = [c["id"] for c in json.loads(_cli(state, "history", "--json").stdout)]
    assert list(range(1, len(ids) + 1)) == ids
    assert 7 <= len(ids)
    assert ids[-2:] == [c["id"] for c in json.loads(_cli(state, "history", "--json", "--limit", "2").stdout)]
    done = _cli(state, "rollback", "prompt")
    assert (0, "") == (done.returncode, done.stderr)
    assert "rolled back to checkpoint 4" in done.stdout
    assert "'BE BRIEF. V1'" in _cli(state, "show", "answer").stdout
    done = _cli(state, "rollback", "99")
    assert 1 == done.returncode
    assert "checkpoint 99 does not exist" in done.stderr


def test_reset_command(agent: tuple[Path, Path]):
    """reset forgets steps (downstream unless --only); --all forgets everything."""
    _, state = agent
    done = _cli(state, "reset", "answer")
    assert "forgot 2 slot(s): answer, verdict" == done.stdout.strip()
    done = _cli(state, "reset", "prompt", "--only")
    assert "forgot 1 slot(s): prompt" == done.stdout.strip()
    done = _cli(state, "reset", "--all")
    assert "forgot 1 slot(s): page/1" == done.stdout.strip()
    done = _cli(state, "reset")
    assert 1 == done.returncode
    assert "pass --all" in done.stderr


def test_export_and_import(agent: tuple[Path, Path], tmp_path: Path):
    """export writes one file; import into an empty directory resumes with every step skipped."""
    script, state = agent
    exported = tmp_path / "state.export"
    done = _cli(state, "export", "-o", str(exported))
    assert 0 == done.returncode
    assert exported.exists()
    other = tmp_path / "other"
    done = _cli(other, "import", str(exported))
    assert (0, "") == (done.returncode, done.stderr)
    before = {p.name: p.read_bytes() for p in other.glob("*.msgpack")}
    subprocess.run([sys.executable, str(script), str(other), "v2"], check=True)
    assert before == {p.name: p.read_bytes() for p in other.glob("*.msgpack")}
    manifest = json.loads(_cli(other, "status", "--json").stdout)
    # the imported four runs (two per script run: its `with` block, then run()), and two more
    assert ("completed", 6) == (manifest["status"], manifest["runs"])
    bad = tmp_path / "bad.export"
    bad.write_bytes(exported.read_bytes()[:500])
    done = _cli(other, "import", str(bad))
    assert 1 == done.returncode
    assert "resumable:" in done.stderr
    assert before == {p.name: p.read_bytes() for p in other.glob("*.msgpack")}


def test_clean(agent: tuple[Path, Path]):
    """clean drops history beyond --keep, never a current output; --dry-run removes nothing."""
    _, state = agent
    outputs = {p.name: p.read_bytes() for p in state.glob("*.msgpack")}
    objects = state / ".resumable" / "objects"
    kept = sorted(objects.glob("*.msgpack"))
    assert kept
    done = _cli(state, "clean", "--older-than", "0s", "--keep", "1", "--dry-run")
    assert "would remove" in done.stdout
    assert kept == sorted(objects.glob("*.msgpack"))
    done = _cli(state, "clean", "--older-than", "0s", "--keep", "1")
    assert (0, "") == (done.returncode, done.stderr)
    assert "removed" in done.stdout
    assert len(list(objects.glob("*.msgpack"))) < len(kept)
    assert outputs == {p.name: p.read_bytes() for p in state.glob("*.msgpack")}
    assert 2 == _cli(state, "clean", "--older-than", "soon").returncode


def test_clean_removes_outputs_of_steps_that_no_longer_exist(agent: tuple[Path, Path]):
    """Once runs stop defining a step, clean removes its outputs, and only those."""
    script, state = agent
    script.write_text(
        AGENT.replace("@pipe.step\ndef verdict", "def verdict").replace(
            "pipe.run(text=sys.argv[2])", "pipe.run(text=sys.argv[2])\n"
        )
    )
    subprocess.run([sys.executable, str(script), str(state), "v2"], check=True)
    done = _cli(state, "clean", "--older-than", "0s")
    assert "verdict.msgpack (output of removed step 'verdict')" in done.stdout
    assert not (state / "verdict.msgpack").exists()
    assert (state / "answer.msgpack").exists()
    assert "verdict" not in json.loads(_cli(state, "status", "--json").stdout)["steps"]


HOLD = """
import sys, time
from resumable import Pipeline, load
with Pipeline(state_dir=sys.argv[1]):
    print("holding", flush=True)
    time.sleep(60)
"""


def test_changing_commands_refuse_while_a_run_holds_the_lock(agent: tuple[Path, Path], tmp_path: Path):
    """reset, rollback, import, clean and export refuse, naming the holder; status still works."""
    _, state = agent
    exported = tmp_path / "x.export"
    assert 0 == _cli(state, "export", "-o", str(exported)).returncode
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert "holding" == holder.stdout.readline().strip()
        for args in (["reset", "answer"], ["rollback", "1"], ["import", str(exported)], ["clean"]):
            done = _cli(state, *args)
            assert 1 == done.returncode, args
            assert f"pid {holder.pid}" in done.stderr
        assert 0 == _cli(state, "status").returncode
        assert 0 == _cli(state, "verify").returncode
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


def test_clean_removes_row_chunks_left_by_a_completed_step(tmp_path: Path):
    """Chunks left behind by a step that completed (a death in between) are removed by clean."""
    from resumable import checkpointed_map

    state = tmp_path / "state"
    pipe = Pipeline("p", state_dir=state)

    @pipe.step
    def enrich(rows: list[int]) -> list[int]:
        return checkpointed_map(lambda r: r + 1, rows, every=2)

    with pipe:
        enrich([1, 2, 3])
    leftover = state / ".resumable" / "batches" / "steps" / "enrich" / "000000000000-000000000002-0-x.msgpack"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"left by a killed process")
    done = _cli(state, "clean")
    assert "row chunk of completed step 'enrich'" in done.stdout
    assert not leftover.exists()
    assert [2, 3, 4] == load(state / "enrich.msgpack")


def test_verify_checks_kept_versions(agent: tuple[Path, Path]):
    """verify also checks the output versions history keeps, naming a damaged one."""
    _, state = agent
    kept = sorted((state / ".resumable" / "objects").glob("*.msgpack"))
    assert kept
    data = bytearray(kept[0].read_bytes())
    data[-1] ^= 1
    kept[0].write_bytes(bytes(data))
    done = _cli(state, "verify")
    assert 1 == done.returncode
    assert f"DAMAGED {kept[0]}: checksum mismatch" in done.stdout
