"""
Code digests: a step reruns when its logic changes, not when its text moves.

The digest of a function is taken from its syntax tree (comments, whitespace,
docstring, decorators, annotations and line numbers left out), so reformatting,
documenting or moving a function keeps its outputs. What the function refers to by
a global or closure name is part of the digest too:

- plain functions defined in the same module (transitively),
- other steps (their version if pinned, else their code digest),
- constants of simple types (str, bytes, numbers, bool, None and tuples of them),
  so editing ``PROMPT = "..."`` or ``MODEL = "..."`` reruns the steps that use it.

Code from other modules and installed packages is not; pin ``version=`` when such a
change should rerun a step. When the source is unavailable the bytecode is hashed
instead, which also changes across Python versions.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import textwrap
import types
import weakref
from collections.abc import Callable
from typing import Any

from ._fingerprint import _Unhashable, digest_value

# AST fields that never change what code does.
_SKIP_FIELDS = frozenset({"ctx", "type_comment", "kind"})
_TOP_SKIP = frozenset({"name", "decorator_list", "returns", "type_params"})
_CONSTANT_TYPES = (str, bytes, int, float, complex, bool, type(None))
_MAX_CONSTANT_ITEMS = 10_000

_cache: weakref.WeakKeyDictionary[types.FunctionType, str] = weakref.WeakKeyDictionary()
# Source lines of modules, as they were when their first step was decorated: a file edited
# while the script runs must not change the digest of the code that is running.
_snapshots: dict[str, list[str]] = {}


def snapshot_source(fn: object) -> None:
    """Keep the source file of *fn* as it is now (called when a step is decorated)."""
    code = getattr(inspect.unwrap(fn), "__code__", None)  # type: ignore[arg-type]
    if isinstance(code, types.CodeType):
        # decorating runs while the module executes: the file now is the code now (a module
        # reloaded after an edit is snapshotted again)
        linecache.checkcache(code.co_filename)
        lines = linecache.getlines(code.co_filename, getattr(fn, "__globals__", None))
        if lines:
            _snapshots[code.co_filename] = list(lines)


def _source(fn: types.FunctionType) -> str | None:
    code = fn.__code__
    lines = _snapshots.get(code.co_filename) or linecache.getlines(code.co_filename, fn.__globals__)
    start = code.co_firstlineno - 1
    if not lines or start >= len(lines):
        return None
    return "".join(inspect.getblock(lines[start:]))


def _canon(node: ast.AST, out: list[str], *, top: bool = False) -> None:
    out.append(type(node).__name__)
    out.append("(")
    for field in node._fields:
        if field in _SKIP_FIELDS or (top and field in _TOP_SKIP):
            continue
        if field == "annotation" and isinstance(node, ast.arg):
            continue
        value = getattr(node, field, None)
        if top and field == "body" and isinstance(value, list):
            value = _without_docstring(value)
        if value is None or (isinstance(value, list) and not value):
            continue
        out.append(field)
        out.append("=")
        if isinstance(value, ast.AST):
            _canon(value, out)
        elif isinstance(value, list):
            out.append("[")
            for item in value:
                if isinstance(item, ast.AST):
                    _canon(item, out)
                else:
                    out.append(repr(item))
                out.append(",")
            out.append("]")
        else:
            out.append(repr(value))
        out.append(";")
    out.append(")")


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return body[1:] or [ast.Pass()]
    return body


def _source_digest(fn: types.FunctionType) -> str | None:
    try:
        source = _source(fn)
        if source is None:
            return None
        tree = ast.parse(textwrap.dedent(source))
    except (SyntaxError, ValueError):  # ValueError: a null byte; IndentationError is a SyntaxError
        return None
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    if fn.__name__ == "<lambda>":
        matches: list[ast.AST] = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)]
    else:
        matches = [n for n in ast.walk(tree) if isinstance(n, kinds) and n.name == fn.__name__]
    if not matches:
        return None
    if len(matches) > 1 and fn.__name__ == "<lambda>":
        return None  # several lambdas on one line: cannot tell which one this is
    out: list[str] = []
    _canon(matches[0], out, top=True)
    return hashlib.sha256("".join(out).encode()).hexdigest()


def _bytecode_digest(code: types.CodeType, doc: str | None, extra: bytes) -> str:
    h = hashlib.sha256(extra)

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            elif not (doc is not None and const == doc and c is code):
                h.update(repr(const).encode())

    feed(code)
    return h.hexdigest()


def function_digest(fn: types.FunctionType) -> str:
    """Digest of one function's own logic (not of what it calls)."""
    digest = _cache.get(fn)
    if digest is None:
        digest = _source_digest(fn)
        if digest is None:
            defaults = repr((fn.__defaults__, fn.__kwdefaults__)).encode()
            digest = "bytecode:" + _bytecode_digest(fn.__code__, fn.__doc__, defaults)
        _cache[fn] = digest
    return digest


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _constant_digest(value: object) -> str | None:
    if isinstance(value, _CONSTANT_TYPES) and type(value) in _CONSTANT_TYPES:
        pass
    elif type(value) in {tuple, frozenset}:
        items: Any = value
        if len(items) > _MAX_CONSTANT_ITEMS or not all(type(v) in _CONSTANT_TYPES for v in items):
            return None
    else:
        return None
    try:
        return digest_value(value)[:16]
    except _Unhashable:  # pragma: no cover - every constant type is hashable
        return None


def code_components(fn: types.FunctionType, step_identity: Callable[[object], str | None]) -> dict[str, str]:
    """
    The digests that make up a step's code identity, by component name.

    ``code`` is the function itself; ``fn NAME``, ``step NAME`` and ``const NAME`` are what
    it refers to. *step_identity* returns the identity of an object if it is a step.
    """
    components: dict[str, str] = {}
    seen: set[types.CodeType] = set()

    def visit(func: types.FunctionType, label: str) -> None:
        if func.__code__ in seen:
            return
        seen.add(func.__code__)
        components[label] = function_digest(func)[:16]
        refs: list[tuple[str, object]] = []
        namespace = func.__globals__
        refs.extend((n, namespace[n]) for n in sorted(_names(func.__code__)) if n in namespace)
        for name, cell in zip(func.__code__.co_freevars, func.__closure__ or (), strict=False):
            try:
                refs.append((name, cell.cell_contents))
            except ValueError:  # an empty cell (the closure variable is not assigned yet)
                continue
        for name, value in refs:
            if name.startswith("__"):
                continue
            identity = step_identity(value)
            if identity is not None:
                components[f"step {name}"] = identity[:16]
            elif isinstance(value, types.FunctionType) and value.__module__ == fn.__module__:
                visit(value, f"fn {name}")
            else:
                constant = _constant_digest(value)
                if constant is not None:
                    components[f"const {name}"] = constant

    visit(fn, "code")
    return components


def combine(components: dict[str, str]) -> str:
    """One digest for a set of components."""
    text = ";".join(f"{k}={v}" for k, v in sorted(components.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def describe_change(old: dict[str, str] | None, new: dict[str, str]) -> str:
    """A short phrase saying which components differ, e.g. ``fn clean, const PROMPT``."""
    if not old:
        return ""
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    labels = ["its own code" if k == "code" else k for k in changed]
    return ", ".join(labels[:5]) + (" ..." if len(labels) > 5 else "")
