"""
The pipeline runner: a pipeline's steps in order, outputs passed on by parameter name.

A skipped step's output is passed on unloaded (a :class:`StoredOutput`, fingerprinted from
its stored digests); it is read only when a step that runs needs its value.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

from ._codec import DamagedFileError, value_digest
from ._fingerprint import Outputs, StoredOutput
from ._journal import read_header
from ._plan import Plan
from ._session import Found, RunState
from ._slots import slot_file
from ._step import StepSpec
from .exceptions import ResumableError, SerializationError, StepDefinitionError


class Run:
    """What :meth:`Pipeline.run` did: outputs (loaded on access), executed and skipped slots."""

    def __init__(self, outputs: Mapping[str, Any], executed: list[str], skipped: list[str]) -> None:
        self.outputs: Mapping[str, Any] = Outputs(outputs)
        self.executed = executed
        self.skipped = skipped

    def __repr__(self) -> str:
        return f"Run(executed={self.executed!r}, skipped={self.skipped!r})"


def run_steps(owner: str, run: RunState, specs: list[StepSpec[Any, Any]], inputs: Mapping[str, Any]) -> Run:
    """Run *specs* in order, passing outputs on by parameter name (see ``Pipeline.run``)."""
    outputs: dict[str, Any] = {}
    executed: list[str] = []
    skipped: list[str] = []
    for spec in specs:
        args, kwargs = _arguments(owner, spec, outputs, inputs)
        value, ran, slot = _run_one(run, spec, args, kwargs)
        outputs[spec.name] = value
        (executed if ran else skipped).append(slot)
    return Run(outputs, executed, skipped)


def run_without_state(owner: str, specs: list[StepSpec[Any, Any]], inputs: Mapping[str, Any]) -> Run:
    """``RESUMABLE_DISABLE=1``: every step runs, in order; nothing is read or written."""
    outputs: dict[str, Any] = {}
    for spec in specs:
        args, kwargs = _arguments(owner, spec, outputs, inputs)
        call = _call(spec, args, kwargs)
        outputs[spec.name] = _run_async(spec, call) if spec.is_async else call()
    return Run(outputs, [spec.name for spec in specs], [])


def _run_one(
    run: RunState, spec: StepSpec[Any, Any], args: list[Any], kwargs: dict[str, Any]
) -> tuple[Any, bool, str]:
    if spec.key is not None:  # the key may need the values themselves
        args, kwargs = _resolved(args), _resolved(kwargs)
    plan = spec.plan(tuple(args), kwargs)
    found = run.peek(spec, plan)
    if found.hit:  # its value is the output's header
        digest, plain = value_digest(found.value), found.value.get("pdigest")
        redo = functools.partial(_load_or_redo, run, spec, plan, args, kwargs, digest=digest)
        plain = plain if isinstance(plain, str) else None
        return StoredOutput(plan.slot, digest, redo, plain), False, plan.slot
    value = _execute(run, spec, plan, found, _call(spec, args, kwargs))
    # downstream steps see the stored digests, exactly as when this step is skipped
    digest, plain = plan.output_digest or "", plan.output_plain_digest
    return StoredOutput(plan.slot, digest, lambda: value, plain), True, plan.slot


def _load_or_redo(  # noqa: PLR0913 - what the lazy value needs to load or make the output
    run: RunState,
    spec: StepSpec[Any, Any],
    plan: Plan,
    args: list[Any],
    kwargs: dict[str, Any],
    *,
    digest: str,
) -> Any:
    """
    The output this run found for a skipped step, read when first used: made again (with its
    events) if removed or replaced since while the run is open; an error once it has closed.
    """
    key = slot_file(plan.slot)
    if not run.closed:  # as a call of the step would
        found = run.lookup(spec, plan)
        return found.value if found.hit else _execute(run, spec, plan, found, _call(spec, args, kwargs))
    try:
        header, _ = read_header(run.store, key)
        if value_digest(header) == digest:
            return run.load(spec, plan)
        what = "was replaced by another output"
    except FileNotFoundError:
        what = "was removed (a reset, a rollback or a clean)"
    except (DamagedFileError, SerializationError) as exc:
        what = f"cannot be read ({exc})"
    msg = (
        f"the output of step {plan.slot!r} ({run.store.location}/{key}) {what} after the run "
        "that found it had ended, and a closed run writes nothing: run the pipeline again "
        "(pipe.run()) to get its output, or read run.outputs inside `with pipe:` to have a "
        "missing output made again while the run is open"
    )
    raise ResumableError(msg)


def _resolved(values: Any) -> Any:
    if isinstance(values, dict):
        return {k: v.get() if isinstance(v, StoredOutput) else v for k, v in values.items()}
    return [v.get() if isinstance(v, StoredOutput) else v for v in values]


def _arguments(
    owner: str, spec: StepSpec[Any, Any], outputs: Mapping[str, Any], inputs: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for name, param in spec.signature.parameters.items():
        if param.kind in {param.VAR_POSITIONAL, param.VAR_KEYWORD}:
            continue
        if name in outputs:
            value = outputs[name]
        elif name in inputs:
            value = inputs[name]
        elif param.default is not param.empty:
            continue
        else:
            msg = (
                f"{owner}.run(): step {spec.name!r} needs {name!r}, but no earlier step is "
                f"called {name!r} and no input {name}=... was given"
            )
            raise StepDefinitionError(msg, step=spec.name)
        if param.kind is param.POSITIONAL_ONLY:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _call(spec: StepSpec[Any, Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    return functools.partial(spec.fn, *_resolved(args), **_resolved(kwargs))


def _execute(run: RunState, spec: StepSpec[Any, Any], plan: Plan, found: Found, call: Any) -> Any:
    if not spec.is_async:
        return run.execute(spec, plan, found, call)
    return _run_async(spec, functools.partial(run.execute_async, spec, plan, found, call))


def _run_async(spec: StepSpec[Any, Any], coroutine: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    import asyncio  # noqa: PLC0415 - only async steps need it; it takes longer to import than this package

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine())
    msg = (
        f"Pipeline.run() cannot run async step {spec.name!r} inside a running event loop; "
        "call the step and await it instead"
    )
    raise ResumableError(msg)
