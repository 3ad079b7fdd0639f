"""
Random and adversarial bytes in every kind of state file: no run and no command crashes with
anything but a ResumableError, and no value is ever returned from a damaged file.

A state with every kind of file (manifest, event log, unkeyed and keyed outputs, a kept
history version, a batch record and its chunk log, a code record, the file-digest cache,
the output log as a killed run leaves it) is
made once, and once more with the batch's chunks in files of their own (the layout of object
stores and of earlier versions); each case copies it, damages one file, runs the pipeline
again and every read-only command on it.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest

from resumable import Pipeline, ResumableError, checkpointed_map
from resumable._cli import main
from resumable._stores._local import LocalStore

ROWS = 30
EXPECTED = {
    "base": {"n": 3, "text": "x" * 50},
    "pages": [1, 4, 9],
    "total": sum(x * 2 for x in range(ROWS)),
}


def _run(state: Path, *, fail_batch: bool = False, version: str = "1") -> dict[str, Any]:
    """The pipeline: an unkeyed step, a keyed one, and a step with a batch (failing half-way if asked)."""
    pipe = Pipeline("fuzz", state_dir=state)

    @pipe.step(version=version)
    def base() -> dict[str, Any]:
        return {"n": 3, "text": "x" * 50}

    @pipe.step(key="{i}")
    def page(i: int) -> int:
        return i * i

    def double(x: int) -> int:
        if fail_batch and x == ROWS // 2:
            raise RuntimeError("half-way")
        return x * 2

    @pipe.step
    def total() -> int:
        return sum(checkpointed_map(double, range(ROWS), every=4))

    with pipe:
        return {"base": base(), "pages": [page(i) for i in (1, 2, 3)], "total": total()}


def _pristine(state: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _run(state)
        _run(state, version="2")  # base reran: its old version is kept for history
        (state / "total.msgpack").unlink()  # ... and total is unfinished, with committed chunks
        with pytest.raises(RuntimeError, match="half-way"):
            _run(state, fail_batch=True, version="2")
    return state


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state holding every kind of file (an unfinished batch included, its chunks in a log)."""
    return _pristine(tmp_path_factory.mktemp("fuzz") / "state")


@pytest.fixture(scope="module")
def pristine_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same, with the batch's chunks in files of their own."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(LocalStore, "slow_appends", True)
        return _pristine(tmp_path_factory.mktemp("fuzz-files") / "state")


KINDS = {
    "manifest": "manifest.json",
    "events": "events.jsonl",
    "output": "base.msgpack",
    "keyed output": "page/2.msgpack",
    "history version": ".resumable/objects/*.msgpack",
    "batch record": ".resumable/batches/steps/total/batch.msgpack",
    "batch chunk log": ".resumable/batches/steps/total/chunks.log",
    "batch chunk file": ".resumable/batches/steps/total/0*.msgpack",
    "code record": ".resumable/code/*.json",
}


def _mutations(data: bytes, rng: random.Random) -> list[tuple[str, bytes]]:
    """Ways to damage *data*: bit flips, cuts, garbage, and adversarial structures."""
    out: list[tuple[str, bytes]] = [("empty", b""), ("one byte", data[:1]), ("cut", data[: len(data) // 2])]
    for n in (1, 3, 8):
        flipped = bytearray(data)
        for _ in range(n):
            if flipped:
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
        out.append((f"{n} bit flip(s)", bytes(flipped)))
    out.append(("garbage", bytes(rng.randrange(256) for _ in range(max(16, len(data))))))
    out.append(("json list", b"[]\n"))
    out.append(
        ("json types", json.dumps({"steps": [], "runs": "3", "events_offset": -5, "slot": 1}).encode())
    )
    out.append(("nul bytes", b"\x00" * len(data)))
    out.append(("huge length", b"\xdb\xff\xff\xff\xff" + data[5:]))
    cut = rng.randrange(len(data)) if data else 0
    out.append(("cut at random", data[:cut]))
    return out


MUTATIONS = 12


def _cases() -> list[tuple[str, int]]:
    return [(kind, i) for kind in KINDS for i in range(MUTATIONS)]


def _cli_is_calm(state: Path) -> None:
    """Every read-only command ends with an exit code, never an unexpected exception."""
    for args in (
        ["status"],
        ["status", "--json"],
        ["history"],
        ["verify"],
        ["show", "base"],
        ["show", "page", "--key", "2"],
        ["why", "total"],
    ):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            code = main(["--state-dir", str(state), *args])
        assert code in {0, 1, 2, 3}, args


@pytest.mark.parametrize(("kind", "which"), _cases(), ids=[f"{k}-{i}" for k, i in _cases()])
def test_damaged_state_never_crashes_and_never_returns_damage(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str, which: int
) -> None:
    state = tmp_path / "state"
    shutil.copytree(
        request.getfixturevalue("pristine_files" if kind == "batch chunk file" else "pristine"), state
    )
    targets = sorted(state.glob(KINDS[kind]))
    assert targets, f"the pristine state has no {kind}"
    target = targets[0]
    rng = random.Random(f"{kind}-{which}")  # noqa: S311 - reproducible damage, not secrets
    name, damaged = _mutations(target.read_bytes(), rng)[which]
    target.write_bytes(damaged)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _cli_is_calm(state)
        try:
            result = _run(state, version="2")
        except ResumableError:
            result = None  # refused clearly: allowed; a value from the damage is not
        else:
            assert EXPECTED == result, name
        _cli_is_calm(state)
        # and the run after it is whole again
        assert EXPECTED == _run(state, version="2"), name
