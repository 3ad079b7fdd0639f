"""The run state: one open run of a pipeline, in one session of its store (:class:`RunState`)."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import itertools
import logging
import os
import random
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _codehash
from ._codec import (
    DamagedFileError,
    Verified,
    encode,
    frame,
    parse_header,
    read_verified,
    utcnow,
    value_digest,
    verify,
)
from ._codec_types import qualified_name
from ._files import file_digests
from ._fingerprint import content_digest, provenance
from ._journal import Journal, header_authentic, read_header
from ._plan import Plan, StepView
from ._slots import STEP_BATCHES, batch_dir, slot_file
from ._stores import Stamp, Store, key_stamp
from ._units import human_size
from ._warn import warn
from .exceptions import ResumableError, SerializationError, StepChangedError, StepInterruptedError

log = logging.getLogger("resumable")


class Later:
    """A module of this package, imported when first used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name, __package__), attr)


# Steps run without history and why until a step runs or a run closes: `import resumable`
# does not load them.
if TYPE_CHECKING:
    from . import _history, _why
else:
    _history, _why = Later("._history"), Later("._why")


LARGE_OUTPUT = 100 * 1024 * 1024  # outputs larger than this log a warning
RETRY_BASE_DELAY = 0.5  # seconds before the first retry; doubles each attempt
RETRY_MAX_DELAY = 60.0
_MAX_TRACEBACK = 20_000
# A run logs the skips of the slots completed last (at most this many), and of slots the
# manifest does not hold as completed; the skips of older slots are not logged.
SKIPS_LOGGED = 32
LAG = 8 * 1024  # bytes of log a named session's manifest.json may lag (replayed by each open)


class Execution:
    """The step running in this context (so batch helpers inside it know their slot)."""

    __slots__ = ("batches", "loops", "plan", "retry_in", "run", "spec")

    def __init__(self, run: RunState, spec: StepView, plan: Plan) -> None:
        self.run = run
        self.spec = spec
        self.plan = plan
        # numbers the step's unnamed batches in call order (next() is atomic: threads may share it)
        self.batches = itertools.count()
        self.loops = Loops()  # its `checkpointed` loops still open
        self.retry_in = 0.0  # seconds before the next attempt, once this one failed


class Loops(weakref.WeakSet[Any]):
    """The unfinished ``checkpointed`` loops of a step call (or run): closing them commits their rows."""

    def close(self) -> None:
        for loop in list(self):
            loop.close()


current_execution: contextvars.ContextVar[Execution | None] = contextvars.ContextVar(
    "resumable_execution", default=None
)


def _remember(value: object, header: dict[str, Any], *, loaded: bool = True) -> None:
    # A value with no digest of its own, passed to another step, is known by the stored
    # checksum as long as it still encodes to the stored bytes (provenance checks that at
    # every use). Any other value is fingerprinted by its content, wherever it came from.
    if "pdigest" in header:
        return
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


# Small files skipped more than once in a run are kept verified in memory, stamped (at most
# this size and count): a later skip of the same slot decodes from memory.
_VERIFIED_MAX_FILE = 16 * 1024
_VERIFIED_MAX_FILES = 1024


class Found(NamedTuple):
    """The result of looking a call up: a hit with its value, or a miss with a reason."""

    hit: bool
    value: Any = None
    reason: str = ""
    detail: str = ""
    was: str | None = None  # for a miss on a stored output: the code digest that made it
    params: list[str] | None = None  # and the parameters whose values differ from its


class _Writing:
    """A batch's writes in a run, which the run's close waits for (see :meth:`RunState.writing`)."""

    __slots__ = ("run", "what")

    def __init__(self, run: RunState, what: str) -> None:
        self.run, self.what = run, what

    def __enter__(self) -> None:
        self.run._enter_writing(self.what)  # noqa: SLF001 - the run's own protocol

    def __exit__(self, *exc: object) -> None:
        self.run._exit_writing()  # noqa: SLF001 - the run's own protocol


class RunState:
    """
    One open run of a pipeline: it holds the store's lock until it closes, keeps the
    journal, looks step calls up (a skip, or a miss with its reason) and runs the misses
    (start recorded, retries, the output stored, the end recorded).
    """

    def __init__(  # noqa: PLR0913 - the pipeline's options
        self,
        store: Store,
        *,
        pipeline: str,
        durable: bool,
        allow_pickle: bool,
        secret: bytes | None,
        keep_checkpoints: int,
        lagging_manifest: bool,
    ) -> None:
        self.store = store
        self.durable = durable
        # a named session: manifest.json is rewritten once its log has grown LAG bytes past it
        self.lagging_manifest = lagging_manifest
        self.keep_checkpoints = keep_checkpoints
        self.allow_pickle = allow_pickle
        self.secret = secret
        self.journal = Journal(store, pipeline=pipeline, secret=secret, durable=durable)
        self.loops = Loops()  # `checkpointed` loops of named batches, outside steps
        self._lock: Any = None
        self.token = os.urandom(8).hex()
        self._single_slot: dict[str, str | None] = {}  # step -> its first arguments (None: warned)
        # one call at a time per slot of an idempotent=False step (see slot_lock)
        self._slot_locks: dict[tuple[str, bool], Any] = {}
        self._slot_locks_lock = threading.Lock()
        self.maintenance = False
        self.last_failure: BaseException | None = None
        # how the last step call of this run ended: "ok", "failed" or "interrupted"
        self.last_outcome = "ok"
        # code components as they were when the run opened, to explain every rerun the same way
        self._code_before: dict[str, dict[str, str]] = {}
        self._skipped: set[str] = set()
        self._recent: set[str] = set()  # the slots completed last when the run opened
        self._code_recorded: set[str] = set()  # code digests whose record is in the store (_why)
        # slot -> (stamp, verified file) of files skipped again in this run
        self._verified: dict[str, tuple[Stamp, Verified]] = {}
        self._writers: dict[int, int] = {}  # thread -> depth of the batch writes it is in (see writing)
        self._closing = False
        # re-entrant: a Ctrl-C that left it held does not lock its own thread's close out
        self._quiet = threading.Condition()

    def open(self, *, maintenance: bool = False, prepare: Callable[[], None] | None = None) -> None:
        """
        Take the lock and load the state; a normal open also counts a new run. *prepare* is
        called holding the lock, before the state is read (a named session finishes a
        killed fork or delete there).
        """
        self.maintenance = maintenance
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": utcnow(),
            "argv": sys.argv[:4],
            # tells this run apart from others of this process (see Pipeline._maintenance)
            "run_token": self.token,
        }
        self._lock = self.store.lock(holder)
        try:
            if prepare is not None:
                prepare()
            if not maintenance:  # (only a run fingerprints Path arguments)
                file_digests.attach(self.store, self.secret)
            manifest = self.journal.load()
            if manifest.runs and manifest.pipeline != self.journal.pipeline and not maintenance:
                log.warning(
                    "%s was last used by pipeline %r, now by %r: their steps share it "
                    "(give each script its own state directory to keep them apart)",
                    self.store.location, manifest.pipeline, self.journal.pipeline,
                )  # fmt: skip
            self._code_before = {k: dict(v) for k, v in manifest.code.items()}
            self._recent = set(manifest.completed_steps[-SKIPS_LOGGED:])
            if manifest.status == "running" and manifest.runs > 0:
                # the lock was free, so the run that wrote "running" died without closing
                self.journal.record("run_finished", status="interrupted", detected="next run")
                self.store.remove_temp_files()  # what the dead run was writing: only we can write now
                # a kill between storing a batch step's output and deleting its row chunks
                for slot in sorted(
                    {s for s, _ in chunks_of_completed(self.store, manifest.steps.is_completed)}
                ):
                    self.forget_batches(slot)
            if not maintenance:
                self.journal.record(
                    "run_started",
                    run=manifest.runs + 1,
                    pipeline=self.journal.pipeline,
                    workflow_id=manifest.workflow_id,
                    pid=holder["pid"],
                    host=holder["host"],
                )
                if self.journal.rebuilt or not (self.journal.large or self.lagging_manifest):
                    self.journal.flush(durable=False)  # manifest.json says "running" at once
                else:  # a large or lagging manifest is rewritten later; readers fold the log
                    self.journal.write_pending(durable=False)
        except BaseException:
            self._release()
            raise

    def close(self, status: str, error: BaseException | None = None, defined: Iterable[str] = ()) -> None:
        """
        Record how the run ended (and which steps it had *defined*), drop output versions
        no retained checkpoint needs, write the manifest durably and release the lock.
        """
        try:
            self.loops.close()  # loops of named batches left by an exception: commit their rows
            me = threading.get_ident()
            with self._quiet:  # batch commits under way on other threads end first
                self._closing = True
                self._quiet.wait_for(lambda: self._writers.keys() <= {me})
            if self.maintenance:  # a maintenance lock (CLI, reset ...) keeps all history
                if self.journal.unsaved:  # a look at the state writes nothing
                    self.journal.flush(durable=self.durable)
                return
            lagging = self.lagging_manifest and not self.journal.rebuilt
            fields: dict[str, Any] = {"status": status}
            if error is not None and status == "failed" and error is not self.last_failure:
                fields["error"] = _error_fields(error)
            # lagging: the close is durable in the log (one fsync), not in manifest.json
            self.journal.record("run_finished", sync=lagging, defined=sorted(defined), **fields)
            self.journal.write_pending(durable=False)  # the log must hold every event prune replays
            manifest = self.journal.manifest
            _history.prune(self.store, self.secret, self.keep_checkpoints, manifest, durable=False)
            file_digests.save(self.store, self.secret)
            if not lagging:
                self.journal.flush(durable=self.durable)
            elif manifest.events_offset - self.journal.saved_offset >= LAG:
                self.journal.flush(durable=False)
        finally:
            self._release()

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def lookup(self, spec: StepView, plan: Plan) -> Found:
        """Return the stored output of *plan* if it is there and valid, else why not."""
        if plan.key is None:
            self._check_single_slot(spec, plan)
        key = slot_file(plan.slot)
        checked: Verified | None = None
        try:
            # A slot skipped before in this run is stamped, before it is read, and kept verified
            # (the other order could keep a stale copy); a first skip needs no stamp.
            stamp = key_stamp(self.store, key) if plan.slot in self._skipped else None
            known = self._verified.get(plan.slot)
            if known is not None and known[0] == stamp:  # verified in this run, unchanged since
                checked = known[1]
                header, head_len = checked.header, checked.head_len
            else:
                data = self.store.read(key)
                header, head_len = parse_header(data)
        except (FileNotFoundError, DamagedFileError) as exc:
            return self._unusable(plan, exc)
        miss = self._check_header(spec, plan, header)
        if miss is not None:
            return miss
        fresh = checked is None
        try:
            if checked is None:
                verify(data, header, head_len, self.secret)
                checked = Verified(data, header, head_len)
            value = checked.decode(allow_pickle=self.allow_pickle)
        except DamagedFileError as exc:
            return self._corrupt(plan, str(exc))
        if fresh and stamp is not None:
            self._keep_verified(plan.slot, stamp, checked)
        _remember(value, header)
        return self._hit(spec, plan, value, header, head_len)

    def peek(self, spec: StepView, plan: Plan) -> Found:
        """Like :meth:`lookup`, reading only the header (authenticated with a secret), which a hit holds."""
        try:
            header, head_len = read_header(self.store, slot_file(plan.slot))
        except (FileNotFoundError, DamagedFileError) as exc:
            return self._unusable(plan, exc)
        if self.secret is not None and not header_authentic(header, self.secret):
            return self._corrupt(plan, "authentication failed (written without the secret, or tampered with)")
        miss = self._check_header(spec, plan, header)
        if miss is not None:
            return miss
        return self._hit(spec, plan, header, header, head_len)

    def _unusable(self, plan: Plan, exc: Exception) -> Found:
        """The miss for a slot whose file is missing, or whose header is damaged."""
        if not isinstance(exc, FileNotFoundError):
            return self._corrupt(plan, str(exc))
        rec = self.journal.manifest.steps.get(plan.slot)
        if rec is not None and rec.status == "reset":
            return Found(hit=False, reason="reset")
        if rec is not None and rec.status in {"failed", "interrupted"}:
            return Found(hit=False, reason="new", detail=f"the previous attempt {rec.status}")
        return Found(hit=False, reason="new")

    def _check_header(self, spec: StepView, plan: Plan, header: dict[str, Any]) -> Found | None:
        if header["slot"] != plan.slot:
            return self._corrupt(plan, f"it holds slot {header['slot']!r}")
        if header.get("fingerprint") != plan.fingerprint:
            plan.replaces = header["hsum"]  # the version a rerun replaces: history keeps it
            return self._mismatch(spec, plan, header)
        return None

    def _keep_verified(self, slot: str, stamp: Stamp, checked: Verified) -> None:
        # small files without out-of-band buffers only: their values never share the data's memory
        if checked.header["buffers"] or len(checked.data) > _VERIFIED_MAX_FILE:
            return
        if len(self._verified) >= _VERIFIED_MAX_FILES:
            self._verified.clear()
        self._verified[slot] = (stamp, Verified(bytes(checked.data), checked.header, checked.head_len))

    def _hit(self, spec: StepView, plan: Plan, value: Any, header: dict[str, Any], head_len: int) -> Found:
        self.last_outcome = "ok"
        if plan.slot not in self._skipped:  # one event and one log line per slot and run are enough
            self._skipped.add(plan.slot)
            code = header.get("code")
            # a pinned version kept an output made by other code
            kept = spec.version is not None and isinstance(code, str) and code != plan.identity.code
            if log.isEnabledFor(logging.INFO):
                note = f"stored {header.get('created_at', '?')}"
                if kept:
                    changed = _codehash.describe_change(self._old_code(spec.name), plan.identity.components)
                    note += (
                        f"; kept despite a code change ({changed or 'its code'}) "
                        f"because version {spec.version!r} is pinned"
                    )
                log.info("step %r skipped: %s", plan.slot, note)
            if kept:  # (for `why`)
                self._record_code(spec, plan)
                self.journal.record("step_kept", slot=plan.slot, code=plan.identity.code, was=code)
            # The skips of the slots completed last are logged (why and report show them);
            # older ones change nothing: a run replaying a conversation of 200 turns would
            # otherwise log 200 skips, and the log would grow with the square of its length.
            completed = self.journal.manifest.steps.is_completed(plan.slot)
            if kept or plan.slot in self._recent or not completed:
                self.journal.record(
                    "step_skipped",
                    defer=completed,  # written with the next event: a request's skips in one write
                    slot=plan.slot,
                    fingerprint=plan.fingerprint,
                    bytes=head_len + header["size"],
                    created_at=header.get("created_at"),
                    file=header["hsum"],
                )
        return Found(hit=True, value=value)

    def load(self, spec: StepView, plan: Plan) -> Any:
        """Load a stored output found earlier by a header-only lookup."""
        key = slot_file(plan.slot)
        data = self.store.read(key)
        try:
            checked = read_verified(data, self.secret)
            value = checked.decode(allow_pickle=self.allow_pickle)
        except DamagedFileError as exc:
            where = f"{self.store.location}/{key}"
            msg = f"cannot load the output of step {plan.slot!r} from {where}: {exc}"
            raise SerializationError(msg, step=spec.name) from None
        _remember(value, checked.header)
        return value

    def slot_lock(self, slot: str, *, asynchronous: bool = False) -> Any:
        """
        The lock that serialises calls of one slot of an ``idempotent=False`` step (an
        :class:`asyncio.Lock` for coroutines): a second call waits for the first, then finds
        its stored output instead of taking the running step for one a dead run left behind.
        """
        with self._slot_locks_lock:
            lock = self._slot_locks.get((slot, asynchronous))
            if lock is None:
                if asynchronous:
                    import asyncio  # noqa: PLC0415 - loaded by the async caller already; slow to import

                    lock = asyncio.Lock()
                else:
                    lock = threading.RLock()
                self._slot_locks[slot, asynchronous] = lock
            return lock

    def _record_code(self, spec: StepView, plan: Plan) -> None:
        """Keep the code a step runs for `resumable why`: once per code and run, again if it failed."""
        if plan.identity.code in self._code_recorded:
            return
        if _why.record_code(self.store, spec.name, plan.identity):
            self._code_recorded.add(plan.identity.code)

    def _old_code(self, step: str) -> dict[str, str] | None:
        return self._code_before.get(step) or self.journal.manifest.code.get(step)

    def _corrupt(self, plan: Plan, why: str) -> Found:
        where = f"{self.store.location}/{slot_file(plan.slot)}"
        warn(f"{where} cannot be used ({why}); step {plan.slot!r} will be recomputed.")
        return Found(hit=False, reason="corrupt", detail=why)

    def _mismatch(self, spec: StepView, plan: Plan, header: dict[str, Any]) -> Found:
        ident = plan.identity
        stored = header.get("identity")
        old_params = header.get("params")
        params = None
        if isinstance(old_params, dict):
            names = old_params.keys() | plan.params.keys()
            params = sorted(n for n in names if old_params.get(n) != plan.params.get(n))
        was = header.get("code") if isinstance(header.get("code"), str) else None
        made = header.get("created_at") if isinstance(header.get("created_at"), str) else None
        if stored == ident.identity:
            reason, what, detail = "inputs changed", "its arguments", ", ".join(params or [])
        elif spec.version is not None or str(stored).startswith("version:"):
            old = str(stored).removeprefix("version:").removeprefix("code:")[:12]
            reason, what, detail = "version changed", "its version", f"{old} -> {spec.version}"
        else:
            record = _why.read_code(self.store, was) or {}
            old_components = record.get("components") or self._old_code(spec.name)
            changed = _codehash.describe_change(old_components, ident.components)
            reason, what, detail = "code changed", "its code", changed
        if not spec.idempotent:
            change = f"{what} changed ({detail})" if detail else f"{what} changed"
            raise StepChangedError(plan.slot, change, made, step=spec.name)
        return Found(hit=False, reason=reason, detail=detail, was=was, params=params)

    def _check_single_slot(self, spec: StepView, plan: Plan) -> None:
        first = self._single_slot.setdefault(spec.name, plan.args)
        if first is None or first == plan.args:
            return
        self._single_slot[spec.name] = None
        # advise a key from an argument that names the call well (str or int), else all of them
        if plan.bound is None:  # a memoized call: its arguments are all simple values
            names = list(spec.signature.parameters)[:1]
        else:
            names = [name for name, value in plan.bound.items() if type(value) in {str, int}]
        advice = "@step(key=resumable.by_arguments) (one slot per distinct set of arguments)"
        if names:
            example = f"@step(key='{{{names[0]}}}')"
            advice = f"key=, e.g. {example} if {names[0]} tells the calls apart, or {advice}"
        warn(
            f"step {spec.name!r} was called twice in this run with different arguments, "
            "but it has a single slot: each call replaces the stored output, so a rerun "
            f"recomputes all but the last. Give it one slot per call with {advice}."
        )

    def writing(self, what: str) -> _Writing:
        """
        Keep the run from closing while *what* (a batch) writes; raise :class:`ResumableError`
        once the run has begun to close, as it then no longer holds the lock. A thread
        already writing may go on (nested calls).
        """
        return _Writing(self, what)

    def _enter_writing(self, what: str) -> None:
        me = threading.get_ident()
        with self._quiet:
            depth = self._writers.get(me, 0)
            # a thread already writing ends what it began, until the lock is given up
            if self._lock is None or (not depth and self._closing):
                msg = (
                    f"{what}: its run has already ended (the `with pipe:` block or the script's "
                    "run closed before it ran or finished), and a closed run writes nothing. "
                    "Await it inside the block, or open the pipeline again around it."
                )
                raise ResumableError(msg)
            self._writers[me] = depth + 1

    def _exit_writing(self) -> None:
        me = threading.get_ident()
        with self._quiet:
            depth = self._writers.pop(me) - 1
            if depth:
                self._writers[me] = depth
            if self._closing:
                self._quiet.notify_all()

    @property
    def closing(self) -> bool:
        """True once the run has begun to close: a batch may write nothing more (see writing)."""
        return self._closing or self._lock is None

    @property
    def closed(self) -> bool:
        """True once the run has released its lock: nothing may be written for it any more."""
        return self._lock is None

    def begin(self, spec: StepView, plan: Plan, found: Found) -> float:
        """Record that a step starts running (durably for non-idempotent steps)."""
        if not spec.idempotent:
            rec = self.journal.manifest.steps.get(plan.slot)
            if rec is not None and rec.status in {"interrupted", "running"}:
                raise StepInterruptedError(plan.slot, rec.started_at, step=spec.name)
        detail = f" ({found.detail})" if found.detail else ""
        log.info("step %r running: %s%s", plan.slot, found.reason, detail)
        self._record_code(spec, plan)
        extra: dict[str, Any] = {}  # for `resumable report`; older logs lack them
        if plan.key is not None and "~" in plan.slot:  # a long key, shortened in its slot
            extra["key"] = plan.key[:1000]
        outer = current_execution.get()
        if outer is not None:
            extra["parent"] = outer.plan.slot
        self.journal.record(
            "step_started",
            # a non-idempotent step's start must be on disk before its side effects begin; any
            # start is appended at once, so `status` and `report` show the step running
            sync=not spec.idempotent,
            slot=plan.slot,
            step=spec.name,
            reason=found.reason,
            detail=found.detail or None,
            fingerprint=plan.fingerprint,
            attempt=1,
            code=plan.identity.code,
            was=found.was,
            params=found.params,
            **extra,
        )
        return time.perf_counter()

    def complete(self, spec: StepView, plan: Plan, value: Any, started: float, attempts: int) -> None:
        """Store the output atomically, then record the step as completed."""
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
        try:
            encoded = encode(value, allow_pickle=self.allow_pickle, what=f"the output of step {plan.slot!r}")
            # passed on unloaded (the runner), the output counts as its content does
            plain = plan.output_plain_digest = content_digest(value)
            if plain is not None:
                meta["pdigest"] = plain
            framed = frame(encoded, meta, secret=self.secret)
            if plan.replaces is not None and self.keep_checkpoints > 0:
                _history.keep_version(self.store, plan.slot, plan.replaces, durable=self.durable)
            self.store.write(slot_file(plan.slot), framed.chunks(), durable=self.durable)
        except BaseException as exc:
            if isinstance(exc, SerializationError):
                exc.step = spec.name
            self._failed(spec, plan, exc, started, attempts)
            raise
        header, size = framed.header, framed.size
        if size > LARGE_OUTPUT:
            log.warning(
                "step %r output is %s; large outputs slow every save and load", plan.slot, human_size(size)
            )
        plan.output_digest = value_digest(header)
        _remember(value, header, loaded=False)
        if plan.slot in self.journal.manifest.batches:  # the output now holds what they held
            self.forget_batches(plan.slot)
        fields: dict[str, Any] = {}
        if self.journal.manifest.code.get(spec.name) != ident.components:
            fields["code"] = ident.components
        self.journal.record(
            "step_completed",
            # Appended at once; a step that must not run twice is synced, its output's directory
            # first (Store.sync): it is never recorded as done before its output is durable.
            sync=not spec.idempotent,
            t=header["created_at"],  # one time for the output and its completion
            slot=plan.slot,
            fingerprint=plan.fingerprint,
            file=header["hsum"],
            bytes=size,
            duration_s=round(time.perf_counter() - started, 6),
            attempts=attempts,
            **fields,
        )
        self.last_outcome = "ok"
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "step %r completed in %.3fs, %s", plan.slot, time.perf_counter() - started, human_size(size)
            )

    def forget_batches(self, slot: str | None, name: str | None = None) -> None:
        """Delete the row chunks of a step slot's batches (or of a named batch)."""
        # deepest first, so that emptied sub-directories go too
        keys = sorted(self.store.list(batch_dir(slot, name)), key=lambda k: -k.count("/"))
        for key in keys:
            self.store.delete(key, durable=False)
        batch = slot if slot is not None else name
        if batch in self.journal.manifest.batches:
            self.journal.record("batch_done", batch=batch)

    def _failed(self, spec: StepView, plan: Plan, exc: BaseException, started: float, attempts: int) -> None:
        """Record an exception that escapes a step (if the log cannot take it, it gets a note)."""
        self.last_outcome = "failed" if isinstance(exc, Exception) else "interrupted"
        duration = round(time.perf_counter() - started, 6)
        try:
            if not isinstance(exc, Exception):
                self.journal.record("step_interrupted", slot=plan.slot, duration_s=duration)
                return
            self.last_failure = exc
            log.info(
                "step %r failed after %d attempt(s): %s: %s", plan.slot, attempts, type(exc).__name__, exc
            )
            self.journal.record(
                "step_failed",
                slot=plan.slot,
                step=spec.name,
                attempts=attempts,
                duration_s=duration,
                error=_error_fields(exc),
            )
        except OSError as log_error:
            exc.add_note(f"(the failure could not be recorded in the event log either: {log_error})")

    @contextlib.contextmanager
    def _attempt(self, spec: StepView, plan: Plan, started: float, attempt: int) -> Iterator[Execution]:
        """One attempt of a step: an exception worth a retry sets ``retry_in``, any other is raised."""
        execution = Execution(self, spec, plan)
        token = current_execution.set(execution)
        try:
            yield execution
        except BaseException as exc:
            execution.loops.close()
            if not (
                isinstance(exc, Exception) and isinstance(exc, spec.retry_on) and attempt <= spec.retries
            ):
                self._failed(spec, plan, exc, started, attempt)
                raise
            delay = min(RETRY_BASE_DELAY * 2.0 ** (attempt - 1), RETRY_MAX_DELAY)
            execution.retry_in = delay = delay * random.uniform(0.5, 1.0)  # noqa: S311 - spreading retries, not secrets
            log.warning(
                "step %r attempt %d of %d failed (%s: %s); retrying in %.1fs",
                plan.slot, attempt, spec.retries + 1, type(exc).__name__, exc, delay,
            )  # fmt: skip
            self.journal.record("step_retry", slot=plan.slot, attempt=attempt + 1, error=_error_fields(exc))
        finally:
            current_execution.reset(token)

    def execute(self, spec: StepView, plan: Plan, found: Found, call: Callable[[], Any]) -> Any:
        """Run a step that missed, with retries, and store its output."""
        started = self.begin(spec, plan, found)
        delay = 0.0
        for attempt in itertools.count(1):
            with self._attempt(spec, plan, started, attempt) as execution:
                if delay:  # a retry: an interrupt while it waits ends the step as one inside it would
                    time.sleep(delay)
                value = call()
                break
            delay = execution.retry_in
        self.complete(spec, plan, value, started, attempt)
        return value

    async def execute_async(
        self, spec: StepView, plan: Plan, found: Found, call: Callable[[], Coroutine[Any, Any, Any]]
    ) -> Any:
        """The async twin of :meth:`execute`; a durable output is written off the event loop."""
        import asyncio  # noqa: PLC0415 - loaded by the async caller already; slow to import

        started = self.begin(spec, plan, found)
        delay = 0.0
        for attempt in itertools.count(1):
            with self._attempt(spec, plan, started, attempt) as execution:
                if delay:
                    await asyncio.sleep(delay)
                value = await call()
                break
            delay = execution.retry_in
        if self.durable:  # an fsync takes milliseconds: keep the event loop serving others
            await asyncio.to_thread(self.complete, spec, plan, value, started, attempt)
        else:
            self.complete(spec, plan, value, started, attempt)
        return value


def chunks_of_completed(store: Store, completed: Callable[[str], bool]) -> list[tuple[str, str]]:
    """The row chunks of the batches of the slots that *completed*, as (slot, key), in one listing."""
    found = []
    for key in store.list(STEP_BATCHES):
        parts = key[len(STEP_BATCHES) :].split("/")
        # a slot is a step name, or a step name and a key: its directory is one or two deep
        owners = sorted(slot for slot in ("/".join(parts[:1]), "/".join(parts[:2])) if completed(slot))
        if owners and len(parts) > len(owners[0].split("/")):
            found.append((owners[0], key))
    return sorted(found)
