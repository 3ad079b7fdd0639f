"""The resumable command line: status and verify."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resumable import Pipeline, UsageError, load
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
    """An empty directory holds no state: said on stderr, exit 3."""
    assert 3 == main(["--state-dir", str(tmp_path), "status"])
    captured = capsys.readouterr()
    assert ("", f"resumable: no state in {tmp_path} (nothing has run with this state directory)\n") == (
        captured.out,
        captured.err,
    )


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
    path.write_text(path.read_text().replace('"format": 2', '"format": 7'))
    assert 1 == main(["--state-dir", str(filled), "verify"])
    assert "format 7" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]):
    """Unknown commands, missing commands and bad counts are usage errors (exit 2)."""
    for argv in ([], ["frobnicate"], ["history", "--limit", "-1"], ["clean", "--keep", "x"]):
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
    assert (2, "") == (done.returncode, done.stdout)
    assert (
        f"resumable: no stored output for 'nope' in {state} "
        "(it holds steps answer, page, prompt, verdict; slots page/1)\n"
    ) == done.stderr
    done = _cli(state, "show", "page")
    assert (2, "resumable: 'page' is a keyed step: pass --key K, or one of its slots: page/1\n") == (
        done.returncode,
        done.stderr,
    )


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


def test_rollback_to_an_unknown_checkpoint_is_a_usage_error(agent: tuple[Path, Path]):
    """rollback to an id, label or step the history does not hold exits 2 (as cli.md says) and changes nothing."""
    _, state = agent
    before = _tree(state)
    del before[".resumable/lock"]  # taking the lock writes its holder there
    done = _cli(state, "rollback", "99")
    assert (2, "") == (done.returncode, done.stdout)
    assert "checkpoint 99 does not exist or is no longer kept (the latest is" in done.stderr
    done = _cli(state, "rollback", "nope")
    assert (2, "") == (done.returncode, done.stdout)
    assert "resumable: no checkpoint, snapshot label or step 'nope' in the history\n" == done.stderr
    after = _tree(state)
    del after[".resumable/lock"]
    assert before == after


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
    assert (2, "resumable: name the steps to reset, or pass --all (not both)\n") == (
        done.returncode,
        done.stderr,
    )


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


def test_clean_removes_row_chunks_left_by_completed_keyed_slots_only(tmp_path: Path):
    """Keyed slots too: the chunks of a completed slot go, those of a slot not completed stay."""
    state = tmp_path / "state"
    pipe = Pipeline("p", state_dir=state)

    @pipe.step(key="{n}")
    def part(n: int) -> int:
        return n

    with pipe:
        part(1)
    steps = state / ".resumable" / "batches" / "steps"
    done_chunk = steps / "part" / "1" / "chunks.log"
    open_chunk = steps / "part" / "2" / "chunks.log"
    for chunk in (done_chunk, open_chunk):
        chunk.parent.mkdir(parents=True)
        chunk.write_bytes(b"left by a killed process")
    dry = _cli(state, "clean", "--dry-run")
    assert "row chunk of completed step 'part/1'" in dry.stdout
    assert "part/2" not in dry.stdout
    assert 1 == dry.stdout.count("chunks.log")
    _cli(state, "clean")
    assert not done_chunk.exists()
    assert open_chunk.exists()


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


# --- read-only commands, no state, pipes, options (issue 10) -----------------------------

READ_ONLY = (
    ["status"],
    ["status", "--json"],
    ["history"],
    ["history", "--json"],
    ["show", "answer"],
    ["show", "page", "--key", "1", "--json"],
    ["why", "answer"],
    ["why", "page", "--key", "1", "--json"],
    ["verify"],
)


def _tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every file and directory under *root* with its mtime, size and mode."""
    out = {}
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        out[str(path.relative_to(root))] = (st.st_mtime_ns, st.st_size, st.st_mode)
    return out


def test_read_only_commands_change_nothing(agent: tuple[Path, Path], tmp_path: Path):
    """status, history, show, verify and export create, modify and lock nothing in the state."""
    _, state = agent
    before = _tree(state)
    exported = tmp_path / "copy.state"
    for args in [*READ_ONLY, ["export", "-o", str(exported)]]:
        done = _cli(state, *args)
        assert (0, "") == (done.returncode, done.stderr), args
    assert before == _tree(state)
    assert exported.stat().st_size > 0


def test_read_only_commands_create_no_state_directory(tmp_path: Path):
    """Run where there is no state, the read-only commands create neither ./state nor .resumable."""
    for args in (
        ["status"],
        ["history"],
        ["show", "answer"],
        ["why", "x"],
        ["verify"],
        ["export", "-o", "x"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "resumable", *args],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            check=False,
        )
        assert 3 == done.returncode, args
    assert [] == list(tmp_path.iterdir())


def test_read_only_commands_work_while_a_run_holds_the_lock(agent: tuple[Path, Path], tmp_path: Path):
    """While another process holds the run lock, every read-only command succeeds."""
    _, state = agent
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(state)], stdout=subprocess.PIPE, text=True)
    try:
        assert "holding" == holder.stdout.readline().strip()
        assert f"pid {holder.pid}" in _cli(state, "reset", "answer").stderr  # the lock is held
        for args in READ_ONLY:
            done = _cli(state, *args)
            assert (0, "") == (done.returncode, done.stderr), args
        assert "'BE BRIEF. V2'" in _cli(state, "show", "answer").stdout
        assert "running" == json.loads(_cli(state, "status", "--json").stdout)["status"]
        points = json.loads(_cli(state, "history", "--json").stdout)
        exported = tmp_path / "during.state"
        done = _cli(state, "export", "-o", str(exported))
        assert (0, "") == (done.returncode, done.stderr)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # what was exported during the run is a state a run resumes from, with the same history
    other = tmp_path / "other"
    assert 0 == _cli(other, "import", str(exported)).returncode
    assert points == json.loads(_cli(other, "history", "--json").stdout)
    assert "'BE BRIEF. V2'" in _cli(other, "show", "answer").stdout


@pytest.mark.parametrize(
    "args",
    [
        ["status"],
        ["status", "--json"],
        ["history"],
        ["show", "answer"],
        ["why", "answer"],
        ["verify"],
        ["export", "-o", "out.state"],
        ["reset", "answer"],
        ["rollback", "1"],
        ["clean"],
    ],
)
def test_no_state_is_said_with_exit_3(tmp_path: Path, args: list[str]):
    """Where nothing has run, a command says "no state in DIR" on stderr and exits 3."""
    done = subprocess.run(
        [sys.executable, "-m", "resumable", *args], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    expected = f"resumable: no state in {tmp_path / 'state'} (nothing has run with this state directory)\n"
    assert (3, "", expected) == (done.returncode, done.stdout, done.stderr)
    assert [] == list(tmp_path.iterdir())


def test_a_file_as_state_directory_is_reported(tmp_path: Path):
    """--state-dir naming a file is a StateDirectoryError: exit 1, the path and the ways out."""
    path = tmp_path / "afile"
    path.write_text("not a directory")
    done = _cli(path, "status")
    assert 1 == done.returncode
    assert done.stderr.startswith(
        f"resumable: cannot use state directory {path}: it is a file, not a directory."
    )
    assert "RESUMABLE_DISABLE=1" in done.stderr


def _closed_early(*command: str) -> subprocess.CompletedProcess[str]:
    """Run *command* into a small pipe whose reader takes one line and goes away (`| head -1`)."""
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)  # so the output cannot all fit in the pipe
    proc = subprocess.Popen(command, stdout=write, stderr=subprocess.PIPE, text=True)
    os.close(write)
    with os.fdopen(read, "rb") as reader:
        first = reader.readline()
    err = proc.stderr.read()
    proc.stderr.close()
    return subprocess.CompletedProcess(command, proc.wait(), first.decode(), err)


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path):
    """`show big | head -1` and `history | head -1` exit 0 without a word on stderr."""
    state = tmp_path / "state"
    pipe = Pipeline("big", state_dir=state, keep_checkpoints=500)  # a long history to print

    @pipe.step
    def big() -> dict[str, list[str]]:
        return {f"k{i}": [f"{i}-{j}" * 500 for j in range(20)] for i in range(20)}

    @pipe.step(key="{n}")
    def many(n: int) -> int:
        return n

    with pipe:
        big()
        for n in range(300):
            many(n)
    cli = [sys.executable, "-m", "resumable", "--state-dir", str(state)]
    for args in (["show", "big"], ["show", "big", "--json"], ["history", "--limit", "500"]):
        done = _closed_early(*cli, *args)
        assert (0, "") == (done.returncode, done.stderr), args
        assert done.stdout.strip(), args
    assert 8192 < len(_cli(state, "history", "--limit", "500").stdout)  # twice what the pipe holds


def test_state_dir_before_or_after_the_command(agent: tuple[Path, Path], tmp_path: Path):
    """--state-dir works before and after the command; after it, it wins."""
    _, state = agent
    before = subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", str(state), "history", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    after = subprocess.run(
        [sys.executable, "-m", "resumable", "history", "--state-dir", str(state), "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    both = _cli(tmp_path / "elsewhere", "show", "answer", "--state-dir", str(state))
    assert (0, 0, 0) == (before.returncode, after.returncode, both.returncode)
    assert json.loads(before.stdout) == json.loads(after.stdout)
    assert 7 <= len(json.loads(after.stdout))
    assert "'BE BRIEF. V2'" in both.stdout


def test_names_outside_the_state_are_refused(agent: tuple[Path, Path], tmp_path: Path):
    """reset and show resolve names against the state: `../precious` is a usage error, untouched."""
    _, state = agent
    precious = tmp_path / "precious.msgpack"
    precious.write_bytes(b"keep me")
    outputs = {p: p.read_bytes() for p in state.rglob("*.msgpack")}
    known = "steps answer, page, prompt, verdict; slots page/1"
    for name in ("../precious", "page/../../precious", "answer/x"):
        done = _cli(state, "reset", name)
        expected = (
            f"resumable: nothing to reset: no step, slot or batch {name!r} in {state} (known: {known})\n"
        )
        assert (2, expected) == (done.returncode, done.stderr), name
        done = _cli(state, "show", name)
        expected = f"resumable: no stored output for {name!r} in {state} (it holds {known})\n"
        assert (2, expected) == (done.returncode, done.stderr), name
    assert 2 == _cli(state, "show", "page", "--key", "../../precious").returncode
    assert b"keep me" == precious.read_bytes()
    assert outputs == {p: p.read_bytes() for p in state.rglob("*.msgpack")}
    pipe = Pipeline("p", state_dir=state)
    with pytest.raises(UsageError, match=r"no step, slot or batch '\.\./precious'"):
        pipe.reset("../precious")
    assert b"keep me" == precious.read_bytes()


# --- stray temporary files (issue 10 point 9) ---------------------------------------------


def test_rollback_leaves_no_temporary_file(tmp_path: Path):
    """Edit a step, run, `resumable rollback s`: no temporary file is left in the state."""
    script = tmp_path / "p.py"
    source = (
        "from resumable import step\n"
        "@step\ndef s() -> str:\n    return 'v' + '1'\n"
        "@step\ndef t(x: str) -> str:\n    return x + '!'\n"
        "print(t(s()))\n"
    )
    script.write_text(source)
    run = [sys.executable, str(script)]
    outputs = [subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=True).stdout]
    script.write_text(source.replace("'v' + '1'", "'w' + '1'"))
    outputs.append(subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=True).stdout)
    state = tmp_path / "state"
    done = _cli(state, "rollback", "s")
    assert (0, "") == (done.returncode, done.stderr)
    assert [] == sorted(str(p) for p in state.rglob("*.tmp"))
    outputs.append(subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, check=True).stdout)
    done = _cli(state, "rollback", "s")  # the version in place is the one restored
    assert (0, "") == (done.returncode, done.stderr)
    assert [] == sorted(str(p) for p in state.rglob("*.tmp"))
    assert "nothing to clean" == _cli(state, "clean").stdout.strip()
    assert ["v1!\n", "w1!\n", "w1!\n"] == outputs
    assert "'v1'" in _cli(state, "show", "s").stdout


def test_clean_dry_run_lists_exactly_what_clean_removes(agent: tuple[Path, Path]):
    """On a state with temp files, a removed step and old versions, both lists are the same."""
    script, state = agent
    script.write_text(AGENT.replace("@pipe.step\ndef verdict", "def verdict"))
    subprocess.run([sys.executable, str(script), str(state), "v3"], check=True)
    temps = [
        state / ".answer.msgpack.999-1-0.tmp",
        state / ".resumable" / "objects" / ".0123.msgpack.999-1-1.tmp",
        state / "page" / ".1.msgpack.999-1-2.tmp",
    ]
    for path in temps:
        path.write_bytes(b"left by a killed writer")
    args = ("clean", "--older-than", "0s", "--keep", "1")
    dry = _cli(state, *args, "--dry-run")
    assert (0, "") == (dry.returncode, dry.stderr)
    assert all(p.exists() for p in temps)
    real = _cli(state, *args)
    assert (0, "") == (real.returncode, real.stderr)
    would = [line.removeprefix("would remove ") for line in dry.stdout.splitlines()]
    removed = [line.removeprefix("removed ") for line in real.stdout.splitlines()]
    assert removed == would
    listed = {line.split(" (", 1)[0] for line in removed[:-1]}
    assert {str(p.relative_to(state)) for p in temps} <= listed
    assert "verdict.msgpack" in listed
    assert any(key.startswith(".resumable/objects/") and not key.endswith(".tmp") for key in listed)
    assert not any(p.exists() for p in temps)
    assert "nothing to clean" == _cli(state, *args, "--dry-run").stdout.strip()


WHY = """
import sys
from resumable import step

RATE = 3
LOCK = __import__("threading").Lock()


def helper(x):
    return x * RATE


@step(version=sys.argv[1] if sys.argv[1] != "-" else None)
def price(x: int) -> int:
    with LOCK:
        return helper(x)


@step(key="{n}")
def page(n: int) -> int:
    return n + 1


print(price(2), page(1), page(2))
"""


def test_why_explains_each_kind_of_rerun(tmp_path: Path):
    """Edit a helper, a value, pin a version: `why` names what changed, with a diff."""
    script = tmp_path / "p.py"
    script.write_text(WHY)
    state = tmp_path / "state"

    def run(version: str = "-") -> None:
        subprocess.run([sys.executable, str(script), version], cwd=tmp_path, check=True, capture_output=True)

    run()
    first = _cli(state, "why", "price")
    assert first.stdout.startswith("price: ran (run 1, 20")
    assert ": new\n" in first.stdout
    assert "not part of its identity (cannot be fingerprinted): LOCK (_thread.lock)" in first.stdout
    script.write_text(WHY.replace("RATE = 3", "RATE = 4"))
    run()
    out = _cli(state, "why", "price").stdout
    assert "price: ran (run 2, " in out
    assert "code changed (const RATE)" in out
    assert "  value RATE: 3 -> 4" in out
    script.write_text(WHY.replace("RATE = 3", "RATE = 4").replace("x * RATE", "x * RATE + 0"))
    run()
    out = _cli(state, "why", "price").stdout
    assert "  function helper changed" in out
    assert "    -    return x * RATE\n    +    return x * RATE + 0" in out
    run("1")  # pinning a version: runs once (the identity is now the version) ...
    script.write_text(WHY.replace("x * RATE", "x * RATE * 1"))
    run("1")  # ... and then keeps the output despite an edit
    out = _cli(state, "why", "price").stdout
    assert "price: skipped (run 5, " in out
    assert "its code changed, but its version is pinned" in out
    assert "value RATE: 3 -> 4" not in out  # compared with the code that made the output
    assert "  function helper changed" in out
    assert "    +    return x * RATE * 1" in out


def test_why_picks_slots_and_prints_json(tmp_path: Path):
    script = tmp_path / "p.py"
    script.write_text(WHY)
    state = tmp_path / "state"
    subprocess.run([sys.executable, str(script), "-"], cwd=tmp_path, check=True, capture_output=True)
    both = _cli(state, "why", "page").stdout.splitlines()
    assert [line.split(":")[0] for line in both] == ["page/1", "page/2"]
    assert ["page/2"] == [
        d["slot"] for d in json.loads(_cli(state, "why", "page", "--key", "2", "--json").stdout)
    ]
    assert _cli(state, "why", "page/1").stdout.startswith("page/1: ran (run 1")
    done = _cli(state, "why", "nope")
    assert (2, "") == (done.returncode, done.stdout)
    assert "no run has called 'nope'" in done.stderr
    assert "(see `resumable status`)" in done.stderr
    listed = _cli(state, "status")  # the hint works: it names the steps that ran
    assert 0 == listed.returncode
    assert "page" in listed.stdout


def test_a_code_record_that_could_not_be_written_is_written_when_the_code_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record `why` diffs against is not worth failing a step for, and is not given up either."""
    from resumable._stores._local import LocalStore

    pipe = Pipeline("codes", state_dir=tmp_path / "state")

    @pipe.step(key="{n}")
    def page(n: int) -> int:
        return n

    real_write = LocalStore.write
    refused: list[str] = []

    def full_once(self: LocalStore, key: str, chunks: Any, *, durable: bool) -> None:
        if key.startswith(".resumable/code/") and not refused:
            refused.append(key)
            raise OSError(28, "No space left on device")
        real_write(self, key, chunks, durable=durable)

    monkeypatch.setattr(LocalStore, "write", full_once)
    with pipe:
        page(1)
        assert [] == list((tmp_path / "state").glob(".resumable/code/*.json"))
        page(2)
    assert [Path(refused[0]).name] == [p.name for p in (tmp_path / "state").glob(".resumable/code/*.json")]


def test_a_code_record_is_written_again_into_a_new_state_in_the_same_process(tmp_path: Path) -> None:
    """A state directory removed and made again by the same process gets the record `why` needs."""
    import shutil

    state = tmp_path / "state"
    for _ in range(2):
        pipe = Pipeline("codes", state_dir=state)

        @pipe.step
        def total(n: int) -> int:
            return n

        with pipe:
            total(1)
        assert 1 == len(list(state.glob(".resumable/code/*.json")))
        shutil.rmtree(state)
