"""
Pipelines and their named sessions: where steps store their outputs, and the run lifecycle.

A pipeline's run opens at its first step call (script mode) or when a ``with`` block
enters it, and closes at interpreter exit or at the end of the block.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, Self, TypeVar, overload

from . import _context
from ._codec import DamagedFileError, parse_header, secret_bytes, utcnow, verify
from ._exit import exit_hooks, status_for
from ._journal import read_head, read_state
from ._manifest import Manifest
from ._plan import Plan
from ._runner import Run, run_steps, run_without_state
from ._session import Later, RunState
from ._slots import (
    BATCHES,
    OUTPUT_SUFFIX,
    STEP_BATCHES,
    check_session_id,
    is_output_file,
    slot_file,
    step_of,
)
from ._step import KeySpec, RetryOn, Step, StepSpec, step
from ._stores import Store, open_store
from .exceptions import (
    SessionBusyError,
    StateLockedError,
    StepDefinitionError,
    UsageError,
)

# History, reports and sessions are not needed to run steps, and importing them would make
# `import resumable` take half as long again.
if TYPE_CHECKING:
    from . import _history, _report, _sessions, _why
    from ._history import Checkpoint
    from ._sessions import SessionInfo
    from ._why import Decision
else:
    _history, _report, _sessions, _why = map(Later, ("._history", "._report", "._sessions", "._why"))

P = ParamSpec("P")
R = TypeVar("R")


class Pipeline:
    """
    Where steps keep their state, and one run at a time over it.

    Args:
        name: shown in the manifest (default: the script's file name).
        state_dir: a local directory (default ``$RESUMABLE_STATE_DIR``, else ``./state``).
        store: a URL (``memory://name`` ...) or a :class:`Store`, instead of *state_dir*.
        durable: fsync every file it writes before the step returns, and its directory
            with those of the writes of the same 0.1 s (``False`` is faster, and still
            atomic: a crash of the process loses nothing, a power loss may).
        allow_pickle: store outputs msgpack cannot encode with cloudpickle, and read them.
        secret: authenticate every file with this key (default ``$RESUMABLE_SECRET``).
        keep_checkpoints: how many checkpoints history keeps.
        storage_options: passed to fsspec for remote stores (endpoint, credentials ...).
        session: run in this named session of the store (default ``$RESUMABLE_SESSION``,
            else the default session: the store's root). See :meth:`session`.
    """

    def __init__(  # noqa: PLR0913 - the documented options
        self,
        name: str | None = None,
        *,
        state_dir: str | os.PathLike[str] | None = None,
        store: str | Store | None = None,
        durable: bool = True,
        allow_pickle: bool = True,
        secret: str | bytes | None = None,
        keep_checkpoints: int = 20,
        storage_options: Mapping[str, Any] | None = None,
        session: str | None = None,
    ) -> None:
        if state_dir is not None and store is not None:
            msg = "pass either state_dir= or store= to Pipeline, not both"
            raise UsageError(msg)
        if type(keep_checkpoints) is not int or keep_checkpoints < 0:
            msg = f"keep_checkpoints must be an int >= 0, got {keep_checkpoints!r}"
            raise UsageError(msg)
        self._name = name
        self._location: str | os.PathLike[str] | Store | None = store if store is not None else state_dir
        self.durable = durable
        self.allow_pickle = allow_pickle
        self._secret_arg = secret
        self.keep_checkpoints = keep_checkpoints
        self._storage_options = dict(storage_options or {})
        if session is None:
            session = os.environ.get("RESUMABLE_SESSION") or None
        self._session_id: str | None = None if session is None else check_session_id(session)
        self._root: Store | None = None
        self._metadata: Mapping[str, Any] | None = None
        self._steps: dict[str, StepSpec[Any, Any]] = {}
        self._store: Store | None = None
        self._run: RunState | None = None
        self._dropped: weakref.finalize[..., Any] | None = None  # closes a script-mode run if dropped
        self._lock = threading.RLock()
        self._depth = 0
        self._tokens: list[Any] = []  # what each `with` set in the context, reset on exit

    def __repr__(self) -> str:
        where = self._store.location if self._store is not None else self._location
        return f"Pipeline(name={self.name!r}, store={where!r})"

    @property
    def name(self) -> str:
        """The pipeline's name, as recorded in the manifest."""
        if self._name is not None:
            return self._name
        script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
        return os.path.splitext(script)[0] or "default"

    @property
    def store(self) -> Store:
        """The store holding this pipeline's state (resolved on first use): its session's."""
        with self._lock:
            if self._store is None:
                root, sid = self._root_store, self._session_id
                self._store = root if sid is None else _sessions.session_store(root, sid)
            return self._store

    @property
    def _root_store(self) -> Store:
        """The store of the default session, which holds the named ones."""
        with self._lock:
            if self._root is None:
                location = self._location or os.environ.get("RESUMABLE_STATE_DIR") or "state"
                self._root = open_store(location, self._storage_options or None)
            return self._root

    @property
    def session_id(self) -> str | None:
        """The named session this runs in, or None for the default session."""
        return self._session_id

    @property
    def _secret(self) -> bytes | None:
        return secret_bytes(self._secret_arg)

    @overload
    def step(self, fn: Callable[P, R], /) -> Step[P, R]: ...
    @overload
    def step(
        self,
        /,
        *,
        name: str | None = None,
        version: str | None = None,
        key: KeySpec | None = None,
        ignore: Iterable[str] = (),
        retries: int = 0,
        retry_on: RetryOn = Exception,
        idempotent: bool = True,
    ) -> Callable[[Callable[P, R]], Step[P, R]]: ...
    def step(self, fn: Callable[P, R] | None = None, /, **options: Any) -> Any:
        """The ``@step`` decorator, binding steps to this pipeline."""
        decorate: Callable[[Callable[P, R]], Step[P, R]] = step(**options, pipeline=self)
        return decorate if fn is None else decorate(fn)

    def _new_run(self, *, maintenance: bool, prepare: Callable[[], None] | None = None) -> RunState:
        run = RunState(
            self.store,
            pipeline=self.name,
            durable=self.durable,
            allow_pickle=self.allow_pickle,
            secret=self._secret,
            keep_checkpoints=self.keep_checkpoints,
            lagging_manifest=self._session_id is not None,
        )
        sid = self._session_id
        claim = prepare is None and sid is not None  # (a fork names its session itself)
        if claim:
            prepare = functools.partial(_sessions.prepare, self.store, durable=self.durable)
        try:
            run.open(maintenance=maintenance, prepare=prepare)
        except StateLockedError as exc:
            if sid is None or isinstance(exc, SessionBusyError):
                raise
            raise SessionBusyError(sid, self.store.location, exc.holder) from None
        if claim and sid is not None:  # (sid: for mypy, claim implies it)
            try:
                _sessions.claim(run.journal, sid, metadata=self._metadata)
            except BaseException:
                run.close("failed")  # (releases the lock)
                raise
        _open_runs[run.token] = run
        if not (maintenance or self._root_store.slow_appends):  # (an object store's index changes at a close)
            self._index_session(run)  # running
        return run

    def _index_session(self, run: RunState) -> None:
        if self._session_id is not None:
            _sessions.record(self._root_store, self._session_id, run.journal.manifest)

    def _session_for(self, spec: StepSpec[Any, Any] | None = None) -> RunState:
        """The open run, opening one if there is none (script mode: closed at exit)."""
        named = _context.session_of(self)
        if named is not None:  # inside `with self.session(id)` in this context
            return named._session_for(spec)  # type: ignore[no-any-return]  # noqa: SLF001
        run = self._run
        if run is None:
            with self._lock:
                run = self._run
                if run is None:
                    run = self._run = self._new_run(maintenance=False)
                    if self._depth == 0:
                        exit_hooks.watch(self, self._close_at_exit)
                        # dropped before exit (a pipeline per request): its run ends with it
                        self._dropped = weakref.finalize(self, _close_dropped, run)
                        self._dropped.atexit = False  # at exit, _close_at_exit knows the status
        if spec is not None and spec.pipeline is None:
            own = self._steps.get(spec.name)
            if own is not None:
                msg = (
                    f"step {spec.name!r} ({spec.qualname}) cannot run in {self!r}: the pipeline "
                    f"has its own step of that name ({own.qualname}); rename one with name=."
                )
                raise StepDefinitionError(msg, step=spec.name)
        return run

    def _close(self, status: str, error: BaseException | None) -> None:
        with self._lock:
            run, self._run = self._run, None
            if self._dropped is not None:
                self._dropped.detach()
                self._dropped = None
            if run is not None:
                # the steps this process defines for this pipeline (`resumable clean` reads them)
                defined = sorted(set(self._steps) | set(_context.unbound_steps()))
                run.close(status, error, defined=defined)
                self._index_session(run)

    def _close_at_exit(self, status: str, error: BaseException | None) -> None:
        """Close the run script mode opened, as the interpreter exits with *status*."""
        run = self._run
        if status == "completed" and run is not None and run.last_outcome == "interrupted":
            status = "interrupted"  # Ctrl-C in a step, caught by the script, which then exited
        self._close(status, error)

    def __enter__(self) -> Self:
        with self._lock:
            if self._run is None and not _context.disabled():  # RESUMABLE_DISABLE=1: no state at all
                self._run = self._new_run(maintenance=False)
            self._depth += 1
        self._tokens.append(_context.enter(self))
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _context.leave(self, self._tokens.pop())
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                exit_hooks.forget(self)
                self._close(status_for(exc), exc)

    @contextmanager
    def _maintenance(self) -> Iterator[RunState]:
        """The open run, or the lock and state for a moment (no run is counted)."""
        with self._lock:
            run, own = (self._run, False) if self._run is not None else self._maintenance_run()
            try:
                yield run
            finally:
                if own:
                    run.close("completed")
                    self._index_session(run)

    def _maintenance_run(self) -> tuple[RunState, bool]:
        """A run of our own that counts no run (True), or the open run holding the lock here (False)."""
        try:
            return self._new_run(maintenance=True), True
        except StateLockedError as exc:
            # Another Pipeline object of this process runs over the same state (the default
            # pipeline in a notebook): the state is changed through its run. (A forked child
            # inherits the parent's runs, not its lock.)
            held = _open_runs.get(str(exc.holder.get("run_token")))
            if held is None or held.closed or exc.holder.get("pid") != os.getpid():
                raise
            return held, False

    def _registry(self) -> dict[str, StepSpec[Any, Any]]:
        # a pipeline without steps of its own runs the module-level ones (script mode)
        return self._steps or _context.unbound_steps()

    def run(self, **inputs: Any) -> Run:
        """
        Run the pipeline's steps in the order they were defined.

        A parameter named like an earlier step receives that step's output; the others
        come from *inputs* or their defaults. Completed steps are skipped, and a skipped
        step's output is loaded only if a step that runs needs it.

        Raises:
            StepDefinitionError: a parameter has no source, or an input is used by no step.
        """
        specs = list(self._registry().values())
        wanted = {p for s in specs for p in s.signature.parameters} - {s.name for s in specs}
        unused = sorted(set(inputs) - wanted)
        if unused:
            msg = f"{self!r}.run(): no step has a parameter named {', '.join(map(repr, unused))}"
            raise StepDefinitionError(msg)
        if _context.disabled():  # RESUMABLE_DISABLE=1: no run, no state directory
            return run_without_state(repr(self), specs, inputs)
        if self._run is not None:
            return run_steps(repr(self), self._session_for(), specs, inputs)
        with self:
            return run_steps(repr(self), self._session_for(), specs, inputs)

    def session(
        self,
        id: str,  # noqa: A002 - the name SPEC §13 gives it
        *,
        wait: float | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Session:
        """
        Named session *id* of this pipeline's store: an independent slice of it (its own
        slots, manifest, event log, checkpoints and lock). Use it as ``with`` or ``async
        with``: inside, this pipeline's steps and module-level steps run in the session, in
        this thread or asyncio task only; other sessions run at the same time elsewhere.

        Args:
            id: any non-empty str of up to 200 characters.
            wait: None (the default) raises :class:`SessionBusyError` at once if another run
                holds the session; a number of seconds waits up to that long for it (with
                ``async with``, without blocking the event loop).
            metadata: JSON values kept with the session (shown by ``sessions()``); given,
                it replaces what was kept.
        """
        return Session(self, id, wait=wait, metadata=metadata)

    def sessions(
        self, *, status: str | None = None, prefix: str | None = None, limit: int | None = None
    ) -> list[SessionInfo]:
        """
        The named sessions of this pipeline's store, newest (last updated) first: only those
        with *status* (``running``, ``completed``, ``failed``, ``interrupted``, ``new``),
        whose id starts with *prefix*, at most *limit* of them. Reads only: takes no lock.
        """
        return _sessions.list_sessions(self._root_store, status=status, prefix=prefix, limit=limit)

    def fork(self, src: str, dst: str, *, at: int | str | None = None) -> SessionInfo:
        """
        Create session *dst* from session *src*'s state at checkpoint *at* (a checkpoint id,
        a snapshot label, or a step, as in :meth:`rollback`; None: its latest state). Files
        are shared, not copied (hard links locally, server-side copies on object stores), so
        running *dst* with unchanged inputs runs no step, and changing one input reruns
        exactly the steps that depend on it. *src* may be running: the fork takes the state
        a kill would have left.

        Raises:
            UsageError: *src* does not exist, or *dst* does.
            SessionBusyError: a run holds *dst*.
        """
        src, dst = check_session_id(src), check_session_id(dst)
        root = self._root_store
        if src == dst:
            raise UsageError(f"cannot fork session {src!r} into itself")
        if not _sessions.exists(root, src):
            raise UsageError(f"no session {src!r} to fork in {root.location} (see `resumable sessions`)")
        self.session(dst)._fork_from(src, at)  # noqa: SLF001 - the session's own
        return next(s for s in self.sessions(prefix=dst) if s.id == dst)

    def delete_session(self, id: str) -> None:  # noqa: A002 - as in session()
        """
        Remove session *id* and all its files, crash-safely: if the process is killed at any
        instant, the next run of a session with that id starts empty.

        Raises:
            UsageError: there is no such session.
            SessionBusyError: a run holds it.
        """
        _sessions.delete(self._root_store, id, durable=self.durable)

    def status(self) -> Manifest:
        """The manifest: where the pipeline stands (a copy; reading it takes no lock)."""
        run = self._run
        if run is not None:
            return run.journal.copy()
        return read_state(self.store, pipeline=self.name, secret=self._secret)

    def reset(self, *steps: str, downstream: bool = True) -> list[str]:
        """
        Forget the outputs of *steps* (step names or slots such as ``fetch_page/3``), and by
        default of every step completed after them; with no arguments, forget everything.
        A name may also be that of a batch run outside steps (``checkpointed(..., name=)``),
        whose committed rows are then forgotten. Returns the slots (and batches) forgotten.

        Raises:
            UsageError: a name matches no step, slot or batch that the state holds.
            StateLockedError: another process is running the pipeline.
        """
        with self._maintenance() as run:
            manifest = run.journal.manifest
            known, batches = self._known_slots(run)
            if not steps:
                slots, forgotten = known, sorted(batches)
            else:
                slots, forgotten = set(), []
                defined = set(self._registry())
                for target in steps:
                    # Only what the state holds can be named: a name is never made into a path.
                    matched = {s for s in known if s == target or step_of(s) == target}
                    if target in batches:
                        forgotten.append(target)
                    elif not matched and target not in defined:
                        msg = (
                            f"nothing to reset: no step, slot or batch {target!r} in "
                            f"{self.store.location} (known: {describe_slots(known | defined, batches)})"
                        )
                        raise UsageError(msg)
                    slots |= matched
                if downstream:
                    done = manifest.completed_steps
                    positions = [i for i, s in enumerate(done) if s in slots]
                    if positions:
                        slots |= set(done[min(positions) :])
            for name in forgotten:
                run.forget_batches(None, name)
            rank = {s: i for i, s in enumerate(manifest.completed_steps)}
            return self._forget(run, sorted(slots, key=lambda s: (rank.get(s, len(rank)), s))) + forgotten

    def _known_slots(self, run: RunState) -> tuple[set[str], set[str]]:
        """The slots the state holds (manifest, output files, row chunks) and its named batches."""
        manifest = run.journal.manifest
        listed = run.store.list()
        slots = {k[: -len(OUTPUT_SUFFIX)] for k in listed if is_output_file(k)}
        slots |= {s for s, rec in manifest.steps.items() if rec.status != "reset"}
        batches: set[str] = set()
        named_dir = f"{BATCHES}/named/"
        for key in listed:
            if key.startswith(STEP_BATCHES):
                # steps/<step>/[<key>/][<sub-batch>/]<chunk>: the slot is at most two levels
                slots.add("/".join(key[len(STEP_BATCHES) :].split("/")[:-1][:2]))
            elif key.startswith(named_dir):
                batches.add(key[len(named_dir) :].split("/", 1)[0])
        return {s for s in slots if is_output_file(slot_file(s))}, batches

    def _forget(self, run: RunState, slots: list[str]) -> list[str]:
        # the run's store, not this pipeline's: the run may be another pipeline's (_maintenance)
        store = run.store
        for slot in slots:
            if run.keep_checkpoints > 0:  # a checkpoint may need this version back
                _history.keep_version(store, slot, _history.file_version(store, slot), durable=run.durable)
            store.delete(slot_file(slot), durable=run.durable)
            run.forget_batches(slot)
        if slots:
            run.journal.record("steps_reset", slots=slots)
        return slots

    def report(
        self, path: str | os.PathLike[str], *, run: int | str = "all", compare: int | str | None = None
    ) -> str:
        """
        Write one self-contained HTML file showing the runs of this state: a timeline, why each
        step ran or was skipped, batches, resumes, a comparison and the last error. The same as
        ``resumable report``; it takes no lock and writes nothing in the state, so it works
        during a run (events this process has not written yet are written first).

        *run* is a run number, ``"last"`` or ``"all"``; *compare* a run number (or ``"run3"``),
        a checkpoint (``"checkpoint12"``) or another session (``"ID"``, ``"ID@CHECKPOINT"``,
        ``"."`` for the default session) to compare the current state with. A session
        (``pipe.session(id).report(...)``) reports its own runs. Returns the absolute path of
        the file written.

        Raises:
            UsageError: *run* or *compare* names something the event log does not hold.
        """
        self._write_pending()
        return _report.report(
            self.store, self._secret, path, run=run, compare=compare,
            root=self._root_store, session=self._session_id,
        )  # fmt: skip

    def why(self, step: str, key: str | None = None) -> list[Decision]:
        """
        Why each slot of *step* (or its slot for *key*) last ran or was skipped, from the
        event log: the reason, and what changed since the output it replaced (code
        components with a unified diff of their source, values, arguments). The same as
        ``resumable why STEP``; it takes no lock (events this process has not written yet are
        written first).

        Raises:
            UsageError: no run has called *step* (or that slot).
        """
        self._write_pending()
        decisions = _why.explain(_history.events(self.store, self._secret), self.store, step, key)
        if not decisions:
            where = f"{step!r} with key {key!r}" if key is not None else repr(step)
            msg = (
                f"no run has called {where} in {self.store.location}: nothing to explain "
                "(see `resumable status`)"
            )
            raise UsageError(msg)
        return decisions

    def _write_pending(self) -> None:
        """Write the events of the open run that are not written yet, for readers of the log."""
        run = self._run
        if run is not None and not run.closed:
            run.journal.write_pending(durable=False)

    def checkpoints(self) -> list[Checkpoint]:
        """
        The checkpoints that :meth:`rollback` can restore, oldest first: one after each
        completed step, plus those made by :meth:`snapshot` (the newest
        ``keep_checkpoints`` of them).

        Raises:
            StateLockedError: another process is running the pipeline (the command line's
                ``resumable history`` reads them without the lock).
        """
        with self._maintenance() as run, run.journal.lock:
            run.journal.write_pending(durable=False)
            manifest = run.journal.copy()
        return _history.checkpoints(self.store, self._secret, self.keep_checkpoints, manifest)

    def snapshot(self, label: str) -> Checkpoint:
        """Add a checkpoint labelled *label* (``rollback(label)`` returns to it)."""
        if not isinstance(label, str) or not label or label.isdigit():
            msg = f"a snapshot label must be a non-empty str that is not a number, got {label!r}"
            raise UsageError(msg)
        with self._maintenance() as run:
            run.journal.record("snapshot", label=label)
            manifest = run.journal.manifest
            return _history.Checkpoint(
                manifest.checkpoints, manifest.last_update, None, label, list(manifest.completed_steps)
            )

    def rollback(self, to: int | str) -> Checkpoint:
        """
        Restore the state exactly as it was at checkpoint *to*, outputs overwritten since
        included: *to* is a checkpoint id, a snapshot label, or a step (or slot) name, which
        means the state just before that step last completed. Returns the checkpoint.

        Raises:
            UsageError: *to* names no checkpoint in the history.
            ResumableError: the checkpoint can no longer be restored (pruned, or damaged).
            StateLockedError: another process is running the pipeline.
        """
        with self._maintenance() as run:
            return _history.rollback(run, to)

    def save_state(self) -> dict[str, Any]:
        """
        The whole state (manifest, event log, outputs, kept versions) as plain data that
        msgpack can serialize: store it anywhere, give it to :meth:`load_state` later.

        Raises:
            StateLockedError: another process is running the pipeline (the command line's
                ``resumable export`` copies the state without the lock: :func:`snapshot`).
        """
        with self._maintenance() as run:
            run.journal.flush(durable=False)
            return snapshot(run.store)

    def load_state(self, state: Mapping[str, Any]) -> None:
        """
        Replace the whole state with *state* from :meth:`save_state`, all or nothing: every
        file is checked (checksums, and authenticity with a secret) before anything changes.

        Raises:
            DamagedStateError: *state* is not state data, or something in it is damaged.
            StateFormatError: *state* comes from a newer version of resumable.
        """
        files = _history.check_state(state, self._secret)
        with self._maintenance() as run:
            known = run.journal.manifest.session
            _history.load_state(run, files)
            if self._session_id is not None:  # it stays this session, whoever's state it was
                _sessions.claim(run.journal, self._session_id, known=known)

    def _has_output(self, plan: Plan) -> bool:
        """True if *plan*'s slot holds a valid output with its fingerprint."""
        try:
            data = self.store.read(slot_file(plan.slot))
            header, head_len = parse_header(data)
            if header.get("fingerprint") != plan.fingerprint or header["slot"] != plan.slot:
                return False  # (no need to hash the output)
            verify(data, header, head_len, self._secret)
        except (FileNotFoundError, DamagedFileError):
            return False
        return True


# The runs this process has open, by the token their lock names (held no longer than they are).
_open_runs: weakref.WeakValueDictionary[str, RunState] = weakref.WeakValueDictionary()


def _close_dropped(run: RunState) -> None:
    """Close the script-mode run of a pipeline that was garbage-collected before exit."""
    if not run.closed:
        run.close("interrupted" if run.last_outcome == "interrupted" else "completed")


def describe_slots(slots: Iterable[str], batches: Iterable[str] = ()) -> str:
    """``steps a, b; slots fetch/1, fetch/2`` (at most 20 of each), for messages."""
    slots = sorted(slots)
    names = sorted({step_of(s) for s in slots})
    keyed = [s for s in slots if "/" in s]
    parts = [f"steps {_some(names)}" if names else "no steps"]
    if keyed:
        parts.append(f"slots {_some(keyed)}")
    if batches:
        parts.append(f"batches {_some(sorted(batches))}")
    return "; ".join(parts)


def _some(items: list[str], limit: int = 20) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def snapshot(store: Store) -> dict[str, Any]:
    """Every file of the state as data, read without the lock: what a kill could have left (see read_head)."""
    files = read_head(store)
    for key in sorted(store.list()):
        if key in files:
            continue
        try:
            files[key] = bytes(store.read(key))
        except FileNotFoundError:
            continue  # removed meanwhile (the running process pruned an old version)
    return {
        "kind": _history.STATE_KIND,
        "format": _history.STATE_FORMAT,
        "created_at": utcnow(),
        "files": dict(sorted(files.items())),
    }


_POLL = 0.02  # seconds before the second attempt at a busy session's lock (doubling up to _POLL_MAX)
_POLL_MAX = 0.5


class Session(Pipeline):
    """
    A named session of a pipeline (``pipe.session(id)``): use it as ``with`` or ``async
    with``. It has the pipeline's per-state methods (``status``, ``checkpoints``,
    ``snapshot``, ``rollback``, ``reset``, ``why``, ``save_state``, ``load_state``, ``run``)
    for this session, and :meth:`outputs`.
    """

    def __init__(
        self, parent: Pipeline, session: str, *, wait: float | None, metadata: Mapping[str, Any] | None
    ) -> None:
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, int | float) or wait < 0):
            msg = f"wait must be a number of seconds >= 0 or None, got {wait!r}"
            raise UsageError(msg)
        if metadata is not None and not isinstance(metadata, Mapping):
            msg = f"metadata must be a mapping (JSON values), got {type(metadata).__name__}"
            raise UsageError(msg)
        super().__init__(
            parent._name,  # noqa: SLF001 - the parent's options
            store=parent._root_store,  # noqa: SLF001
            durable=parent.durable,
            allow_pickle=parent.allow_pickle,
            secret=parent._secret_arg,  # noqa: SLF001
            keep_checkpoints=parent.keep_checkpoints,
            session=session,
        )
        self._steps = parent._steps  # noqa: SLF001 - the same step definitions
        self._parent = parent
        self._wait = wait
        # JSON values, as the event log keeps them (what JSON has not is kept as its str)
        self._metadata = None if metadata is None else json.loads(json.dumps(dict(metadata), default=str))

    def __repr__(self) -> str:
        return f"Session({self.id!r}, pipeline={self.name!r}, store={self._root_store.location!r})"

    @property
    def id(self) -> str:
        """The session's id."""
        assert self._session_id is not None  # noqa: S101 - a Session is always named
        return self._session_id

    def _try_open(self, started: float, attempt: int) -> float | None:
        """
        Open the run (None) if the session's lock is free; else the wait before the next
        attempt, or the :class:`SessionBusyError` once out of time.
        """
        with self._lock:
            if self._run is None and not _context.disabled():
                try:
                    self._run = self._new_run(maintenance=False)
                except SessionBusyError:
                    left = 0.0 if self._wait is None else started + self._wait - time.monotonic()
                    if left <= 0:
                        raise
                    return min(_POLL * 2.0 ** min(attempt, 8), _POLL_MAX, left)
            return None

    def _opened(self) -> Self:
        with self._lock:
            self._depth += 1
        self._tokens.append(_context.enter_session(self, self._parent))
        return self

    def __enter__(self) -> Self:
        started, attempt = time.monotonic(), 0
        while (delay := self._try_open(started, attempt)) is not None:
            time.sleep(delay)
            attempt += 1
        return self._opened()

    async def __aenter__(self) -> Self:
        import asyncio  # noqa: PLC0415 - only async users need it

        started, attempt = time.monotonic(), 0
        remote = self._root_store.slow_appends  # a round trip or more: off the event loop
        while (
            delay := await asyncio.to_thread(self._try_open, started, attempt)
            if remote
            else self._try_open(started, attempt)
        ) is not None:
            await asyncio.sleep(delay)
            attempt += 1
        return self._opened()  # (here: the context variables are this task's)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        _context.leave_session(self._tokens.pop())
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._close(status_for(exc), exc)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__(exc_type, exc, tb)

    def outputs(self, step: str) -> Mapping[str, Any]:
        """
        The completed outputs of keyed step *step* in this session: an ordered mapping key →
        value (completion order), each value read when it is used. A service reads a
        conversation this way without replaying it.
        """
        return _sessions.outputs(
            self.status(), self.store, step, secret=self._secret, allow_pickle=self.allow_pickle
        )

    def _fork_from(self, src: str, at: int | str | None) -> None:
        """Fill this (new) session with *src*'s state at *at* (see :meth:`Pipeline.fork`)."""
        store = self.store
        with self._lock:
            fill = functools.partial(_sessions.fill_fork, self._root_store, src, self.id, store)
            run = self._new_run(maintenance=True, prepare=fill)
            try:
                point = run.journal.manifest.checkpoints if at is None else _history.rollback(run, at).id
                # where it came from, in its history (and a label to roll back to)
                run.journal.record("snapshot", label=f"forked from {src}@{point}")
                metadata = (run.journal.manifest.session or {}).get("metadata") or {}  # src's
                run.journal.record("session", id=self.id, created_at=utcnow(), parent=src, metadata=metadata)
                # complete: from here the session is dst's (a failure above leaves the marker,
                # and whoever opens the session next empties it); its events are in the log first
                run.journal.write_pending(durable=True)
                store.delete(_sessions.INCOMPLETE, durable=True)
            finally:
                run.close("completed")
            self._index_session(run)


_context.set_default_factory(Pipeline)
