"""
Code digests: a step reruns when its logic changes, not when its text moves.

The digest of a function is taken from its syntax tree (comments, whitespace,
docstring, decorators, annotations and line numbers left out), so reformatting,
documenting or moving a function keeps its outputs. What the function refers to by
a global or closure name is part of the digest too:

- plain functions defined in the same module (transitively), also behind decorators
  (``functools.lru_cache`` and anything setting ``__wrapped__``) and inside dicts, lists
  and tuples the code uses (dispatch tables),
- other steps (their version if pinned, else their identity, as of each call),
- every other value it reads that can be fingerprinted like an argument (strings,
  numbers, containers, dataclasses ...), read again at every call, so editing
  ``PROMPT = "..."`` or ``WEATHER = {...}``, or reassigning a global during the run,
  reruns the steps that use it. Values that cannot be fingerprinted (clients, locks,
  modules) are left out, and ``resumable why`` lists them; so is what the code changes
  itself (``CALLS.append(x)``, ``CACHE[k] = v``), read from its bytecode.

A step's :class:`CodeShape` records every name it followed and what it was bound to, and
each call checks those bindings (attribute reads, no hashing): a helper or step defined
again (a notebook cell run again), or a function whose ``__code__`` was replaced (hot
reload), makes the shape be worked out again, as a fresh process would.

Code from other modules and installed packages is not; pin ``version=`` when such a
change should rerun a step. When the source is unavailable the bytecode is hashed
instead, which also changes across Python versions.
"""

from __future__ import annotations

import ast
import copy
import dis
import functools
import hashlib
import inspect
import linecache
import textwrap
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Literal

import msgpack

from ._codec_types import qualified_name
from ._fingerprint import _Unhashable, digest_value

# AST fields that never change what code does.
_SKIP_FIELDS = frozenset({"ctx", "type_comment", "kind"})
_TOP_SKIP = frozenset({"name", "decorator_list", "returns", "type_params"})
_MAX_CONSTANT_ITEMS = 10_000

# each function's code and the digest of its logic (a function whose __code__ is replaced
# gets another; equal code objects can come from sources differing in default values)
_cache: weakref.WeakKeyDictionary[types.FunctionType, tuple[types.CodeType, str]] = (
    weakref.WeakKeyDictionary()
)
# Source lines of modules, as they were when their first step was decorated: a file edited
# while the script runs must not change the digest of the code that is running.
_snapshots: dict[str, list[str]] = {}
# the code each function had when a shape last read it: new code in an old function (hot
# reload) was compiled from the file as it is now, so its file is read again
_code_seen: weakref.WeakKeyDictionary[types.FunctionType, types.CodeType] = weakref.WeakKeyDictionary()


def _snapshot(fn: types.FunctionType) -> None:
    filename = fn.__code__.co_filename
    linecache.checkcache(filename)
    lines = linecache.getlines(filename, fn.__globals__)
    if lines:
        _snapshots[filename] = list(lines)


def snapshot_source(fn: object) -> None:
    """Keep the source files of the functions *fn* runs as they are now (when a step is decorated)."""
    # decorating runs while the module executes: the file now is the code now (a module
    # reloaded after an edit is snapshotted again)
    for func in _functions_of(fn):
        _snapshot(func)


def _source(fn: types.FunctionType) -> str | None:
    code = fn.__code__
    lines = _snapshots.get(code.co_filename) or linecache.getlines(code.co_filename, fn.__globals__)
    start = code.co_firstlineno - 1
    if not lines or start >= len(lines):
        return None
    return "".join(inspect.getblock(lines[start:]))


# per node class: the fields that may hold code (all but _SKIP_FIELDS, which never do), and
# those the canonical text writes (an argument's annotation left out), each with its "field="
_FIELDS: dict[type, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]] = {}


def _fields_of(kind: type) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    fields = _FIELDS.get(kind)
    if fields is None:
        code = tuple(f for f in kind._fields if f not in _SKIP_FIELDS)  # type: ignore[attr-defined]
        written = tuple((f, f"{f}=") for f in code if not (f == "annotation" and issubclass(kind, ast.arg)))
        fields = _FIELDS[kind] = (code, written)
    return fields


def _canon(node: ast.AST, out: list[str], *, top: bool = False) -> None:
    """The canonical text of *node* (appended to *out*): what the code digest hashes."""
    kind = type(node)
    out.append(kind.__name__)
    out.append("(")
    for field, label in _fields_of(kind)[1]:
        if top and field in _TOP_SKIP:
            continue
        value = getattr(node, field, None)
        if top and field == "body" and isinstance(value, list):
            value = _without_docstring(value)
        if value is None or (type(value) is list and not value):
            continue
        out.append(label)
        if isinstance(value, ast.AST):
            _canon(value, out)
        elif type(value) is list:
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
    The syntax tree of *fn* from its own lines alone, or None (then the whole file is parsed).

    Its lines run from its first (decorator) line to the first line after its header that is
    indented no deeper than that line, skipping blank lines, comments and lines a backslash
    continues. A line like that inside a string or brackets cuts them open, so the lines do
    not parse alone and the whole file is parsed instead: a function is never cut short.
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
    try:
        tree = ast.parse(textwrap.dedent("".join(lines[start:end])))
    except (SyntaxError, ValueError):
        return None
    node = tree.body[0] if len(tree.body) == 1 else None
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
    """The syntax tree of *fn* from its source (as snapshotted), or None if it cannot be found."""
    code = fn.__code__
    lines = _snapshots.get(code.co_filename) or linecache.getlines(code.co_filename, fn.__globals__)
    # its own lines alone if they parse; else the whole file (parsed once), with no tokenizing
    found = _own_lines_node(fn, lines) if lines else None
    if found is None and lines:
        index = _module_nodes(code.co_filename, lines)
        found = _indexed(fn, index) if index is not None else None
    if found is not None:
        return found
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
    return matches[0]


def _source_digest(node: ast.AST | None) -> str | None:
    if node is None:
        return None
    out: list[str] = []
    _canon(node, out, top=True)
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


def function_digest(fn: types.FunctionType, node: ast.AST | Literal[False] | None = False) -> str:
    """
    Digest of one function's own logic (not of what it calls); *node*: its syntax tree, if
    known. Its default values are not part of it: they are arguments, or values it reads.
    """
    code = fn.__code__
    known = _cache.get(fn)
    if known is not None and known[0] is code:  # the code is held: it cannot be another one
        return known[1]
    digest = _source_digest(_function_node(fn) if node is False else node)
    if digest is None:
        digest = "bytecode:" + _bytecode_digest(code, fn.__doc__, b"")
    _cache[fn] = (code, digest)
    return digest


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})


def _global_names(code: types.CodeType) -> set[str]:
    """The global names *code* (and the code nested in it) loads or stores: not attribute names."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


_MISSING = object()
_MAX_SOURCE = 20_000  # characters of a component's source kept for `resumable why`
_MAX_REPR = 200
# Digests of immutable values read by steps (and None for values that cannot be fingerprinted),
# by identity; the value is held so its id stays its own. A constant that is not reassigned
# then costs one dict lookup per call.
_immutable_digests: dict[int, tuple[object, str | None]] = {}
_IMMUTABLE = (str, bytes, int, float, complex, bool, type(None))


class NoIdentity(Exception):  # noqa: N818 - turned into StepDefinitionError by the step
    """A callable whose code cannot be told from what it is (a builtin, a C extension ...)."""


class CodeShape:
    """
    What a step's code identity is made of: digests of its own code, its wrappers and the
    same-module helpers it calls; the steps it calls and the values it reads by name, both
    read again at every call (a global reassigned or changed in place between calls counts);
    and what every name it followed was bound to, which :meth:`current` checks at each call.
    """

    __slots__ = (
        "_sources",
        "cells",
        "functions",
        "globals",
        "last",
        "left_out",
        "nodes",
        "others",
        "reads",
        "static",
        "steps",
    )

    def __init__(self) -> None:
        self.static: dict[str, str] = {}
        self.nodes: dict[str, ast.AST] = {}  # component label -> syntax tree
        self.reads: list[tuple[str, Callable[[], object]]] = []  # ("const NAME", getter)
        self.steps: list[tuple[str, Any]] = []  # ("step NAME", its StepSpec)
        self.left_out: dict[str, str] = {}  # names whose values cannot be fingerprinted -> type
        # bindings: (namespace, name, what it held), (cell, what it held), (function, its
        # code, defaults and keyword defaults), (how to read something, what it was)
        self.globals: list[tuple[dict[str, Any], str, object]] = []
        self.cells: list[tuple[types.CellType, object]] = []
        self.functions: list[tuple[types.FunctionType, types.CodeType, object, object]] = []
        self.others: list[tuple[Callable[[], object], object]] = []
        self.last: tuple[dict[str, str], dict[str, str], Any] | None = None  # values -> identity
        self._sources: dict[str, str] | None = None

    def sources(self) -> dict[str, str]:
        """Component label -> normalized source, for `why`: made when first asked (a skip never asks)."""
        if self._sources is None:
            found = {label: normalized_source(node) for label, node in self.nodes.items()}
            self._sources = {label: source for label, source in found.items() if source is not None}
        return self._sources

    def current(self) -> bool:
        """True while every name the shape followed is bound as when it was made (no hashing)."""
        for namespace, name, value in self.globals:
            if namespace.get(name, _MISSING) is not value:
                return False
        for fn, code, defaults, kwargs in self.functions:
            if fn.__code__ is not code or fn.__defaults__ is not defaults or fn.__kwdefaults__ is not kwargs:
                return False
        return (not self.cells or all(_cell(cell)() is value for cell, value in self.cells)) and (
            not self.others or all(read() == value for read, value in self.others)
        )

    def values(
        self, owner: object, within: tuple[object, ...]
    ) -> tuple[dict[str, str], dict[str, str]] | None:
        """
        The digests of the values and steps the code reads, as they are now, and the names
        left out (by type); None if a value read became code (the shape must be made again).
        *within*: the steps whose identity is being worked out on this thread (a cycle).
        """
        found = read_values(self)
        if found is None:
            return None
        if self.steps:
            inside = (*within, owner)
            for label, spec in self.steps:
                found[0][label] = "cycle" if spec in inside else spec.identity(inside).identity[:16]
        return found


def _global(namespace: dict[str, Any], name: str) -> Callable[[], object]:
    return lambda: namespace.get(name, _MISSING)


def _cell(cell: types.CellType) -> Callable[[], object]:
    def read() -> object:
        try:
            return cell.cell_contents
        except ValueError:  # an empty cell (the closure variable is not assigned yet)
            return _MISSING

    return read


def _is_code(value: object) -> bool:
    """Modules, classes and functions: code, not data (other modules' code is not followed)."""
    return isinstance(value, (types.ModuleType, type)) or callable(value)


def value_digest(value: object) -> str | None:
    """
    The digest of a value a step reads, or None if it cannot be fingerprinted. Plain data
    is digested from its msgpack encoding (C speed); other values as arguments are.
    """
    tp = type(value)
    items: Any = value
    immutable = tp in _IMMUTABLE or (
        (tp is tuple or tp is frozenset) and all(type(v) in _IMMUTABLE for v in items)
    )
    known = _immutable_digests.get(id(value))
    if known is not None and known[0] is value:
        return known[1]
    digest = _fresh_digest(value)
    if immutable or digest is None:  # what cannot be fingerprinted never will be
        if len(_immutable_digests) > 10_000:
            _immutable_digests.clear()
        _immutable_digests[id(value)] = (value, digest)
    return digest


# id -> (the value a step read, its msgpack bytes then, their digest): values steps read are
# module globals and closure cells, alive anyway; at most a thousand are kept
_packed_digests: dict[int, tuple[object, bytes, str]] = {}
_PACKED_MAX = 64 * 1024


def _refuse(value: object) -> None:
    raise TypeError(type(value).__name__)


def _fresh_digest(value: object) -> str | None:
    # Plain JSON-like data (exact types: dict, list, str, bytes, int, float, bool, None) is
    # packed by msgpack's C packer, which is fast and tells them all apart.
    try:
        packed = msgpack.packb(value, use_bin_type=True, strict_types=True, default=_refuse)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        # the same object packing to the same bytes as last time: the same digest, unhashed
        last = _packed_digests.get(id(value))
        if last is not None and last[0] is value and last[1] == packed:
            return last[2]
        digest = "p" + hashlib.sha256(packed).hexdigest()[:15]
        if len(packed) <= _PACKED_MAX:  # a large value would be kept twice
            if len(_packed_digests) > 1_000:
                _packed_digests.clear()
            _packed_digests[id(value)] = (value, packed, digest)
        return digest
    from ._codec import encode, value_checksum  # noqa: PLC0415 - the codec is loaded by then anyway
    from .exceptions import SerializationError  # noqa: PLC0415

    try:
        encoded = encode(value, allow_pickle=False)
    except SerializationError:
        pass
    else:
        return "m" + value_checksum(encoded, [0] * len(encoded.buffers)).partition(":")[2][:15]
    try:
        return "f" + digest_value(value)[:15]
    except (_Unhashable, RecursionError):
        return None


def short_repr(value: object) -> str:
    """A one-line repr of at most a few hundred characters, for `resumable why`."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a broken __repr__ must not break a step
        text = f"<{type(value).__name__}: repr failed: {exc!r}>"
    text = " ".join(text.split())
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


# Methods that change the container they are called on, and functions that change their
# first argument.
_MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "add", "discard",
    "update", "setdefault", "sort", "reverse", "appendleft", "extendleft", "popleft",
    "difference_update", "intersection_update", "symmetric_difference_update",
})  # fmt: skip
_CHANGES_FIRST = frozenset({
    "heappush", "heappop", "heapify", "heapreplace", "heappushpop", "insort", "insort_left",
    "insort_right", "shuffle", "setattr", "delattr",
})  # fmt: skip
# opcodes that leave the stack as it is, and those after which the next one is not reached
_NO_STACK = frozenset({
    "NOP", "RESUME", "CACHE", "EXTENDED_ARG", "PRECALL", "KW_NAMES", "COPY_FREE_VARS",
    "MAKE_CELL", "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP",
    "JUMP_NO_INTERRUPT", "NOT_TAKEN",
})  # fmt: skip
_NO_NEXT = frozenset({
    "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP", "JUMP_NO_INTERRUPT",
    "RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE",
})  # fmt: skip
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)

# What the simulated stack holds: None, or (root, first attribute, last attribute) for a
# value reached from a global or closure name (or a method's ``self``) by attributes and
# subscripts: ``D["k"].items`` is ("D", None, "items"), ``self.rows.append`` ("self", "rows", "append").
_Label = tuple[str, str | None, str | None] | None


def changed_names(code: types.CodeType) -> set[str]:
    """
    Global and closure names whose values the code changes (``global X`` assigned, ``X[k] =
    v``, ``X.a += 1``, ``del X[k]``, ``X.append(...)``, ``heapq.heappush(X, ...)``), and a
    method's ``self.NAME`` attributes it changes: state the step writes, not an input it
    reads. Read from the bytecode, so it holds whether or not the source can be read; a
    pattern it cannot follow leaves the name an input.
    """
    names: set[str] = set()
    _changes(code, names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # less the locals it shares with nested code
            names |= {n for n in changed_names(const) if n.partition(".")[0] not in code.co_cellvars}
    return names


def _pop(stack: list[_Label], count: int = 1) -> list[_Label]:
    popped = [stack.pop() if stack else None for _ in range(count)]
    popped.reverse()
    return popped


def _at(stack: list[_Label], depth: int) -> _Label:
    return stack[-depth] if 0 < depth <= len(stack) else None


def _name(label: _Label, attribute: str | None = None) -> str | None:
    """The name a change of the value *label* stands for (of its *attribute*, if given) changes."""
    if label is None:
        return None
    root, first, _ = label
    if root != "self":
        return root
    first = first or attribute
    return f"self.{first}" if first is not None else None


def _changes(code: types.CodeType, names: set[str]) -> None:  # noqa: C901, PLR0912, PLR0915 - one opcode per branch
    """Add to *names* what one code object changes (a linear walk of a simulated stack)."""
    stack: list[_Label] = []
    at_target: dict[int, list[_Label]] = {}  # the stack a forward jump arrives with
    reached = True
    this = code.co_varnames[0] if code.co_argcount and code.co_varnames[0] == "self" else None
    for ins in dis.get_instructions(code):
        op, arg = ins.opname, ins.arg
        if ins.offset in at_target:
            saved = at_target.pop(ins.offset)
            # a merge keeps only what both paths agree on
            stack = (
                saved if not reached else [a if a == b else None for a, b in zip(stack, saved, strict=False)]
            )
        elif not reached:
            stack = []  # an exception handler, or dead code: nothing known
        reached = op not in _NO_NEXT
        changed: str | None = None
        if op in {"LOAD_GLOBAL", "LOAD_NAME"} or (
            op in {"LOAD_DEREF", "LOAD_CLASSDEREF"} and ins.argval in code.co_freevars
        ):
            if op == "LOAD_GLOBAL" and arg is not None and dis.stack_effect(ins.opcode, arg) == 2:
                stack.append(None)  # the NULL of a call
            stack.append((ins.argval, None, None))
        elif op == "LOAD_FAST" and ins.argval == this:
            stack.append(("self", None, None))
        elif op in {"STORE_GLOBAL", "DELETE_GLOBAL"} or (
            op in {"STORE_DEREF", "DELETE_DEREF"} and ins.argval in code.co_freevars
        ):
            changed = ins.argval
            if op.startswith("STORE"):
                _pop(stack)
        elif op in {"LOAD_ATTR", "LOAD_METHOD"}:
            (obj,) = _pop(stack)
            stack.append((obj[0], obj[1] or ins.argval, ins.argval) if obj is not None else None)
            if dis.stack_effect(ins.opcode, arg) == 1:  # a method: the function, then self
                stack.append(obj)
        elif op == "BINARY_SUBSCR":
            container, _ = _pop(stack, 2)
            stack.append(container)
        elif op in {"STORE_SUBSCR", "DELETE_SUBSCR"}:
            changed = _name(_at(stack, 2))
            _pop(stack, 3 if op == "STORE_SUBSCR" else 2)
        elif op in {"STORE_ATTR", "DELETE_ATTR"}:
            changed = _name(_at(stack, 1), ins.argval)
            _pop(stack, 2 if op == "STORE_ATTR" else 1)
        elif op == "COPY" and arg is not None:
            stack.append(_at(stack, arg))
        elif op == "SWAP" and arg is not None and arg <= len(stack):
            stack[-1], stack[-arg] = stack[-arg], stack[-1]
        elif op == "CALL" and arg is not None:
            names.update(_call_changes(stack, arg))
            _pop(stack, arg + 2)
            stack.append(None)
        elif op not in _NO_STACK:
            if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval > ins.offset:
                at_target.setdefault(ins.argval, _after(list(stack), ins, jump=True))
            stack = _after(stack, ins, jump=False)
            continue
        if changed is not None:
            names.add(changed)
        if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval > ins.offset:
            at_target.setdefault(ins.argval, list(stack))


def _after(stack: list[_Label], ins: dis.Instruction, *, jump: bool) -> list[_Label]:
    """*stack* after an operation making new values from those it takes (*jump*: if it jumps)."""
    arg = ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None
    effect = dis.stack_effect(ins.opcode, arg, jump=jump)
    if effect < 0:
        _pop(stack, -effect)
    else:
        stack.extend([None] * effect)
    if stack:
        stack[-1] = None  # what the operation made is not a name's value
    return stack


def _call_changes(stack: list[_Label], count: int) -> Iterator[str]:
    """What a call of *count* arguments changes: a mutating method's value, a function's first argument."""
    for func in (_at(stack, count + 1), _at(stack, count + 2)):  # the callable and self (or NULL)
        if func is None:
            continue
        attr = func[2]
        if attr in _MUTATORS and (name := _name(func if func[1] != attr else (func[0], None, None))):
            yield name
        if (attr or func[0]) in _CHANGES_FIRST and count >= 1 and (name := _name(_at(stack, count))):
            yield name


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
    seen: set[int] = set()
    while id(value) not in seen:
        if isinstance(value, types.FunctionType) and value.__globals__ is home:
            return value
        seen.add(id(value))
        value = getattr(value, "__wrapped__", None)
        if value is None:
            return None
    return None  # a cycle of __wrapped__


def _functions_inside(value: object, module: dict[str, Any]) -> list[tuple[str, types.FunctionType]] | None:
    """The same-module functions held by a dict, list or tuple (a dispatch table), or None."""
    items: list[tuple[str, object]]
    if type(value) is dict:
        items = [(repr(k), v) for k, v in value.items()]
    elif type(value) is list or type(value) is tuple:
        items = [(str(i), v) for i, v in enumerate(value)]
    else:
        return None
    if len(items) > _MAX_CONSTANT_ITEMS:
        return None
    found = [(label, fn) for label, v in items if (fn := _helper(v, module)) is not None]
    return found or None


def _wrapped(obj: object) -> object | None:
    """What *obj* wraps (``__wrapped__``, set by ``functools.wraps``), or None."""
    if isinstance(obj, (types.MethodType, functools.partial)):  # they hold their function
        return None
    attributes = getattr(obj, "__dict__", None)
    return attributes.get("__wrapped__") if type(attributes) is dict else None


def _parts(obj: object, depth: int = 0) -> list[types.FunctionType]:
    """
    The Python functions *obj* runs as a step (its wrappers, the function a partial or a
    method holds, a callable object's ``__call__``).

    Raises:
        NoIdentity: part of it has no Python code (a builtin, a C extension's callable), or
            the decorators wrap each other in a cycle.
    """
    if depth > 100:
        msg = "its decorators (__wrapped__) wrap each other in a cycle"
        raise NoIdentity(msg)
    inner = _wrapped(obj)
    found: list[types.FunctionType] = [] if inner is None else _parts(inner, depth + 1)
    if isinstance(obj, types.FunctionType):
        return [obj, *found]
    if isinstance(obj, functools.partial):
        for arg in (*obj.args, *obj.keywords.values()):
            if not _is_code(arg) and value_digest(arg) is None:
                msg = f"the partial's argument {short_repr(arg)} cannot be fingerprinted"
                raise NoIdentity(msg)
        return [*_parts(obj.func, depth + 1), *found]
    if isinstance(obj, types.MethodType):
        return [*_parts(obj.__func__, depth + 1), *found]
    call = getattr(type(obj), "__call__", None)  # noqa: B004 - the class's own __call__
    if isinstance(call, types.FunctionType):
        return [*_parts(call, depth + 1), *found]
    if inner is not None:  # a decorator written in C (lru_cache): what it wraps is the code
        return found
    msg = f"{type(obj).__name__} {short_repr(obj)} has no Python code to digest"
    raise NoIdentity(msg)


def check_identity(obj: object) -> None:
    """
    Raises:
        NoIdentity: the code of callable *obj* cannot be told from what it is (then only a
            ``version=`` can tie its outputs to it).
    """
    _parts(obj)


def _functions_of(obj: object) -> list[types.FunctionType]:
    try:
        return _parts(obj)
    except NoIdentity:
        return []


class _Builder:
    """Works out a :class:`CodeShape`: every callable, name and value a step's code reaches."""

    def __init__(self, step_of: Callable[[object], Any], owner: object) -> None:
        self.shape = CodeShape()
        self.step_of = step_of
        self.owner = owner
        self.seen: set[types.FunctionType] = set()
        self.changed: set[str] = set()
        self.wrappers = 0

    def callable(self, obj: object, label: str, *, main: bool) -> None:
        """
        Add a callable the step runs. *main*: its signature is the step's (its defaults are
        then arguments, fingerprinted with them); the others' defaults are values it reads.
        """
        inner = _wrapped(obj)
        if inner is not None:  # the wrapped function is the step's code, its wrappers too
            self.callable(inner, label, main=main)
            self.wrappers += 1
            self.level(obj, f"wrapper {self.wrappers}", main=False, wrapper=True)
            return
        self.level(obj, label, main=main, wrapper=False)

    def level(self, obj: object, label: str, *, main: bool, wrapper: bool) -> None:
        shape = self.shape
        if isinstance(obj, types.FunctionType):
            self.visit(obj, label, main=main)
        elif isinstance(obj, functools.partial):
            self.callable(obj.func, label, main=main)
            home = _home(obj.func)
            for i, arg in enumerate(obj.args):
                self.reference(f"partial[{i}]", arg, _item(obj.args, i), home)
            for key, arg in obj.keywords.items():
                self.reference(f"partial({key}=)", arg, _key(obj.keywords, key), home)
        elif isinstance(obj, types.MethodType):
            self.callable(obj.__func__, label, main=main)
            self.instance(obj.__self__, "self", _home(obj.__func__))
        elif isinstance(call := _class_call(obj), types.FunctionType):
            shape.others.append((functools.partial(_class_call, obj), call))
            self.callable(call, label, main=main)
            self.instance(obj, "self", call.__globals__)
        elif not wrapper:  # (a decorator written in C adds no code of its own)
            raise NoIdentity(type(obj).__name__)

    def instance(self, obj: object, name: str, home: dict[str, Any]) -> None:
        """
        The object a method or a callable object runs with: its attributes, each like a
        value the code reads (those the code changes, such as a cache it fills, left out);
        an object without attributes of its own by its value.
        """
        if isinstance(obj, (type, types.ModuleType)):  # a classmethod's class: code
            return
        attributes = getattr(obj, "__dict__", None)
        if type(attributes) is not dict:
            if value_digest(obj) is None:
                self.shape.left_out[name] = qualified_name(type(obj))
            else:
                self.shape.reads.append((f"const {name}", lambda: obj))
            return
        self.shape.others.append((functools.partial(_names_of, attributes), _names_of(attributes)))
        for attr, value in attributes.items():
            if not attr.startswith("__"):  # a decorator's copies of __name__, __wrapped__ ...
                self.reference(f"{name}.{attr}", value, _key(attributes, attr), home)

    def visit(self, func: types.FunctionType, label: str, *, main: bool) -> None:
        """Add one function: its own code, what its names refer to and, unless *main*, its defaults."""
        shape = self.shape
        code = func.__code__
        shape.functions.append((func, code, func.__defaults__, func.__kwdefaults__))
        if func in self.seen:
            return
        self.seen.add(func)
        if _code_seen.get(func, code) is not code:
            _snapshot(func)  # new code in a live function (hot reload): from the file as it is now
        _code_seen[func] = code
        node = _function_node(func)
        shape.static[label] = function_digest(func, node)[:16]
        if node is not None:
            shape.nodes[label] = node
        self.changed |= changed_names(code)
        home = func.__globals__
        for name in sorted(_global_names(code)):
            if not name.startswith("__"):
                read = _global(home, name)
                self.reference(name, read(), read, home, (home, name))
        for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
            read = _cell(cell)
            self.reference(name, read(), read, home, cell)
        if main:
            return
        # the defaults of a function the step calls are values it reads
        positional = code.co_varnames[: code.co_argcount]
        defaults = func.__defaults__ or ()
        for i, value in enumerate(defaults):
            param = positional[len(positional) - len(defaults) + i]
            self.reference(f"{func.__name__}({param}=)", value, _default(func, i), home)
        for param, value in (func.__kwdefaults__ or {}).items():
            self.reference(f"{func.__name__}({param}=)", value, _kwdefault(func, param), home)

    def reference(
        self,
        name: str,
        value: object,
        read: Callable[[], object],
        home: dict[str, Any],
        where: tuple[dict[str, Any], str] | types.CellType | None = None,
    ) -> None:
        """Put one name the code refers to where it belongs in the shape."""
        shape = self.shape
        inside = None
        if value is not _MISSING and not _is_code(value):
            inside = _functions_inside(value, home)
            if inside is None:
                shape.reads.append((f"const {name}", read))  # read at every call, by value
                return
        # code, a dispatch table, or not defined (yet): bound by identity, so that a change
        # makes the shape again
        if isinstance(where, tuple):
            shape.globals.append((where[0], where[1], value))
        elif isinstance(where, types.CellType):
            shape.cells.append((where, value))
        else:
            shape.others.append((functools.partial(_same, read, value), True))
        if inside is not None:
            self.table(name, value, inside)
        elif value is not _MISSING:
            self.code(name, value, home)

    def table(self, name: str, table: object, inside: list[tuple[str, types.FunctionType]]) -> None:
        """A dispatch table: its functions are code, and its entries are bound."""
        keys = repr([entry for entry, _ in inside]).encode()
        self.shape.static[f"table {name}"] = hashlib.sha256(keys).hexdigest()[:16]
        self.shape.others.append((functools.partial(_same_items, table, _items(table)), True))
        for entry, func in inside:
            self.visit(func, f"fn {name}[{entry}]", main=False)

    def code(self, name: str, value: object, home: dict[str, Any]) -> None:
        """A name bound to code: a step, a helper (followed), a module (left out), other code."""
        shape = self.shape
        spec = self.step_of(value)
        if spec is not None:
            if spec is self.owner:
                shape.static[f"step {name}"] = "self"
            else:
                shape.steps.append((f"step {name}", spec))
            return
        helper = _helper(value, home)
        if helper is not None:
            self.visit(helper, f"fn {name}", main=False)
        elif isinstance(value, types.ModuleType):
            shape.left_out[name] = "module"

    def finish(self) -> CodeShape:
        # What the step changes itself (a call counter, a cache it fills) is state it writes:
        # counting it would make every call a change.
        shape = self.shape
        changed = self.changed
        for read in [r for r in shape.reads if r[0].removeprefix("const ") in changed]:
            shape.reads.remove(read)
            shape.left_out[read[0].removeprefix("const ")] = "changed by the step"
        return shape


def _home(obj: object) -> dict[str, Any]:
    """The globals of the function *obj* runs (through partials, methods and wrappers)."""
    found = _functions_of(obj)
    return found[-1].__globals__ if found else {}


def _item(items: tuple[object, ...], i: int) -> Callable[[], object]:
    return lambda: items[i]


def _key(mapping: dict[str, Any], key: str) -> Callable[[], object]:
    return lambda: mapping.get(key, _MISSING)


def _default(func: types.FunctionType, i: int) -> Callable[[], object]:
    return lambda: (func.__defaults__ or ())[i]


def _kwdefault(func: types.FunctionType, param: str) -> Callable[[], object]:
    return lambda: (func.__kwdefaults__ or {}).get(param, _MISSING)


def _class_call(obj: object) -> object:
    return getattr(type(obj), "__call__", None)  # noqa: B004 - the class's own __call__


def _names_of(attributes: dict[str, Any]) -> tuple[str, ...]:
    return tuple(attributes)


def _same(read: Callable[[], object], value: object) -> bool:
    return read() is value


def _items(table: Any) -> tuple[tuple[object, ...], tuple[object, ...]]:
    return (tuple(table), tuple(table.values())) if type(table) is dict else ((), tuple(table))


def _same_items(table: Any, items: tuple[tuple[object, ...], tuple[object, ...]]) -> bool:
    """True while a dispatch table holds the very objects it held (it is held, and they are)."""
    keys, values = _items(table)
    return (
        keys == items[0]
        and len(values) == len(items[1])
        and all(a is b for a, b in zip(values, items[1], strict=True))
    )


def code_shape(fn: object, step_of: Callable[[object], Any], owner: object = None) -> CodeShape:
    """
    The components of the code identity of a step running callable *fn* (see
    :class:`CodeShape`).

    ``code`` is the function itself (``wrapper N`` its decorators); ``fn NAME``, ``step
    NAME``, ``table NAME`` and ``const NAME`` are what it refers to. *step_of* returns the
    step an object is (its ``StepSpec``), or None; *owner* is the step being worked out.

    Raises:
        NoIdentity: part of *fn* has no Python code (see :func:`check_identity`).
    """
    builder = _Builder(step_of, owner)
    builder.callable(fn, "code", main=True)
    return builder.finish()


def read_values(shape: CodeShape) -> tuple[dict[str, str], dict[str, str]] | None:
    """
    The digests of the values *shape* reads, as they are now, and those left out (by type);
    None if one of them is code now (the shape is out of date).
    """
    digests: dict[str, str] = {}
    left_out: dict[str, str] = {}
    for label, getter in shape.reads:
        value = getter()
        if value is _MISSING:
            continue
        if _is_code(value) and label != "const self":
            return None
        digest = value_digest(value)
        if digest is None:
            left_out[label.removeprefix("const ")] = qualified_name(type(value))
        else:
            digests[label] = digest
    return digests, left_out


def code_components(fn: object, step_of: Callable[[object], Any]) -> dict[str, str]:
    """All the digests of a step's code identity as of now: its shape, the values and steps it reads."""
    shape = code_shape(fn, step_of)
    found = shape.values(None, ())
    assert found is not None  # noqa: S101 - the shape was just made
    return {**shape.static, **found[0]}


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
