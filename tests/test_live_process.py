"""
A long-lived process (a notebook, a service): lazy outputs after their run, pipelines that
are dropped, a reset from the process that holds the run, files rewritten in place, and the
``.gitignore`` of a new state directory.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import tracemalloc
import weakref
from pathlib import Path

import pytest

from resumable import Pipeline, ResumableError, ResumableWarning, StateLockedError
from resumable._cli import main as cli
from resumable._exit import exit_hooks
from resumable._files import FileDigests
from resumable._stores._memory import MemoryStore

ROOT = Path(__file__).resolve().parent.parent


def _python(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None, **kw: object):
    """Run *script* in a fresh interpreter that imports this checkout of resumable."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        cwd=cwd,
        env=full_env,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


def _events(state: Path) -> list[str]:
    return [json.loads(line)["event"] for line in (state / "events.jsonl").read_text().splitlines()]


def _two_steps(pipe: Pipeline, calls: list[str]) -> None:
    @pipe.step
    def a() -> list[int]:
        calls.append("a")
        return [1, 2, 3]

    @pipe.step
    def b(a: list[int]) -> int:
        calls.append("b")
        return sum(a)


# 7. nothing writes the state without its lock ---------------------------------------------


def test_a_lazy_output_removed_after_its_run_closed_is_an_error_not_a_write(tmp_path: Path):
    """run.outputs["b"] after `b` was reset, with the run closed: a clear error, nothing written."""
    state = tmp_path / "state"
    pipe = Pipeline("lazy", state_dir=state)
    calls: list[str] = []
    _two_steps(pipe, calls)
    pipe.run()
    run = pipe.run()  # both skipped: their outputs are loaded lazily
    assert ["a", "b"] == run.skipped
    pipe.reset("b")
    events = _events(state)
    with pytest.raises(ResumableError, match=r"step 'b'.*run the pipeline again") as info:
        run.outputs["b"]
    assert str(state) in str(info.value)
    assert ["a", "b"] == calls  # not recomputed
    assert not (state / "b.msgpack").exists()  # nothing written
    assert events == _events(state)  # and nothing recorded
    assert [1, 2, 3] == run.outputs["a"]  # an output still there loads as before


def test_asking_whether_run_outputs_holds_a_step_loads_nothing(tmp_path: Path):
    """`"b" in run.outputs` answers from the names: no file read, so a removed file is no error."""
    state = tmp_path / "state"
    pipe = Pipeline("lazy", state_dir=state)
    _two_steps(pipe, [])
    pipe.run()
    run = pipe.run()
    pipe.reset("b")
    assert "b" in run.outputs
    assert "c" not in run.outputs


def test_a_lazy_output_replaced_after_its_run_closed_is_not_returned(tmp_path: Path):
    """A later run that stored another value in the slot: the earlier run's outputs do not return it."""
    state = tmp_path / "state"
    pipe = Pipeline("lazy", state_dir=state)

    @pipe.step
    def a() -> int:
        return 1

    @pipe.step
    def b(a: int, scale: int) -> int:
        return a * scale

    pipe.run(scale=2)
    first = pipe.run(scale=2)
    assert ["b"] == [s for s in first.skipped if s == "b"]
    assert 30 == pipe.run(scale=30).outputs["b"]
    with pytest.raises(ResumableError, match="step 'b'"):
        first.outputs["b"]


def test_a_lazy_output_missing_inside_its_open_run_is_recomputed_with_its_events(tmp_path: Path):
    """While the run is open it holds the lock: the output is computed again, and recorded."""
    state = tmp_path / "state"
    pipe = Pipeline("lazy", state_dir=state)
    calls: list[str] = []
    _two_steps(pipe, calls)
    pipe.run()
    with pipe:
        run = pipe.run()
        pipe.reset("b")
        assert 6 == run.outputs["b"]
    assert ["a", "b", "b"] == calls
    assert (state / "b.msgpack").exists()
    assert ["step_started", "step_completed"] == _events(state)[-3:-1]


def test_a_lazy_output_is_not_written_while_another_process_holds_the_state(tmp_path: Path):
    """Another process runs the pipeline: reading a removed lazy output raises and writes nothing."""
    state = tmp_path / "state"
    pipe = Pipeline("lazy", state_dir=state)
    calls: list[str] = []
    _two_steps(pipe, calls)
    pipe.run()
    run = pipe.run()
    pipe.reset("b")
    holder = _python(
        f"""
        import sys
        from resumable import Pipeline
        with Pipeline("other", state_dir={str(state)!r}):
            print("holding", flush=True)
            sys.stdin.readline()
        """,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert "holding\n" == holder.stdout.readline()
        with pytest.raises(ResumableError, match="step 'b'"):
            run.outputs["b"]
        assert not (state / "b.msgpack").exists()
    finally:
        holder.communicate("\n", timeout=60)
    assert 0 == holder.returncode
    assert ["a", "b"] == calls


# 9. a dropped pipeline is garbage-collected ------------------------------------------------


def _serve_one(i: int, payload: int = 1 << 20) -> bytes:
    """A request handler: its own pipeline, in its own memory store, used in a `with` block."""
    with Pipeline(f"request-{i}", store=f"memory://request-{i}") as pipe:

        @pipe.step
        def answer(n: int) -> bytes:
            return bytes([n % 256]) * payload

        return answer(i)[:1]


def test_a_dropped_pipeline_and_its_steps_are_collected(tmp_path: Path):
    """Nothing in the library keeps a pipeline alive once the caller drops it and its steps."""
    pipe = Pipeline("dropped", state_dir=tmp_path / "state")

    @pipe.step
    def f(x: int) -> int:
        return x + 1

    with pipe:
        assert 2 == f(1)
    ref = weakref.ref(pipe)
    del pipe, f
    gc.collect()
    assert ref() is None


def test_a_dropped_pipeline_frees_its_named_memory_store():
    """memory://name lives while a pipeline uses it; the last one dropped, a new one starts empty."""
    _serve_one(7, payload=10)
    gc.collect()
    with Pipeline("again", store="memory://request-7") as pipe:
        assert [] == pipe.status().completed_steps
    # while a pipeline holds it, the same name is the same store
    keep = Pipeline("keep", store="memory://shared")
    keep.store.write("x", [b"1"], durable=False)
    assert b"1" == bytes(Pipeline("other", store="memory://shared").store.read("x"))
    del keep
    gc.collect()
    with pytest.raises(FileNotFoundError):
        Pipeline("new", store="memory://shared").store.read("x")


def test_a_dropped_script_mode_pipeline_closes_its_run(tmp_path: Path):
    """A pipeline whose steps ran outside `with` closes its run when dropped, freeing the lock."""
    state = tmp_path / "state"
    pipe = Pipeline("script", state_dir=state)

    @pipe.step
    def f() -> int:
        return 1

    assert 1 == f()  # opens a run that lasts until the pipeline goes
    with pytest.raises(StateLockedError):
        Pipeline("other", state_dir=state).__enter__()
    ref = weakref.ref(pipe)
    del pipe, f
    gc.collect()
    assert ref() is None
    with Pipeline("other", state_dir=state) as other:
        assert ["f"] == other.status().completed_steps
    finished = [
        json.loads(line).get("status")
        for line in (state / "events.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "run_finished"
    ]
    assert ["completed", "completed"] == finished  # closed when dropped, not left "running"


def test_a_service_making_a_pipeline_per_request_does_not_grow():
    """200 requests, each with its own pipeline and a 1 MB output: memory stays flat."""
    for i in range(5):  # warm up: imports, caches
        _serve_one(i)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            _serve_one(1000 + i)
        gc.collect()  # a pipeline and its steps refer to each other: the collector frees them
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20 * (1 << 20), f"grew by {grown / (1 << 20):.1f} MB over 200 requests"
    assert not [name for name in MemoryStore._named if name.startswith("request-1")]


# 10. a reset from the process that holds the run ------------------------------------------


def test_a_reset_from_the_process_holding_the_default_run_resets_it(tmp_path: Path):
    """A notebook: a module-level step ran (the default run is open); Pipeline().reset("f") works."""
    script = """
        from pathlib import Path
        from resumable import Pipeline, step

        @step
        def f() -> int:
            with open("calls.txt", "a") as calls:
                calls.write("f\\n")
            return len(Path("calls.txt").read_text().split())

        print(f(), f())
        print(Pipeline().reset("f"))
        print(f(), f())
    """
    proc = _python(script, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    assert 0 == proc.returncode, err
    assert ["1 1", "['f']", "2 2"] == out.splitlines()
    events = _events(tmp_path / "state")
    assert ["reset"] == [
        json.loads(line)["reason"]
        for line in (tmp_path / "state" / "events.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "step_started"
    ][1:]
    assert 1 == events.count("run_started")


def test_a_reset_through_another_pipeline_object_of_this_process(tmp_path: Path):
    """Another Pipeline object over the same directory borrows the open run: reset, rollback, CLI."""
    state = tmp_path / "state"
    pipe = Pipeline("notebook", state_dir=state)
    calls: list[int] = []

    @pipe.step
    def f() -> int:
        calls.append(1)
        return len(calls)

    @pipe.step
    def g() -> int:
        return 10

    try:
        assert 1 == f()
        assert 10 == g()
        assert ["f", "g"] == Pipeline(state_dir=state).reset("f")
        assert 2 == f()
        assert 0 == cli(["reset", "f", "--state-dir", str(state)])  # the CLI, in this process
        assert 3 == f()
        assert 3 == f()
        other = Pipeline(state_dir=state)
        assert "mark" == other.snapshot("mark").label
        assert "mark" == other.checkpoints()[-1].label
        assert "f.msgpack" in other.save_state()["files"]
    finally:
        exit_hooks.forget(pipe)
        pipe._close("completed", None)
    assert [1, 1, 1] == calls


def test_the_command_line_in_another_process_is_refused_while_a_run_holds_the_state(tmp_path: Path):
    """A live run elsewhere: `resumable reset` is refused, naming the holder and what to do."""
    state = tmp_path / "state"
    holder = _python(
        f"""
        import sys
        from resumable import Pipeline
        pipe = Pipeline("notebook", state_dir={str(state)!r})

        @pipe.step
        def f() -> int:
            return 1

        f()
        print("holding", flush=True)
        sys.stdin.readline()
        """,
        cwd=tmp_path,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert "holding\n" == holder.stdout.readline()
        proc = _python(
            "from resumable._cli import main; raise SystemExit(main())",
            "reset",
            "f",
            "--state-dir",
            str(state),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = proc.communicate(timeout=120)
        assert 1 == proc.returncode, out
        assert f"pid {holder.pid}" in err
        assert "Pipeline().reset" in err
    finally:
        holder.communicate("\n", timeout=60)
    assert (state / "f.msgpack").exists()


# 11. files rewritten in place --------------------------------------------------------------


def _rewrite_keeping_stat(path: Path, data: bytes) -> None:
    """Rewrite *path* in place (same inode and size) and put its mtime back, as `cp -p` does."""
    st = path.stat()
    assert len(data) == st.st_size
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (st.st_size, st.st_mtime_ns, st.st_ino) == (after.st_size, after.st_mtime_ns, after.st_ino)


def _old(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 3600 * 1_000_000_000))


def test_a_file_rewritten_with_its_mtime_kept_is_read_again(tmp_path: Path):
    """A step of a Path argument reruns when the file's contents change, whatever its mtime says."""
    source = tmp_path / "input.txt"
    source.write_bytes(b"aaaa\n")
    _old(source)
    pipe = Pipeline("files", state_dir=tmp_path / "state")

    @pipe.step
    def read(path: Path) -> bytes:
        return path.read_bytes()

    with pipe:  # a notebook cell, then another after the file changed
        assert b"aaaa\n" == read(source)
    _rewrite_keeping_stat(source, b"bbbb\n")
    with pipe:
        assert b"bbbb\n" == read(source)


def test_the_stat_cache_keys_a_file_on_its_ctime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A digest cached for a file is not used once the file's ctime moved (size, mtime, inode kept)."""
    monkeypatch.setattr("resumable._files._RACY_NS", 0)  # cache even a file written just now
    source = tmp_path / "input.txt"
    source.write_bytes(b"aaaa")
    _old(source)
    cache = FileDigests()
    first = cache.digest(source)
    assert cache._cache  # cached
    ctime = source.stat().st_ctime_ns
    while source.stat().st_ctime_ns == ctime:  # the file system's clock ticks in steps
        _rewrite_keeping_stat(source, b"bbbb")
    assert first != cache.digest(source)


def test_a_file_rewritten_in_place_between_processes_is_read_again(tmp_path: Path):
    """`rsync -t --inplace` between two runs: the next process sees the new contents."""
    source = tmp_path / "input.txt"
    source.write_bytes(b"one\n")
    _old(source)
    script = f"""
        from pathlib import Path
        from resumable import step

        @step
        def read(path: Path) -> str:
            return path.read_text()

        print(read(Path({str(source)!r})).strip())
    """
    outputs = []
    for data in (b"one\n", b"two\n"):
        if data != b"one\n":
            _rewrite_keeping_stat(source, data)
        proc = _python(script, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = proc.communicate(timeout=120)
        assert 0 == proc.returncode, err
        outputs.append(out.strip())
    assert ["one", "two"] == outputs


# 12. the .gitignore of a new state directory ----------------------------------------------


def test_a_new_state_directory_has_a_gitignore(tmp_path: Path):
    """`*` in <state>/.gitignore; it is no step file: status, verify, clean, export, import ignore it."""
    state = tmp_path / "state"
    pipe = Pipeline("git", state_dir=state)
    calls: list[str] = []
    _two_steps(pipe, calls)
    pipe.run()
    ignore = (state / ".gitignore").read_text()
    assert "*" in ignore.splitlines()
    assert [".gitignore"] == [k for k in os.listdir(state) if k.startswith(".git")]
    assert ["a", "b"] == pipe.status().completed_steps
    assert 0 == cli(["verify", "--state-dir", str(state)])
    assert 0 == cli(["clean", "--dry-run", "--older-than", "0s", "--state-dir", str(state)])
    saved = pipe.save_state()
    assert ".gitignore" not in saved["files"]
    assert 0 == cli(["export", "-o", str(tmp_path / "state.msgpack"), "--state-dir", str(state)])
    assert 0 == cli(["import", str(tmp_path / "state.msgpack"), "--state-dir", str(tmp_path / "copy")])
    assert (tmp_path / "copy" / ".gitignore").exists()
    (state / "manifest.json").unlink()
    (state / "events.jsonl").unlink()  # the manifest is rebuilt from the step files
    with pytest.warns(ResumableWarning, match="2 step file"), Pipeline("git", state_dir=state) as again:
        assert ["a", "b"] == sorted(again.status().steps)
    pipe.load_state(saved)
    assert (state / ".gitignore").exists()
    assert ["a", "b"] == calls


def test_an_existing_directory_gets_no_gitignore(tmp_path: Path):
    """Only a directory resumable creates is ignored: an existing one is the user's to manage."""
    state = tmp_path / "state"
    state.mkdir()
    with Pipeline("git", state_dir=state) as pipe:

        @pipe.step
        def f() -> int:
            return 1

        f()
    assert not (state / ".gitignore").exists()
