"""
A step called in a live process whose code or data changed since its last call behaves as
in a fresh process started now: it reruns when, and only when, a fresh process would.

Notebook cells are compiled under their own file names with their source in ``linecache``,
as IPython does; one test runs real IPython cells, others edit a script between processes.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
import linecache
import os
import subprocess
import sys
import textwrap
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from resumable import Pipeline, StepDefinitionError, step
from resumable._exit import exit_hooks

ROOT = Path(__file__).resolve().parent.parent
_cells = itertools.count()


class Notebook:
    """A namespace that cells run in, each compiled under its own name with its source kept."""

    def __init__(self, pipe: Pipeline) -> None:
        self.namespace: dict[str, Any] = {"__name__": "notebook", "pipe": pipe, "RUNS": []}

    def run(self, source: str) -> None:
        source = textwrap.dedent(source)
        filename = f"<cell-{next(_cells)}>"
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), self.namespace)  # noqa: S102 - a notebook cell

    def __getitem__(self, name: str) -> Any:
        return self.namespace[name]

    @property
    def runs(self) -> list[Any]:
        return self.namespace["RUNS"]  # type: ignore[no-any-return]


@pytest.fixture
def notebook(pipe: Pipeline) -> Iterator[Notebook]:
    with pipe:
        yield Notebook(pipe)


# --------------------------------------------------------------------------------------
# redefined in the same process


def test_a_helper_defined_again_reruns_the_step(notebook):
    """A notebook cell redefining a same-module helper after the step's first call reruns it."""
    notebook.run("""
        def helper(x):
            return x * 3

        @pipe.step
        def scale(xs):
            RUNS.append("scale")
            return [helper(x) for x in xs]
    """)
    assert [3, 6, 9] == notebook["scale"]([1, 2, 3])
    assert [3, 6, 9] == notebook["scale"]([1, 2, 3])
    notebook.run("""
        def helper(x):
            return x + 100 + 2 * x
    """)
    assert [103, 106, 109] == notebook["scale"]([1, 2, 3])
    assert [103, 106, 109] == notebook["scale"]([1, 2, 3])
    assert ["scale", "scale"] == notebook.runs


def test_a_step_defined_again_reruns_the_steps_calling_it(notebook):
    """``@step def b`` run again with other code: ``a``, which calls it, reruns too."""
    notebook.run("""
        @pipe.step
        def b(x):
            return x * 2

        @pipe.step
        def a(x):
            RUNS.append("a")
            return b(x) + x
    """)
    assert 30 == notebook["a"](10)
    notebook.run("""
        @pipe.step
        def b(x):
            return x * 2 + 10
    """)
    assert 40 == notebook["a"](10)
    assert 40 == notebook["a"](10)
    assert ["a", "a"] == notebook.runs


def test_the_same_cell_run_again_is_a_skip(notebook):
    """Running the very same cells again (new function objects, same code) changes nothing."""
    cell = """
        LIMIT = 3

        def helper(x):
            return min(x, LIMIT)

        @pipe.step
        def clip(xs):
            RUNS.append("clip")
            return [helper(x) for x in xs]
    """
    notebook.run(cell)
    assert [1, 3] == notebook["clip"]([1, 5])
    notebook.run(cell)
    assert [1, 3] == notebook["clip"]([1, 5])
    assert ["clip"] == notebook.runs


def test_a_name_defined_after_the_first_call_is_followed(notebook):
    """A helper missing at the first call (which failed) and defined later is part of the identity."""
    notebook.run("""
        @pipe.step
        def late(x):
            RUNS.append("late")
            return helper(x)
    """)
    with pytest.raises(NameError):
        notebook["late"](1)
    notebook.run("def helper(x):\n    return x + 1\n")
    assert 2 == notebook["late"](1)
    notebook.run("def helper(x):\n    return x + 2\n")
    assert 3 == notebook["late"](1)
    assert 3 == notebook["late"](1)
    assert ["late", "late", "late"] == notebook.runs


def test_a_helper_in_a_dispatch_table_replaced_in_place_reruns(notebook):
    """``TABLE["op"] = other_function`` is a code change of the steps using the table."""
    notebook.run("""
        def double(x):
            return 2 * x

        def triple(x):
            return 3 * x

        OPS = {"f": double}

        @pipe.step
        def apply(x):
            RUNS.append("apply")
            return OPS["f"](x)
    """)
    assert 8 == notebook["apply"](4)
    notebook["OPS"]["f"] = notebook["triple"]
    assert 12 == notebook["apply"](4)
    assert ["apply", "apply"] == notebook.runs


def test_a_function_whose_code_is_replaced_reruns(pipe, tmp_path, monkeypatch):
    """Hot reload (a live function's ``__code__`` replaced from the edited file) reruns the steps using it."""
    source = textwrap.dedent("""
        from resumable import step

        RUNS = []

        def helper(x):
            return x + 1

        @step
        def hot(x):
            RUNS.append(x)
            return helper(x)
    """)
    path = tmp_path / "hot_module.py"
    path.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "hot_module", raising=False)
    import hot_module  # type: ignore[import-not-found]

    with pipe:
        assert 2 == hot_module.hot(1)
        # what a hot reloader does: compile the edited file, put the new code in the live function
        edited = source.replace("return x + 1", "return x + 1000")
        path.write_text(edited)
        compiled = compile(edited, str(path), "exec")
        code = {c.co_name: c for c in compiled.co_consts if isinstance(c, types.CodeType)}
        hot_module.helper.__code__ = code["helper"]
        assert 1001 == hot_module.hot(1)
        hot_module.hot.__wrapped__.__code__ = code["hot"]  # the step's own code, unchanged
        assert 1001 == hot_module.hot(1)
    assert [1, 1] == hot_module.RUNS


# --------------------------------------------------------------------------------------
# every shape of callable


def score(mode: str, x: int) -> str:
    return f"{mode}:{x}"


def test_a_partial_counts_its_function_and_frozen_arguments(pipe):
    """``step(functools.partial(f, a))``: its frozen arguments are fingerprinted like arguments."""
    runs = []

    def scored(mode: str, x: int, *, scale: list[int]) -> str:
        runs.append(mode)
        return score(mode, x * scale[0])

    scale = [1]
    fast = pipe.step(functools.partial(scored, "fast", scale=scale), name="score")
    slow = pipe.step(functools.partial(scored, "slow", scale=scale), name="score")
    with pipe:
        assert "fast:1" == fast(1)
    with pipe:
        assert "fast:1" == fast(1)
    with pipe:
        assert "slow:1" == slow(1)
    scale[0] = 2  # changed in place: as it is at the call
    with pipe:
        assert "slow:2" == slow(1)
    with pipe:
        assert "slow:2" == slow(1)
    assert ["fast", "slow", "slow"] == runs


def test_a_partial_of_something_that_cannot_be_fingerprinted_is_refused(pipe):
    """A frozen argument with no digest is refused at decoration, with a remedy; version= accepts it."""
    lock = threading.Lock()
    with pytest.raises(StepDefinitionError, match=r"pass version="):
        pipe.step(functools.partial(score, lock), name="locked")
    pinned = pipe.step(functools.partial(lambda lock, x: x, lock), name="locked", version="1")
    with pipe:
        assert 3 == pinned(3)


def test_code_without_python_source_is_refused_unless_pinned(pipe):
    """A builtin or a C callable has no code to digest: decorating it asks for version=."""
    with pytest.raises(StepDefinitionError, match=r"step 'size'.*pass version="):
        pipe.step(len, name="size")
    size = pipe.step(len, name="size", version="1")
    with pipe:
        assert 3 == size([1, 2, 3])


class Scorer:
    """A callable object, and a method made a step at run time (joblib's idiom)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.runs: list[int] = []  # changed by the code: not an input
        self.lock = threading.Lock()  # cannot be fingerprinted: left out
        self.f = step(self.f, name="scorer_f", key="{x}")

    def f(self, x: int) -> bool:
        self.runs.append(x)
        return x > self.threshold

    def __call__(self, x: int) -> bool:
        self.runs.append(x)
        return x >= self.threshold


def test_a_method_made_a_step_at_run_time_counts_self(pipe):
    """``self.f = step(self.f)``: the method's code and the instance's attributes are its identity."""
    with pipe:
        scorer = Scorer(3)
        assert [False, True] == [scorer.f(3), scorer.f(4)]
        assert [False, True] == [scorer.f(3), scorer.f(4)]
        scorer.threshold = 2
        assert [True, True] == [scorer.f(3), scorer.f(4)]
    assert [3, 4, 3, 4] == scorer.runs


def test_a_callable_object_counts_its_class_code_and_attributes(pipe):
    """A callable object as a step: its class's ``__call__`` and its attributes, as they are at the call."""

    class Local(Scorer):
        pass

    with pipe:
        scorer = Local(3)
        as_step = pipe.step(scorer, name="scorer")
        assert as_step(3)
        assert as_step(3)
        scorer.threshold = 4
        assert not as_step(3)

        def stricter(self: Scorer, x: int) -> bool:
            self.runs.append(x)
            return x > self.threshold + 10

        Local.__call__ = stricter  # type: ignore[method-assign]
        assert not as_step(3)
        assert not as_step(3)
    assert [3, 3, 3] == scorer.runs


def test_the_code_of_a_decorator_under_step_is_part_of_the_identity(notebook):
    """A wrapper's code counts, with functools.wraps or without, as does the function it wraps."""
    notebook.run("""
        import functools

        def logged(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                return fn(*args, **kwargs) + 1
            return wrapper

        def plain(fn):
            def wrapper(x):
                return fn(x) + 1
            return wrapper

        @pipe.step
        @logged
        def with_wraps(x):
            RUNS.append("with_wraps")
            return x

        @pipe.step(name="without_wraps")
        @plain
        def without_wraps(x):
            RUNS.append("without_wraps")
            return x
    """)
    assert [11, 11] == [notebook["with_wraps"](10), notebook["without_wraps"](10)]
    assert [11, 11] == [notebook["with_wraps"](10), notebook["without_wraps"](10)]
    notebook.run("""
        def logged(fn):
            @functools.wraps(fn)
            def wrapper(*args, **kwargs):
                return fn(*args, **kwargs) + 2
            return wrapper

        def plain(fn):
            def wrapper(x):
                return fn(x) + 2
            return wrapper

        @pipe.step
        @logged
        def with_wraps(x):
            RUNS.append("with_wraps")
            return x

        @pipe.step(name="without_wraps")
        @plain
        def without_wraps(x):
            RUNS.append("without_wraps")
            return x
    """)
    assert [12, 12] == [notebook["with_wraps"](10), notebook["without_wraps"](10)]
    assert ["with_wraps", "without_wraps"] * 2 == notebook.runs


# --------------------------------------------------------------------------------------
# defaults, and what the step changes


def test_a_mutable_default_changed_in_place_counts_as_it_is_at_the_call(notebook):
    """``def scale(n, opts=OPTS)``, then ``OPTS["threshold"] = 10``: the next call reruns."""
    notebook.run("""
        OPTS = {"threshold": 1}

        def factor(x, table=OPTS):
            return x * table["threshold"]

        @pipe.step(key="{n}")
        def scale(n, opts=OPTS):
            RUNS.append("scale")
            return n * opts["threshold"]

        @pipe.step(key="{n}")
        def via_helper(n):
            RUNS.append("via_helper")
            return factor(n)
    """)
    assert [5, 5, 5, 5] == [
        notebook["scale"](5),
        notebook["scale"](5),
        notebook["via_helper"](5),
        notebook["via_helper"](5),
    ]
    notebook["OPTS"]["threshold"] = 10
    assert [50, 50, 50, 50] == [
        notebook["scale"](5),
        notebook["scale"](5),
        notebook["via_helper"](5),
        notebook["via_helper"](5),
    ]
    assert ["scale", "via_helper"] * 2 == notebook.runs


MUTATING = """
import heapq
from resumable import step

CALLS = []
QUEUE = []
SEEN = {}
TOTAL = 0

@step
def record(x):
    global TOTAL
    CALLS.append(x)
    heapq.heappush(QUEUE, x)
    SEEN[x] = True
    TOTAL += x
    return x * 2

print(record(3), record(3), len(CALLS))
"""


def _run(args: list[str], cwd: Path, **kwargs: Any) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RESUMABLE_PROGRESS": "0"}
    done = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        **kwargs,
    )
    assert 0 == done.returncode, done.stderr
    return done.stdout


def test_what_a_step_changes_is_not_an_input_without_source(tmp_path):
    """State the step writes (``append``, ``heappush``, ``D[k] = v``, ``X += ...``) is left out, also under ``python -c``."""
    assert "6 6 1\n" == _run(["-c", MUTATING], tmp_path)
    assert "6 6 0\n" == _run(["-c", MUTATING], tmp_path)  # a fresh process: a skip too


def test_what_a_step_changes_is_not_an_input_in_a_pyc_only_install(tmp_path):
    """A module installed as bytecode only (no .py) is read from its bytecode."""
    import py_compile

    package = tmp_path / "lib"
    package.mkdir()
    (package / "mutating.py").write_text(MUTATING.replace("print(", "RESULT = ("))
    py_compile.compile(str(package / "mutating.py"), cfile=str(package / "mutating.pyc"))
    (package / "mutating.py").unlink()
    program = f"import sys; sys.path.insert(0, {str(package)!r}); import mutating; print(mutating.RESULT)"
    assert "(6, 6, 1)\n" == _run(["-c", program], tmp_path)
    assert "(6, 6, 0)\n" == _run(["-c", program], tmp_path)


def test_a_step_changing_a_global_in_place_is_a_skip_in_the_same_process(pipe):
    """Calling a step that fills a queue again, with the same argument, is a skip."""
    queue: list[int] = []
    runs = []

    @pipe.step(key="{x}")
    def push(x: int) -> int:
        runs.append(x)
        heapq.heappush(queue, x)
        return x

    with pipe:
        assert [2, 2, 1] == [push(2), push(2), push(1)]
    assert [2, 1] == runs


# --------------------------------------------------------------------------------------
# outputs passed back, NumPy types


def test_passing_a_steps_output_back_is_a_skip(pipe):
    """``rows = validate(rows)`` twice in one run: the second is a skip, with no warning."""
    runs = []

    @pipe.step
    def validate(rows: list[dict[str, int]]) -> list[dict[str, int]]:
        runs.append(len(rows))
        return rows

    with pipe:
        rows = [{"a": i} for i in range(100)]
        rows = validate(rows)
        rows = validate(rows)
    assert [100] == runs
    with pipe:
        rows = validate([{"a": i} for i in range(100)])
        rows = validate(rows)
    assert [100] == runs


def test_numpy_types_as_arguments(pipe):
    """``np.dtype("f4")`` and ``np.float32`` fingerprint (alike: they compare equal), other dtypes differ."""
    runs = []

    @pipe.step(key="{n}")
    def zeros(n: int, dtype: Any) -> np.ndarray:
        runs.append(str(np.dtype(dtype)))
        return np.zeros(n, dtype=dtype)

    with pipe:
        assert np.float32 == zeros(3, np.dtype("f4")).dtype
        assert np.float32 == zeros(3, np.float32).dtype
        assert np.float64 == zeros(3, np.float64).dtype
    assert ["float32", "float64"] == runs


# --------------------------------------------------------------------------------------
# concurrency: threads and tasks serving several pipelines


def _reply(t: int, user: int) -> list[dict[str, str]]:
    return [
        {"role": "user", "text": f"message {t} from {user}"},
        {"role": "assistant", "text": f"reply {t} " * 20},
    ]


def test_threads_replaying_conversations_never_rerun_a_turn(tmp_path):
    """
    Ten threads, one state directory per user, each replaying its conversation per request
    (``history += turn(t, history, user)``): every turn runs once, however often replayed.
    """
    runs: list[tuple[int, int]] = []
    lock = threading.Lock()

    @step(key="{t}")
    def turn(t: int, history: list[dict[str, str]], user: int) -> list[dict[str, str]]:
        with lock:
            runs.append((user, t))
        return _reply(t, user)

    errors: list[BaseException] = []

    def serve(user: int) -> None:
        try:
            for _ in range(15):
                with Pipeline(f"user{user}", state_dir=tmp_path / str(user), durable=False) as pipe:
                    history: list[dict[str, str]] = []
                    for t in range(5):
                        history += turn(t, history, user)
                    exit_hooks.forget(pipe)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(user,)) for user in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [] == errors
    assert sorted((user, t) for user in range(10) for t in range(5)) == sorted(runs)


def test_tasks_replaying_conversations_never_rerun_a_turn(tmp_path):
    """The same with asyncio tasks, one per user, and an async step."""
    runs: list[tuple[int, int]] = []

    @step(key="{t}")
    async def aturn(t: int, history: list[dict[str, str]], user: int) -> list[dict[str, str]]:
        runs.append((user, t))
        await asyncio.sleep(0)
        return _reply(t, user)

    async def serve(user: int) -> None:
        for _ in range(20):
            with Pipeline(f"user{user}", state_dir=tmp_path / str(user), durable=False) as pipe:
                history: list[dict[str, str]] = []
                for t in range(5):
                    history += await aturn(t, history, user)
                exit_hooks.forget(pipe)

    async def main() -> None:
        await asyncio.gather(*(serve(user) for user in range(10)))

    asyncio.run(main())
    assert sorted((user, t) for user in range(10) for t in range(5)) == sorted(runs)


# --------------------------------------------------------------------------------------
# in real interpreters: IPython, and scripts edited between processes


IPYTHON = r"""
import json, sys
from IPython.core.interactiveshell import InteractiveShell

shell = InteractiveShell.instance()
cells = json.loads(sys.argv[1])
for cell in cells:
    result = shell.run_cell(cell)
    result.raise_error()
"""

IPYTHON_CELLS = [
    "from resumable import step\nRUNS = []",
    "def helper(x):\n    return x * 3\n",
    "@step\ndef scale(xs):\n    RUNS.append(1)\n    return [helper(x) for x in xs]\n",
    "print(scale([1, 2, 3]), scale([1, 2, 3]), len(RUNS))",
    "def helper(x):\n    return x + 100 + 2 * x\n",
    "print(scale([1, 2, 3]), scale([1, 2, 3]), len(RUNS))",
]


def test_a_helper_defined_again_in_ipython_reruns_the_step(tmp_path):
    """Through real IPython cells: the helper's new definition reruns the step, once."""
    pytest.importorskip("IPython")
    import json

    out = _run(["-c", IPYTHON, json.dumps(IPYTHON_CELLS)], tmp_path)
    assert ["[3, 6, 9] [3, 6, 9] 1", "[103, 106, 109] [103, 106, 109] 2"] == out.split("\n")[-3:-1]


SCRIPT = """
import functools
from resumable import step

RUNS = []

class Scorer:
    def __init__(self, threshold):
        self.threshold = threshold

    def __call__(self, x):
        RUNS.append("object")
        return x > self.threshold

def score(mode, x):
    RUNS.append("partial")
    return f"{mode}:{x}"

def twice(fn):
    @functools.wraps(fn)
    def wrapper(x):
        return fn(x) * 2
    return wrapper

@step
@twice
def wrapped(x):
    RUNS.append("wrapped")
    return x

by_partial = step(functools.partial(score, "MODE"), name="by_partial")
by_object = step(Scorer(THRESHOLD), name="by_object")
print(by_partial(1), by_object(5), wrapped(3), sorted(RUNS))
"""


def test_every_shape_of_callable_reruns_when_a_fresh_process_edits_it(tmp_path):
    """A script run again unchanged skips everything; each edit reruns the step it belongs to only."""
    script = tmp_path / "script.py"

    def run(source: str) -> str:
        script.write_text(source)
        return _run([str(script)], tmp_path).strip()

    base = SCRIPT.replace("THRESHOLD", "3")
    assert "MODE:1 True 6 ['object', 'partial', 'wrapped']" == run(base)
    assert "MODE:1 True 6 []" == run(base)
    assert "fast:1 True 6 ['partial']" == run(base.replace('"MODE"', '"fast"'))
    assert "MODE:1 False 6 ['object', 'partial']" == run(SCRIPT.replace("THRESHOLD", "7"))
    assert "MODE:1 False 9 ['wrapped']" == run(SCRIPT.replace("THRESHOLD", "7").replace("* 2", "* 3"))


def test_an_edited_helper_reruns_in_a_python_i_session_fed_by_a_pipe(tmp_path):
    """``python -i`` reading a session from a pipe (no source for its functions): redefinition reruns."""
    session = textwrap.dedent("""\
        from resumable import step
        RUNS = []
        def helper(x):
            return x * 3

        @step
        def scale(x):
            RUNS.append(1)
            return helper(x)

        print("first", scale(2), scale(2), len(RUNS))
        def helper(x):
            return x * 4

        print("second", scale(2), scale(2), len(RUNS))
    """)
    out = _run(["-i", "-q"], tmp_path, input=session)
    assert ["first 6 6 1", "second 8 8 2"] == [
        line.strip(">. ") for line in out.splitlines() if "first" in line or "second" in line
    ]
