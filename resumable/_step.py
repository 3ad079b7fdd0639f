"""
The ``@step`` decorator: options validated at decoration time, sync and async wrappers.

A decorated function stays a plain function (made with :func:`functools.wraps`), so it
binds as a method, keeps its signature and docstring, and an ``async def`` step is
still a coroutine function. Its metadata lives in one attribute, ``__resumable_step__``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
import string
import threading
from collections.abc import Callable, Iterable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import blake3

from . import _codehash, _codeshape
from ._context import Host, current_pipeline, disabled, register, session_of
from ._fingerprint import digest_parameters
from ._plan import Identity, Plan
from ._slots import check_name, slot_id
from .exceptions import StepDefinitionError

P = ParamSpec("P")
P2 = ParamSpec("P2")
R = TypeVar("R")
S = TypeVar("S")
R_co = TypeVar("R_co", covariant=True)

KeySpec = str | Callable[..., str]
RetryOn = type[BaseException] | tuple[type[BaseException], ...]


def by_arguments(*args: Any, **kwargs: Any) -> str:  # noqa: ARG001 - the signature of a key function
    """
    ``@step(key=by_arguments)``: one slot per distinct set of arguments, as ``joblib.Memory``
    keeps one output per call. The key is a short digest of the arguments (those in
    ``ignore`` left out), so any argument that can be fingerprinted works, a DataFrame too::

        @step(key=by_arguments)
        def score(frame: pd.DataFrame, model: str) -> float: ...

    Slots are then named by digests (``score/3f9c0d...``); prefer a format string such as
    ``key="{url}"`` where one argument names the work well.
    """
    msg = "by_arguments is a key for @step(key=by_arguments), not a function to call"
    raise StepDefinitionError(msg)


# Argument types whose equal values always have equal digests (floats do not: 0.0 == -0.0).
_MEMO_TYPES = frozenset({int, str, bytes, bool, type(None)})
_MEMO_SIZE = 4096


class Step(Protocol[P, R_co]):
    """A function decorated with ``@step``: call it like the original."""

    @property
    def __resumable_step__(self) -> StepSpec[Any, Any]: ...
    @property
    def __wrapped__(self) -> Callable[P, R_co]: ...

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    # A step defined in a class binds like the function it wraps.
    @overload
    def __get__(self, instance: None, owner: type[Any] | None = None) -> Self: ...
    @overload
    def __get__(
        self: Step[Concatenate[S, P2], R], instance: S, owner: type[Any] | None = None
    ) -> Callable[P2, R]: ...

    def is_cached(self, *args: P.args, **kwargs: P.kwargs) -> bool:
        """True if a call with these arguments would return a stored output."""

    def forget(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Drop the stored output of the slot these arguments map to."""


class StepSpec(Generic[P, R]):
    """Everything known about one step, its options validated; shared by all its calls."""

    def __init__(  # noqa: PLR0913 - the options of @step
        self,
        fn: Callable[P, R],
        *,
        name: str | None = None,
        version: str | None = None,
        key: KeySpec | None = None,
        ignore: Iterable[str] = (),
        retries: int = 0,
        retry_on: RetryOn = Exception,
        idempotent: bool = True,
        pipeline: Host | None = None,
    ) -> None:
        if not callable(fn) or isinstance(fn, type):
            msg = f"@step decorates functions, not {type(fn).__name__} objects"
            raise StepDefinitionError(msg)
        if isinstance(fn, (staticmethod, classmethod)):
            msg = "put @step below @staticmethod/@classmethod, directly on the function"
            raise StepDefinitionError(msg)
        self.fn = fn
        self.name = check_name(name if name is not None else getattr(fn, "__name__", None))
        if version is not None and (not isinstance(version, str) or not version):
            raise self._invalid(f"version must be a non-empty str, got {version!r}")
        if type(retries) is not int or retries < 0:
            raise self._invalid(f"retries must be an int >= 0, got {retries!r}")
        types = retry_on if isinstance(retry_on, tuple) else (retry_on,)
        if not types or not all(isinstance(t, type) and issubclass(t, Exception) for t in types):
            shown = types[0] if len(types) == 1 else types
            raise self._invalid(
                "retry_on must be an exception class or a tuple of them "
                f"(subclasses of Exception), got {shown!r}"
            )
        self.version = version
        self.retries = retries
        self.retry_on: tuple[type[BaseException], ...] = types
        self.idempotent = bool(idempotent)
        self.pipeline = pipeline
        self.is_async = inspect.iscoroutinefunction(fn)
        self.signature = self._signature()
        params = self.signature.parameters
        self.ignore = frozenset((ignore,) if isinstance(ignore, str) else ignore)
        unknown = sorted(self.ignore - set(params))
        if unknown:
            raise self._invalid(f"ignore= names {unknown}, which are not parameters of it")
        self.key = self._check_key(key, params)
        self._memo_defaults = self._immutable_defaults()
        self._shape: Any = None  # the _codeshape.CodeShape of the step, once known
        self._plans: dict[tuple[object, ...], tuple[str, str | None, str, str, dict[str, str]]] = {}
        self._identity_lock = threading.Lock()
        module, qualname = getattr(fn, "__module__", "?"), getattr(fn, "__qualname__", self.name)
        self.qualname = f"{module}.{qualname}"
        self._identifiable = True
        try:
            _codeshape.check_identity(fn)
        except _codeshape.NoIdentity as exc:
            if self.version is None:
                raise self._invalid(
                    f"cannot tell when the code of {fn!r} changes ({exc}); "
                    "pass version='1' to @step, and change it when the step should rerun"
                ) from None
            self._identifiable = False

    def _invalid(self, problem: str) -> StepDefinitionError:
        """The error for a bad option or key of this step, naming it."""
        return StepDefinitionError(f"step {self.name!r}: {problem}", step=self.name)

    def _signature(self) -> inspect.Signature:
        try:
            return inspect.signature(self.fn)
        except (TypeError, ValueError) as exc:
            raise self._invalid(f"cannot read the signature of {self.fn!r} ({exc})") from None

    def _immutable_defaults(self) -> bool:
        """True if no default can change in place (a call using defaults may then be memoized)."""
        return all(
            p.default is inspect.Parameter.empty or name in self.ignore or type(p.default) in _MEMO_TYPES
            for name, p in self.signature.parameters.items()
        )

    def _check_key(self, key: KeySpec | None, params: Any) -> KeySpec | None:
        if key is None or callable(key):
            return key
        if not isinstance(key, str):
            raise self._invalid(f"key must be a format string or a callable, got {key!r}")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(key) if f is not None]
        except ValueError as exc:
            raise self._invalid(f"key {key!r} is not a valid format string ({exc})") from None
        for field in fields:
            root = re.split(r"[.\[]", field, maxsplit=1)[0]
            if root not in params:
                raise self._invalid(
                    f"key {key!r} refers to {{{field}}}, but the step has "
                    f"no parameter {root!r}; name parameters, e.g. key='{{{next(iter(params), 'x')}}}'"
                )
        return key

    def identity(self, within: tuple[object, ...] = ()) -> Identity:
        """
        The step's identity for a call now: its code's shape is worked out again when a name
        it followed is rebound. *within*: the steps whose identity asks for this one's.
        """
        shape = self._shape
        if shape is None or not shape.current():
            shape = self._reshape(shape)
        last = shape.last  # one tuple: threads see a consistent triple
        if last is not None and not shape.reads and not shape.steps:  # all its digests are fixed
            return last[2]  # type: ignore[no-any-return]
        found = shape.values(self, within)
        if found is None:  # a value it reads is code now: follow it
            shape = self._reshape(shape, again=True)
            found = shape.values(self, within) or ({}, {})
            last = shape.last
        values, left_out = found
        if last is not None and last[0] == values and last[1] == left_out:
            return last[2]  # type: ignore[no-any-return]
        components = {**shape.static, **values}
        code = _codehash.combine(components)
        label = f"version:{self.version}" if self.version is not None else f"code:{code}"
        left = {**shape.left_out, **left_out}
        ident = Identity(label, code, components, shape.sources, left, shape.reads)
        shape.last = (values, left_out, ident)
        return ident

    def _reshape(self, stale: Any, *, again: bool = False) -> Any:
        """Work the shape of the step's code out (again), unless another thread just did."""
        with self._identity_lock:
            shape = self._shape
            if shape is stale and (again or shape is None or not shape.current()):
                if shape is not None:  # its own function may have new parameters (hot reload)
                    self.signature = self._signature()
                    self._memo_defaults = self._immutable_defaults()
                    self._plans = {}
                shape = self._shape = self._code_shape()
            return shape

    def _code_shape(self) -> Any:
        if not self._identifiable:  # pinned by its version: only that ties its code down
            shape = _codeshape.CodeShape()
            shape.static["code"] = blake3.blake3(self.qualname.encode()).hexdigest()[:16]
            return shape
        return _codeshape.code_shape(self.fn, _step_of, self)

    def key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any], bound: dict[str, Any]) -> str | None:
        """The slot key of a call, or None for an unkeyed step."""
        spec = self.key
        if spec is None:
            return None
        if isinstance(spec, str):
            try:
                key = spec.format_map(bound)
            except (AttributeError, LookupError, ValueError, TypeError) as exc:
                raise self._invalid(f"cannot format key {spec!r}: {type(exc).__name__}: {exc}") from None
        else:
            key = spec(*args, **kwargs)
        if not isinstance(key, str):
            raise self._invalid(f"the key function returned {type(key).__name__} {key!r}; return a str")
        if re.search(r" at 0x[0-9a-fA-F]+", key):
            raise self._invalid(
                f"key {key!r} contains a memory address, which changes "
                "every run; build the key from a stable attribute instead"
            )
        return key

    def plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Plan:
        """Resolve a call to its slot and fingerprint."""
        ident = self.identity()
        memo_key = None
        memoizable = (not callable(self.key) or self.key is by_arguments) and (
            self._memo_defaults or len(args) >= len(self.signature.parameters)
        )
        if not kwargs and memoizable and all(type(a) in _MEMO_TYPES for a in args):
            # Calls with the same simple arguments (and the same identity and immutable
            # defaults) resolve the same way: remember them. (The types are part of the key:
            # 1, 1.0 and True are equal as dict keys.)
            memo_key = (ident.identity, *zip(map(type, args), args, strict=True))
            known = self._plans.get(memo_key)
            if known is not None:
                return Plan(*known, identity=ident)
        try:
            ba = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}(): {exc}") from None
        ba.apply_defaults()
        bound = ba.arguments
        digest, params = digest_parameters(self.name, bound, self.ignore)
        key = digest[:16] if self.key is by_arguments else self.key_for(args, kwargs, bound)
        fingerprint = blake3.blake3(f"{ident.identity}|{digest}".encode()).hexdigest()[:32]
        resolved = (slot_id(self.name, key), key, fingerprint, digest, params)
        if memo_key is not None:
            if len(self._plans) >= _MEMO_SIZE:
                self._plans.clear()
            self._plans[memo_key] = resolved
        return Plan(*resolved, identity=ident, bound=bound)

    def host(self) -> Host:
        """The step's own pipeline, else the current one; in its named session if one is entered here."""
        if self.pipeline is None:
            current: Host = current_pipeline()  # (a named session is the current pipeline there)
            return current
        named: Host | None = session_of(self.pipeline)
        return self.pipeline if named is None else named

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if disabled():
            return self.fn(*args, **kwargs)
        run = self.host()._session_for(self)  # noqa: SLF001 - the Host protocol
        plan = self.plan(args, kwargs)
        # never two calls of a non-idempotent slot at once: the second finds the first's output
        with contextlib.nullcontext() if self.idempotent else run.slot_lock(plan.slot):
            found = run.lookup(self, plan)
            if found.hit:
                return found.value
            return run.execute(self, plan, found, functools.partial(self.fn, *args, **kwargs))

    async def call_async(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if disabled():
            return await self.fn(*args, **kwargs)  # type: ignore[misc]
        run = self.host()._session_for(self)  # noqa: SLF001 - the Host protocol
        plan = self.plan(args, kwargs)
        async with (
            contextlib.nullcontext() if self.idempotent else run.slot_lock(plan.slot, asynchronous=True)
        ):
            found = run.lookup(self, plan)
            if found.hit:
                return found.value
            call: Any = functools.partial(self.fn, *args, **kwargs)
            return await run.execute_async(self, plan, found, call)

    def is_cached(self, *args: Any, **kwargs: Any) -> bool:
        plan = self.plan(args, kwargs)
        return self.host()._has_output(plan)  # noqa: SLF001 - the Host protocol

    def forget(self, *args: Any, **kwargs: Any) -> None:
        plan = self.plan(args, kwargs)
        self.host().reset(plan.slot, downstream=False)


def _step_of(value: object) -> StepSpec[Any, Any] | None:
    """The step *value* is, or None (for code digests of steps calling steps)."""
    spec = getattr(value, "__resumable_step__", None)
    return spec if isinstance(spec, StepSpec) else None


@overload
def step(fn: Callable[P, R], /) -> Step[P, R]: ...
@overload
def step(
    *,
    name: str | None = None,
    version: str | None = None,
    key: KeySpec | None = None,
    ignore: Iterable[str] = (),
    retries: int = 0,
    retry_on: RetryOn = Exception,
    idempotent: bool = True,
    pipeline: Host | None = None,
) -> Callable[[Callable[P, R]], Step[P, R]]: ...
def step(  # noqa: PLR0913 - the documented options
    fn: Callable[P, R] | None = None,
    /,
    *,
    name: str | None = None,
    version: str | None = None,
    key: KeySpec | None = None,
    ignore: Iterable[str] = (),
    retries: int = 0,
    retry_on: RetryOn = Exception,
    idempotent: bool = True,
    pipeline: Host | None = None,
) -> Step[P, R] | Callable[[Callable[P, R]], Step[P, R]]:
    """
    Make a function a step: its output is stored, and a later call with the same
    arguments and code returns the stored output instead of running it again.

    Use it bare (``@step``) or with options:

    - *name*: the step's name (default: the function's ``__name__``); it names its files.
    - *version*: pin the step's identity; code edits no longer invalidate its outputs,
      changing the version does.
    - *key*: one slot per distinct key: a format string over the parameters
      (``"{page}"``) or a callable taking the step's arguments and returning a str.
    - *ignore*: parameter names left out of the fingerprint (clients, loggers ...).
    - *retries*: run again up to this many times, with exponential backoff (0.5 s doubling,
      at most 60 s, each delay between half and all of that, at random), on an exception.
    - *retry_on*: the exception type (or tuple of types) worth a retry (default
      ``Exception``); any other exception propagates at once.
    - *idempotent*: ``False`` for side effects that must not silently happen twice: if a
      run dies while the step runs, the next call raises :class:`StepInterruptedError`.
    - *pipeline*: bind the step to this pipeline (default: the current pipeline).

    Raises:
        StepDefinitionError: the name, key or an option is invalid, or another function
            already uses the name.
    """

    def decorate(fn: Callable[P, R]) -> Step[P, R]:
        spec: StepSpec[P, R] = StepSpec(
            fn,
            name=name,
            version=version,
            key=key,
            ignore=ignore,
            retries=retries,
            retry_on=retry_on,
            idempotent=idempotent,
            pipeline=pipeline,
        )
        wrapper: Any
        if spec.is_async:

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                return await spec.call_async(args, kwargs)

        else:

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                return spec.call(args, kwargs)

        wrapper.__resumable_step__ = spec
        wrapper.is_cached = spec.is_cached
        wrapper.forget = spec.forget
        register(spec)
        result: Step[P, R] = wrapper
        return result

    return decorate if fn is None else decorate(fn)
