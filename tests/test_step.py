"""The @step decorator: definition, calling, skipping, reasons, retries, side effects."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import threading
import time
from pathlib import Path

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import resumable._session
from resumable import (
    FingerprintError,
    Pipeline,
    ResumableWarning,
    StepDefinitionError,
    StepInterruptedError,
    step,
)


def test_bare_and_with_options(pipe: Pipeline):
    """@pipe.step and @pipe.step(...) both make steps that store and skip."""
    calls: list[int] = []

    @pipe.step
    def double(x: int) -> int:
        calls.append(x)
        return 2 * x

    @pipe.step(name="triple_it", version="1")
    def triple(x: int) -> int:
        calls.append(x)
        return 3 * x

    with pipe:
        assert (4, 6) == (double(2), triple(2))
        assert (4, 6) == (double(2), triple(2))
    assert [2, 2] == calls
    assert {"double", "triple_it"} == set(pipe.status().steps)


def test_wrapper_keeps_metadata():
    """The wrapper keeps name, docstring, signature and type hints; async stays async."""
    p = Pipeline(store="memory://")

    @p.step
    def add(a: int, b: int = 1) -> int:
        """Add two numbers."""
        return a + b

    @p.step
    async def fetch(url: str) -> str:
        return url

    assert "add" == add.__name__
    assert "Add two numbers." == add.__doc__
    assert inspect.signature(add.__wrapped__) == inspect.signature(add)
    assert {"a": int, "b": int, "return": int} == inspect.get_annotations(add, eval_str=True)
    assert inspect.iscoroutinefunction(fetch)
    assert add.__resumable_step__.name == "add"


def test_method_binds_and_is_cached(pipe: Pipeline):
    """A step defined in a class binds as a method; self is fingerprinted when it can be."""
    import attrs

    @attrs.frozen
    class Agent:
        model: str

        @pipe.step
        def answer(self, question: str) -> str:
            return f"{self.model}: {question}"

    with pipe:
        agent = Agent("m1")
        assert "m1: hi" == agent.answer("hi")
        assert Agent.answer.is_cached(agent, "hi")
        assert not Agent.answer.is_cached(Agent("m2"), "hi")


@pytest.mark.parametrize(
    "name",
    ["", "a/b", "..", ".hidden", "-x", "x\n", "<lambda>", "out.msgpack", "a:b", "x" * 101, " x"],
)
def test_invalid_names_are_rejected(name: str):
    """Names that cannot be file names fail at decoration time, suggesting name=."""
    with pytest.raises(StepDefinitionError, match="name="):
        step(name=name)(lambda: None)


def test_lambda_needs_a_name():
    """A lambda's __name__ cannot be a file name: the error says to pass name=."""
    p = Pipeline(store="memory://")
    with pytest.raises(StepDefinitionError, match="name="):
        p.step(lambda x: x)
    assert p.step(name="ident")(lambda x: x).__resumable_step__.name == "ident"


def test_duplicate_name_is_an_error_but_redefinition_is_not():
    """Another function with the same name fails; re-running the same definition does not."""
    p = Pipeline(store="memory://")

    def make():
        @p.step
        def load(x: int) -> int:
            return x

        return load

    first = make()
    second = make()  # same module and qualname: a notebook cell run twice
    assert first.__resumable_step__.qualname == second.__resumable_step__.qualname

    with pytest.raises(StepDefinitionError, match="already used"):

        @p.step
        def load(x: int) -> int:
            return x

    with pytest.raises(StepDefinitionError, match="differ only by case"):

        @p.step
        def LOAD(x: int) -> int:
            return x


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"key": "{nope}"}, "no parameter 'nope'"),
        ({"key": "{"}, "not a valid format string"),
        ({"key": 3}, "format string or a callable"),
        ({"ignore": ["zzz"]}, "not parameters"),
        ({"retries": -1}, "retries"),
        ({"version": ""}, "version"),
    ],
)
def test_bad_options_fail_at_decoration(options: dict, match: str):
    """Options are validated when the function is decorated."""
    p = Pipeline(store="memory://")
    with pytest.raises(StepDefinitionError, match=match):

        @p.step(**options)
        def f(page: int) -> int:
            return page


def test_keyed_slots_on_disk(pipe: Pipeline, state_dir: Path):
    """Each distinct key is its own slot, file state/<step>/<key>.msgpack."""

    @pipe.step(key="{page}")
    def fetch_page(page: int) -> dict:
        return {"page": page}

    with pipe:
        assert [{"page": p} for p in range(3)] == [fetch_page(p) for p in range(3)]
    expected = {f"fetch_page/{p}.msgpack" for p in range(3)}
    files = {p.relative_to(state_dir).as_posix() for p in state_dir.rglob("*.msgpack")}
    assert expected == files
    assert ["fetch_page/0", "fetch_page/1", "fetch_page/2"] == pipe.status().completed_steps


def test_keys_are_encoded_safely(pipe: Pipeline, state_dir: Path):
    """Keys never leave the state directory or collide, whatever they contain."""
    keys = ["../../etc/passwd", "a/b", "A", "a", "", "%41", "ü", "x" * 400, "x" * 401]

    @pipe.step(key=lambda k: k)
    def echo(k: str) -> str:
        return k

    with pipe:
        assert keys == [echo(k) for k in keys]
        assert keys == [echo(k) for k in keys]  # all skipped, none overwrote another
    files = list(state_dir.rglob("*.msgpack"))
    assert len(keys) == len(files)
    assert all(state_dir / "echo" == f.parent for f in files)
    assert all(len(f.name) < 255 for f in files)


def test_key_function_must_return_str(pipe: Pipeline):
    """A key function returning something else is a clear error."""

    @pipe.step(key=lambda n: n)
    def f(n: int) -> int:
        return n

    with pipe, pytest.raises(StepDefinitionError, match="return a str"):
        f(3)


def test_key_with_memory_address_is_refused(pipe: Pipeline):
    """A key that would change every run (an object's default repr) is refused."""

    class Thing:
        pass

    @pipe.step(key="{thing}", ignore=["thing"])
    def f(thing: Thing) -> int:
        return 1

    with pipe, pytest.raises(StepDefinitionError, match="memory address"):
        f(Thing())


def test_ignore_leaves_parameters_out(pipe: Pipeline):
    """Ignored parameters do not affect the fingerprint (and need no digest)."""
    calls = []

    @pipe.step(ignore=["client"])
    def ask(question: str, client: object) -> str:
        calls.append(question)
        return question.upper()

    with pipe:
        assert "HI" == ask("hi", object())
        assert "HI" == ask("hi", object())
    assert ["hi"] == calls


def test_unfingerprintable_argument(pipe: Pipeline):
    """An argument without a stable digest is a FingerprintError naming step and parameter."""

    @pipe.step
    def use(lock: object) -> int:
        return 1

    with pipe, pytest.raises(FingerprintError, match=r"step 'use'.*'lock'.*ignore=\('lock',\)"):
        use(threading.Lock())


def _reason(pipe: Pipeline, slot: str) -> str | None:
    return pipe.status().steps[slot].reason


def test_reasons(pipe: Pipeline):
    """Each rerun records why: new, inputs changed, version changed, reset."""
    with pipe:

        @pipe.step(version="1")
        def square(x: int) -> int:
            return x * x

        square(2)
        assert "new" == _reason(pipe, "square")
        with pytest.warns(ResumableWarning, match="key="):
            square(3)
        assert "inputs changed" == _reason(pipe, "square")

        @pipe.step(version="2")
        def square(x: int) -> int:
            return x * x

        square(3)
        assert "version changed" == _reason(pipe, "square")
        square.forget(3)
        assert "reset" == pipe.status().steps["square"].status
        square(3)
        assert "reset" == _reason(pipe, "square")


def test_code_changed_reason(pipe: Pipeline, tmp_path: Path, state_dir: Path):
    """Editing the logic of a step reruns it with reason 'code changed'."""
    import importlib.util
    import sys

    def load(source: str):
        path = tmp_path / "mod_code_changed.py"
        path.write_text(source)
        sys.modules.pop("mod_code_changed", None)
        spec = importlib.util.spec_from_file_location("mod_code_changed", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    template = "import resumable\nPIPE = None\n\ndef helper(x):\n    return x {op} 1\n\ndef double(x):\n    return helper(x) * 2\n"
    with pipe:
        for op, expected_reason in [("+", "new"), ("+", None), ("-", "code changed")]:
            module = load(template.format(op=op))
            double = pipe.step(module.double)
            double(1)
            rec = pipe.status().steps["double"]
            if expected_reason:
                assert expected_reason == rec.reason
    assert '"detail":"fn helper"' in (state_dir / "events.jsonl").read_text()


def test_version_pins_against_code_edits(pipe: Pipeline, caplog: pytest.LogCaptureFixture):
    """With version=, a code edit keeps the output, and the skip log says so."""
    with pipe:

        @pipe.step(version="1")
        def f(x: int) -> int:
            return x + 1

        assert 2 == f(1)

        @pipe.step(version="1")
        def f(x: int) -> int:
            return x + 100

        with caplog.at_level(logging.INFO, logger="resumable"):
            assert 2 == f(1)
    assert "version '1' is pinned" in caplog.text


def test_log_lines(pipe: Pipeline, caplog: pytest.LogCaptureFixture):
    """One INFO line per step run (with its reason) and per skip."""

    @pipe.step
    def g(x: int) -> int:
        return x

    with caplog.at_level(logging.INFO, logger="resumable"), pipe:
        g(1)
        g(1)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert 2 == len(lines)
    assert "step 'g' running: new" == lines[0]
    assert lines[1].startswith("step 'g' skipped: stored 20")


def test_exceptions_propagate_unchanged(pipe: Pipeline):
    """A step's exception escapes as is (same object, same traceback) and is recorded."""
    boom = ValueError("boom")

    @pipe.step
    def bad() -> None:
        raise boom

    with pipe:
        with pytest.raises(ValueError, match="boom") as info:
            bad()
        assert boom is info.value
        assert "bad" in [entry.name for entry in info.traceback]
        status = pipe.status()
    assert "failed" == status.steps["bad"].status
    assert ("bad", "ValueError", "boom") == (status.error.step, status.error.type, status.error.message)
    assert "raise boom" in status.error.traceback
    assert "bad" == status.current_step


def test_failed_step_keeps_completed_ones(pipe: Pipeline):
    """A failure loses nothing already completed; the rerun skips it."""
    calls = []

    @pipe.step
    def ok() -> int:
        calls.append("ok")
        return 1

    @pipe.step
    def flaky(fail: bool) -> int:
        calls.append("flaky")
        if fail:
            raise RuntimeError
        return 2

    with pipe:
        ok()
        with pytest.raises(RuntimeError):
            flaky(True)
    with pipe:
        assert (1, 2) == (ok(), flaky(False))
    assert ["ok", "flaky", "flaky"] == calls
    assert "completed" == pipe.status().status


def test_retries(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """retries=N runs again with growing delays and records the attempts."""
    delays: list[float] = []
    monkeypatch.setattr(resumable._session.time, "sleep", delays.append)
    attempts = []

    @pipe.step(retries=3)
    def shaky() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("try again")
        return "ok"

    with pipe:
        assert "ok" == shaky()
    assert 3 == len(attempts)
    assert 2 == len(delays)
    assert 0.25 <= delays[0] <= 0.5  # 0.5 s, 1 s ... each with jitter: between half and all of it
    assert 0.5 <= delays[1] <= 1.0
    assert 3 == pipe.status().steps["shaky"].attempts


def test_retry_on_limits_retries_to_the_named_errors(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """retry_on=ConnectionError: a ValueError propagates at once; a ConnectionError is retried."""
    monkeypatch.setattr(resumable._session.time, "sleep", lambda _s: None)
    errors = [ConnectionError("blip"), ValueError("bad input")]
    calls: list[int] = []

    @pipe.step(retries=5, retry_on=(ConnectionError, TimeoutError))
    def fetch() -> str:
        calls.append(1)
        raise errors[len(calls) - 1]

    with pipe, pytest.raises(ValueError, match="bad input"):
        fetch()
    assert 2 == len(calls)
    with pytest.raises(StepDefinitionError, match="retry_on must be an exception class"):
        pipe.step(name="bad", retries=1, retry_on="ConnectionError")(lambda: 1)  # type: ignore[arg-type]


def test_retries_exhausted(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """After N retries the last error propagates."""
    monkeypatch.setattr(resumable._session.time, "sleep", lambda _s: None)

    @pipe.step(retries=2)
    def never() -> None:
        raise ConnectionError("down")

    with pipe, pytest.raises(ConnectionError, match="down"):
        never()
    assert 3 == pipe.status().steps["never"].attempts


def test_async_retries(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """Async steps retry with asyncio.sleep."""
    slept: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    attempts = []

    @pipe.step(retries=1)
    async def once_more() -> int:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError
        return 7

    with pipe:
        assert 7 == asyncio.run(once_more())
    assert 1 == len(slept)
    assert 0.25 <= slept[0] <= 0.5  # with jitter


def test_non_idempotent_interrupted(pipe: Pipeline):
    """A non-idempotent step that died mid-run refuses to run again until reset."""
    calls = []

    @pipe.step(idempotent=False)
    def charge(amount: int) -> str:
        calls.append(amount)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return "charged"

    with pytest.raises(KeyboardInterrupt), pipe:
        charge(10)
    assert "interrupted" == pipe.status().status
    with pipe:
        with pytest.raises(StepInterruptedError, match="resumable reset charge"):
            charge(10)
        assert ["charge"] == pipe.reset("charge")
        assert "charged" == charge(10)
    assert [10, 10] == calls


def test_non_idempotent_failure_reruns(pipe: Pipeline):
    """An exception (not a death) lets a non-idempotent step run again."""
    calls = []

    @pipe.step(idempotent=False)
    def send() -> str:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("smtp down")
        return "sent"

    with pipe:
        with pytest.raises(OSError, match="smtp"):
            send()
        assert "sent" == send()


def test_is_cached_and_forget(pipe: Pipeline):
    """is_cached says whether a call would skip; forget drops one slot only."""

    @pipe.step(key="{n}")
    def sq(n: int) -> int:
        return n * n

    with pipe:
        assert not sq.is_cached(2)
        sq(2)
        sq(3)
        assert sq.is_cached(2)
        sq.forget(2)
        assert not sq.is_cached(2)
        assert sq.is_cached(3)


def test_single_slot_called_with_different_arguments(pipe: Pipeline):
    """Calling an unkeyed step with different arguments in one run warns to add key=."""

    @pipe.step
    def fetch(page: int) -> int:
        return page

    with pipe:
        fetch(1)
        with pytest.warns(ResumableWarning, match=r"key="):
            fetch(2)
        fetch(3)  # warned once per step and run


def test_steps_calling_steps(pipe: Pipeline):
    """A step may call steps; each has its own slot, and completion order is recorded."""

    @pipe.step
    def inner(x: int) -> int:
        return x + 1

    @pipe.step
    def outer(x: int) -> int:
        return inner(x) * 10

    with pipe:
        assert 30 == outer(2)
        assert 30 == outer(2)
    assert ["inner", "outer"] == pipe.status().completed_steps


def test_threads_update_state_consistently(pipe: Pipeline):
    """Keyed steps called from many threads all complete and are all recorded."""
    from concurrent.futures import ThreadPoolExecutor

    @pipe.step(key="{n}")
    def work(n: int) -> int:
        time.sleep(0.001)
        return n * 2

    with pipe, ThreadPoolExecutor(8) as pool:
        assert [n * 2 for n in range(64)] == list(pool.map(work, range(64)))
    status = pipe.status()
    assert 64 == len(status.completed_steps)
    assert all(r.status == "completed" for r in status.steps.values())


def test_asyncio_gather(pipe: Pipeline):
    """Async keyed steps run concurrently under gather; a rerun skips them all."""
    calls = []

    @pipe.step(key="{n}")
    async def fetch(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0.001)
        return n + 100

    async def main() -> list[int]:
        return list(await asyncio.gather(*(fetch(n) for n in range(20))))

    with pipe:
        assert [n + 100 for n in range(20)] == asyncio.run(main())
        assert [n + 100 for n in range(20)] == asyncio.run(main())
    assert 20 == len(calls)


def test_disable(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch, state_dir: Path):
    """RESUMABLE_DISABLE=1 runs steps normally and writes nothing."""
    monkeypatch.setenv("RESUMABLE_DISABLE", "1")
    calls = []

    @pipe.step
    def f() -> int:
        calls.append(1)
        return 1

    assert (1, 1) == (f(), f())
    assert [1, 1] == calls
    assert not state_dir.exists()


def test_serialization_error_keeps_previous_output(pipe: Pipeline, state_dir: Path):
    """An output that cannot be stored fails before the previous output is touched."""
    from resumable import SerializationError

    @pipe.step
    def produce(kind: str) -> object:
        return (x for x in range(3)) if kind == "gen" else [1, 2]

    with pipe:
        produce("list")
    before = (state_dir / "produce.msgpack").read_bytes()
    with pipe, pytest.raises(SerializationError, match=r"step 'produce'.*generator"):
        produce("gen")
    assert before == (state_dir / "produce.msgpack").read_bytes()
    assert "failed" == pipe.status().steps["produce"].status


def test_key_file_names_are_readable_and_escaped(pipe: Pipeline, state_dir: Path):
    """Lower-case letters, digits, '_', '-' and '.' stay; upper case and the rest become %XX."""

    @pipe.step(key=lambda k: k)
    def named(k: str) -> str:
        return k

    with pipe:
        named("user_17-2026.json")
        named("Page A/b")
    files = {p.name for p in (state_dir / "named").glob("*.msgpack")}
    assert {"user_17-2026.json.msgpack", "%50age%20%41%2Fb.msgpack"} == files


def _escaped_char_by_char(key: str) -> str:
    """The slot file name of *key* as defined: every character looked at, one at a time."""
    out = []
    for i, ch in enumerate(key):
        if ch in "abcdefghijklmnopqrstuvwxyz0123456789_-." and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    encoded = "".join(out) or "%"
    if len(encoded) > 150:
        digest = blake3.blake3(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        encoded = f"{encoded[:100]}~{digest}"
    return encoded


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="ab.-_9Z/%\n\u00e9", max_size=8)
    | st.text(alphabet="abc.-_", min_size=140, max_size=160)
    | st.text(max_size=20)
)
def test_a_key_that_needs_no_escape_is_its_own_file_name(key: str) -> None:
    """The fast path for plain keys names exactly the file the character-by-character escape names."""
    from resumable._slots import encode_key

    assert _escaped_char_by_char(key) == encode_key(key)


def test_concurrent_calls_of_one_non_idempotent_slot_run_it_once(pipe: Pipeline):
    """Threads (or coroutines) calling the same idempotent=False slot at once: one runs, the others get its output."""
    import asyncio
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    charges: list[str] = []
    lock = threading.Lock()

    @pipe.step(key="{customer}", idempotent=False)
    def charge(customer: str) -> str:
        time.sleep(0.05)  # long enough for the other calls to arrive while it runs
        with lock:
            charges.append(customer)
        return f"charged {customer}"

    @pipe.step(key="{customer}", idempotent=False)
    async def refund(customer: str) -> str:
        await asyncio.sleep(0.05)
        charges.append(f"refund {customer}")
        return f"refunded {customer}"

    async def refunds() -> list[str]:
        return await asyncio.gather(*(refund("bob") for _ in range(4)))

    with pipe:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(charge, ["ann"] * 4))
        assert ["refunded bob"] * 4 == asyncio.run(refunds())
    assert ["charged ann"] * 4 == results
    assert ["ann", "refund bob"] == charges


def test_by_arguments_keys_a_step_by_all_its_arguments(pipe: Pipeline, state_dir: Path):
    """key=by_arguments: one slot per distinct set of arguments (ignored ones left out), any fingerprintable type."""
    from resumable import by_arguments

    calls: list[tuple[object, ...]] = []

    @pipe.step(key=by_arguments, ignore=("verbose",))
    def score(rows: list[int], model: str, verbose: bool = False) -> int:
        calls.append((tuple(rows), model))
        return sum(rows) * len(model)

    with pipe:
        assert 6 == score([1, 2, 3], "a")
        assert 12 == score([1, 2, 3], "ab")
        assert 6 == score([1, 2, 3], "a", verbose=True)  # same slot: verbose is ignored
    with pipe:
        assert 12 == score([1, 2, 3], model="ab")
    assert [((1, 2, 3), "a"), ((1, 2, 3), "ab")] == calls
    assert 2 == len(list((state_dir / "score").glob("*.msgpack")))
    with pytest.raises(Exception, match="not a function to call"):
        by_arguments(1)


def test_the_single_slot_hint_works_for_frames_too(pipe: Pipeline):
    """The warning for an unkeyed step called with two different tables advises a key that tells them apart."""
    import warnings as _warnings

    from resumable import ResumableWarning

    @pipe.step
    def total(table: list[list[int]], label: str = "t") -> int:
        return sum(map(sum, table))

    @pipe.step
    def total_tables(table: list[list[int]]) -> int:
        return sum(map(sum, table))

    with pipe, pytest.warns(ResumableWarning) as caught:  # noqa: PT031 - the calls make the warnings
        total([[1]], label="a")
        total([[2]], label="b")
        total_tables([[1, 2], [3]])
        total_tables([[1, 3], [3]])
    assert "@step(key='{label}')" in str(caught[0].message)
    assert "@step(key=resumable.by_arguments)" in str(caught[1].message)
    assert "{table}" not in str(caught[1].message)  # a printout as a file name: never advised

    # following the advice: each table gets its own slot, and nothing warns
    @pipe.step(key=__import__("resumable").by_arguments)
    def total_keyed(table: list[list[int]]) -> int:
        return sum(map(sum, table))

    with pipe, _warnings.catch_warnings():
        _warnings.simplefilter("error")
        assert (6, 7) == (total_keyed([[1, 2], [3]]), total_keyed([[1, 3], [3]]))


@pytest.mark.parametrize(
    ("value", "off"), [(None, False), ("", False), ("0", False), ("1", True), ("yes", True)]
)
def test_resumable_disable_is_read_at_every_call(
    monkeypatch: pytest.MonkeyPatch, value: str | None, off: bool
):
    """The check reads the environment as it is now (a fast path, the same answer as os.environ)."""
    from resumable._context import disabled

    if value is None:
        monkeypatch.delenv("RESUMABLE_DISABLE", raising=False)
    else:
        monkeypatch.setenv("RESUMABLE_DISABLE", value)
    assert off is disabled()
    monkeypatch.setattr(os, "environ", dict(os.environ))  # replaced whole: read through it
    assert off is disabled()


def test_a_misspelt_option_is_refused_as_steps():
    with pytest.raises(TypeError, match=r"step\(\) got an unexpected keyword argument 'retires'"):
        step(retires=2)  # type: ignore[call-overload]
