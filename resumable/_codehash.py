"""
Code digests: a step reruns when its logic changes, not when its text moves.

A function's digest is taken from its syntax tree (comments, whitespace, docstring,
decorators, annotations and line numbers left out), or from its bytecode when its source
cannot be found. What a step's code refers to (same-module helpers and dispatch tables,
other steps, the values it reads) is followed by :mod:`._codeshape`; code from other
modules is not (pin ``version=`` for that).
"""

from __future__ import annotations

import ast
import copy
import linecache
import types
from itertools import islice
from typing import Any

import blake3

from ._codec import encode, value_checksum
from ._codec_types import object_fields
from ._fingerprint import _Unhashable, digest_value
from .exceptions import SerializationError

# AST fields that never change what code does.
_SKIP_FIELDS = frozenset({"ctx", "type_comment", "kind"})
_TOP_SKIP = frozenset({"name", "decorator_list", "returns", "type_params"})
_MAX_CONSTANT_ITEMS = 10_000
# what a dispatch table never holds: a container of only these is data
_PLAIN_DATA = frozenset({
    type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset,
})  # fmt: skip

# Source lines of modules, as they were when their first step was decorated: a file edited
# while the script runs must not change the digest of the code that is running.
_snapshots: dict[str, list[str]] = {}


def _snapshot(fn: types.FunctionType) -> None:
    filename = fn.__code__.co_filename
    linecache.checkcache(filename)
    lines = linecache.getlines(filename, fn.__globals__)
    if lines:
        _snapshots[filename] = list(lines)


def _canon(node: ast.AST, *, top: bool = False) -> str:
    """The canonical text of *node*, ``Kind(field=value;...)``: what the code digest hashes."""
    parts = []
    for field, found in ast.iter_fields(node):
        if (
            field in _SKIP_FIELDS
            or (top and field in _TOP_SKIP)
            or (field == "annotation" and isinstance(node, ast.arg))
        ):
            continue
        value = _without_docstring(found) if top and field == "body" and isinstance(found, list) else found
        if value is None or (type(value) is list and not value):
            continue
        if isinstance(value, ast.AST):
            text = _canon(value)
        elif type(value) is list:
            text = "[" + "".join(f"{_canon(v) if isinstance(v, ast.AST) else repr(v)}," for v in value) + "]"
        else:
            text = repr(value)
        parts.append(f"{field}={text};")
    return f"{type(node).__name__}({''.join(parts)})"


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return body[1:] or [ast.Pass()]
    return body


# file name -> (the lines parsed, first line -> the function and lambda nodes starting there)
_modules: dict[str, tuple[list[str], dict[int, list[ast.AST]]]] = {}


def _module_nodes(filename: str, lines: list[str]) -> dict[int, list[ast.AST]] | None:
    """The functions and lambdas of a whole source file by first line (parsed once per file)."""
    known = _modules.get(filename)
    if known is not None and known[0] is lines:
        return known[1]
    try:
        tree = ast.parse("".join(lines))
    except (SyntaxError, ValueError):
        return None
    index: dict[int, list[ast.AST]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            index.setdefault(first, []).append(node)
        elif isinstance(node, ast.Lambda):
            index.setdefault(node.lineno, []).append(node)
    _modules[filename] = (lines, index)
    return index


def _own_lines_node(fn: types.FunctionType, lines: list[str]) -> ast.AST | None:
    """
    The syntax tree of *fn* from its own lines alone, or None (then the whole file is parsed):
    up to the first line after its header indented no deeper than its first, not counting
    blank, comment or continued lines. A cut inside a string or brackets does not parse.
    """
    if fn.__name__ == "<lambda>":
        return None
    start = fn.__code__.co_firstlineno - 1
    if not 0 <= start < len(lines):
        return None
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start
    while end < len(lines) and lines[end].lstrip().startswith("@"):  # one-line decorators
        end += 1
    end += 1  # the def line
    while end < len(lines):
        line = lines[end]
        text = line.strip()
        continued = lines[end - 1].rstrip().endswith("\\")
        if text and not text.startswith("#") and len(line) - len(line.lstrip()) <= indent and not continued:
            break
        end += 1
    source = "".join(lines[start:end])
    try:  # indented, it is parsed as a block's body: as in its file, strings keep their indentation
        body = ast.parse(f"if 1:\n{source}" if indent else source).body
    except (SyntaxError, ValueError):
        return None
    if indent and isinstance(body[0], ast.If):
        body = body[0].body
    node = body[0] if len(body) == 1 else None
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn.__name__:
        return node
    return None


def _indexed(fn: types.FunctionType, index: dict[int, list[ast.AST]]) -> ast.AST | None:
    here = index.get(fn.__code__.co_firstlineno, [])
    if fn.__name__ == "<lambda>":
        lambdas = [n for n in here if isinstance(n, ast.Lambda)]
        return lambdas[0] if len(lambdas) == 1 else None
    named = [
        n for n in here if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == fn.__name__
    ]
    return named[0] if named else None


def _function_node(fn: types.FunctionType) -> ast.AST | None:
    """The syntax tree of *fn* from its file (as snapshotted), or None if it cannot be found."""
    code = fn.__code__
    lines = _snapshots.get(code.co_filename) or linecache.getlines(code.co_filename, fn.__globals__)
    if not lines:
        return None
    # its own lines alone if they parse (most functions: no need to parse the whole file)
    found = _own_lines_node(fn, lines)
    if found is None:
        index = _module_nodes(code.co_filename, lines)
        found = _indexed(fn, index) if index is not None else None
    return found


def function_digest(fn: types.FunctionType, node: ast.AST | None) -> str:
    """
    Digest of one function's own logic from its syntax tree *node* (from its bytecode if
    None). Its default values are not part of it: they are arguments, or values it reads.
    """
    if node is not None:
        return blake3.blake3(_canon(node, top=True).encode()).hexdigest()
    h = blake3.blake3()
    code, doc = fn.__code__, fn.__doc__

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr((c.co_names, c.co_varnames, c.co_freevars, c.co_cellvars)).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            elif not (doc is not None and const == doc and c is code):
                h.update(repr(const).encode())

    feed(code)
    return "bytecode:" + h.hexdigest()


_MAX_SOURCE = 20_000  # characters of a component's source kept for `resumable why`
_MAX_REPR = 200


def value_digest(value: object, describe: str | None = None) -> str | None:
    """
    The digest of a value a step reads: its fingerprint as an argument, else its encoding
    without pickles, else None. *describe* names it if it takes long.
    """
    try:
        return "f" + digest_value(value, describe=describe)[:15]
    except (_Unhashable, RecursionError):
        pass

    try:
        encoded = encode(value, allow_pickle=False)
    except (SerializationError, RecursionError):
        return None
    return "m" + value_checksum(encoded, [0] * len(encoded.buffers)).partition(":")[2][:15]


_BRACKETS: dict[type, tuple[str, str]] = {
    list: ("[", "]"),
    tuple: ("(", ")"),
    dict: ("{", "}"),
    set: ("{", "}"),
    frozenset: ("frozenset({", "})"),
}
_MAX_ITEMS = 8


def short_repr(value: object) -> str:
    """
    A one-line repr of at most a few hundred characters, for `resumable why`: a few items
    of a container, never the repr (or a sort) of all of it.
    """
    try:
        text = _short(value, 3)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not break a step
        text = f"<{type(value).__name__}: repr failed: {exc!r}>"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def _short(value: Any, level: int) -> str:
    tp = type(value)
    fields = None if tp in _BRACKETS else object_fields(value)
    if tp in _BRACKETS and value:
        left, right = _BRACKETS[tp]
        if level <= 0:
            return f"{left}...{right}"
        shown = islice(value.items() if tp is dict else value, _MAX_ITEMS)
        if tp is dict:
            items = [f"{_short(k, level - 1)}: {_short(v, level - 1)}" for k, v in shown]
        else:
            items = [_short(item, level - 1) for item in shown]
        single = "," if tp is tuple and len(value) == 1 else ""
        return left + ", ".join(items) + (", ..." if len(value) > _MAX_ITEMS else single) + right
    if fields is not None:
        if level <= 0:
            return f"{tp.__name__}(...)"
        named = [f"{name}={_short(field, level - 1)}" for name, field in fields[:_MAX_ITEMS]]
        return f"{tp.__name__}({', '.join(named)}{', ...' if len(fields) > _MAX_ITEMS else ''})"
    text = repr(value)
    return text if len(text) <= 120 else text[:57] + "..." + text[-60:]


def normalized_source(node: ast.AST) -> str | None:
    """A function's source as the digest sees it (no docstring, comments or decorators)."""
    node = copy.deepcopy(node)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        node.body = _without_docstring(node.body)
        node.decorator_list = []
    try:
        return ast.unparse(node)[:_MAX_SOURCE]
    except Exception:  # noqa: BLE001 - unparse of an odd tree: the digest still stands
        return None


def _helper(value: object, home: dict[str, Any]) -> types.FunctionType | None:
    """
    *value* as a plain function of the module whose globals are *home*, looking through
    decorators (``__wrapped__``): the outermost such function, or None.
    """
    for _ in range(100):  # (decorators that wrap each other in a cycle end it)
        if isinstance(value, types.FunctionType) and value.__globals__ is home:
            return value
        value = getattr(value, "__wrapped__", None)
        if value is None:
            break
    return None


def _functions_inside(table: Any, module: dict[str, Any]) -> list[tuple[str, types.FunctionType]] | None:
    """The same-module functions held by a dict, list or tuple (a dispatch table), or None."""
    tp = type(table)
    if not (tp is dict or tp is list or tp is tuple) or len(table) > _MAX_CONSTANT_ITEMS:
        return None  # data, not a table: looking through a large value would cost every first call
    if set(map(type, table.values() if tp is dict else table)) <= _PLAIN_DATA:
        return None
    items = table.items() if tp is dict else enumerate(table)  # (an index's repr is its str)
    found = [(repr(key), fn) for key, v in items if (fn := _helper(v, module)) is not None]
    return found or None


def combine(components: dict[str, str]) -> str:
    """One digest for a set of components."""
    text = ";".join(f"{k}={v}" for k, v in sorted(components.items()))
    return blake3.blake3(text.encode()).hexdigest()[:32]


def describe_change(old: dict[str, str] | None, new: dict[str, str]) -> str:
    """A short phrase saying which components differ, e.g. ``fn clean, const PROMPT``."""
    if not old:
        return ""
    changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    labels = ["its own code" if k == "code" else k for k in changed]
    return ", ".join(labels[:5]) + (" ..." if len(labels) > 5 else "")
