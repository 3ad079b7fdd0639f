"""
Running a step that missed: recorded start, retries, the output stored, the end recorded.

``step_started`` is logged first (fsynced for ``idempotent=False`` steps); the function
runs with retries; its output is encoded before anything is overwritten (so an output
that cannot be stored fails with the previous one intact), written atomically, and
``step_completed`` is logged. :class:`StepExecution` is the part of a run that does this.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import random
import time
import traceback
import weakref
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ._codec import encode, frame, value_digest
from ._codec_types import qualified_name
from ._fingerprint import digest_value, provenance, trackable
from ._render import human_size
from ._slots import batch_dir, slot_file
from .exceptions import SerializationError, StepInterruptedError

if TYPE_CHECKING:
    from ._journal import Journal
    from ._run import Found, RunState
    from ._step import Plan, StepSpec
    from ._stores import Store

log = logging.getLogger("resumable")

LARGE_OUTPUT = 100 * 1024 * 1024  # outputs larger than this log a warning
RETRY_BASE_DELAY = 0.5  # seconds before the first retry; doubles each attempt
RETRY_MAX_DELAY = 60.0
_MAX_TRACEBACK = 20_000


class Execution:
    """The step running in this context (so batch helpers inside it know their slot)."""

    __slots__ = ("batches", "loops", "plan", "run", "spec")

    def __init__(self, run: RunState, spec: StepSpec[Any, Any], plan: Plan) -> None:
        self.run = run
        self.spec = spec
        self.plan = plan
        # numbers the step's unnamed batches in call order (next() is atomic: threads may share it)
        self.batches = itertools.count()
        self.loops = Loops()  # its `checkpointed` loops still open


class Loops:
    """
    The ``checkpointed`` loops of a step call (or of a run, outside steps) not finished yet.

    A loop kept in a variable (``loop = checkpointed(...)``) outlives an exception raised in
    its body: the traceback holds the frame that holds it. Closing the loops as the
    exception leaves the step (or the run) commits their finished rows at once, while the
    run can still write them.
    """

    __slots__ = ("_open",)

    def __init__(self) -> None:
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()

    def add(self, loop: Any) -> None:
        self._open.add(loop)

    def discard(self, loop: Any) -> None:
        self._open.discard(loop)

    def close(self) -> None:
        for loop in list(self._open):
            loop.close()


current_execution: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "resumable_execution", default=None
)


class StepExecution:
    """What a run does with a step that has to run (mixed into :class:`RunState`)."""

    store: Store
    durable: bool
    secret: bytes | None
    allow_pickle: bool
    keep_checkpoints: int
    journal: Journal
    last_failure: BaseException | None
    last_outcome: str

    def begin(self, spec: StepSpec[Any, Any], plan: Plan, found: Found) -> float:
        """Record that a step starts running (durably for non-idempotent steps)."""
        rec = self.journal.manifest.steps.get(plan.slot)
        if not spec.idempotent and rec is not None and rec.status in {"interrupted", "running"}:
            raise StepInterruptedError(plan.slot, rec.started_at, step=spec.name)
        detail = f" ({found.detail})" if found.detail else ""
        log.info("step %r running: %s%s", plan.slot, found.reason, detail)
        from . import _why  # noqa: PLC0415 - kept out of `import resumable`

        _why.record_code(self.store, spec.name, plan.identity)
        self.journal.record(
            "step_started",
            # a non-idempotent step's start must be on disk before its side effects begin
            sync=not spec.idempotent,
            defer=spec.idempotent,
            slot=plan.slot,
            step=spec.name,
            reason=found.reason,
            detail=found.detail or None,
            fingerprint=plan.fingerprint,
            attempt=1,
            code=plan.identity.code,
            was=found.was,
            params=found.params,
        )
        return time.perf_counter()

    def _retry_or_fail(
        self, spec: StepSpec[Any, Any], plan: Plan, exc: BaseException, started: float, attempt: int
    ) -> float | None:
        """After an attempt raised: the delay before the next one, or None (recorded: re-raise)."""
        if isinstance(exc, Exception) and isinstance(exc, spec.retry_on) and attempt <= spec.retries:
            return self._retry_delay(spec, plan, attempt, exc)
        self._failed_noting(spec, plan, exc, started, attempt)
        return None

    def _retry_delay(self, spec: StepSpec[Any, Any], plan: Plan, attempt: int, exc: Exception) -> float:
        # Exponential backoff with jitter: many workers failing at once do not retry at once.
        delay = min(RETRY_BASE_DELAY * 2.0 ** (attempt - 1), RETRY_MAX_DELAY)
        delay *= random.uniform(0.5, 1.0)  # noqa: S311 - spreading retries, not secrets
        log.warning(
            "step %r attempt %d of %d failed (%s: %s); retrying in %.1fs",
            plan.slot, attempt, spec.retries + 1, type(exc).__name__, exc, delay,
        )  # fmt: skip
        self.journal.record("step_retry", slot=plan.slot, attempt=attempt + 1, error=_error_fields(exc))
        return delay

    def complete(
        self, spec: StepSpec[Any, Any], plan: Plan, value: Any, started: float, attempts: int
    ) -> None:
        """Store the output atomically, then record the step as completed."""
        try:
            encoded = encode(value, allow_pickle=self.allow_pickle, what=f"the output of step {plan.slot!r}")
        except SerializationError as exc:
            exc.step = spec.name
            self._failed_noting(spec, plan, exc, started, attempts)
            raise
        ident = plan.identity
        meta = {
            "slot": plan.slot,
            "step": spec.name,
            "key": plan.key,
            "fingerprint": plan.fingerprint,
            "identity": ident.identity,
            "code": ident.code,
            "args": plan.args,
            "params": plan.params,
        }
        if not trackable(value):  # hashed by content when passed on: cheap, and known unloaded
            meta["pdigest"] = plan.output_plain_digest = digest_value(value)
        header_last = getattr(self.store, "write_header_last", None)
        framed = frame(encoded, meta, secret=self.secret)
        header, size = framed.header, framed.size
        if size > LARGE_OUTPUT:
            log.warning(
                "step %r output is %s; large outputs slow every save and load", plan.slot, human_size(size)
            )
        if plan.replaces is not None and self.keep_checkpoints > 0:
            from . import _history  # noqa: PLC0415 - imported when history is first used

            _history.keep_version(self.store, plan.slot, plan.replaces, durable=self.durable)
        try:
            if header_last is not None and framed.hashing:
                key = slot_file(plan.slot)
                header_last(
                    key, framed.head_len, framed.value_chunks, framed.header_bytes, durable=self.durable
                )
            else:
                self.store.write(slot_file(plan.slot), framed.chunks(), durable=self.durable)
        except BaseException as exc:
            self._failed_noting(spec, plan, exc, started, attempts)
            raise
        plan.output_digest = value_digest(header)
        _remember(value, header, loaded=False)
        if plan.slot in self.journal.manifest.batches:  # the output now holds what they held
            self.forget_batches(plan.slot)
        fields: dict[str, Any] = {}
        if self.journal.manifest.code.get(spec.name) != ident.components:
            fields["code"] = ident.components
        self.journal.record(
            "step_completed",
            # The output file, fsynced, is what a rerun relies on: the event follows within
            # FLUSH_INTERVAL (with the next ones), so that a store costs one fsync pair.
            defer=spec.idempotent,
            slot=plan.slot,
            fingerprint=plan.fingerprint,
            file=header["hsum"],
            bytes=size,
            duration_s=round(time.perf_counter() - started, 6),
            attempts=attempts,
            **fields,
        )
        self.last_outcome = "ok"
        log.debug(
            "step %r completed in %.3fs, %s", plan.slot, time.perf_counter() - started, human_size(size)
        )

    def forget_batches(self, slot: str | None, name: str | None = None) -> int:
        """Delete the row chunks of a step slot's batches (or of a named batch)."""
        # deepest first, so that emptied sub-directories go too
        keys = sorted(self.store.list(batch_dir(slot, name)), key=lambda k: -k.count("/"))
        for key in keys:
            self.store.delete(key, durable=False)
        batch = slot if slot is not None else name
        if batch in self.journal.manifest.batches:
            self.journal.record("batch_done", batch=batch)
        return len(keys)

    def _failed_noting(
        self, spec: StepSpec[Any, Any], plan: Plan, exc: BaseException, started: float, attempts: int
    ) -> None:
        """Record a failure to store; if the log cannot take it either, the first error wins."""
        try:
            self.failed(spec, plan, exc, started, attempts)
        except OSError as log_error:  # e.g. the disk is full: report the output's error
            exc.add_note(f"(the failure could not be recorded in the event log either: {log_error})")

    def failed(
        self, spec: StepSpec[Any, Any], plan: Plan, exc: BaseException, started: float, attempts: int
    ) -> None:
        """Record an exception that escapes a step (it is re-raised by the caller)."""
        self.last_outcome = "failed" if isinstance(exc, Exception) else "interrupted"
        if not isinstance(exc, Exception):
            self.journal.record(
                "step_interrupted", slot=plan.slot, duration_s=round(time.perf_counter() - started, 6)
            )
            return
        self.last_failure = exc
        log.info("step %r failed after %d attempt(s): %s: %s", plan.slot, attempts, type(exc).__name__, exc)
        self.journal.record(  # raises OSError only if the log cannot be written: the caller notes it
            "step_failed",
            slot=plan.slot,
            step=spec.name,
            attempts=attempts,
            duration_s=round(time.perf_counter() - started, 6),
            error=_error_fields(exc),
        )

    def execute(self, spec: StepSpec[Any, Any], plan: Plan, found: Found, call: Callable[[], Any]) -> Any:
        """Run a step that missed, with retries, and store its output."""
        started = self.begin(spec, plan, found)
        attempt = 1
        while True:
            execution = Execution(self, spec, plan)  # type: ignore[arg-type]
            token = current_execution.set(execution)
            try:
                value = call()
            except BaseException as exc:
                execution.loops.close()
                delay = self._retry_or_fail(spec, plan, exc, started, attempt)
                if delay is None:
                    raise
            else:
                self.complete(spec, plan, value, started, attempt)
                return value
            finally:
                current_execution.reset(token)
            try:
                time.sleep(delay)
            except BaseException as exc:
                self._failed_noting(spec, plan, exc, started, attempt)
                raise
            attempt += 1

    async def execute_async(
        self, spec: StepSpec[Any, Any], plan: Plan, found: Found, call: Callable[[], Coroutine[Any, Any, Any]]
    ) -> Any:
        """The async twin of :meth:`execute`; the output is written off the event loop."""
        import asyncio  # noqa: PLC0415 - imported by the caller already; kept out of `import resumable`

        started = self.begin(spec, plan, found)
        attempt = 1
        while True:
            execution = Execution(self, spec, plan)  # type: ignore[arg-type]
            token = current_execution.set(execution)
            try:
                value = await call()
            except BaseException as exc:
                execution.loops.close()
                delay = self._retry_or_fail(spec, plan, exc, started, attempt)
                if delay is None:
                    raise
            else:
                if self.durable:
                    # an fsync takes milliseconds: keep the event loop serving other steps
                    await asyncio.to_thread(self.complete, spec, plan, value, started, attempt)
                else:
                    self.complete(spec, plan, value, started, attempt)
                return value
            finally:
                current_execution.reset(token)
            try:
                await asyncio.sleep(delay)
            except BaseException as exc:
                self._failed_noting(spec, plan, exc, started, attempt)
                raise
            attempt += 1


def _remember(value: object, header: dict[str, Any], *, loaded: bool = True) -> None:
    # Passed to another step, the value is known by the stored checksum as long as it still
    # encodes to the stored bytes (provenance checks that at every use).
    buffers = header["buffers"]
    pads = tuple(pad for pad, _ in buffers) if buffers else ()
    pickled = loaded and header["encoding"] == "msgpack+pickle"
    provenance.remember(value, header["checksum"], pads, loaded_pickle=pickled)


def _error_fields(exc: BaseException) -> dict[str, str]:
    text = "".join(traceback.format_exception(exc))
    return {
        "type": qualified_name(type(exc)),
        "message": str(exc)[:2000],
        "traceback": text[-_MAX_TRACEBACK:],
    }
