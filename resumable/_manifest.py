"""
The progress manifest: what ``state/manifest.json`` holds, and how events update it.

The manifest is a fold of the event log: every change is an event appended to
``events.jsonl`` and applied here. ``manifest.json`` is that fold written out, with the
log offset it covers, so a reader replays only the few events written after it. The records
of a keyed step's slots are written beside its outputs, in ``<step>.records`` (msgpack)
(:class:`Steps`); ``manifest.json`` keeps a summary of them.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import json
import operator
import re
import threading
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, ClassVar, Literal, NamedTuple, get_args

import attrs

from ._slots import step_of
from .exceptions import StateFormatError

FORMAT = 2
RunStatus = Literal["running", "completed", "failed", "interrupted"]
StepStatus = Literal["new", "running", "completed", "failed", "interrupted", "reset"]
RUN_STATUSES: tuple[RunStatus, ...] = get_args(RunStatus)


class Record:
    """The equality and repr of the public records (attrs would compile them for each at import)."""

    __slots__ = ()
    __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]
    __hash__ = None  # type: ignore[assignment]  # they are mutable, or hold a dict

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        names = [a.name for a in self.__attrs_attrs__]
        return [getattr(self, n) for n in names] == [getattr(other, n) for n in names]

    def __repr__(self) -> str:
        fields = ", ".join(f"{a.name}={getattr(self, a.name)!r}" for a in self.__attrs_attrs__)
        return f"{type(self).__qualname__}({fields})"


@attrs.define(eq=False, repr=False)
class StepRecord(Record):
    """What the manifest knows of one slot."""

    status: StepStatus
    """``new``, ``running``, ``completed``, ``failed``, ``interrupted`` or ``reset``."""
    fingerprint: str | None = None
    reason: str | None = None
    """Why it last ran: ``new``, ``inputs changed``, ``code changed`` ..."""
    started_at: str | None = None
    finished_at: str | None = None
    duration_s: float | None = None
    attempts: int = 0
    bytes: int | None = None
    file: str | None = None
    """Which version of the output file the slot holds (its header digest); checkpoints
    refer to outputs by it."""


@attrs.define(eq=False, repr=False)
class ErrorRecord(Record):
    """The last error that escaped a step (``step`` is None for an error outside steps)."""

    step: str | None
    type: str
    message: str
    traceback: str


@attrs.define(eq=False, repr=False)
class BatchRecord(Record):
    """Progress of one batch of rows committed in chunks."""

    done: int
    every: int
    total: int | None = None
    failures: int = 0


class Steps(MutableMapping[str, StepRecord]):
    """
    The slot records of a manifest, by slot.

    A keyed step's records live in a file of their own (``<step>.records``). Those of a
    state read from disk are read when one of them is first used (:meth:`defer`): opening a
    state of 100,000 keyed slots reads none of them, and a run that only skips writes none.
    """

    __slots__ = ("_deferred", "_steps", "lock")

    def __init__(self, records: Mapping[str, StepRecord] | None = None) -> None:
        self._steps: dict[str, dict[str, StepRecord]] = {}  # per step name, its slots' records
        for slot, record in (records or {}).items():
            self._steps.setdefault(step_of(slot), {})[slot] = record
        self._deferred: dict[str, Deferred] = {}  # per keyed step not read yet
        # held while a step's records are read (the journal's lock: they are read once)
        self.lock: threading.RLock | contextlib.nullcontext[None] = contextlib.nullcontext()

    def defer(self, step: str, deferred: Deferred) -> None:
        """Leave the records of keyed *step* unread until one is used."""
        self._deferred[step] = deferred

    def _group(self, slot: str) -> dict[str, StepRecord] | None:
        """The records of *slot*'s step, read first if they were not."""
        step = step_of(slot)
        if step in self._deferred:
            with self.lock:
                deferred = self._deferred.get(step)
                if deferred is not None:  # else read meanwhile
                    self._steps.setdefault(step, {}).update(deferred.read())
                    del self._deferred[step]  # last: is_completed reads without the lock
        return self._steps.get(step)

    def parse_all(self) -> None:
        """Read the records of every keyed step not read yet."""
        for step in list(self._deferred):
            self._group(step)

    def is_completed(self, slot: str) -> bool:
        """True if *slot*'s record says completed (without reading a keyed step's records)."""
        deferred = self._deferred.get(step_of(slot)) if self._deferred else None
        if deferred is not None:
            return slot in deferred.completed
        record = self._steps.get(step_of(slot), {}).get(slot)
        return record is not None and record.status == "completed"

    def deferred(self) -> dict[str, dict[str, Any]]:
        """The summary of each keyed step whose records are not read (their file is as it was)."""
        return {step: deferred.summary for step, deferred in self._deferred.items()}

    def groups(self) -> ItemsView[str, dict[str, StepRecord]]:
        """The records read, per step name (a view, no copy)."""
        return self._steps.items()

    def parsed(self) -> Iterator[tuple[str, StepRecord]]:
        """The records read."""
        return itertools.chain.from_iterable(group.items() for group in self._steps.values())

    def completed_bytes(self) -> int:
        """The size of the outputs of completed slots (from their summaries for steps not read)."""
        read = sum(r.bytes or 0 for _, r in self.parsed() if r.status == "completed")
        return read + sum(int(d.summary["bytes"]) for d in self._deferred.values())

    def completed_files(self) -> dict[str, str]:
        """The output version (``file``) of every completed slot (records not read stay unread)."""
        unread = [d.read().items() for d in list(self._deferred.values())]
        records = itertools.chain(self.parsed(), *unread)
        return {s: r.file for s, r in records if r.status == "completed" and r.file is not None}

    def __getitem__(self, slot: str) -> StepRecord:
        group = self._group(slot)
        if group is None:
            raise KeyError(slot)
        return group[slot]

    def __setitem__(self, slot: str, record: StepRecord) -> None:
        self._group(slot)
        self._steps.setdefault(step_of(slot), {})[slot] = record

    def __delitem__(self, slot: str) -> None:
        group = self._group(slot)
        if group is None:
            raise KeyError(slot)
        del group[slot]

    def __iter__(self) -> Iterator[str]:
        self.parse_all()
        return iter([slot for group in list(self._steps.values()) for slot in list(group)])

    def __len__(self) -> int:
        self.parse_all()
        return sum(map(len, self._steps.values()))

    def __repr__(self) -> str:
        return f"{dict(self.items())!r}"


class Deferred(NamedTuple):
    """A keyed step's records not read yet: how to read them, and what manifest.json says of them."""

    read: Callable[[], Mapping[str, StepRecord]]
    completed: frozenset[str]
    """Its completed slots (``completed_steps`` lists them)."""
    summary: dict[str, Any]


def _as_steps(records: Mapping[str, StepRecord]) -> Steps:
    return records if isinstance(records, Steps) else Steps(records)


@attrs.define(
    eq=False, repr=False, on_setattr=attrs.setters.NO_OP
)  # converters at init only: the fold sets fields often
class Manifest(Record):
    """The state of a pipeline: returned by ``Pipeline.status()``."""

    workflow_id: str
    pipeline: str
    format: int = FORMAT
    status: RunStatus = "running"
    current_step: str | None = None
    completed_steps: list[str] = attrs.field(factory=list)
    last_update: str | None = None
    runs: int = 0
    steps: Steps = attrs.field(factory=Steps, converter=_as_steps)
    """Per slot, its record: a mapping (a keyed step's records are read when first used)."""
    error: ErrorRecord | None = None
    batches: dict[str, BatchRecord] = attrs.field(factory=dict)
    code: dict[str, dict[str, str]] = attrs.field(factory=dict)
    """Per step name, the digests of its code components when it last completed."""
    checkpoints: int = 0
    """The number of the latest checkpoint (one per completed step, plus snapshots)."""
    defined: dict[str, str] = attrs.field(factory=dict)
    """Per step name, when a run last had it defined (``resumable clean`` uses it)."""
    events_offset: int = 0
    """How many bytes of ``events.jsonl`` this manifest includes."""
    session: dict[str, Any] | None = None
    """A named session's ``id``, ``created_at``, ``parent`` (forked from) and ``metadata``."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (a deep copy), every record included, keys in the documented order."""
        return self._data({slot: _record_dict(rec) for slot, rec in self.steps.items()})

    def _data(self, steps: dict[str, Any], keyed: dict[str, Any] | None = None) -> dict[str, Any]:
        # Written out by hand: attrs.asdict is ten times slower.
        return {
            "workflow_id": self.workflow_id,
            "pipeline": self.pipeline,
            "format": self.format,
            "status": self.status,
            "current_step": self.current_step,
            "completed_steps": list(self.completed_steps),
            "last_update": self.last_update,
            "runs": self.runs,
            "steps": steps,
            **({} if keyed is None else {"keyed": keyed}),
            "error": None if self.error is None else attrs.asdict(self.error),
            "batches": {name: attrs.asdict(b) for name, b in self.batches.items()},
            "code": {name: dict(parts) for name, parts in self.code.items()},
            "checkpoints": self.checkpoints,
            "defined": dict(self.defined),
            "events_offset": self.events_offset,
            **({} if self.session is None else {"session": copy.deepcopy(self.session)}),
        }

    def dump(self) -> tuple[dict[str, Any], dict[str, dict[str, list[Any]]]]:
        """
        The data of ``manifest.json`` (a summary per keyed step under ``keyed``) and, per keyed
        step whose records were read, its records file's data: a list per field, ``slots`` first.
        """
        steps: dict[str, Any] = {}
        files: dict[str, dict[str, list[Any]]] = {}
        for step, group in self.steps.groups():
            keyed = {slot: rec for slot, rec in group.items() if "/" in slot}
            steps.update((slot, _record_dict(rec)) for slot, rec in group.items() if "/" not in slot)
            if keyed:
                columns = {name: list(map(get, keyed.values())) for name, get in _FIELD_GETTERS.items()}
                files[step] = {"slots": list(keyed), **columns}
        summaries = self.steps.deferred()
        for step, columns in files.items():
            prefix = step + "/"
            last = next((s for s in reversed(self.completed_steps) if s.startswith(prefix)), None)
            counts: collections.Counter[str] = collections.Counter(columns["status"])
            done = (b for b, s in zip(columns["bytes"], columns["status"], strict=True) if s == "completed")
            summaries[step] = {
                "status": dict(sorted(counts.items())),
                "last_completed": last,
                "bytes": sum(b or 0 for b in done),
            }
        return self._data(steps, dict(sorted(summaries.items()))), files

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """
        Build a manifest from its JSON data, checking every field (``keyed`` summaries are
        ignored: the journal reads the records they stand for).

        Raises:
            StateFormatError: the data comes from a newer version.
            ValueError: the data is malformed (the message says which field).
        """
        version = data.get("format")
        if type(version) is int and version > FORMAT:
            raise StateFormatError("manifest.json", version, FORMAT)
        if type(version) is not int or version < 1:
            msg = f"format {version!r} is not one this version reads"
            raise ValueError(msg)
        data = {**data, "format": FORMAT}  # 0.1.0's format 1 kept every record here: read as it is
        problem = manifest_problem(data)
        if problem is not None:
            raise ValueError(problem)
        data.pop("keyed", None)
        steps = {k: StepRecord(**v) for k, v in data.pop("steps", {}).items()}
        batches = {k: BatchRecord(**v) for k, v in data.pop("batches", {}).items()}
        error = data.pop("error", None)
        return cls(
            **data, steps=steps, batches=batches, error=None if error is None else ErrorRecord(**error)
        )


def records_of(step: str, data: object) -> dict[str, StepRecord] | None:
    """The records of keyed *step* in *data* (read from its file, see dump); None if they are not valid."""
    if type(data) is not dict or data.keys() != _RECORDS_KEYS:
        return None
    slots = data["slots"]
    prefix = step + "/"
    if type(slots) is not list or not all(map(_slot, slots)) or len(set(slots)) != len(slots):
        return None
    if not all(slot.startswith(prefix) for slot in slots):
        return None
    columns = [data[name] for name in _RECORD_FIELDS]
    for column, check in zip(columns, _RECORD_CHECKS, strict=True):
        if type(column) is not list or len(column) != len(slots) or not set(map(type, column)) <= check:
            return None
    return dict(zip(slots, map(StepRecord, *columns), strict=True))


_RECORD_FIELDS = tuple(a.name for a in attrs.fields(StepRecord))


def _record_dict(rec: StepRecord) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in _RECORD_FIELDS}


_FIELD_GETTERS = {name: operator.attrgetter(name) for name in _RECORD_FIELDS}


# Validation of data read from disk. A check is a set of exact types (``type(v) in check``:
# a bool is not an int) or a predicate; one small table per record kind keeps it cheap.
_Check = frozenset[type] | Callable[[Any], bool]
_NONE: type = type(None)
_STR: frozenset[type] = frozenset({str})
_OPT_STR: frozenset[type] = frozenset({str, _NONE})
_INT: frozenset[type] = frozenset({int})
_OPT_INT: frozenset[type] = frozenset({int, _NONE})
_OPT_NUM: frozenset[type] = frozenset({int, float, _NONE})
_BOOL: frozenset[type] = frozenset({bool})
# a slot: a step name, or a step name and an encoded key; never a path that leaves the directory
_SLOT = re.compile(r"[^./\\\x00-\x1f][^/\\\x00-\x1f]*(?:/[^./\\\x00-\x1f][^/\\\x00-\x1f]*)?")


def _fits(check: _Check, value: object) -> bool:
    if isinstance(check, frozenset):
        return type(value) in check
    return check(value)


def _record(fields: Mapping[str, _Check], required: Iterable[str] | None = None) -> Callable[[Any], bool]:
    """A predicate: a dict with the *required* keys (default: all), no others than *fields*, each fitting."""
    needed = tuple(fields if required is None else required)

    def check(data: object) -> bool:
        return (
            type(data) is dict
            and all(key in data for key in needed)
            and all(key in fields and _fits(fields[key], value) for key, value in data.items())
        )

    return check


def _map_of(check: _Check, key: Callable[[Any], bool] = lambda k: type(k) is str) -> Callable[[Any], bool]:
    """A predicate: a dict of keys fitting *key* (default: str), each value fitting *check*."""
    return lambda data: type(data) is dict and all(key(k) and _fits(check, v) for k, v in data.items())


def _slot(value: object) -> bool:
    return type(value) is str and _SLOT.fullmatch(value) is not None


def is_step_name(value: object) -> bool:
    """True if *value* could name a step (a slot with no key)."""
    return _slot(value) and "/" not in value  # type: ignore[operator]  # _slot: a str


def _slots(value: object) -> bool:
    return type(value) is list and all(map(_slot, value))


def _strs(value: object) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


_RECORD_TYPES: dict[str, frozenset[type]] = {
    "status": _STR,
    "fingerprint": _OPT_STR,
    "reason": _OPT_STR,
    "started_at": _OPT_STR,
    "finished_at": _OPT_STR,
    "duration_s": _OPT_NUM,
    "attempts": _INT,
    "bytes": _OPT_INT,
    "file": _OPT_STR,
}
_STEP_RECORD = _record(_RECORD_TYPES, ("status",))
_RECORD_CHECKS = tuple(_RECORD_TYPES[name] for name in _RECORD_FIELDS)
_RECORDS_KEYS = frozenset({"slots", *_RECORD_FIELDS})
_BATCH_RECORD = _record({"done": _INT, "every": _INT, "total": _OPT_INT, "failures": _INT}, ("done", "every"))
# an error as events carry it (the manifest's adds the step)
_EVENT_ERROR = _record({"type": _STR, "message": _STR, "traceback": _STR})
_ERROR_RECORD = _record({"step": _OPT_STR, "type": _STR, "message": _STR, "traceback": _STR})
_STR_MAP = _map_of(_STR)
_SESSION_FIELDS: dict[str, _Check] = {
    "id": _STR,
    "created_at": _OPT_STR,
    "parent": _OPT_STR,
    "metadata": lambda v: type(v) is dict,
}
_SESSION = _record(_SESSION_FIELDS, ("id",))
_CODE = _map_of(_STR_MAP)


def _run_status(value: object) -> bool:
    return type(value) is str and value in RUN_STATUSES


_MANIFEST: dict[str, _Check] = {
    "workflow_id": _STR,
    "pipeline": _STR,
    "format": _INT,
    "status": _run_status,
    "current_step": _OPT_STR,
    "completed_steps": _slots,
    "last_update": _OPT_STR,
    "runs": _count,
    "steps": _map_of(_STEP_RECORD, _slot),
    # per keyed step, how many of its slots have each status, the last completed and their bytes
    "keyed": _map_of(
        _record({"status": _map_of(_INT), "last_completed": _OPT_STR, "bytes": _INT}), is_step_name
    ),
    "error": lambda v: v is None or _ERROR_RECORD(v),
    "batches": _map_of(_BATCH_RECORD),
    "code": _CODE,
    "checkpoints": _count,
    "defined": _STR_MAP,
    "events_offset": _count,
    "session": lambda v: v is None or _SESSION(v),
}


def manifest_problem(data: Mapping[str, Any]) -> str | None:
    """What is wrong with manifest data read from disk, or None if every field is valid."""
    for key in ("workflow_id", "pipeline"):
        if key not in data:
            return f"no {key!r}"
    for key, value in data.items():
        check = _MANIFEST.get(key)
        if check is None:
            return f"unknown field {key!r}"
        if not _fits(check, value):
            return f"field {key!r} is not valid ({type(value).__name__})"
    return None


def _skip_rows(value: object) -> bool:
    """0.1.0 logged skips in a row as one event: a row per slot, each a ``step_skipped``'s fields."""
    return type(value) is list and all(
        type(row) is list and len(row) == 5 and valid_event({"event": "step_skipped", **skip_fields(row)})
        for row in value
    )


def skip_fields(row: list[Any]) -> dict[str, Any]:
    """One row of a ``steps_skipped`` event as the fields of a ``step_skipped`` event."""
    slot, fingerprint, size, created_at, file = row
    return {"slot": slot, "fingerprint": fingerprint, "bytes": size, "created_at": created_at, "file": file}


def _inserts(value: object) -> bool:
    """``[[index, slot], ...]`` with indices in increasing order."""
    if type(value) is not list or not all(type(p) is list and len(p) == 2 and _count(p[0]) for p in value):
        return False
    indices = [p[0] for p in value]
    return indices == sorted(set(indices)) and all(_slot(p[1]) for p in value)


# what a rollback changed: the records set (None: removed), the completed slots to drop from
# their list and those to insert into it (at their index), and the code records
_ROLLBACK_CHANGES = _record(
    {
        "steps": _map_of(lambda v: v is None or _STEP_RECORD(v), _slot),
        "drop": _slots,
        "insert": _inserts,
        "code": _CODE,
    }
)
_RAN: dict[str, _Check] = {"duration_s": _OPT_NUM, "attempts": _INT}
# per event: the fields it must have, and the check of each field the fold reads (others are ignored)
EVENT_SCHEMA: dict[str, tuple[tuple[str, ...], dict[str, _Check]]] = {
    "run_started": ((), {"run": _count, "pipeline": _STR}),
    "run_finished": (("status",), {"status": _run_status, "defined": _strs, "error": _EVENT_ERROR}),
    "step_started": (
        ("slot",),
        {
            "slot": _slot,
            "reason": _OPT_STR,
            "fingerprint": _OPT_STR,
            "attempt": _INT,
            "detail": _OPT_STR,
            "code": _OPT_STR,
            "was": _OPT_STR,
            "params": lambda v: v is None or _strs(v),
        },
    ),
    # a pinned version kept an output that other code made (read by `resumable why`)
    "step_kept": (("slot",), {"slot": _slot, "code": _OPT_STR, "was": _OPT_STR}),
    "step_retry": (("slot",), {"slot": _slot, "attempt": _INT}),
    "step_completed": (
        ("slot",),
        {
            "slot": _slot,
            "fingerprint": _OPT_STR,
            "bytes": _OPT_INT,
            "file": _OPT_STR,
            "code": _STR_MAP,
            "recovered": _BOOL,
            **_RAN,
        },
    ),
    "step_skipped": (
        ("slot",),
        {"slot": _slot, "fingerprint": _OPT_STR, "bytes": _OPT_INT, "created_at": _OPT_STR, "file": _OPT_STR},
    ),
    # skips logged together: [slot, fingerprint, bytes, created_at, file] each
    "steps_skipped": (("skips",), {"skips": _skip_rows}),
    "step_failed": (("slot", "error"), {"slot": _slot, "error": _EVENT_ERROR, **_RAN}),
    "step_interrupted": (("slot",), {"slot": _slot, **_RAN}),
    "steps_reset": (("slots",), {"slots": _slots}),
    "snapshot": ((), {"label": _OPT_STR}),
    "steps_removed": ((), {"slots": _slots, "steps": _strs}),
    # the state rolled back to, as what changed from the state before it
    "rollback": (("changes",), {"changes": _ROLLBACK_CHANGES, "to": _INT}),
    "batch": (("batch", "progress"), {"batch": _STR, "progress": _BATCH_RECORD}),
    "batch_done": (("batch",), {"batch": _STR}),
    # a named session's identity: when it was created (or forked), or its metadata changed
    "session": (("id",), _SESSION_FIELDS),
}


def valid_event(event: object) -> bool:
    """True if *event* (a line of the log, parsed) is one the fold can apply as it is."""
    if type(event) is not dict:
        return False
    name = event.get("event")
    schema = EVENT_SCHEMA.get(name) if type(name) is str else None
    if schema is None or type(event.get("t", "")) is not str:
        return False
    required, checks = schema
    if not all(key in event for key in required):
        return False
    for key, value in event.items():  # one lookup per field: a replay checks every line of the log
        check = checks.get(key)
        if check is not None and not (type(value) in check if isinstance(check, frozenset) else check(value)):
            return False
    return True


def dumps(data: Mapping[str, Any]) -> bytes:
    """Manifest data as JSON text: a line per key, and per entry of its mappings (slot, batch, step)."""
    lines = []
    for key, value in data.items():
        if key in {"steps", "batches", "code", "defined", "keyed"} and isinstance(value, dict) and value:
            entries = ",\n".join(f"    {_json(k)}: {_json(v)}" for k, v in value.items())
            lines.append(f"  {_json(key)}: {{\n{entries}\n  }}")
        else:
            lines.append(f"  {_json(key)}: {_json(value)}")
    return ("{\n" + ",\n".join(lines) + "\n}\n").encode()


# one encoder for every value: json.dumps with options builds a new encoder at each call
_json = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": ")).encode


class Fold:
    """Applies events to a manifest, keeping the transient state the fold needs."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        # records not read are of no running slot (a manifest that says running has every one read)
        self._running: list[str] = [slot for slot, rec in manifest.steps.parsed() if rec.status == "running"]
        # mirrors completed_steps so that completing a slot costs O(1), not O(slots)
        self._completed: set[str] = set(manifest.completed_steps)

    def _record(self, slot: str) -> StepRecord:
        rec = self.manifest.steps.get(slot)
        if rec is None:
            rec = self.manifest.steps[slot] = StepRecord(status="new")
        return rec

    def uncomplete(self, slot: str) -> None:
        """Take *slot* out of the completed slots."""
        if slot in self._completed:
            self._completed.discard(slot)
            self.manifest.completed_steps.remove(slot)

    def _done_running(self, slot: str) -> None:
        if slot in self._running:
            self._running.remove(slot)
        m = self.manifest
        if m.current_step == slot or m.current_step is None:
            m.current_step = self._running[-1] if self._running else None

    def _complete(self, slot: str) -> None:
        self.uncomplete(slot)  # (moved to the end)
        self._completed.add(slot)
        self.manifest.completed_steps.append(slot)

    def apply(self, event: Mapping[str, Any]) -> None:
        """Apply one event (one that changes nothing here, as ``step_kept``, has no handler)."""
        self.manifest.last_update = event.get("t", self.manifest.last_update)
        handler = _HANDLERS.get(event.get("event", ""))
        if handler is not None:
            handler(self, event)

    def _run_started(self, event: Mapping[str, Any]) -> None:
        m = self.manifest
        m.runs = event.get("run", m.runs + 1)
        m.pipeline = event.get("pipeline", m.pipeline)
        m.status = "running"
        m.error = None
        m.current_step = None
        self._running.clear()

    def _run_finished(self, event: Mapping[str, Any]) -> None:
        m = self.manifest
        m.status = event["status"]
        for name in event.get("defined", ()):
            m.defined[name] = event.get("t", "")
        if "error" in event:
            m.error = ErrorRecord(None, **event["error"])
        for running in self._running:
            m.steps[running].status = "interrupted"
        self._running.clear()
        if m.status != "failed":
            m.current_step = None

    def _step_started(self, event: Mapping[str, Any]) -> None:
        slot = event["slot"]
        rec = self._record(slot)
        rec.status = "running"
        rec.reason = event.get("reason")
        rec.fingerprint = event.get("fingerprint")
        rec.started_at = event.get("t")
        rec.finished_at = rec.duration_s = None
        rec.attempts = event.get("attempt", 1)
        if slot in self._running:
            self._running.remove(slot)
        self._running.append(slot)
        self.manifest.current_step = slot
        self.uncomplete(slot)  # running again: not completed until it finishes

    def _step_retry(self, event: Mapping[str, Any]) -> None:
        self._record(event["slot"]).attempts = event.get("attempt", 1)

    def _step_completed(self, event: Mapping[str, Any]) -> None:
        slot = event["slot"]
        rec = self._record(slot)
        rec.status = "completed"
        rec.fingerprint = event.get("fingerprint", rec.fingerprint)
        rec.finished_at = event.get("t")
        rec.duration_s = event.get("duration_s")
        rec.bytes = event.get("bytes")
        rec.attempts = event.get("attempts", rec.attempts)
        rec.file = event.get("file")
        if "code" in event:
            self.manifest.code[slot.split("/", 1)[0]] = event["code"]
        self.manifest.checkpoints += 1
        self._complete(slot)
        self._done_running(slot)

    def _step_skipped(self, event: Mapping[str, Any]) -> None:
        slot = event["slot"]
        if self.manifest.steps.is_completed(slot):  # the common case: a keyed step's records stay unread
            return
        # the manifest lagged behind the files: learn the slot from its skip
        rec = self._record(slot)
        rec.status = "completed"
        rec.fingerprint = event.get("fingerprint")
        rec.bytes = event.get("bytes")
        rec.finished_at = event.get("created_at")
        rec.file = event.get("file")
        self._complete(slot)
        self._done_running(slot)

    def _steps_skipped(self, event: Mapping[str, Any]) -> None:
        for row in event["skips"]:  # skips logged together by 0.1.0: a row per slot
            self._step_skipped(skip_fields(row))

    def _step_failed(self, event: Mapping[str, Any]) -> None:
        slot = event["slot"]
        failed = event["event"] == "step_failed"
        rec = self._record(slot)
        rec.status = "failed" if failed else "interrupted"
        rec.finished_at = event.get("t")
        rec.duration_s = event.get("duration_s")
        rec.attempts = event.get("attempts", rec.attempts)
        self.uncomplete(slot)
        self._done_running(slot)
        if failed:
            self.manifest.error = ErrorRecord(slot, **event["error"])
            self.manifest.current_step = slot

    def remove(self, slots: Iterable[str]) -> None:
        """Forget *slots* (completed slots whose outputs are gone)."""
        m = self.manifest
        gone = set(slots)
        for slot in gone:
            m.steps.pop(slot, None)
        m.completed_steps[:] = [s for s in m.completed_steps if s not in gone]
        self._completed -= gone

    def _steps_reset(self, event: Mapping[str, Any]) -> None:
        m = self.manifest
        reset = set(event["slots"])
        for name in reset:
            m.steps[name] = StepRecord(status="reset")
        m.completed_steps[:] = [s for s in m.completed_steps if s not in reset]
        self._completed -= reset
        self._running = [s for s in self._running if s not in reset]
        if m.current_step in reset:
            m.current_step = self._running[-1] if self._running else None

    def _snapshot(self, _event: Mapping[str, Any]) -> None:
        self.manifest.checkpoints += 1

    def _rollback(self, event: Mapping[str, Any]) -> None:
        # The event carries what changed from the state before it to the state rolled back
        # to: replaying it needs nothing else.
        m = self.manifest
        changes = event["changes"]
        for slot, rec in changes["steps"].items():
            if rec is None:
                m.steps.pop(slot, None)
            else:
                m.steps[slot] = StepRecord(**rec)
        dropped = set(changes["drop"])
        completed = [slot for slot in m.completed_steps if slot not in dropped]
        for index, slot in changes["insert"]:
            completed.insert(index, slot)
        m.completed_steps = completed
        m.code = {name: dict(parts) for name, parts in changes["code"].items()}
        m.batches = {}
        m.current_step = None
        self._completed = set(m.completed_steps)
        self._running = []

    _step_interrupted = _step_failed

    def _steps_removed(self, event: Mapping[str, Any]) -> None:
        # outputs of steps that no longer exist, dropped by `resumable clean`
        self.remove(event.get("slots", ()))
        for name in event.get("steps", ()):
            self.manifest.code.pop(name, None)
            self.manifest.defined.pop(name, None)

    def _batch(self, event: Mapping[str, Any]) -> None:
        self.manifest.batches[event["batch"]] = BatchRecord(**event["progress"])

    def _batch_done(self, event: Mapping[str, Any]) -> None:
        self.manifest.batches.pop(event["batch"], None)

    def _session(self, event: Mapping[str, Any]) -> None:
        self.manifest.session = {
            "id": event["id"],
            "created_at": event.get("created_at"),
            "parent": event.get("parent"),
            "metadata": dict(event.get("metadata") or {}),
        }


# per event, its handler: Fold._<event name>
_HANDLERS: dict[str, Callable[[Fold, Mapping[str, Any]], None]] = {
    name: getattr(Fold, f"_{name}") for name in EVENT_SCHEMA if hasattr(Fold, f"_{name}")
}
