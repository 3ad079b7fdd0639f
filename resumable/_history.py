"""
Checkpoints, rollback, and the whole state as data (docs/history.md, "How it stays cheap").

A checkpoint is a point in the event log; the state at a checkpoint is the fold of the log
up to it, naming each slot's output by its file version (the header digest ``hsum``). A
version about to be replaced or deleted is kept under ``.resumable/objects/``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import attrs

from ._codec import DamagedFileError, encode, frame, read_verified
from ._journal import header_authentic, parse_event, parse_manifest, parse_records, read_header, state_error
from ._manifest import Fold, Manifest, StepRecord
from ._slots import (
    EVENTS,
    INTERNAL_DIR,
    LOCK,
    MANIFEST,
    OBJECTS,
    OUTPUT_SUFFIX,
    RECORDS,
    is_output_file,
    slot_file,
    step_of,
)
from ._stores import Store
from .exceptions import DamagedStateError, ResumableError, StateFormatError, UsageError

if TYPE_CHECKING:
    from ._journal import Journal


class Keeper(Protocol):
    """What changing the history needs of an open run (a ``RunState``, a layer above)."""

    store: Store
    durable: bool
    secret: bytes | None
    keep_checkpoints: int
    journal: Journal


log = logging.getLogger("resumable")

STATE_FORMAT = 1
STATE_KIND = "resumable-state"


@attrs.frozen
class Checkpoint:
    """A point in a pipeline's history that :meth:`Pipeline.rollback` can restore."""

    id: int
    created_at: str | None
    slot: str | None
    """The slot whose completion made it, or None for a snapshot."""
    label: str | None
    """The snapshot's label, or None."""
    completed_steps: list[str]
    """The slots completed at that point, in completion order."""


def object_key(file: str) -> str:
    """Where a kept version of an output file lives."""
    return f"{OBJECTS}/{file}{OUTPUT_SUFFIX}"


def keep_version(store: Store, slot: str, file: str | None, *, durable: bool) -> None:
    """Keep the version *file* of *slot*'s output before it is replaced or deleted."""
    if file is not None:
        with contextlib.suppress(FileNotFoundError):
            store.copy(slot_file(slot), object_key(file), durable=durable)


def file_version(store: Store, slot: str) -> str | None:
    """The version (header digest) of the output file of *slot*, None if absent or damaged."""
    try:
        header, _ = read_header(store, slot_file(slot))
    except (FileNotFoundError, DamagedFileError, StateFormatError):
        return None
    return str(header.get("hsum")) if header.get("slot") == slot else None


@attrs.define
class _Point:
    checkpoint: Checkpoint
    after_rollback: int | None = None
    """The checkpoint a rollback restored just before this one was made (no checkpoint between)."""
    steps: Mapping[str, StepRecord] | None = None
    """The slots' records at this checkpoint (only for a checkpoint to restore: they are big)."""
    code: dict[str, dict[str, str]] = attrs.field(factory=dict)
    changes: dict[str, str | None] | None = None
    """For the checkpoints asked for: the versions changed since the one asked for before (None: gone)."""
    base: tuple[int, dict[str, Any]] | None = None
    """The log offset after this checkpoint and the whole manifest then, as data (for a history base)."""


_EMPTY = Checkpoint(0, None, None, None, [])


def events(store: Store, secret: bytes | None) -> Iterator[dict[str, Any]]:
    """The valid events of the log (loading it warned about the others), in order."""
    return (event for _, event in _events_from(store, secret, 0))


def _events_from(store: Store, secret: bytes | None, start: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(offset after it, event)`` for each valid event of the log from byte *start* on."""
    offset = end = start  # where the next piece is read; after the last complete line
    rest = b""
    # a megabyte at a time (a replay that stops early reads no more); at once where a read is a round trip
    size = None if store.slow_appends else _LOG_PIECE
    while True:
        try:
            piece = store.read(EVENTS, offset, None if size is None else offset + size)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise state_error(exc, store, EVENTS) from exc
        offset += len(piece)
        # only complete lines: a last line without its newline is being written, or was cut short
        *lines, rest = (rest + piece).split(b"\n")
        for line in lines:
            end += len(line) + 1
            event = parse_event(line, secret)
            if not isinstance(event, str):
                yield end, event
        if size is None or len(piece) < size:
            return


_LOG_PIECE = 1 << 20


# the state at one checkpoint and where the events after it start (docs/history.md)
HISTORY_BASE = f"{INTERNAL_DIR}/history-base.msgpack"
BASE_AFTER = 50  # checkpoints older than the retained ones before a new base is written


def _write_base(
    store: Store, secret: bytes | None, offset: int, manifest: dict[str, Any], point: Checkpoint
) -> None:
    checkpoint = attrs.asdict(point, filter=lambda field, _: field.name != "completed_steps")
    record = {"offset": offset, "manifest": manifest, "checkpoint": checkpoint}
    # the checkpoint id in the header too: a close reads it without decoding the whole base
    meta = {"slot": HISTORY_BASE, "checkpoint": point.id}
    framed = frame(encode(record, allow_pickle=False, what="the history base"), meta, secret=secret)
    store.write(HISTORY_BASE, framed.chunks(), durable=True)


_NOT_COPIED: list[str] = []  # the completed slots of a checkpoint not asked for (never read)


def replay(  # noqa: C901 - one pass over the log answers every kind of history question
    store: Store,
    secret: bytes | None,
    want: Iterable[int] = (),
    restore: int | None = None,
    base_at: int | None = None,
) -> list[_Point]:
    """
    The checkpoints of the history (since the history base), in order: all, or those asked for.
    Those in *want* hold the changes of output versions, *restore* the records then (it ends
    the replay), *base_at* a copy of the manifest and the log offset after it.
    """
    wanted = set(want)
    ids = wanted | {i for i in (restore, base_at) if i is not None}
    last = max(ids, default=None)  # the log after the last checkpoint asked for is not read
    start, fold, first = _replay_start(store, secret)
    versions = _Versions()

    def point(checkpoint: Checkpoint, rolled_back_to: int | None, offset: int | None) -> _Point:
        # Only the checkpoints asked for get a copy of the state: copying it at every
        # checkpoint would make a replay quadratic in the number of slots.
        m, number = fold.manifest, checkpoint.id
        made = _Point(checkpoint, rolled_back_to)
        if number in wanted or number == restore:
            made.checkpoint = attrs.evolve(checkpoint, completed_steps=list(m.completed_steps))
        if number in wanted:
            made.changes = versions.at(m)
        if number == base_at and offset is not None:
            made.base = (offset, m.to_dict())  # a deep copy, as the base will hold it
        if number == restore:  # the fold's records, not a copy: the replay stops here
            made.steps, made.code = m.steps, {k: dict(v) for k, v in m.code.items()}
        return made

    points = [] if first is None else [point(first, None, None)]
    if first is not None and first.id == restore:
        return points
    rolled_back_to: int | None = None
    for offset, event in _events_from(store, secret, start):
        fold.apply(event)
        versions.touch(event)
        kind = event.get("event")
        if kind == "rollback":
            rolled_back_to = event.get("to", 0)
        if kind not in {"step_completed", "snapshot"}:
            continue
        number = fold.manifest.checkpoints
        if not ids or number in ids:
            checkpoint = Checkpoint(
                number, event.get("t"), event.get("slot"), event.get("label"), _NOT_COPIED
            )
            points.append(point(checkpoint, rolled_back_to, offset))
        rolled_back_to = None
        if last is not None and number >= last:
            break  # what follows (skips, mostly) makes no checkpoint asked for
    return points


class _Versions:
    """The output version of every completed slot as a replay goes, updated for the slots events touch."""

    def __init__(self) -> None:
        self._now: dict[str, str] = {}
        self._touched: set[str] | None = None  # None: any slot may have changed

    def touch(self, event: Mapping[str, Any]) -> None:
        if self._touched is None:
            return
        slot, slots = event.get("slot"), event.get("slots")
        if isinstance(slot, str):
            self._touched.add(slot)
        if isinstance(slots, list):
            self._touched.update(s for s in slots if isinstance(s, str))
        if event.get("event") == "steps_skipped":
            self._touched.update(row[0] for row in event["skips"])
        elif event.get("event") == "rollback" or event.get("steps"):
            self._touched = None  # the whole state changed (or every slot of some steps)

    def at(self, m: Manifest) -> dict[str, str | None]:
        """The versions that changed since the last call (None: gone) in the manifest *m*."""
        if self._touched is None:
            now = m.steps.completed_files()
            changes: dict[str, str | None] = dict.fromkeys(self._now.keys() - now.keys())
            changes.update(now.items() - self._now.items())
            self._now = now
        else:
            changes = {slot: _version_of(m.steps.get(slot)) for slot in self._touched}
            _apply(self._now, changes)
        self._touched = set()
        return changes


def _apply(versions: dict[str, str], changes: Mapping[str, str | None]) -> None:
    for slot, version in changes.items():
        if version is None:
            versions.pop(slot, None)
        else:
            versions[slot] = version


def _replay_start(store: Store, secret: bytes | None) -> tuple[int, Fold, Checkpoint | None]:
    """Where a replay starts: the history base (its offset, state and checkpoint), else the empty state."""
    try:
        data = read_verified(store.read(HISTORY_BASE), secret).decode(allow_pickle=False)
        start, manifest = data["offset"], Manifest.from_dict(data["manifest"])
        first = Checkpoint(**data["checkpoint"], completed_steps=list(manifest.completed_steps))
    except FileNotFoundError:
        pass
    except (DamagedFileError, StateFormatError, ValueError, TypeError, KeyError) as exc:
        log.warning("history base %s not used (%s): the whole event log is replayed", HISTORY_BASE, exc)
    else:
        # it must be of its checkpoint, and point just after a line of this log
        if type(start) is int and start >= 0 and first.id == manifest.checkpoints:
            with contextlib.suppress(FileNotFoundError):
                if store.read(EVENTS, start - 1, start) == b"\n":
                    return start, Fold(manifest), first
    return 0, Fold(Manifest(workflow_id="", pipeline="")), None


def _each_versions(points: Iterable[_Point]) -> Iterator[tuple[_Point, dict[str, str]]]:
    """Each point asked for, with its versions: one map brought up to date (use it before the next)."""
    now: dict[str, str] = {}
    for point in points:
        if point.changes is not None:
            _apply(now, point.changes)
            yield point, now


def _kept(store: Store) -> set[str]:
    return {
        k[len(OBJECTS) + 1 : -len(OUTPUT_SUFFIX)]
        for k in store.list(f"{OBJECTS}/")
        if k.endswith(OUTPUT_SUFFIX)
    }


def _newest(manifest: Manifest, count: int) -> set[int]:
    """The ids of the newest *count* checkpoints (ids are numbered 1, 2, 3 ... in order)."""
    last = manifest.checkpoints
    return set(range(max(1, last - count + 1), last + 1)) if count > 0 else set()


def checkpoints(store: Store, secret: bytes | None, newest: int, manifest: Manifest) -> list[Checkpoint]:
    """The checkpoints among the *newest* that can still be restored, oldest first."""
    available = _kept(store) | set(manifest.steps.completed_files().values())
    points = _each_versions(replay(store, secret, _newest(manifest, newest)))
    return [p.checkpoint for p, versions in points if available.issuperset(versions.values())]


def unneeded_versions(
    store: Store, secret: bytes | None, keep: int, manifest: Manifest, since: str | None = None
) -> list[str]:
    """Kept versions that neither the state nor the newest *keep* checkpoints (nor those *since*) need."""
    kept = _kept(store)
    if not kept:
        return []
    ids = _newest(manifest, keep)
    if since is not None:
        ids |= {p.checkpoint.id for p in replay(store, secret) if (p.checkpoint.created_at or "") >= since}
    return _unneeded(kept, manifest, replay(store, secret, ids))


def _unneeded(kept: set[str], manifest: Manifest, points: Iterable[_Point]) -> list[str]:
    """The keys of the *kept* versions that the current state and the *points* asked for do not need."""
    candidates = set(kept)
    for _, versions in _each_versions(points):
        candidates.difference_update(versions.values())
    if candidates:  # (the current records are read only then: a run that only skips reads none)
        # a rollback may have put some back
        candidates.difference_update(manifest.steps.completed_files().values())
    return [object_key(v) for v in sorted(candidates)]


def prune(store: Store, secret: bytes | None, keep: int, manifest: Manifest, *, durable: bool) -> int:
    """
    Delete kept versions that neither the state nor a retained checkpoint needs, and fold many
    checkpoints older than the retained ones into a new history base, in one replay of the log.
    """
    kept = _kept(store)
    at = _rebase_at(store, secret, keep, manifest)
    if not kept and at is None:
        return 0
    points = replay(store, secret, _newest(manifest, keep) if kept else (), base_at=at)
    unneeded = _unneeded(kept, manifest, points)
    for key in unneeded:
        store.delete(key, durable=durable)
    for point in points:
        if point.checkpoint.id == at and point.base is not None:
            _write_base(store, secret, *point.base, point.checkpoint)
    return len(unneeded)


def _rebase_at(store: Store, secret: bytes | None, keep: int, manifest: Manifest) -> int | None:
    """The checkpoint just before the retained ones, if the log before them is long enough to fold."""
    retained = _newest(manifest, keep)
    at = (min(retained) if retained else manifest.checkpoints + 1) - 1
    if at < BASE_AFTER:
        return None
    try:  # the checkpoint of the base there is, from its header alone
        header, _ = read_header(store, HISTORY_BASE)
    except (FileNotFoundError, DamagedFileError, StateFormatError):
        header = {}  # none, or damaged: a new one is written
    found = header.get("checkpoint")
    authentic = secret is None or header_authentic(header, secret)
    base = found if type(found) is int and found >= 0 and authentic else 0
    return at if at - base >= BASE_AFTER else None


def find(points: list[_Point], target: int | str) -> int:
    """
    The id of the checkpoint *target* names: an id, a snapshot label, or a step (or slot)
    name, which means the state just before that step last completed (0: the empty state).
    """
    if isinstance(target, int) or target.isdigit():
        number = int(target)
        if number == 0 or any(p.checkpoint.id == number for p in points):
            return number
        latest = points[-1].checkpoint.id if points else 0
        msg = f"checkpoint {number} does not exist or is no longer kept (the latest is {latest})"
        raise UsageError(msg)
    labelled = [p for p in points if p.checkpoint.label == target]
    if labelled:
        return labelled[-1].checkpoint.id
    made_by = [
        i
        for i, p in enumerate(points)
        if p.checkpoint.slot is not None and target in {p.checkpoint.slot, step_of(p.checkpoint.slot)}
    ]
    if not made_by:
        msg = f"no checkpoint, snapshot label or step {target!r} in the history"
        raise UsageError(msg)
    last = points[made_by[-1]]
    if last.after_rollback is not None:  # the state just before it is the one a rollback restored
        return find(points, last.after_rollback)  # (if it is still kept)
    before = made_by[-1] - 1
    return points[before].checkpoint.id if before >= 0 else 0


def rollback(run: Keeper, target: int | str) -> Checkpoint:
    """Restore the state at *target* (see :func:`find`), outputs included, byte for byte."""
    store, durable = run.store, run.durable
    run.journal.write_pending(durable=False)  # the log must hold every event replayed
    point = _state_at(store, run.secret, target)
    number = point.checkpoint.id
    current = run.journal.manifest.steps.completed_files()
    then = point.steps or {}
    wanted = {slot: v for slot, rec in then.items() if (v := _version_of(rec)) is not None}
    missing = sorted(set(wanted.values()) - _kept(store) - set(current.values()))
    if missing:
        _cannot_restore(run, number, sorted(s for s, v in wanted.items() if v in missing))
    for slot in sorted(set(current) | set(wanted)):
        if current.get(slot) == wanted.get(slot):
            continue
        keep_version(store, slot, current.get(slot), durable=durable)
        if slot in wanted:
            store.copy(object_key(wanted[slot]), slot_file(slot), durable=durable)
        else:
            store.delete(slot_file(slot), durable=durable)
    run.journal.record("rollback", to=number, changes=_changes(run.journal.manifest, point))
    return point.checkpoint


def _state_at(store: Store, secret: bytes | None, target: int | str) -> _Point:
    """The point of the checkpoint *target* names (see :func:`find`), with its records."""
    if isinstance(target, int) or target.isdigit():
        # a checkpoint id: one replay both finds it and gives its state; a name needs two
        points = replay(store, secret, restore=int(target))
        if points and points[-1].checkpoint.id == int(target):
            return points[-1]
    number = find(replay(store, secret), target)  # (or the whole history, for the error)
    return replay(store, secret, restore=number)[-1] if number else _Point(_EMPTY, steps={})


def _version_of(rec: StepRecord | None) -> str | None:
    """The output version a slot's record says it holds (None: it holds none, not completed)."""
    return rec.file if rec is not None and rec.status == "completed" else None


def _cannot_restore(run: Keeper, number: int, slots: list[str]) -> NoReturn:
    names = ", ".join(slots)
    if number in _newest(run.journal.manifest, run.keep_checkpoints):
        # a retained checkpoint's versions are never pruned: a damaged file is not kept
        why = f"the output of {names} it needs was damaged, so no copy of it was kept when it was recomputed"
    else:
        why = (
            f"the output of {names} it needs is no longer kept (pruned: only the newest "
            f"{run.keep_checkpoints} checkpoints are kept, see Pipeline(keep_checkpoints=...)), "
            "or it was damaged"
        )
    msg = (
        f"checkpoint {number} can no longer be restored: {why}. Nothing was changed. Roll back to "
        "one of the checkpoints `resumable history` (pipe.checkpoints()) lists: those can be restored."
    )
    raise ResumableError(msg)


def _changes(now: Manifest, then: _Point) -> dict[str, Any]:
    """What a rollback from *now* to *then* changes, as its event carries it."""
    target = then.steps or {}
    steps: dict[str, Any] = {}
    for slot in sorted(set(now.steps) | set(target)):
        old, new = now.steps.get(slot), target.get(slot)
        if old != new:
            steps[slot] = None if new is None else attrs.asdict(new)
    drop, insert = _reorder(now.completed_steps, then.checkpoint.completed_steps)
    return {"steps": steps, "drop": drop, "insert": insert, "code": then.code}


def _reorder(before: list[str], after: list[str]) -> tuple[list[str], list[tuple[int, str]]]:
    """
    The items of *before* to drop, then those of *after* to insert (at their index), to turn one
    into the other; items already in *after*'s order stay (greedily: a slot completed again
    since has moved to the end, and only it moves back).
    """
    where = {slot: i for i, slot in enumerate(after)}
    stay: set[str] = set()
    last = -1
    for slot in before:
        if where.get(slot, -1) > last:
            stay.add(slot)
            last = where[slot]
    drop = [slot for slot in before if slot not in stay]
    insert = [(i, slot) for i, slot in enumerate(after) if slot not in stay]
    return drop, insert


def check_state(state: object, secret: bytes | None) -> dict[str, bytes]:
    """The files of state data from ``Pipeline.save_state``, checked (see ``Pipeline.load_state``)."""
    if not isinstance(state, Mapping) or state.get("kind") != STATE_KIND:
        msg = "this is not resumable state data (save_state() or `resumable export` make it)"
        raise DamagedStateError(msg)
    found = state.get("format")
    if not isinstance(found, int):
        msg = "the state data has no format number"
        raise DamagedStateError(msg)
    if found > STATE_FORMAT:
        raise StateFormatError("the state data", found, STATE_FORMAT)
    files = state.get("files")
    if not isinstance(files, Mapping) or not all(
        isinstance(k, str) and isinstance(v, bytes | bytearray) for k, v in files.items()
    ):
        msg = "the state data's files are not a mapping of names to bytes"
        raise DamagedStateError(msg)
    problems = [p for key, data in files.items() if (p := _file_problem(key, bytes(data), secret))]
    if problems:
        shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        msg = f"the state data is damaged, nothing was changed: {shown}"
        raise DamagedStateError(msg)
    return {k: bytes(v) for k, v in files.items()}


def _file_problem(key: str, data: bytes, secret: bytes | None) -> str | None:
    parts = key.split("/")
    if key.startswith("/") or "\\" in key or any(p in {"", ".", ".."} for p in parts) or key == LOCK:
        return f"{key!r} is not a valid state file name"
    if key == MANIFEST:
        parsed = parse_manifest(data, secret, MANIFEST)
        return f"{MANIFEST}: {parsed}" if isinstance(parsed, str) else None
    if key.endswith(RECORDS):
        problem = parse_records(key.removesuffix(RECORDS), data, secret)[1]
    else:  # (damaged lines of the log are skipped with a warning when replayed, like on disk)
        problem = check_bytes(data, key, secret) if key.endswith(OUTPUT_SUFFIX) else None
    return None if problem is None else f"{key}: {problem}"


def check_bytes(data: bytes | bytearray, key: str, secret: bytes | None) -> str | None:
    """What is wrong with *data* as the file *key*, or None."""
    try:
        checked = read_verified(data, secret)
        checked.check_decodes()  # a checksummed file can still be hostile
    except (DamagedFileError, StateFormatError) as exc:
        return str(exc)
    if is_output_file(key) and checked.header["slot"] + OUTPUT_SUFFIX != key:
        return f"holds slot {checked.header['slot']!r}, not the one its path names"
    return None


def load_state(run: Keeper, files: Mapping[str, bytes]) -> None:
    """
    Replace every file of the state with *files* (checked by :func:`check_state`), all or
    nothing: the files before are put back if a write fails. The manifest is written last: a
    kill half-way leaves it out of step with the log, and the next run rebuilds it.
    """
    store = run.store
    before = {key: bytes(store.read(key)) for key in store.list() if key != LOCK}
    try:
        for key, data in sorted(files.items(), key=lambda kv: kv[0] == MANIFEST):
            if before.get(key) != data:
                store.write(key, [data], durable=run.durable)
        for key in before:
            if key not in files:
                store.delete(key, durable=False)
    except BaseException:
        _put_back(store, before, files)
        raise
    run.journal.load()


def _put_back(store: Store, before: Mapping[str, bytes], files: Mapping[str, bytes]) -> None:
    """Undo a swap that failed half-way, as far as the store lets us."""
    for key in sorted(set(files) - set(before)):
        with contextlib.suppress(OSError):
            store.delete(key, durable=False)
    for key, data in sorted(before.items(), key=lambda kv: kv[0] == MANIFEST):
        with contextlib.suppress(OSError):
            if key not in files or files[key] != data:
                store.write(key, [data], durable=True)
