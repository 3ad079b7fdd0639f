"""
Code digests (_codehash): a step's identity follows its logic, the same-module helpers it
calls and the constants it reads, not its comments, docstring, decorators or position.

Functions under test are written to real .py files in tmp_path and imported with importlib,
so ``inspect.getsource`` reads them as it reads user code.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import linecache
import logging
import os
import sys
import textwrap
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from resumable import Pipeline, _codehash, _codeshape
from resumable._codehash import combine, describe_change, function_digest
from resumable._codeshape import check_identity, code_shape
from resumable._step import _step_of

ModuleFactory = Callable[..., types.ModuleType]


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleFactory:
    """Write source to a uniquely named module in tmp_path and import it (removed afterwards)."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(source: str, name: str | None = None) -> types.ModuleType:
        name = name or f"codehash_{uuid.uuid4().hex[:12]}"
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(source))
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)
        spec.loader.exec_module(module)
        return module

    return make


def digest_of(fn: types.FunctionType) -> str:
    """function_digest computed afresh."""
    return function_digest(fn, _codehash._function_node(fn))


def components_of(fn: types.FunctionType) -> dict[str, str]:
    """Every digest of *fn*'s code identity computed afresh, with steps identified as the runner does."""
    shape = code_shape(fn, _step_of)
    found = shape.values(None, ())
    assert found is not None
    return {**shape.static, **found[0]}


def function_without_source(source: str, filename: str) -> types.FunctionType:
    """The first function defined by *source*, compiled from a string: inspect cannot find its source."""
    module_code = compile(textwrap.dedent(source), filename, "exec")
    code = next(c for c in module_code.co_consts if isinstance(c, types.CodeType))
    return types.FunctionType(code, {"__name__": "nosource"})


BASE = """
def helper(x):
    return x * 2


def total(items, scale=3):
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
"""

COSMETIC = {
    "comments": """
# a comment above
def helper(x):
    return x * 2  # doubled


def total(items, scale=3):  # the step
    # start at zero
    result = 0
    for item in items:
        result += helper(item) * scale  # accumulate
    return result
""",
    "whitespace and line breaks": """
def helper(x):
    return x * 2
def total(items,
          scale = 3):

    result  =  0

    for item in (
        items
    ):
        result += (helper(item)
                   * scale)
    return (result)
""",
    "docstring": '''
def helper(x):
    """Double it."""
    return x * 2


def total(items, scale=3):
    """
    Add up the doubled items, scaled.

    A long explanation that changes nothing.
    """
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
''',
    "decorator arguments": """
def decorate(**options):
    return lambda fn: fn


def helper(x):
    return x * 2


@decorate(retries=5, name="renamed")
@decorate(version=None)
def total(items, scale=3):
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
""",
    "type annotations": """
from __future__ import annotations


def helper(x: int) -> int:
    return x * 2


def total(items: list[int], scale: int = 3) -> int:
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
""",
    "moved further down": """
import math

UNRELATED = [1, 2, 3]


def unrelated(y):
    return math.sqrt(y)



class Unrelated:
    pass


def helper(x):
    return x * 2


def total(items, scale=3):
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
""",
    "unrelated module code changed": """
OTHER = "edited"


def helper(x):
    return x * 2


def unused_helper(z):
    return z - 100


def total(items, scale=3):
    result = 0
    for item in items:
        result += helper(item) * scale
    return result
""",
}


@pytest.mark.parametrize("source", list(COSMETIC.values()), ids=list(COSMETIC))
def test_cosmetic_edits_keep_the_digest(modules, source):
    """Comments, whitespace, docstrings, decorators, annotations and position do not count."""
    base = modules(BASE)
    edited = modules(source)
    assert digest_of(base.total) == digest_of(edited.total)
    assert components_of(base.total) == components_of(edited.total)
    assert {"code", "fn helper"} == set(components_of(edited.total))


LOGIC = {
    "operator": BASE.replace("helper(item) * scale", "helper(item) + scale"),
    "literal": BASE.replace("result = 0", "result = 1"),
    "default value": BASE.replace("scale=3", "scale=4"),
    "added statement": BASE.replace("    result = 0\n", "    result = 0\n    items = sorted(items)\n"),
    "renamed parameter": BASE.replace("items", "values"),
    "keyword-only parameter": BASE.replace("scale=3", "*, scale=3"),
    "return changed": BASE.replace("return result", "return -result"),
    "calls another function": BASE.replace("helper(item) * scale", "abs(item) * scale"),
}


@pytest.mark.parametrize("source", list(LOGIC.values()), ids=list(LOGIC))
def test_logic_edits_change_the_digest(modules, source):
    """Editing what the function does changes function_digest and the combined identity."""
    base = modules(BASE)
    edited = modules(source)
    assert digest_of(base.total) != digest_of(edited.total)
    assert combine(components_of(base.total)) != combine(components_of(edited.total))
    assert "its own code" in describe_change(components_of(base.total), components_of(edited.total))


def test_default_values_count_in_the_same_process(modules):
    """Two functions differing only by a default value have different digests, cache or not."""
    one = modules("def f(x=1):\n    return x\n")
    two = modules("def f(x=2):\n    return x\n")
    assert digest_of(one.f) != digest_of(two.f)


def test_source_edited_after_import_does_not_change_the_digest(modules):
    """A function whose file is edited while the script runs keeps the digest of the code it runs."""
    running = modules(BASE)
    check_identity(running.total)  # what decorating a step does, at import time
    reference = digest_of(modules(BASE).total)
    path = Path(running.__file__)
    path.write_text(textwrap.dedent(BASE.replace("result = 0", "result = 1000")))
    os.utime(path, (1, 1))  # a different mtime, as after any edit
    assert 18 == running.total([1, 2])  # still the code that was imported
    assert reference == digest_of(running.total)


# --------------------------------------------------------------------------------------
# what the function refers to


def test_same_module_helper_is_part_of_the_identity(modules):
    """Editing a helper in the same module changes the components, not the step's own digest."""
    base = modules(BASE)
    edited = modules(BASE.replace("return x * 2", "return x * 3"))
    old, new = components_of(base.total), components_of(edited.total)
    assert digest_of(base.total) == digest_of(edited.total)
    assert old["code"] == new["code"]
    assert old["fn helper"] != new["fn helper"]
    assert "fn helper" == describe_change(old, new)


NESTED_HELPERS = """
def innermost(x):
    return x + 1


def inner(x):
    return innermost(x) * 2


def outer(x):
    return inner(x) - 1


def step_fn(items):
    return [outer(i) for i in items]
"""


def test_helpers_of_helpers_are_followed(modules):
    """A helper of a helper of a helper is part of the digest (transitively)."""
    base = modules(NESTED_HELPERS)
    edited = modules(NESTED_HELPERS.replace("return x + 1", "return x + 2"))
    old, new = components_of(base.step_fn), components_of(edited.step_fn)
    assert {"code", "fn outer", "fn inner", "fn innermost"} == set(old)
    assert "fn innermost" == describe_change(old, new)
    assert combine(old) != combine(new)


def test_helpers_from_other_modules_are_not_followed(modules):
    """A helper imported from another module is not part of the digest (use version= for that)."""
    helper_v1 = modules("def helper(x):\n    return x * 2\n")
    helper_v2 = modules("def helper(x):\n    return x * 3\n")
    source = "from {mod} import helper\n\n\ndef step_fn(x):\n    return helper(x)\n"
    uses_v1 = modules(source.format(mod=helper_v1.__name__))
    uses_v2 = modules(source.format(mod=helper_v2.__name__))
    assert 2 == uses_v1.step_fn(1)
    assert 3 == uses_v2.step_fn(1)
    assert components_of(uses_v1.step_fn) == components_of(uses_v2.step_fn)
    assert ["code"] == list(components_of(uses_v1.step_fn))


def test_installed_package_code_is_not_followed(modules):
    """Calls into the standard library or packages add nothing to the components."""
    module = modules(
        "import json\nimport textwrap\n\n\ndef step_fn(x):\n    return json.dumps(textwrap.dedent(x))\n"
    )
    assert ["code"] == list(components_of(module.step_fn))


CONSTANTS = '''
PROMPT = "Summarise the text:"
MODELS = ("small", "large")
LIMIT = 3
SETTINGS = {"temperature": 0}


def render(text):
    return f"{PROMPT} {text}"


def step_fn(text):
    """Uses constants directly and through a helper."""
    return [render(text), MODELS[:LIMIT], SETTINGS]
'''


@pytest.mark.parametrize(
    ("old", "new", "changed"),
    [
        ('PROMPT = "Summarise the text:"', 'PROMPT = "Summarize:"', "const PROMPT"),
        ('MODELS = ("small", "large")', 'MODELS = ("small", "huge")', "const MODELS"),
        ("LIMIT = 3", "LIMIT = 4", "const LIMIT"),
        ('{"temperature": 0}', '{"temperature": 1}', "const SETTINGS"),
    ],
)
def test_module_constants_are_part_of_the_identity(modules, old, new, changed):
    """Editing a constant the step (or its helper) reads, containers included, changes the identity."""
    base = modules(CONSTANTS)
    edited = modules(CONSTANTS.replace(old, new))
    before, after = components_of(base.step_fn), components_of(edited.step_fn)
    assert {"code", "fn render", "const PROMPT", "const MODELS", "const LIMIT", "const SETTINGS"} == set(
        before
    )
    assert changed == describe_change(before, after)
    assert digest_of(base.step_fn) == digest_of(edited.step_fn)


def test_module_values_are_read_at_call_time(modules):
    """A global reassigned or changed in place between calls is seen by the next call."""
    base = modules(CONSTANTS)
    first = components_of(base.step_fn)
    base.SETTINGS["temperature"] = 0.5
    changed_in_place = components_of(base.step_fn)
    base.LIMIT = 4
    reassigned = components_of(base.step_fn)
    assert "const SETTINGS" == describe_change(first, changed_in_place)
    assert "const LIMIT" == describe_change(changed_in_place, reassigned)


WRITTEN = """
import threading

CALLS = []
CACHE = {}
TOTAL = 0
LOCK = threading.Lock()


def step_fn(x):
    global TOTAL
    CALLS.append(x)
    CACHE[x] = x
    TOTAL += x
    with LOCK:
        return x
"""


def test_state_the_step_writes_is_not_an_input(modules):
    """Values the step changes itself (a call log, a cache, a global total) and locks are left out."""
    mod = modules(WRITTEN)
    before = components_of(mod.step_fn)
    mod.step_fn(3)
    assert {"code"} == set(before)
    assert before == components_of(mod.step_fn)
    shape = _codeshape.code_shape(mod.step_fn, _step_of)
    assert {
        "CALLS": "changed by the step",
        "CACHE": "changed by the step",
        "TOTAL": "changed by the step",
    } == shape.left_out
    found = shape.values(None, ())
    assert found is not None
    _, left_out = found
    assert {"LOCK": "_thread.lock"} == left_out


HELPERS = """
import functools


@functools.lru_cache
def cached(x):
    return x + {cached}


def double(x):
    return 2 * x


def triple(x):
    return 3 * x


DISPATCH = {{"double": double, "triple": triple}}


def step_fn(op, x):
    return DISPATCH[op](cached(x))
"""


def test_helpers_behind_decorators_and_in_dispatch_tables_are_followed(modules):
    """A helper wrapped in lru_cache and functions held by a dispatch dict are part of the digest."""
    base = components_of(modules(HELPERS.format(cached=1)).step_fn)
    cached = components_of(modules(HELPERS.format(cached=2)).step_fn)
    table = components_of(modules(HELPERS.format(cached=1).replace("return 3 * x", "return 4 * x")).step_fn)
    assert {"code", "fn cached", "table DISPATCH", "fn DISPATCH['double']", "fn DISPATCH['triple']"} == set(
        base
    )
    assert "fn cached" == describe_change(base, cached)
    assert "fn DISPATCH['triple']" == describe_change(base, table)


CLOSURE = """
def make():
    limit = {limit}

    def inner(x):
        return min(x, limit)

    return inner
"""


def test_closure_constants_are_part_of_the_identity(modules):
    """A constant captured by a closure counts like a module constant."""
    three = modules(CLOSURE.format(limit=3)).make()
    four = modules(CLOSURE.format(limit=4)).make()
    old, new = components_of(three), components_of(four)
    assert {"code", "const limit"} == set(old)
    assert "const limit" == describe_change(old, new)


STEPS = """
from resumable import Pipeline

pipe = Pipeline("codehash-steps")


@pipe.step(name="fetch_{tag}", version="3")
def fetch():
    return {body}


@pipe.step(name="parse_{tag}")
def parse():
    return {body}


def step_fn():
    return fetch(), parse()
"""


def test_steps_called_are_identified_by_their_identity(modules):
    """A step calling steps records their identity: the version if pinned, else their code digest."""
    base = modules(STEPS.format(tag="a", body=1))
    edited = modules(STEPS.format(tag="b", body=2))
    old, new = components_of(base.step_fn), components_of(edited.step_fn)
    assert {"code", "step fetch", "step parse"} == set(old)
    assert "version:3"[:16] == old["step fetch"]
    assert old["step fetch"] == new["step fetch"]  # pinned: its code edit does not propagate
    assert old["step parse"] != new["step parse"]
    assert "step parse" == describe_change(old, new)


# --------------------------------------------------------------------------------------
# recursion, lambdas, methods, no source


RECURSIVE = """
def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)


def is_even(n):
    return True if n == 0 else is_odd(n - 1)


def is_odd(n):
    return False if n == 0 else is_even(n - 1)
"""


def test_recursion_terminates(modules):
    """A self-recursive function and two mutually recursive ones have finite components."""
    module = modules(RECURSIVE)
    assert ["code"] == list(components_of(module.fact))
    assert {"code", "fn is_odd"} == set(components_of(module.is_even))
    assert {"code", "fn is_even"} == set(components_of(module.is_odd))
    assert 120 == module.fact(5)


def test_mutual_recursion_follows_the_cycle(modules):
    """Editing is_odd changes the components of is_even, which it calls through the cycle."""
    base = modules(RECURSIVE)
    edited = modules(
        RECURSIVE.replace("False if n == 0 else is_even(n - 1)", "False if n == 0 else not is_odd(n - 1)")
    )
    assert "fn is_odd" == describe_change(components_of(base.is_even), components_of(edited.is_even))


LAMBDAS = """
double = lambda x: x * 2  # noqa
"""


def test_lambda_digest_follows_its_logic(modules):
    """A lambda's digest comes from its source: moved or commented it stays, edited it changes."""
    base = modules(LAMBDAS)
    moved = modules("\n\n\nOTHER = 1\n" + LAMBDAS.replace("# noqa", "# doubled"))
    edited = modules(LAMBDAS.replace("x * 2", "x * 3"))
    assert not digest_of(base.double).startswith("bytecode:")
    assert digest_of(base.double) == digest_of(moved.double)
    assert digest_of(base.double) != digest_of(edited.double)


def test_two_lambdas_on_one_line_use_bytecode(modules):
    """Two lambdas on one line cannot be told apart by source: their bytecode is hashed instead."""
    module = modules("pair = (lambda x: x + 1, lambda x: x - 1)\n")
    first, second = digest_of(module.pair[0]), digest_of(module.pair[1])
    assert [True, True] == [first.startswith("bytecode:"), second.startswith("bytecode:")]
    assert first != second


METHOD = """
class Client:
    def fetch(self, url):
        return url.upper()
"""


def test_methods_are_hashed_from_their_indented_source(modules):
    """A method's source is dedented and parsed; moving its class does not matter."""
    base = modules(METHOD)
    moved = modules("\n\nX = 1\n\n" + METHOD)
    edited = modules(METHOD.replace("upper", "lower"))
    assert not digest_of(base.Client.fetch).startswith("bytecode:")
    assert digest_of(base.Client.fetch) == digest_of(moved.Client.fetch)
    assert digest_of(base.Client.fetch) != digest_of(edited.Client.fetch)


ASYNC = '''
async def fetch(url):
    """Fetch it."""
    return url
'''


def test_async_functions_are_hashed_from_source(modules):
    """async def steps are digested like plain ones: the docstring does not count, logic does."""
    base = modules(ASYNC)
    undocumented = modules(ASYNC.replace('    """Fetch it."""\n', ""))
    edited = modules(ASYNC.replace("return url", "return url * 2"))
    assert digest_of(base.fetch) == digest_of(undocumented.fetch)
    assert digest_of(base.fetch) != digest_of(edited.fetch)


NO_SOURCE = '''
def f(x):
    """Doc."""
    y = x + 1
    return y * 2
'''


def test_bytecode_fallback_without_source():
    """A function whose source cannot be found is digested from its bytecode, docstring left out."""
    tag = uuid.uuid4().hex
    base = function_without_source(NO_SOURCE, f"<no-source-{tag}>")
    moved = function_without_source("\n\n\n" + NO_SOURCE, f"<moved-{tag}>")
    documented = function_without_source(NO_SOURCE.replace("Doc.", "Other documentation."), f"<doc-{tag}>")
    edited = function_without_source(NO_SOURCE.replace("x + 1", "x + 2"), f"<edited-{tag}>")
    renamed_local = function_without_source(NO_SOURCE.replace("y", "z"), f"<renamed-{tag}>")
    assert "Doc." == base.__doc__
    assert digest_of(base).startswith("bytecode:")
    assert digest_of(base) == digest_of(moved)
    assert digest_of(base) == digest_of(documented)
    assert digest_of(base) != digest_of(edited)
    assert digest_of(base) != digest_of(renamed_local)


def test_linecache_source_is_used_when_registered(modules, monkeypatch):
    """With its source in linecache (as in notebooks), an exec'd function is digested from source."""
    filename = f"<cell-{uuid.uuid4().hex}>"
    source = textwrap.dedent(NO_SOURCE)
    monkeypatch.setitem(linecache.cache, filename, (len(source), None, source.splitlines(True), filename))
    from_cell = function_without_source(NO_SOURCE, filename)
    from_file = modules(NO_SOURCE)
    assert not digest_of(from_cell).startswith("bytecode:")
    assert digest_of(from_file.f) == digest_of(from_cell)


# --------------------------------------------------------------------------------------
# describe_change, and the whole chain through a pipeline


def test_describe_change():
    """describe_change names changed, added and removed components, sorted, at most five."""
    old = {"code": "a", "fn helper": "b", "const PROMPT": "c"}
    assert "" == describe_change(None, old)
    assert "" == describe_change({}, old)
    assert "" == describe_change(old, dict(old))
    assert "its own code" == describe_change(old, {**old, "code": "z"})
    assert "const PROMPT, fn helper" == describe_change(old, {**old, "fn helper": "z", "const PROMPT": "z"})
    assert "const MODEL, fn helper" == describe_change(
        old, {"code": "a", "const PROMPT": "c", "const MODEL": "m"}
    )
    many = {f"const C{i}": str(i) for i in range(7)}
    assert "const C0, const C1, const C2, const C3, const C4 ..." == describe_change(many, {})


def test_combine_is_order_free_and_sensitive():
    """combine() gives one digest per set of components, whatever their order."""
    components = {"code": "a", "fn helper": "b"}
    assert combine(components) == combine(dict(reversed(components.items())))
    assert combine(components) != combine({**components, "fn helper": "c"})
    assert 32 == len(combine(components))


PIPELINE_STEP = '''
PROMPT = "{prompt}"


def answer(question):
    """Answer it."""{comment}
    return PROMPT + question
'''


def test_code_change_reruns_a_step_and_says_why(state_dir, modules, caplog):
    """Through a pipeline: a comment edit skips; a constant edit reruns with reason and log naming it."""

    def run(module: types.ModuleType) -> str:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:
            answer = pipe.step(name="answer")(module.answer)
            assert module.PROMPT + "why?" == answer("why?")
            return pipe.status().steps["answer"].reason

    v1 = modules(PIPELINE_STEP.format(prompt="Be brief: ", comment=""))
    v1_commented = modules(PIPELINE_STEP.format(prompt="Be brief: ", comment="  # edited comment"))
    v2 = modules(PIPELINE_STEP.format(prompt="Be thorough: ", comment=""))
    with caplog.at_level(logging.INFO, logger="resumable"):
        reasons = [run(v1), run(v1_commented), run(v2)]
    assert ["new", "new", "code changed"] == reasons
    running = [r.getMessage() for r in caplog.records if "running" in r.getMessage()]
    assert 2 == len(running)
    assert "code changed (const PROMPT)" in running[1]
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert 1 == len(skipped)


_TRICKY = '''
import functools


def comment_at_column_zero(x):
    y = x + 1
# a comment at column 0 inside the body
    return y * 2


def string_at_column_zero(x):
    text = """
not code: at column 0
"""
    return text + str(x)


def continued(x):
    total = x + \\
1
    return total


def signature_on_lines(
    a,
    b,
):
    return a + b


@functools.lru_cache(
    maxsize=None,
)
def decorated_on_lines(x):
    return x


def outer(x):
    def inner(y):
        return y + x
# between
    return inner


class Holder:
    @staticmethod
    def method(x):
        return x - 1

    def other(self):
        return 2
'''


def _both_ways(fn: types.FunctionType) -> tuple[ast.AST | None, ast.AST | None]:
    lines = linecache.getlines(fn.__code__.co_filename, fn.__globals__)
    index = _codehash._module_nodes(fn.__code__.co_filename, lines)
    assert index is not None
    return _codehash._own_lines_node(fn, lines), _codehash._indexed(fn, index)


def _canon(node: ast.AST | None) -> str:
    assert node is not None
    return _codehash._canon(node, top=True)


def test_a_function_is_found_whole_in_its_file(tmp_path: Path):
    """Comments and strings at column 0, continued lines, nested and decorated functions: each is found whole."""
    path = tmp_path / "tricky_module.py"
    path.write_text(_TRICKY)
    spec = importlib.util.spec_from_file_location("tricky_module", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    functions = [
        module.comment_at_column_zero,
        module.string_at_column_zero,
        module.continued,
        module.signature_on_lines,
        module.decorated_on_lines.__wrapped__,
        module.outer,
        module.outer(1),
        module.Holder.method,
        module.Holder.other,
    ]
    alone = 0
    for fn in functions:
        assert _canon(_codehash._function_node(fn)).count("Return(") == 1 + (fn is module.outer), fn
        own, whole = _both_ways(fn)
        if own is not None:  # its own lines parsed alone: the node the whole file gives
            alone += 1
            assert _canon(own) == _canon(whole), fn.__name__
    assert alone >= 5  # the plain ones need no parse of the whole file
    assert "not code: at column 0" in _canon(_codehash._function_node(module.string_at_column_zero))


def test_every_function_of_the_package_reads_the_same_from_its_own_lines():
    """Over resumable's own modules: its own lines never give another node than the whole file."""
    import resumable

    checked = 0
    for path in sorted(Path(resumable.__file__).parent.rglob("*.py")):
        if path.name == "__main__.py":
            continue  # importing it runs the command line
        name = "resumable." + ".".join(
            path.relative_to(Path(resumable.__file__).parent).with_suffix("").parts
        )
        module = importlib.import_module(name.removesuffix(".__init__"))
        for value in list(vars(module).values()):
            candidates = [value, *vars(value).values()] if isinstance(value, type) else [value]
            for fn in candidates:
                fn = getattr(fn, "__func__", fn)
                if not isinstance(fn, types.FunctionType) or fn.__module__ != module.__name__:
                    continue
                own, whole = _both_ways(fn)
                if own is not None and whole is not None:
                    assert _canon(whole) == _canon(own), f"{name}.{fn.__qualname__}"
                    checked += 1
    assert checked > 300


def test_a_comment_after_a_method_does_not_change_its_digest(tmp_path: Path):
    """A method's multi-line string is read as its file holds it, whatever follows the method."""
    method = 'class Holder:\n    def text(self):\n        return """one\n        two"""\n'
    digests = []
    for i, tail in enumerate(["", "# a comment at column 0\n", "\n\nX = 1\n"]):
        path = tmp_path / f"holder_{i}.py"
        path.write_text(method + tail)
        spec = importlib.util.spec_from_file_location(f"holder_{i}", path)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fn = module.Holder.text
        own, whole = _both_ways(fn)
        assert own is not None
        assert _canon(whole) == _canon(own)
        digests.append(function_digest(fn, _codehash._function_node(fn)))
    assert 1 == len(set(digests))


def test_a_value_changed_in_place_gets_a_new_digest_the_same_object_unchanged_the_same():
    """The digest of plain data a step reads is reused only when it packs to the very same bytes."""
    table = {"k": 1, "rows": [1, 2, 3]}
    first = _codehash.value_digest(table)
    assert first == _codehash.value_digest(table)
    table["rows"].append(4)  # in place, one level down
    changed = _codehash.value_digest(table)
    assert changed != first
    assert changed == _codehash.value_digest({"k": 1, "rows": [1, 2, 3, 4]})  # by value, not by object
    table["rows"].pop()
    assert first == _codehash.value_digest(table)


def test_the_sources_why_shows_are_made_only_when_asked(monkeypatch: pytest.MonkeyPatch):
    """Unparsing a step's code is for `resumable why`: a skip, which only needs the digests, never does it."""

    def helper(x: int) -> int:
        """Doubles."""
        return 2 * x

    def fn(x: int) -> int:
        return helper(x) + 1

    made: list[ast.AST] = []
    real = _codeshape.normalized_source
    monkeypatch.setattr(_codeshape, "normalized_source", lambda node: made.append(node) or real(node))
    shape = _codeshape.code_shape(fn, _step_of)
    assert [] == made
    sources = shape.sources()
    assert {"code", "fn helper"} == set(sources)
    assert "return 2 * x" in sources["fn helper"]
    assert "Doubles" not in sources["fn helper"]
    assert 2 == len(made)
    assert sources is shape.sources()  # made once


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _changed_by_definition(node: ast.AST) -> set[str]:
    names: set[str] = set()
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Global, ast.Nonlocal)):
            names.update(sub.names)
        elif (
            isinstance(sub, ast.Call)
            and isinstance(sub.func, ast.Attribute)
            and sub.func.attr in _codeshape._MUTATORS
        ):
            root = _root_name(sub.func.value)
            if root is not None:
                names.add(root)
        else:
            targets: list[ast.AST] = []
            if isinstance(sub, (ast.Assign, ast.Delete)):
                targets = list(sub.targets)
            elif isinstance(sub, (ast.AugAssign, ast.AnnAssign)):
                targets = [sub.target]
            for target in targets:
                if isinstance(target, (ast.Subscript, ast.Attribute)):
                    root = _root_name(target)
                    if root is not None:
                        names.add(root)
    return names


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _real_modules() -> list[types.ModuleType]:
    import inspect
    import json
    import textwrap as tw

    import resumable._batch as batch
    import resumable._history as history
    import resumable._manifest as manifest

    return [json.decoder, tw, ast, inspect, batch, history, manifest]


def test_the_names_code_changes_are_read_from_its_bytecode_as_its_syntax_tree_says():
    """
    What a function changes (``X.append``, ``X[k] = v``, ``X.a += 1``, ``del X[k]``, a
    ``global`` assigned) is read from its bytecode, and gives what its syntax tree says for
    every function of several real modules (the global and closure names among them).
    """
    compared = 0
    for module in _real_modules():
        source = Path(module.__file__).read_text()
        codes = {(c.co_name, c.co_firstlineno): c for c in _code_objects(compile(source, "m", "exec"))}
        for node in ast.walk(ast.parse(source)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            code = codes.get((node.name, first))
            if code is None:
                continue
            # what the header holds (defaults, annotations) runs outside the function
            node.decorator_list, node.returns = [], None
            node.args = ast.arguments(posonlyargs=[], args=[], kwonlyargs=[], kw_defaults=[], defaults=[])
            names = _codeshape._global_names(code) | set(code.co_freevars)
            changed = {n for n in _codeshape.changed_names(code) if not n.startswith("self.")}
            assert {n for n in _changed_by_definition(node) if n in names} == changed
            compared += 1
    assert compared > 400


def test_what_code_changes_is_seen_in_every_form():
    """Methods, subscripts, attributes, augmented assignments, heapq and bisect calls, in comprehensions and handlers."""
    source = textwrap.dedent("""
        import heapq
        from bisect import insort

        def f(x):
            global X
            CALLS.append(x)
            heapq.heappush(Q, x)
            D[x] = 1
            G[x][0] += 1
            X += 1
            A.b.c = 2
            del E[x]
            insort(H, x)
            K.a += 1
            R.append(1 if x else 2)
            try:
                pass
            except Exception as e:
                ERRORS.append(str(e))
            [S.add(i) for i in range(3)]
            local = list(READ)
            local.append(1)
            return len(READ2) + READ3[x] + READ4.get(x) + sorted(READ5)[0] + (READ6 if x else READ7)[0]
    """)
    namespace: dict[str, object] = {}
    exec(compile(source, "<no source>", "exec"), namespace)  # noqa: S102 - code with no file behind it
    fn = namespace["f"]
    assert isinstance(fn, types.FunctionType)
    assert {"A", "CALLS", "D", "E", "ERRORS", "G", "H", "K", "Q", "R", "S", "X"} == _codeshape.changed_names(
        fn.__code__
    )
