"""Errors as a user meets them: each hint is followed, and following it works."""

from __future__ import annotations

import dataclasses
import errno
import json
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import resumable
from resumable import (
    FingerprintError,
    Pipeline,
    ResumableError,
    ResumableWarning,
    StateDirectoryError,
    UsageError,
)
from resumable._stores._local import LocalStore


def double(x: int) -> int:
    return 2 * x


def triple(x: int) -> int:
    return 3 * x


class Model:
    """A user class without a stable digest."""

    def __init__(self, weight: int) -> None:
        self.weight = weight


class FingerprintedModel(Model):
    """The same class, following the hint: a __resumable_fingerprint__() method."""

    def __resumable_fingerprint__(self) -> object:
        return {"weight": self.weight}


@dataclasses.dataclass
class ModelData:
    """The same class, following the other hint: a dataclass of supported values."""

    weight: int


def _message(call: Callable[[], object]) -> str:
    with pytest.raises(FingerprintError) as info:
        call()
    return str(info.value)


# --- FingerprintError hints -------------------------------------------------------------


@pytest.mark.parametrize("fn", [double, len, Model(1).__init__, Model, sys, lambda x: x])
def test_code_argument_hint_suggests_ignore_not_a_method(pipe: Pipeline, fn: object):
    """A function, method, class or module argument: the hint is ignore= or a name, never a method."""

    @pipe.step
    def apply(fn: object, x: int) -> int:
        return x

    with pipe:
        message = _message(lambda: apply(fn, 1))
    assert "pass ignore=('fn',) to @step" in message
    assert "its name as a str" in message
    assert "__resumable_fingerprint__" not in message


def test_following_the_code_argument_hints_works(pipe: Pipeline):
    """ignore=('fn',) with version=, or the function's name as a str: both run and resume."""
    calls: list[str] = []

    @pipe.step(ignore=("fn",), version="1")
    def apply(fn: Callable[[int], int], x: int) -> int:
        calls.append("ignored")
        return fn(x)

    functions = {"double": double, "triple": triple}

    @pipe.step(key="{name}")
    def apply_named(name: str, x: int) -> int:
        calls.append(name)
        return functions[name](x)

    with pipe:
        assert (4, 4) == (apply(double, 2), apply(double, 2))
        assert (4, 6, 6) == (apply_named("double", 2), apply_named("triple", 2), apply_named("triple", 2))
    assert ["ignored", "double", "triple"] == calls


def test_user_class_hint_suggests_a_fingerprint_method(pipe: Pipeline):
    """An instance of the user's class: the hint names the class and __resumable_fingerprint__()."""

    @pipe.step
    def predict(model: object, x: int) -> int:
        return x

    with pipe:
        message = _message(lambda: predict(Model(2), 1))
    assert f"give {Model.__module__}.Model a __resumable_fingerprint__() method" in message
    assert "or make it a dataclass or attrs class" in message


def test_following_the_user_class_hints_works(pipe: Pipeline):
    """With the method, or as a dataclass, the step runs once per distinct model."""
    calls: list[int] = []

    @pipe.step(key="{x}-{model.weight}")
    def predict(model: Model | ModelData, x: int) -> int:
        calls.append(model.weight)
        return model.weight * x

    with pipe:
        results = [
            predict(FingerprintedModel(2), 3),
            predict(FingerprintedModel(2), 3),
            predict(FingerprintedModel(5), 3),
            predict(ModelData(7), 3),
            predict(ModelData(7), 3),
        ]
    assert [6, 6, 15, 21, 21] == results
    assert [2, 5, 7] == calls


def test_client_hint_suggests_ignore_and_following_it_works(pipe: Pipeline):
    """A connection (a library's object): ignore= or the values deciding the output, no method."""
    calls: list[int] = []

    @pipe.step
    def count(conn: sqlite3.Connection, table: str) -> int:
        calls.append(1)
        return 3

    conn = sqlite3.connect(":memory:")
    try:
        with pipe:
            message = _message(lambda: count(conn, "t"))

        @pipe.step(ignore=("conn",))
        def count_rows(conn: sqlite3.Connection, table: str) -> int:
            calls.append(2)
            return int(conn.execute("select 3").fetchone()[0])

        with pipe:
            assert (3, 3) == (count_rows(conn, "t"), count_rows(conn, "t"))
    finally:
        conn.close()
    assert "If it does not affect the output (a client, a connection, a lock ...)" in message
    assert "pass ignore=('conn',) to @step" in message
    assert "__resumable_fingerprint__" not in message
    assert [2] == calls


def test_iterator_hint_suggests_a_list_and_following_it_works(pipe: Pipeline):
    """An iterator argument: pass a list instead, which runs and resumes."""
    calls: list[list[int]] = []

    @pipe.step
    def total(rows: object) -> int:
        calls.append(list(rows))  # type: ignore[call-overload]
        return sum(calls[-1])

    with pipe:
        message = _message(lambda: total(iter([1, 2])))
        assert (3, 3) == (total([1, 2]), total([1, 2]))
    assert "Pass a list or tuple of its items instead" in message
    assert [[1, 2]] == calls


# --- rollback to a checkpoint whose output was damaged ----------------------------------


def test_rollback_to_a_damaged_output_says_so_and_the_hint_works(tmp_path: Path):
    """The message says the file was damaged, nothing changes, and a listed checkpoint restores."""
    state = tmp_path / "state"
    script = tmp_path / "p.py"
    script.write_text(
        "import sys\nfrom resumable import step\n"
        "@step\ndef s() -> str:\n    return 'v1'\n"
        "@step\ndef t(x: str) -> str:\n    return x + '!'\n"
        "print(t(s()))\n"
    )
    env_run = [sys.executable, "-W", "ignore", str(script)]
    subprocess.run(env_run, check=True, cwd=tmp_path, capture_output=True)
    target = state / "s.msgpack"
    data = bytearray(target.read_bytes())
    data[-1] ^= 1
    target.write_bytes(bytes(data))
    subprocess.run(env_run, check=True, cwd=tmp_path, capture_output=True)  # recomputes s
    cli = [sys.executable, "-m", "resumable", "--state-dir", str(state)]
    outputs = {p.name: p.read_bytes() for p in state.glob("*.msgpack")}
    done = subprocess.run([*cli, "rollback", "2"], capture_output=True, text=True, check=False)
    expected = (
        "resumable: checkpoint 2 can no longer be restored: the output of s it needs was damaged, so no copy "
        "of it was kept when it was recomputed. Nothing was changed. Roll back to one of the "
        "checkpoints `resumable history` (pipe.checkpoints()) lists: those can be restored.\n"
    )
    assert (1, expected) == (done.returncode, done.stderr)
    assert outputs == {p.name: p.read_bytes() for p in state.glob("*.msgpack")}
    listed = json.loads(subprocess.run([*cli, "history", "--json"], capture_output=True, check=True).stdout)
    assert [3] == [c["id"] for c in listed]
    done = subprocess.run([*cli, "rollback", "3"], capture_output=True, text=True, check=False)
    assert (0, "") == (done.returncode, done.stderr)
    assert "rolled back to checkpoint 3" in done.stdout


# --- the state directory cannot be used -------------------------------------------------


def test_a_file_as_state_directory_is_a_state_directory_error(tmp_path: Path):
    """A state_dir that is a file: StateDirectoryError (an OSError) naming it and the ways out."""
    path = tmp_path / "afile"
    path.write_text("x")
    pipe = Pipeline("p", state_dir=path)

    @pipe.step
    def one() -> int:
        return 1

    with pytest.raises(StateDirectoryError) as info, pipe:
        one()
    assert isinstance(info.value, OSError)
    assert isinstance(info.value, ResumableError)
    assert (str(path), errno.ENOTDIR) == (info.value.path, info.value.errno)
    assert (
        f"cannot use state directory {path}: it is a file, not a directory. Point the pipeline at a "
        "directory it can write (state_dir= or $RESUMABLE_STATE_DIR), or set RESUMABLE_DISABLE=1 to "
        "run the steps without storing any state."
    ) == str(info.value)


def test_following_the_state_directory_hints_works(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """RESUMABLE_DISABLE=1 runs the steps storing nothing; another directory stores there."""
    path = tmp_path / "afile"
    path.write_text("x")
    calls: list[int] = []

    def script(state: Path) -> int:
        pipe = Pipeline("p", state_dir=state)

        @pipe.step
        def one() -> int:
            calls.append(1)
            return 1

        with pipe:
            return one()

    monkeypatch.setenv("RESUMABLE_DISABLE", "1")
    assert 1 == script(path)
    assert "x" == path.read_text()
    monkeypatch.delenv("RESUMABLE_DISABLE")
    assert (1, 1) == (script(tmp_path / "other"), script(tmp_path / "other"))
    assert [1, 1] == calls  # the second run in the other directory skipped
    assert (tmp_path / "other" / "one.msgpack").exists()


def test_environment_state_dir_that_is_a_file_in_script_mode(tmp_path: Path):
    """RESUMABLE_STATE_DIR naming a file: the script stops with StateDirectoryError, not NotADirectoryError."""
    path = tmp_path / "afile"
    path.write_text("x")
    script = tmp_path / "s.py"
    script.write_text("from resumable import step\n@step\ndef one() -> int:\n    return 1\nprint(one())\n")
    env = {"RESUMABLE_STATE_DIR": str(path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, check=False)
    assert 1 == done.returncode
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"resumable.exceptions.StateDirectoryError: cannot use state directory {path}:")


def test_permission_denied_is_a_state_directory_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Permission denied when a run opens the directory (read-only) becomes StateDirectoryError."""
    state = tmp_path / "state"

    def denied(self: LocalStore, directory: str, *, durable: bool) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", f"{self.root}/.resumable")

    monkeypatch.setattr(LocalStore, "_makedirs", denied)
    pipe = Pipeline("p", state_dir=state)
    with pytest.raises(StateDirectoryError) as info, pipe:
        pass
    assert errno.EACCES == info.value.errno
    assert str(info.value).startswith(
        f"cannot use state directory {state}: permission denied on {state}/.resumable "
        "(read-only, or another user's)."
    )
    assert isinstance(info.value.__cause__, PermissionError)


# --- bad arguments ----------------------------------------------------------------------


def test_bad_arguments_are_usage_errors(pipe: Pipeline, tmp_path: Path):
    """Bad arguments to Pipeline methods raise UsageError, which is also a ValueError."""
    with pytest.raises(UsageError, match="not a number") as info:
        pipe.snapshot("3")
    assert isinstance(info.value, ValueError)
    with pytest.raises(UsageError, match="either state_dir= or store="):
        Pipeline(state_dir=tmp_path, store="memory://")
    assert issubclass(resumable.UsageError, resumable.ResumableError)


def test_resumable_warning_is_not_an_error():
    """ResumableWarning stays a warning: it is no ResumableError."""
    assert not issubclass(ResumableWarning, ResumableError)
    assert issubclass(ResumableWarning, UserWarning)


def test_warnings_point_at_the_users_call(pipe: Pipeline, state_dir: Path):
    """A ResumableWarning names the user's line (the step call), never a line inside resumable."""
    from resumable import ResumableWarning

    @pipe.step
    def parse(n: int) -> int:
        return n

    with pipe, pytest.warns(ResumableWarning, match="key=") as caught:  # noqa: PT031 - two calls make the warning
        parse(1)
        parse(2)  # one slot, two arguments: the warning points here
    assert [__file__] == [w.filename for w in caught]
    (state_dir / "parse.msgpack").write_bytes(b"damaged")
    with pipe, pytest.warns(ResumableWarning, match="will be recomputed") as caught:
        parse(2)
    assert [__file__] == [w.filename for w in caught]


def test_pipeline_run_under_resumable_disable_stores_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Pipeline.run() with RESUMABLE_DISABLE=1 runs every step and creates no state directory."""
    monkeypatch.setenv("RESUMABLE_DISABLE", "1")
    pipe = Pipeline("p", state_dir=tmp_path / "state")
    calls: list[str] = []

    @pipe.step
    def a() -> int:
        calls.append("a")
        return 1

    @pipe.step
    async def b(a: int) -> int:
        calls.append("b")
        return a + 1

    for _ in range(2):
        run = pipe.run()
        assert (2, ["a", "b"], []) == (run.outputs["b"], run.executed, run.skipped)
    assert ["a", "b", "a", "b"] == calls
    assert not (tmp_path / "state").exists()
