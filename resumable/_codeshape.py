"""
A step's code identity in a live process: what it is made of, and when to work it out again.

:func:`code_shape` follows a step's callable (wrappers, a partial's function and arguments,
a method's or callable object's instance) and every name its code refers to. Each call
checks the bindings the shape followed (no hashing): a helper or step defined again, or a
``__code__`` replaced, makes the shape again, as a fresh process would. What the code
changes itself is read from its bytecode (:func:`changed_names`) and left out.
"""

from __future__ import annotations

import ast
import dis
import functools
import operator
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import blake3

from ._codec_types import qualified_name
from ._codehash import (
    _function_node,
    _functions_inside,
    _helper,
    _snapshot,
    function_digest,
    normalized_source,
    short_repr,
    value_digest,
)

_MISSING = object()

# the code each function had when a shape last read it: new code in an old function (hot
# reload) was compiled from the file as it is now, so its file is read again
_code_seen: weakref.WeakKeyDictionary[types.FunctionType, types.CodeType] = weakref.WeakKeyDictionary()


_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"})


def _global_names(code: types.CodeType) -> set[str]:
    """The global names *code* (and the code nested in it) loads or stores: not attribute names."""
    names = {i.argval for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS}
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


class NoIdentity(Exception):  # noqa: N818 - turned into StepDefinitionError by the step
    """A callable whose code cannot be told from what it is (a builtin, a C extension ...)."""


class CodeShape:
    """What a step's code identity is made of, and what its names were bound to."""

    def __init__(self) -> None:
        self.static: dict[str, str] = {}
        self.nodes: dict[str, ast.AST] = {}  # component label -> syntax tree
        self.reads: list[tuple[str, Callable[[], object]]] = []  # ("const NAME", getter)
        self.steps: list[tuple[str, Any]] = []  # ("step NAME", its StepSpec)
        self.left_out: dict[str, str] = {}  # names whose values cannot be fingerprinted -> type
        # what the shape followed: (how to read it now, what it held), and checks of the rest
        self.bound: list[tuple[Callable[[], object], object]] = []
        self.checks: list[Callable[[], bool]] = []
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
        return all(read() is value for read, value in self.bound) and all(check() for check in self.checks)

    def values(
        self, owner: object, within: tuple[object, ...]
    ) -> tuple[dict[str, str], dict[str, str]] | None:
        """
        The digests of the values and steps the code reads now, and the names left out (by
        type); None if a value read became code. *within*: the steps whose identity is being
        worked out on this thread (a cycle).
        """
        step = getattr(owner, "name", None)
        digests: dict[str, str] = {}
        left_out: dict[str, str] = {}
        for label, getter in self.reads:
            value = getter()
            if value is _MISSING:
                continue
            if _is_code(value) and label != "const self":
                return None
            name = label.removeprefix("const ")
            describe = None if step is None else f"step {step!r}: value {name!r} read by its code"
            digest = value_digest(value, describe)
            if digest is None:
                left_out[name] = qualified_name(type(value))
            else:
                digests[label] = digest
        inside = (*within, owner)
        for label, spec in self.steps:
            digests[label] = "cycle" if spec in inside else spec.identity(inside).identity[:16]
        return digests, left_out


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
    """The name a change of *label* (of its *attribute*, if given) changes."""
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
        if ins.opcode in _JUMPS and isinstance(ins.argval, int) and ins.argval > ins.offset:
            after = list(stack) if op in _NO_STACK else _after(list(stack), ins, jump=True)
            at_target.setdefault(ins.argval, after)
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
            stack = _after(stack, ins, jump=False)
        if changed is not None:
            names.add(changed)


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


def _wrapped(obj: object) -> object | None:
    if isinstance(obj, (types.MethodType, functools.partial)):  # they hold their function
        return None
    attributes = getattr(obj, "__dict__", None)
    return attributes.get("__wrapped__") if type(attributes) is dict else None


class _Builder:
    """Works out a :class:`CodeShape`: every callable, name and value a step's code reaches."""

    def __init__(self, step_of: Callable[[object], Any], owner: object) -> None:
        self.shape = CodeShape()
        self.step_of = step_of
        self.owner = owner
        self.seen: set[types.FunctionType] = set()
        self.changed: set[str] = set()
        self.wrappers = 0

    def callable(self, obj: object, label: str, *, main: bool, depth: int = 0) -> dict[str, Any]:
        """
        Add a callable the step runs (*main*: its defaults are arguments, not values it
        reads); return the globals of the innermost function it runs.
        """
        if depth > 100:
            msg = "its decorators (__wrapped__) wrap each other in a cycle"
            raise NoIdentity(msg)
        inner = _wrapped(obj)
        home = None
        if inner is not None:  # the wrapped function is the step's code, its wrappers too
            home = self.callable(inner, label, main=main, depth=depth + 1)
            self.wrappers += 1
            label, main = f"wrapper {self.wrappers}", False
        if isinstance(obj, types.FunctionType):
            self.visit(obj, label, main=main)
            own = obj.__globals__
        elif isinstance(obj, functools.partial):
            own = self.callable(obj.func, label, main=main)
            for i, arg in enumerate(obj.args):
                self.reference(f"partial[{i}]", arg, functools.partial(operator.getitem, obj.args, i), own)
            for key, arg in obj.keywords.items():
                self.reference(f"partial({key}=)", arg, _entry(obj.keywords, key), own)
        elif isinstance(obj, types.MethodType):
            own = self.callable(obj.__func__, label, main=main)
            self.instance(obj.__self__, "self", own)
        elif isinstance(call := _class_call(obj), types.FunctionType):
            self.shape.bound.append((functools.partial(_class_call, obj), call))
            own = self.callable(call, label, main=main)
            self.instance(obj, "self", call.__globals__)
        elif home is None:
            msg = f"{type(obj).__name__} {short_repr(obj)} has no Python code to digest"
            raise NoIdentity(msg)
        else:  # a decorator written in C (such as lru_cache) adds no code of its own
            return home
        return own if home is None else home

    def instance(self, obj: object, name: str, home: dict[str, Any]) -> None:
        """The object a method or a callable object runs with: its attributes, or its value."""
        if isinstance(obj, (type, types.ModuleType)):  # a classmethod's class: code
            return
        attributes = getattr(obj, "__dict__", None)
        if type(attributes) is not dict:
            if value_digest(obj) is None:
                self.shape.left_out[name] = qualified_name(type(obj))
            else:
                self.shape.reads.append((f"const {name}", lambda: obj))
            return
        self.shape.checks.append(functools.partial(_same_names, attributes, tuple(attributes)))
        for attr, value in attributes.items():
            if not attr.startswith("__"):  # a decorator's copies of __name__, __wrapped__ ...
                self.reference(f"{name}.{attr}", value, _entry(attributes, attr), home)

    def visit(self, func: types.FunctionType, label: str, *, main: bool) -> None:
        """Add one function: its own code, what its names refer to and, unless *main*, its defaults."""
        shape = self.shape
        code = func.__code__
        shape.checks.append(
            functools.partial(_same_function, func, code, func.__defaults__, func.__kwdefaults__)
        )
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
                read = _entry(home, name)
                self.reference(name, read(), read, home)
        for name, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
            read = _cell(cell)
            self.reference(name, read(), read, home)
        if main:
            return
        # the defaults of a function the step calls are values it reads
        positional = code.co_varnames[: code.co_argcount]
        defaults = func.__defaults__ or ()
        for i, value in enumerate(defaults):
            param = positional[len(positional) - len(defaults) + i]
            read = functools.partial(operator.getitem, defaults, i)  # a new tuple makes the shape again
            self.reference(f"{func.__name__}({param}=)", value, read, home)
        kwdefaults = func.__kwdefaults__ or {}
        for param, value in kwdefaults.items():
            self.reference(f"{func.__name__}({param}=)", value, _entry(kwdefaults, param), home)

    def reference(self, name: str, value: object, read: Callable[[], object], home: dict[str, Any]) -> None:
        shape = self.shape
        inside = None
        if value is not _MISSING and not _is_code(value):
            inside = _functions_inside(value, home)
            if inside is None:
                shape.reads.append((f"const {name}", read))  # read at every call, by value
                return
        # code, a dispatch table, or not defined (yet): bound by identity, so that a change
        # makes the shape again
        shape.bound.append((read, value))
        if inside is not None:
            self.table(name, value, inside)
        elif value is not _MISSING:
            self.code(name, value, home)

    def table(self, name: str, table: object, inside: list[tuple[str, types.FunctionType]]) -> None:
        keys = repr([entry for entry, _ in inside]).encode()
        self.shape.static[f"table {name}"] = blake3.blake3(keys).hexdigest()[:16]
        self.shape.checks.append(functools.partial(_same_items, table, _held(table)))
        for entry, func in inside:
            self.visit(func, f"fn {name}[{entry}]", main=False)

    def code(self, name: str, value: object, home: dict[str, Any]) -> None:
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


class _Check(_Builder):
    """Walks a step's callable as :class:`_Builder` does, only keeping its source files as they are now."""

    def visit(self, func: types.FunctionType, label: str, *, main: bool) -> None:  # noqa: ARG002 - an override
        _snapshot(func)

    def reference(self, name: str, value: object, read: Callable[[], object], home: dict[str, Any]) -> None:  # noqa: ARG002
        if not _is_code(value) and value_digest(value) is None:  # a partial's argument
            msg = f"the partial's argument {short_repr(value)} cannot be fingerprinted"
            raise NoIdentity(msg)

    def instance(self, obj: object, name: str, home: dict[str, Any]) -> None:
        pass


def check_identity(obj: object) -> None:
    """
    Keep the source files of the Python functions *obj* runs as a step (its wrappers, the
    function a partial or a method holds, a callable object's ``__call__``) as they are
    now; NoIdentity if part of it has no code.
    """
    _Check(lambda _: None, None).callable(obj, "code", main=True)


def _entry(mapping: dict[str, Any], key: str) -> Callable[[], object]:
    return functools.partial(mapping.get, key, _MISSING)


def _class_call(obj: object) -> object:
    return getattr(type(obj), "__call__", None)  # noqa: B004 - the class's own __call__


def _same_names(attributes: dict[str, Any], names: tuple[str, ...]) -> bool:
    return tuple(attributes) == names


def _same_function(
    func: types.FunctionType, code: types.CodeType, defaults: object, kwdefaults: object
) -> bool:
    return func.__code__ is code and func.__defaults__ is defaults and func.__kwdefaults__ is kwdefaults


def _held(table: Any) -> list[object]:
    return [*table, *table.values()] if type(table) is dict else list(table)


def _same_items(table: Any, held: list[object]) -> bool:
    """True while a dispatch table holds the very objects it held."""
    now = _held(table)
    return len(now) == len(held) and all(a is b for a, b in zip(now, held, strict=True))


def code_shape(fn: object, step_of: Callable[[object], Any], owner: object = None) -> CodeShape:
    """
    The code identity of a step running *fn*: ``code`` is the function itself (``wrapper N``
    its decorators); ``fn NAME``, ``step NAME``, ``table NAME`` and ``const NAME`` are what
    it refers to. *step_of* returns the ``StepSpec`` an object is, or None; *owner* is the
    step being worked out.
    """
    builder = _Builder(step_of, owner)
    builder.callable(fn, "code", main=True)
    shape = builder.shape
    # What the step changes itself (a call counter, a cache it fills) is state it writes:
    # counting it would make every call a change.
    for read in [r for r in shape.reads if r[0].removeprefix("const ") in builder.changed]:
        shape.reads.remove(read)
        shape.left_out[read[0].removeprefix("const ")] = "changed by the step"
    return shape
