"""Pipelines: the run lifecycle, the runner, status and reset."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

import resumable._codec
import resumable._session
from resumable import (
    Manifest,
    Pipeline,
    ResumableError,
    StateLockedError,
    StepDefinitionError,
    UsageError,
    step,
)
from resumable._context import current_pipeline, default_pipeline


def _etl(pipe: Pipeline, calls: list[str]):
    @pipe.step
    def download(url: str) -> str:
        calls.append("download")
        return f"data from {url}"

    @pipe.step
    def parse(download: str) -> list[str]:
        calls.append("parse")
        return download.split()

    @pipe.step
    def count(parse: list[str], scale: int = 1) -> int:
        calls.append("count")
        return len(parse) * scale

    return download, parse, count


def test_run_passes_outputs_by_parameter_name(pipe: Pipeline):
    """A parameter named like an earlier step receives its output; others come from inputs."""
    calls: list[str] = []
    _etl(pipe, calls)
    run = pipe.run(url="x")
    assert ["download", "parse", "count"] == run.executed
    assert [] == run.skipped
    assert {"download": "data from x", "parse": ["data", "from", "x"], "count": 3} == dict(run.outputs)
    assert 3 == pipe.run(url="x", scale=1).outputs["count"]
    run = pipe.run(url="x", scale=2)
    assert ["count"] == run.executed
    assert ["download", "parse"] == run.skipped
    assert 6 == run.outputs["count"]
    assert ["download", "parse", "count", "count"] == calls


def test_run_loads_skipped_outputs_only_when_needed(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """Resuming at the last step deserializes only what that step needs."""
    calls: list[str] = []
    _etl(pipe, calls)
    pipe.run(url="x")
    decoded: list[int] = []
    real_decode = resumable._codec.Verified.decode

    def counting_decode(*args, **kwargs):
        decoded.append(1)
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(resumable._codec.Verified, "decode", counting_decode)
    run = pipe.run(url="x")
    assert [] == decoded  # everything skipped: nothing loaded
    run = pipe.run(url="x", scale=3)
    assert ["count"] == run.executed
    assert [1] == decoded  # only parse's output, which count needs
    assert "data from x" == run.outputs["download"]  # loaded on access
    assert [1, 1] == decoded


def test_a_skip_is_logged_once_even_when_its_output_is_loaded_later(
    pipe: Pipeline, caplog: pytest.LogCaptureFixture
):
    """A skipped step whose output a running step then loads is one skip: one log line."""

    @pipe.step
    def a() -> int:
        return 1

    @pipe.step
    def b(a: int, n: int) -> int:
        return a + n

    pipe.run(n=1)
    with caplog.at_level(logging.INFO, logger="resumable"):
        assert 3 == pipe.run(n=2).outputs["b"]
    assert 1 == sum("step 'a' skipped" in r.getMessage() for r in caplog.records)


def test_run_identical_output_stops_propagation(pipe: Pipeline):
    """If a rerun step produces the same output, the steps after it are skipped."""
    calls: list[str] = []

    @pipe.step
    def source(n: int) -> int:
        calls.append("source")
        return n % 2

    @pipe.step
    def expensive(source: int) -> int:
        calls.append("expensive")
        return source * 100

    pipe.run(n=1)
    run = pipe.run(n=3)  # source reruns (inputs changed) but returns the same value
    assert (["source"], ["expensive"]) == (run.executed, run.skipped)


def test_run_errors(pipe: Pipeline):
    """Missing sources and unused inputs are reported before running anything."""
    calls: list[str] = []
    _etl(pipe, calls)
    with pytest.raises(StepDefinitionError, match="needs 'url'"):
        pipe.run()
    with pytest.raises(StepDefinitionError, match="'urll'"):
        pipe.run(urll="x")
    assert [] == calls


def test_run_async_steps(pipe: Pipeline):
    """The runner runs async steps too."""

    @pipe.step
    async def fetch(n: int) -> int:
        await asyncio.sleep(0)
        return n + 1

    @pipe.step
    def show(fetch: int) -> str:
        return f"<{fetch}>"

    assert "<2>" == pipe.run(n=1).outputs["show"]
    assert ["fetch", "show"] == pipe.run(n=1).skipped


def test_run_damaged_upstream_is_recomputed(pipe: Pipeline, state_dir: Path):
    """A skipped output found damaged when it is finally loaded is recomputed, with a warning."""
    calls: list[str] = []
    _etl(pipe, calls)
    pipe.run(url="x")
    path = state_dir / "parse.msgpack"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(resumable.ResumableWarning, match="parse"):
        run = pipe.run(url="x", scale=2)
    assert 6 == run.outputs["count"]
    assert ["download", "parse", "count", "parse", "count"] == calls


def test_with_block_scopes_one_run(pipe: Pipeline, state_dir: Path):
    """A with block opens one run and closes it as completed, counting runs."""

    @pipe.step
    def one() -> int:
        return 1

    for _ in range(3):
        with pipe as entered:
            assert pipe is entered
            assert pipe is current_pipeline()
            one()
            assert "running" == json.loads((state_dir / "manifest.json").read_text())["status"]
    manifest = json.loads((state_dir / "manifest.json").read_text())
    assert ("completed", 3, None) == (manifest["status"], manifest["runs"], manifest["current_step"])


def test_with_block_status_on_exceptions(pipe: Pipeline):
    """The run closes as failed on an error and interrupted on Ctrl-C."""
    with pytest.raises(ZeroDivisionError), pipe:
        _ = 1 / 0
    status = pipe.status()
    assert "failed" == status.status
    assert "ZeroDivisionError" == status.error.type
    assert status.error.step is None
    with pytest.raises(KeyboardInterrupt), pipe:
        raise KeyboardInterrupt
    assert "interrupted" == pipe.status().status


def test_unbound_steps_run_in_the_entered_pipeline(tmp_path: Path):
    """Module-level steps store into the pipeline of the innermost with block."""
    calls = []

    @step(name="unbound_square")
    def square(x: int) -> int:
        calls.append(x)
        return x * x

    first = Pipeline(state_dir=tmp_path / "a")
    second = Pipeline(state_dir=tmp_path / "b")
    with first:
        square(3)
        with second:
            square(3)
        square(3)
    assert [3, 3] == calls
    assert (tmp_path / "a" / "unbound_square.msgpack").exists()
    assert (tmp_path / "b" / "unbound_square.msgpack").exists()
    assert default_pipeline() is current_pipeline()


def test_unbound_step_clashing_with_bound_step(pipe: Pipeline):
    """An unbound step cannot run in a pipeline that has its own step of that name."""

    @step(name="clash")
    def clash_a() -> int:
        return 1

    @pipe.step(name="clash")
    def clash_b() -> int:
        return 2

    with pipe, pytest.raises(StepDefinitionError, match="own step"):
        clash_a()


def test_status_is_a_copy(pipe: Pipeline):
    """status() returns a Manifest snapshot that callers may modify freely."""

    @pipe.step
    def f() -> int:
        return 1

    with pipe:
        f()
        snapshot = pipe.status()
        snapshot.completed_steps.append("bogus")
        assert ["f"] == pipe.status().completed_steps
    assert isinstance(snapshot, Manifest)
    assert 1 == pipe.status().runs


def test_reset_downstream_and_all(pipe: Pipeline, state_dir: Path):
    """reset forgets a step and what completed after it; reset() forgets everything."""
    calls: list[str] = []
    _etl(pipe, calls)
    pipe.run(url="x")
    assert ["parse", "count"] == pipe.reset("parse")
    assert {"download.msgpack"} == {p.name for p in state_dir.glob("*.msgpack")}
    run = pipe.run(url="x")
    assert (["parse", "count"], ["download"]) == (run.executed, run.skipped)
    assert ["parse"] == pipe.reset("parse", downstream=False)
    assert sorted(["download", "count"]) == sorted(pipe.reset())
    assert [] == list(state_dir.glob("*.msgpack"))
    assert {"reset"} == {r.status for r in pipe.status().steps.values()}
    with pytest.raises(UsageError) as info:
        pipe.reset("nope")
    expected = f"nothing to reset: no step, slot or batch 'nope' in {state_dir} (known: steps count, download, parse)"
    assert expected == str(info.value)


def test_reset_keyed_slots(pipe: Pipeline):
    """A step name resets all its slots; a slot id resets one."""

    @pipe.step(key="{n}")
    def page(n: int) -> int:
        return n

    with pipe:
        for n in range(3):
            page(n)
    assert ["page/1"] == pipe.reset("page/1", downstream=False)
    assert ["page/0", "page/2"] == pipe.reset("page")


def test_lock_in_process(pipe: Pipeline, state_dir: Path):
    """
    A second pipeline on the same directory cannot open a run of its own (StateLockedError
    naming the holder); a reset through it changes the state through the open run.
    """
    import os

    with pipe:
        other = Pipeline(state_dir=state_dir)
        with pytest.raises(StateLockedError, match=f"pid {os.getpid()}") as info:
            other.__enter__()
        assert os.getpid() == info.value.holder["pid"]
        assert [] == other.reset()
    with other:
        pass


def test_state_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Without state_dir, $RESUMABLE_STATE_DIR is used, else ./state."""
    monkeypatch.setenv("RESUMABLE_STATE_DIR", str(tmp_path / "env-state"))
    assert str(tmp_path / "env-state") == Pipeline().store.location
    monkeypatch.delenv("RESUMABLE_STATE_DIR")
    monkeypatch.chdir(tmp_path)
    assert str(tmp_path / "state") == Pipeline().store.location


def test_memory_store_is_shared_by_name():
    """memory://name is one store per name within a process."""
    a = Pipeline(store="memory://shared-test")

    @a.step
    def f() -> int:
        return 5

    with a:
        f()
    b = Pipeline(store="memory://shared-test")
    assert ["f"] == b.status().completed_steps
    assert [] == Pipeline(store="memory://").status().completed_steps


def test_bad_pipeline_options(tmp_path: Path):
    """Contradictory or invalid options fail at construction."""
    with pytest.raises(UsageError, match="not both"):
        Pipeline(state_dir=tmp_path, store="memory://")
    with pytest.raises(UsageError, match="keep_checkpoints") as info:
        Pipeline(keep_checkpoints=-1)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ResumableError, match="cannot open store"):
        _ = Pipeline(store="nosuch://x").store


def test_secret_authenticates_files(state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """With a secret, files from another key are refused and recomputed."""
    calls = []

    def make(secret: str | None) -> Pipeline:
        pipe = Pipeline(state_dir=state_dir, secret=secret)

        @pipe.step
        def f() -> int:
            calls.append(1)
            return 1

        return pipe

    pipe = make("k1")
    with pipe:
        pipe._steps["f"].fn()
    with make("k1") as p:
        p._steps["f"].call((), {})
        p._steps["f"].call((), {})
    assert 2 == len(calls)
    monkeypatch.setenv("RESUMABLE_SECRET", "k2")
    with pytest.warns(resumable.ResumableWarning) as caught, make(None) as p:
        p._steps["f"].call((), {})
    assert 3 == len(calls)
    messages = " ".join(str(w.message) for w in caught)
    assert "manifest.json was not authentic" in messages
    assert "not authentic (written without the secret" in messages
    assert "f.msgpack cannot be used (authentication failed" in messages


def test_run_refuses_an_output_header_that_fails_authentication(state_dir: Path):
    """
    With a secret, the runner trusts the header of an output it does not load only if its
    MAC checks: a header written with another key is damage (reason corrupt), recomputed.
    """
    other = Pipeline(state_dir=state_dir, secret="k2")
    _etl(other, [])
    other.run(url="x")
    calls: list[str] = []
    pipe = Pipeline(state_dir=state_dir, secret="k1")
    _etl(pipe, calls)
    with pytest.warns(resumable.ResumableWarning) as caught:
        run = pipe.run(url="x")
    assert ["download", "parse", "count"] == calls
    assert 3 == run.outputs["count"]
    messages = " ".join(str(w.message) for w in caught)
    assert "download.msgpack cannot be used (authentication failed" in messages
    events = [json.loads(line) for line in (state_dir / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["event"] == "step_started" and e["slot"] == "download"]
    assert "corrupt" == started[-1]["reason"]


def test_manifest_and_events_content(pipe: Pipeline, state_dir: Path):
    """manifest.json holds the documented keys; events.jsonl tells the history."""

    @pipe.step
    def f(x: int) -> int:
        return x

    with pipe:
        f(1)
    manifest = json.loads((state_dir / "manifest.json").read_text())
    for key in (
        "format",
        "workflow_id",
        "pipeline",
        "status",
        "current_step",
        "completed_steps",
        "last_update",
        "runs",
        "steps",
        "error",
        "batches",
    ):
        assert key in manifest
    rec = manifest["steps"]["f"]
    assert {
        "status",
        "fingerprint",
        "reason",
        "started_at",
        "finished_at",
        "duration_s",
        "attempts",
        "bytes",
    } <= set(rec)
    assert rec["bytes"] == (state_dir / "f.msgpack").stat().st_size
    events = [json.loads(line)["event"] for line in (state_dir / "events.jsonl").read_text().splitlines()]
    assert ["run_started", "step_started", "step_completed", "run_finished"] == events


def test_state_written_with_a_secret_opens_without_one(state_dir: Path):
    """Signed state read without the secret is used as is (it cannot be checked): no damage reported."""
    calls = []
    with Pipeline(state_dir=state_dir, secret="k") as pipe:

        @pipe.step
        def g() -> int:
            calls.append(1)
            return 1

        g()
    with Pipeline(state_dir=state_dir) as other:
        other.step(g.__wrapped__)()
        assert ["g"] == other.status().completed_steps
    assert [1] == calls


def test_runner_and_direct_calls_agree_on_small_outputs(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """
    After run(), direct calls with the outputs are skips (a short str equal by content, a list
    as the stored output it is), and the runner needs no load.
    """
    calls: list[str] = []
    download, parse, count = _etl(pipe, calls)
    pipe.run(url="x")
    assert parse.is_cached("data from x")
    with pipe:
        assert count.is_cached(parse(download("x")))
    assert ["download", "parse", "count"] == calls
    decoded: list[int] = []
    real_decode = resumable._codec.Verified.decode
    monkeypatch.setattr(
        resumable._codec.Verified, "decode", lambda *a, **k: decoded.append(1) or real_decode(*a, **k)
    )
    assert ["download", "parse", "count"] == pipe.run(url="x").skipped
    assert [] == decoded


def test_why_in_python(pipe: Pipeline):
    """Pipeline.why says why each slot last ran, with the changed components; unknown steps are a UsageError."""
    from resumable import UsageError

    def make(factor: int):
        @pipe.step(name="scale", key="{x}")
        def scale(x: int) -> int:
            return x * factor

        return scale

    with pipe:
        make(2)(1)
    with pipe:
        make(3)(1)
        make(3)(2)
    decisions = pipe.why("scale")
    assert ["scale/1", "scale/2"] == [d.slot for d in decisions]
    assert ("ran", "code changed") == (decisions[0].outcome, decisions[0].reason)
    assert [("value", "factor", "2", "3")] == [(c.kind, c.name, c.old, c.new) for c in decisions[0].changes]
    assert ("ran", "new") == (decisions[1].outcome, decisions[1].reason)
    with pipe:
        make(3)(1)
    assert ["skipped"] == [d.outcome for d in pipe.why("scale", key="1")]
    with pytest.raises(UsageError, match="no run has called 'nope'"):
        pipe.why("nope")
