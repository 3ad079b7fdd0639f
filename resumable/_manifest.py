"""
The progress manifest: what ``state/manifest.json`` holds, and how events update it.

The manifest is a fold of the event log: every change is an event appended to
``events.jsonl`` and applied here. ``manifest.json`` is that fold written out, with the
log offset it covers, so a reader replays only the few events written after it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import operator
import re
import threading
from collections.abc import Callable, ItemsView, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, Literal, get_args

import attrs

from .exceptions import StateFormatError

FORMAT = 1
RunStatus = Literal["running", "completed", "failed", "interrupted"]
StepStatus = Literal["new", "running", "completed", "failed", "interrupted", "reset"]
RUN_STATUSES: tuple[RunStatus, ...] = get_args(RunStatus)


@attrs.define
class StepRecord:
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


@attrs.define
class ErrorRecord:
    """The last error that escaped a step (``step`` is None for an error outside steps)."""

    step: str | None
    type: str
    message: str
    traceback: str


@attrs.define
class BatchRecord:
    """Progress of one batch of rows committed in chunks."""

    done: int
    every: int
    total: int | None = None
    failures: int = 0


class Steps(MutableMapping[str, StepRecord]):
    """
    The slot records of a manifest, by slot, in insertion order.

    Records of completed slots read from a large ``manifest.json`` stay as their JSON text
    until they are used (:meth:`Manifest.loads`): opening a state of 100,000 slots parses
    none of them, holds them as plain strings (no objects for the garbage collector to
    walk), and writing the manifest again copies the text of every record nothing touched.
    A record is checked when it is parsed; one that is not valid goes to :attr:`damaged`,
    which may give a record rebuilt from elsewhere, and is dropped otherwise.

    Until a record is first used, the records stay the one block of text they were read as
    (:meth:`of_block`): opening such a state costs no work per slot, a run that only skips
    writes the block back as it is, and :meth:`is_completed` answers from the completed slots
    the manifest lists. The first other use splits the block into records kept as text.
    """

    __slots__ = ("_block", "_done", "_items", "_texts", "damaged", "invalid", "lock")

    def __init__(self, records: Mapping[str, StepRecord] | None = None) -> None:
        self._items: dict[str, StepRecord | str] = dict(records or {})
        self._texts = 0  # how many records are still text: none, iterating costs nothing more
        self._block: tuple[bytes | bytearray, int, int] | None = None  # raw[start:end], not split yet
        self._done: frozenset[str] = frozenset()  # while there is a block: its completed slots
        self.damaged: Callable[[str], StepRecord | None] = lambda _slot: None
        # told of each record dropped from a block because its key is not a slot
        self.invalid: Callable[[str], None] = lambda _key: None
        # held while a record is parsed (the journal's lock, for one order of locks)
        self.lock: threading.RLock | contextlib.nullcontext[None] = contextlib.nullcontext()

    @classmethod
    def of_text(cls, texts: dict[str, str]) -> Steps:
        steps = cls()
        steps._items = dict(texts)
        steps._texts = len(texts)
        return steps

    @classmethod
    def of_block(cls, raw: bytes | bytearray, start: int, end: int, completed: Iterable[str]) -> Steps:
        """
        The records ``raw[start:end]`` (``"slot": record`` lines, as :func:`dump_chunks` writes them),
        none of them running, of which the slots *completed* are the completed ones.
        """
        steps = cls()
        steps._done = frozenset(completed)
        steps._block = (raw, start, end)
        return steps

    def block(self) -> memoryview | None:
        """The records as the block of text they were read as, if it was never split."""
        block = self._block
        return None if block is None else memoryview(block[0])[block[1] : block[2]]

    def _split(self) -> None:
        """Split the block into records kept as text; those not completed are parsed at once."""
        with self.lock:
            if self._block is None:
                return  # split meanwhile
            raw, start, end = self._block
            try:
                texts = _record_texts(raw, start, end)
            except ValueError:
                texts = None
            if texts is None:
                texts, invalid = _salvage_texts(bytes(raw[start:end]))
                for key in invalid:
                    self.invalid(key)
            items: dict[str, StepRecord | str] = dict(texts)
            for slot in self._done - items.keys():  # a completed slot whose line was damaged
                record = self.damaged(slot)
                if record is not None:
                    items[slot] = record
            waiting = [
                slot for slot, text in items.items() if type(text) is str and not text.startswith(_COMPLETED)
            ]
            for slot in waiting:
                record = _checked(items[slot]) or self.damaged(slot)  # type: ignore[arg-type]
                if record is None:
                    del items[slot]
                else:
                    items[slot] = record
            # published whole, the block last: is_completed reads without the lock
            self._items = items
            self._texts = sum(type(text) is str for text in items.values())
            self._block = None
            self._done = frozenset()

    def __getitem__(self, slot: str) -> StepRecord:
        if self._block is not None:
            self._split()
        value = self._items[slot]
        return self._parse(slot, value) if isinstance(value, str) else value

    def get(self, slot: str, default: StepRecord | None = None) -> StepRecord | None:  # type: ignore[override]
        # the hot path: no exception raised
        if self._block is not None:
            self._split()
        value = self._items.get(slot)
        if isinstance(value, str):
            try:
                return self._parse(slot, value)
            except KeyError:
                return default
        return default if value is None else value

    def is_completed(self, slot: str) -> bool:
        """True if *slot*'s record says completed (a record kept as text is: see loads)."""
        done = self._done  # read first: _split clears it only after the block is gone
        if self._block is not None:
            return slot in done
        value = self._items.get(slot)
        return isinstance(value, str) or (value is not None and value.status == "completed")

    def _parse(self, slot: str, text: str) -> StepRecord:
        with self.lock:  # two threads must not each make a record of one slot
            value = self._items.get(slot, text)
            if not isinstance(value, str):
                return value  # parsed meanwhile
            record = _checked(text) or self.damaged(slot)
            self._texts -= 1
            if record is None:
                self._items.pop(slot, None)
                raise KeyError(slot)
            self._items[slot] = record
            return record

    def __setitem__(self, slot: str, record: StepRecord) -> None:
        if self._block is not None:
            self._split()
        if isinstance(self._items.get(slot), str):
            self._texts -= 1
        self._items[slot] = record

    def __delitem__(self, slot: str) -> None:
        if self._block is not None:
            self._split()
        if isinstance(self._items.pop(slot), str):
            self._texts -= 1

    def __iter__(self) -> Iterator[str]:
        self.parse_all()  # first: a record found damaged is dropped, not met half-way
        return iter(list(self._items))

    def parse_all(self) -> None:
        """Parse (and check) every record still kept as text."""
        if self._block is not None:
            self._split()
        if not self._texts:
            return
        with self.lock:
            slots = [slot for slot, value in self._items.items() if isinstance(value, str)]
            for start in range(0, len(slots), _PARSE_BATCH):  # a batch at a time: bounded memory
                self._parse_batch(slots[start : start + _PARSE_BATCH])

    def completed_files(self) -> dict[str, str]:
        """
        The output version (``file``) of every completed slot, records kept as text read for
        it without being parsed into records (so they are still written back as they were).
        """
        if self._block is not None:
            self._split()
        files: dict[str, str] = {}
        texts: list[str] = []
        for slot, value in list(self._items.items()):
            if isinstance(value, str):
                texts.append(slot)
            elif value.status == "completed" and value.file is not None:
                files[slot] = value.file
        for start in range(0, len(texts), _PARSE_BATCH):
            batch = texts[start : start + _PARSE_BATCH]
            values = json_values([self._items[slot] for slot in batch])  # type: ignore[arg-type]
            for slot, data in zip(batch, values, strict=True):
                if _STEP_RECORD(data):
                    if data["status"] == "completed" and data.get("file") is not None:
                        files[slot] = data["file"]
                    continue
                rec = self.get(slot)  # on its own: a damaged one is rebuilt or dropped
                if rec is not None and rec.status == "completed" and rec.file is not None:
                    files[slot] = rec.file
        return files

    def _parse_batch(self, slots: list[str]) -> None:
        values = json_values([self._items[slot] for slot in slots])  # type: ignore[arg-type]
        for slot, data in zip(slots, values, strict=True):
            if _STEP_RECORD(data):
                self._items[slot] = StepRecord(**data)
                self._texts -= 1
            else:
                self.get(slot)  # on its own: a damaged one is rebuilt or dropped

    def __len__(self) -> int:
        if self._block is not None:
            self._split()
        return len(self._items)

    def __contains__(self, slot: object) -> bool:
        if self._block is not None:
            self._split()
        return slot in self._items

    def slots(self) -> set[str]:
        """The slots that have a record (those kept as text not parsed: they may yet prove damaged)."""
        if self._block is not None:
            self._split()
        return set(self._items)

    def parsed(self) -> Iterator[tuple[str, StepRecord]]:
        """The records already parsed (every record not kept as text; none while in a block)."""
        return ((s, r) for s, r in self._items.items() if type(r) is not str)  # type: ignore[misc]

    def texts(self) -> ItemsView[str, StepRecord | str]:
        """Every record, those never parsed as the text they were read as (for writing; a view, no copy)."""
        if self._block is not None:
            self._split()
        return self._items.items()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        return dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{dict(self.items())!r}"


def _as_steps(records: Mapping[str, StepRecord]) -> Steps:
    return records if isinstance(records, Steps) else Steps(records)


@attrs.define(on_setattr=attrs.setters.NO_OP)  # converters at init only: the fold sets fields often
class Manifest:
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
    """Per slot, its record: a mapping (records of a large manifest are parsed when used)."""
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

    def to_dict(self, *, texts: bool = False) -> dict[str, Any]:
        """
        Plain JSON-ready data (a deep copy), keys in the documented order. With *texts* (for
        :func:`dump_chunks` only), records never parsed stay the text they were read as, which it
        writes as it is, and the others are tuples of their fields.
        """
        # Written out by hand: attrs.asdict is ten times slower, and this runs for every
        # manifest write, over every slot.
        block = self.steps.block() if texts else None
        if block is not None:
            steps: Any = _Verbatim(block)
        elif texts:
            # a record's fields as a tuple, in one C call: a manifest write copies every
            # record under the journal's lock, while other threads' steps wait (see _raw_or_json)
            steps = {
                slot: rec if type(rec) is str else _record_values(rec)  # type: ignore[arg-type]
                for slot, rec in self.steps.texts()
            }
        else:
            steps = {slot: _record_dict(rec) for slot, rec in self.steps.items()}
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
            "error": None if self.error is None else attrs.asdict(self.error),
            "batches": {name: attrs.asdict(b) for name, b in self.batches.items()},
            "code": {name: dict(parts) for name, parts in self.code.items()},
            "checkpoints": self.checkpoints,
            "defined": dict(self.defined),
            "events_offset": self.events_offset,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        """
        Build a manifest from its JSON data, migrating older formats.

        Every field is checked: data read from disk may have been damaged or edited.

        Raises:
            StateFormatError: the data comes from a newer version.
            ValueError: the data is malformed (the message says which field).
        """
        version = data.get("format")
        if type(version) is not int:
            msg = "no format number"
            raise ValueError(msg)
        if version > FORMAT:
            raise StateFormatError("manifest.json", version, FORMAT)
        data = migrate(dict(data))
        problem = manifest_problem(data)
        if problem is not None:
            raise ValueError(problem)
        steps = {k: StepRecord(**v) for k, v in data.pop("steps", {}).items()}
        batches = {k: BatchRecord(**v) for k, v in data.pop("batches", {}).items()}
        error = data.pop("error", None)
        return cls(
            **data, steps=steps, batches=batches, error=None if error is None else ErrorRecord(**error)
        )

    @classmethod
    def loads(cls, raw: bytes | bytearray) -> Manifest | None:
        """
        A manifest from the text of a ``manifest.json`` in the layout :func:`dump_chunks` writes,
        leaving the records of completed slots as text until used (see :class:`Steps`); None
        if the text is not in that layout (then parse it whole with :meth:`from_dict`).

        Raises:
            StateFormatError, ValueError: as :meth:`from_dict`.
        """
        # JSON strings hold no raw newline: these only occur where dump_chunks put them. The bytes
        # are decoded a piece at a time: 30 MB of text is never held beside the records.
        # The steps are most of the text: what follows them (dump_chunks writes the error next) is
        # found from the end, and whether "steps" also occurs elsewhere shows in the data.
        start, end = raw.find(_STEPS_OPEN), raw.rfind(_STEPS_CLOSE + _ERROR_NEXT)
        if start < 0 or end < start:
            return None
        first, last = start + len(_STEPS_OPEN), end
        try:
            data = json.loads(raw[:start] + b'\n  "steps": {}' + raw[end + len(_STEPS_CLOSE) :])
        except (ValueError, RecursionError):  # UnicodeDecodeError too
            return None
        if type(data) is not dict or data.get("steps") != {}:
            return None  # not JSON, or a second "steps" (the last one would count)
        if data.get("status") != "running":
            # No record is running (a run that ends marks them interrupted), and no record is
            # needed at open (the fold needs the running ones): the records stay one block.
            manifest = cls.from_dict(data)
            manifest.steps = Steps.of_block(raw, first, last, manifest.completed_steps)
            return manifest
        return cls._with_texts(data, raw, first, last)

    @classmethod
    def _with_texts(
        cls, data: dict[str, Any], raw: bytes | bytearray, first: int, last: int
    ) -> Manifest | None:
        """:meth:`loads` where some record is running: completed records as text, the rest parsed."""
        try:
            texts = _record_texts(raw, first, last)
        except ValueError:
            return None
        if texts is None:
            return None
        # only completed records wait: one that is not is needed at once (a running one by Fold)
        eager = [slot for slot, record in texts.items() if not record.startswith(_COMPLETED)]
        try:
            data["steps"] = {slot: json.loads(texts[slot]) for slot in eager}
        except (ValueError, RecursionError):
            return None
        manifest = cls.from_dict(data)
        steps = Steps.of_text(texts)
        for slot in eager:
            steps[slot] = manifest.steps[slot]  # in its place: the order of the file is kept
        manifest.steps = steps
        return manifest


def json_values(texts: list[str] | list[bytes]) -> list[Any]:
    """
    The JSON value of each of *texts* (None where one is not JSON), in one json call for them
    all (C speed); one by one only where that fails or the count is off (a damaged text).
    Each value is then checked (as a record, an event): texts crafted to shift values
    between them give nothing that whoever can write them could not write plainly.
    """
    joined: str | bytes = (
        b"[" + b",".join(texts) + b"]"
        if texts and isinstance(texts[0], bytes)
        else "[" + ",".join(texts) + "]"  # type: ignore[arg-type]
    )
    try:
        values = json.loads(joined)
    except (ValueError, RecursionError):
        values = None
    if type(values) is list and len(values) == len(texts):
        return values
    parsed: list[Any] = []
    for text in texts:
        try:
            parsed.append(json.loads(text))
        except (ValueError, RecursionError):
            parsed.append(None)
    return parsed


def _checked(text: str) -> StepRecord | None:
    """The record *text* holds, if it is a valid one."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return StepRecord(**data) if _STEP_RECORD(data) else None


def _record_texts(raw: bytes | bytearray, start: int, end: int) -> dict[str, str] | None:
    """
    The ``"slot": {record}`` lines of *raw* between *start* and *end* (the steps of a
    manifest.json) as text, by slot; None if they are not in the layout dump_chunks writes.

    Raises:
        UnicodeDecodeError: they are not UTF-8.
    """
    texts: dict[str, str] = {}
    while start < end:  # a megabyte at a time: the lines of 30 MB are never all held at once
        stop = raw.find(b",\n", min(start + _PIECE, end), end)
        stop = end if stop < 0 else stop
        for line in raw[start:stop].decode().split(",\n"):
            key, sep, record = line.partition('": ')
            if not sep or not key.startswith('    "') or "\\" in key:
                return None  # not that layout, or an escaped key: parsed whole instead
            texts[key[5:]] = record
        start = stop + 2
    return texts if _all_slots(texts) else None


_PIECE = 1 << 20
_PARSE_BATCH = 4096  # records parsed in one json call by Steps.parse_all


_COMPLETED = '{"status": "completed", '


def _salvage_texts(block: bytes) -> tuple[dict[str, str], list[str]]:
    """
    The records of a block not quite in the layout dump_chunks writes (escaped keys, or damage):
    every line whose key is a slot, record as text (checked when parsed), by slot; and the
    keys that are not slots. A line without a key is left out (its slot, if completed, is
    rebuilt from its output file).
    """
    texts: dict[str, str] = {}
    invalid: list[str] = []
    decoder = json.JSONDecoder()
    for line in block.decode(errors="replace").split(",\n"):
        try:
            key, at = decoder.raw_decode(line, 4)
        except (ValueError, RecursionError):
            continue
        if line[:4] != "    " or line[at : at + 2] != ": " or type(key) is not str:
            continue
        if _slot(key):
            texts[key] = line[at + 2 :]
        else:
            invalid.append(key)
    return texts, invalid


_STEPS_OPEN = b'\n  "steps": {\n'
_STEPS_CLOSE = b"\n  }"
_ERROR_NEXT = b',\n  "error": '
_RECORD_FIELDS = tuple(a.name for a in attrs.fields(StepRecord))


def _record_dict(rec: StepRecord) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in _RECORD_FIELDS}


_record_values: Callable[[StepRecord], tuple[Any, ...]] = operator.attrgetter(*_RECORD_FIELDS)


# Validation of data read from disk. A check is a set of exact types (``type(v) in check``:
# a bool is not an int) or a predicate; one small table per record kind keeps it cheap.
_Check = frozenset[type] | Callable[[Any], bool]
_NONE: type = type(None)
_STR: _Check = frozenset({str})
_OPT_STR: _Check = frozenset({str, _NONE})
_INT: _Check = frozenset({int})
_OPT_INT: _Check = frozenset({int, _NONE})
_OPT_NUM: _Check = frozenset({int, float, _NONE})
_BOOL: _Check = frozenset({bool})
# a slot: a step name, or a step name and an encoded key; never a path that leaves the directory
_SLOT = re.compile(r"[^./\\\x00-\x1f][^/\\\x00-\x1f]*(?:/[^./\\\x00-\x1f][^/\\\x00-\x1f]*)?")
_NOT_IN_SLOTS = ("\n.", "/.", "\n\n", "\n/", "/\n", "//")  # a part empty or starting with a dot
_BAD_SLOT_CHAR = re.compile(r"[\\\x00-\x09\x0b-\x1f]")
_TWO_SLASHES = re.compile(r"/[^/\n]*/")
_MAX_COMBOS = 1024  # allowed type combinations of a record precomputed at most


def _fits(check: _Check, value: object) -> bool:
    if isinstance(check, frozenset):
        return type(value) in check
    return check(value)


def _record(fields: Mapping[str, _Check], required: tuple[str, ...]) -> Callable[[Any], bool]:
    """A predicate: a dict with the *required* keys, no others than *fields*, each fitting."""
    # Type sets are checked inline (a manifest holds thousands of records), predicates called.
    types = {k: c for k, c in fields.items() if isinstance(c, frozenset)}
    predicates = {k: c for k, c in fields.items() if not isinstance(c, frozenset)}
    # The common case, a record with every field, in one step: the tuple of its values'
    # types is one of the allowed combinations (a set lookup instead of a loop per field).
    names = tuple(fields)
    every = frozenset(names)
    combos: frozenset[tuple[type, ...]] | None = None
    if not predicates and len(names) > 1 and math.prod(map(len, types.values())) <= _MAX_COMBOS:
        combos = frozenset(itertools.product(*(types[k] for k in names)))
    values = operator.itemgetter(*names)

    def check(data: object) -> bool:
        if type(data) is not dict:
            return False
        if combos is not None and data.keys() == every:
            return tuple(map(type, values(data))) in combos
        if not all(key in data for key in required):
            return False
        for key, value in data.items():
            allowed = types.get(key)
            if allowed is not None:
                if type(value) not in allowed:
                    return False
                continue
            predicate = predicates.get(key)
            if predicate is None or not predicate(value):
                return False
        return True

    return check


def _map_of(check: _Check) -> Callable[[Any], bool]:
    if isinstance(check, frozenset):
        return lambda data: (
            type(data) is dict and all(type(k) is str and type(v) in check for k, v in data.items())
        )
    return lambda data: type(data) is dict and all(type(k) is str and check(v) for k, v in data.items())


def _slot(value: object) -> bool:
    return type(value) is str and _SLOT.fullmatch(value) is not None


def _all_slots(values: Iterable[Any]) -> bool:
    """
    True if every one of *values* is a slot: the same as ``_slot`` for each, a few C-speed
    scans of them all joined a line each instead of a match per slot (a manifest holds
    100,000). What makes one not a slot shows in the joined text as a character no slot
    holds, an empty part, a part starting with a dot, or a line with two slashes.
    """
    values = values if isinstance(values, list) else list(values)
    if not values:
        return True
    try:
        lines = "\n" + "\n".join(values) + "\n"  # TypeError: not all str
    except TypeError:
        return False
    if lines.count("\n") != len(values) + 1 or any(bad in lines for bad in _NOT_IN_SLOTS):
        return False
    return _BAD_SLOT_CHAR.search(lines) is None and _TWO_SLASHES.search(lines) is None


def _slots(value: object) -> bool:
    return type(value) is list and _all_slots(value)


def _strs(value: object) -> bool:
    return type(value) is list and all(type(v) is str for v in value)


def _count(value: object) -> bool:
    return type(value) is int and value >= 0


_STEP_RECORD = _record(
    {
        "status": _STR,
        "fingerprint": _OPT_STR,
        "reason": _OPT_STR,
        "started_at": _OPT_STR,
        "finished_at": _OPT_STR,
        "duration_s": _OPT_NUM,
        "attempts": _INT,
        "bytes": _OPT_INT,
        "file": _OPT_STR,
    },
    ("status",),
)
_BATCH_RECORD = _record({"done": _INT, "every": _INT, "total": _OPT_INT, "failures": _INT}, ("done", "every"))
# an error as events carry it (the manifest's adds the step)
_EVENT_ERROR = _record({"type": _STR, "message": _STR, "traceback": _STR}, ("type", "message", "traceback"))
_ERROR_RECORD = _record(
    {"step": _OPT_STR, "type": _STR, "message": _STR, "traceback": _STR},
    ("step", "type", "message", "traceback"),
)
_STR_MAP = _map_of(_STR)
_CODE = _map_of(_STR_MAP)
_STEPS = _map_of(_STEP_RECORD)


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
    "steps": lambda v: _STEPS(v) and _all_slots(v),
    "error": lambda v: v is None or _ERROR_RECORD(v),
    "batches": _map_of(_BATCH_RECORD),
    "code": _CODE,
    "checkpoints": _count,
    "defined": _STR_MAP,
    "events_offset": _count,
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


# the types of a skip row: slot, fingerprint, bytes, created_at, file
_TEXT, _OPT_TEXT, _OPT_COUNT = frozenset({str}), frozenset({str, _NONE}), frozenset({int, _NONE})
_SKIP_ROW_TYPES = (
    _TEXT,
    _OPT_TEXT,
    _OPT_COUNT,
    _OPT_TEXT,
    _OPT_TEXT,
)  # slot, fingerprint, bytes, created_at, file
_SKIP_ROW_COMBOS = frozenset(itertools.product(*_SKIP_ROW_TYPES))


def _skip_rows(value: object) -> bool:
    return (
        type(value) is list
        and all(type(row) is list and tuple(map(type, row)) in _SKIP_ROW_COMBOS for row in value)
        and _all_slots(row[0] for row in value)
    )


def skip_fields(row: list[Any]) -> dict[str, Any]:
    """One row of a ``steps_skipped`` event as the fields of a ``step_skipped`` event."""
    slot, fingerprint, size, created_at, file = row
    return {"slot": slot, "fingerprint": fingerprint, "bytes": size, "created_at": created_at, "file": file}


_CHANGED_STEPS = _map_of(lambda v: v is None or _STEP_RECORD(v))


def _inserts(value: object) -> bool:
    """``[[index, slot], ...]`` with indices in increasing order."""
    if type(value) is not list or not all(type(p) is list and len(p) == 2 and _count(p[0]) for p in value):
        return False
    indices = [p[0] for p in value]
    return indices == sorted(set(indices)) and _all_slots(p[1] for p in value)


# what a rollback changed: the records set (None: removed), the completed slots to drop from
# their list and those to insert into it (at their index), and the code records
_ROLLBACK_CHANGES = _record(
    {
        "steps": lambda v: _CHANGED_STEPS(v) and _all_slots(v),
        "drop": _slots,
        "insert": _inserts,
        "code": _CODE,
    },
    ("steps", "drop", "insert", "code"),
)
_SLOT_FIELD = (("slot", _slot),)
_RAN = {"duration_s": _OPT_NUM, "attempts": _INT}
# per event: the fields it must have, and the optional ones the fold reads (others are ignored)
EVENT_SCHEMA: dict[str, tuple[tuple[tuple[str, _Check], ...], dict[str, _Check]]] = {
    "run_started": ((), {"run": _count, "pipeline": _STR}),
    "run_finished": ((("status", _run_status),), {"defined": _strs, "error": _EVENT_ERROR}),
    "step_started": (
        _SLOT_FIELD,
        {
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
    "step_kept": (_SLOT_FIELD, {"code": _OPT_STR, "was": _OPT_STR}),
    "step_retry": (_SLOT_FIELD, {"attempt": _INT}),
    "step_completed": (
        _SLOT_FIELD,
        {
            "fingerprint": _OPT_STR,
            "bytes": _OPT_INT,
            "file": _OPT_STR,
            "code": _STR_MAP,
            "recovered": _BOOL,
            **_RAN,
        },
    ),
    "step_skipped": (
        _SLOT_FIELD,
        {"fingerprint": _OPT_STR, "bytes": _OPT_INT, "created_at": _OPT_STR, "file": _OPT_STR},
    ),
    # skips logged together: [slot, fingerprint, bytes, created_at, file] each
    "steps_skipped": ((("skips", _skip_rows),), {}),
    "step_failed": ((*_SLOT_FIELD, ("error", _EVENT_ERROR)), _RAN),
    "step_interrupted": (_SLOT_FIELD, _RAN),
    "steps_reset": ((("slots", _slots),), {}),
    "snapshot": ((), {"label": _OPT_STR}),
    "steps_removed": ((), {"slots": _slots, "steps": _strs}),
    # the state rolled back to, as what changed from the state before it
    "rollback": ((("changes", _ROLLBACK_CHANGES),), {"to": _INT}),
    "batch": ((("batch", _STR), ("progress", _BATCH_RECORD)), {}),
    "batch_done": ((("batch", _STR),), {}),
}


# per event: its required fields, and the check of every field the fold reads (one lookup
# per field of the event: a replay validates every line of the log)
_EVENT_CHECKS: dict[str, tuple[tuple[str, ...], dict[str, _Check]]] = {
    name: (tuple(key for key, _ in required), {**dict(required), **optional})
    for name, (required, optional) in EVENT_SCHEMA.items()
}


def valid_event(event: object) -> bool:
    """True if *event* (a line of the log, parsed) is one the fold can apply as it is."""
    if type(event) is not dict:
        return False
    name = event.get("event")
    schema = _EVENT_CHECKS.get(name) if type(name) is str else None
    if schema is None or type(event.get("t", "")) is not str:
        return False
    required, checks = schema
    for key in required:
        if key not in event:
            return False
    for key, value in event.items():
        check = checks.get(key)
        if check is not None and not (type(value) in check if isinstance(check, frozenset) else check(value)):
            return False
    return True


class _Verbatim:
    """Records to write back as the block of text they were read as (:meth:`Steps.block`)."""

    # a plain class: making an attrs class at import would slow every `import resumable`
    __slots__ = ("text",)

    def __init__(self, text: memoryview) -> None:
        self.text = text


def dump_chunks(data: Mapping[str, Any]) -> list[bytes | memoryview]:
    """
    Manifest data as JSON, one line per key and one line per slot, batch and step, encoded
    in pieces of about a megabyte (a large manifest is never one string); records written
    back as read are views of the text read, not copies.
    """
    chunks: list[bytes | memoryview] = []
    pending: list[str] = []
    size = 0
    for fragment in _fragments(data):
        if not isinstance(fragment, str):
            chunks.append("".join(pending).encode())
            pending.clear()
            size = 0
            chunks.extend(fragment[at : at + _PIECE] for at in range(0, len(fragment), _PIECE))
            continue
        pending.append(fragment)
        size += len(fragment)
        if size >= _PIECE:
            chunks.append("".join(pending).encode())
            pending.clear()
            size = 0
    chunks.append("".join(pending).encode())
    return [chunk for chunk in chunks if chunk]


def _fragments(data: Mapping[str, Any]) -> Iterator[str | memoryview]:
    last = len(data) - 1
    yield "{"
    for i, (key, value) in enumerate(data.items()):
        comma = "," if i < last else ""
        if type(value) is _Verbatim:
            yield f"\n  {_json(key)}: {{\n"
            yield value.text
            yield f"\n  }}{comma}"
        elif key in {"steps", "batches", "code", "defined"} and isinstance(value, dict) and value:
            yield f"\n  {_json(key)}: {{\n"
            # the text of a record never parsed is written as it was read (Steps)
            encode = _raw_or_json if key == "steps" else _json_value
            separator = ""
            for k, v in value.items():
                yield f"{separator}    {_json_value(k)}: {encode(v)}"
                separator = ",\n"
            yield f"\n  }}{comma}"
        else:
            yield f"\n  {_json(key)}: {_json(value)}{comma}"
    yield "\n}\n"


# one encoder for every value: json.dumps with options builds a new encoder at each call
_json = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": ")).encode


_json_value = _json


def _raw_or_json(value: Any) -> str:
    """A record as written: its text, or its fields (a tuple, see Manifest.to_dict) as JSON."""
    if type(value) is str:
        return value
    return _json_value(dict(zip(_RECORD_FIELDS, value, strict=True)) if type(value) is tuple else value)


# format -> function upgrading data of that format to the next one
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def migrate(data: dict[str, Any]) -> dict[str, Any]:
    """Upgrade manifest data of an older format, one version at a time."""
    while data["format"] < FORMAT:
        data = MIGRATIONS[data["format"]](data)
    return data


class Fold:
    """Applies events to a manifest, keeping the transient state the fold needs."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        # records kept as text are completed ones (Manifest.loads): only parsed ones can be running
        self._running: list[str] = [slot for slot, rec in manifest.steps.parsed() if rec.status == "running"]
        # mirrors completed_steps so that completing a slot costs O(1), not O(slots)
        self._completed: set[str] = set(manifest.completed_steps)

    @property
    def running(self) -> list[str]:
        """The slots running at this point of the log."""
        return list(self._running)

    def _record(self, slot: str) -> StepRecord:
        rec = self.manifest.steps.get(slot)
        if rec is None:
            rec = self.manifest.steps[slot] = StepRecord(status="new")
        return rec

    def forget_completed(self, slot: str) -> None:
        """Take *slot* out of the completed slots (its record was found damaged and is dropped)."""
        self._uncomplete(slot)

    def _uncomplete(self, slot: str) -> None:
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
        done = self.manifest.completed_steps
        if slot in self._completed:
            done.remove(slot)
        self._completed.add(slot)
        done.append(slot)

    def apply(self, event: Mapping[str, Any]) -> None:
        """Apply one event (unknown events are ignored, for forward compatibility)."""
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
        self._uncomplete(slot)  # running again: not completed until it finishes

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
        rec = self.manifest.steps.get(slot)
        if rec is None or rec.status != "completed":
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
        steps = self.manifest.steps
        for row in event["skips"]:
            if not steps.is_completed(row[0]):  # the common case changes nothing: checked cheaply
                self._step_skipped(skip_fields(row))

    def _step_ended(self, event: Mapping[str, Any]) -> None:
        slot = event["slot"]
        failed = event["event"] == "step_failed"
        rec = self._record(slot)
        rec.status = "failed" if failed else "interrupted"
        rec.finished_at = event.get("t")
        rec.duration_s = event.get("duration_s")
        rec.attempts = event.get("attempts", rec.attempts)
        self._uncomplete(slot)
        if failed:
            self.manifest.error = ErrorRecord(slot, **event["error"])
        self._done_running(slot)
        if failed:
            self.manifest.current_step = slot

    def _steps_reset(self, event: Mapping[str, Any]) -> None:
        m = self.manifest
        reset = set(event.get("slots", ()))
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

    def _steps_removed(self, event: Mapping[str, Any]) -> None:
        # outputs of steps that no longer exist, dropped by `resumable clean`
        m = self.manifest
        gone = set(event.get("slots", ()))
        for slot in gone:
            m.steps.pop(slot, None)
        m.completed_steps[:] = [s for s in m.completed_steps if s not in gone]
        self._completed -= gone
        for name in event.get("steps", ()):
            m.code.pop(name, None)
            m.defined.pop(name, None)

    def _batch(self, event: Mapping[str, Any]) -> None:
        self.manifest.batches[event["batch"]] = BatchRecord(**event["progress"])

    def _batch_done(self, event: Mapping[str, Any]) -> None:
        self.manifest.batches.pop(event["batch"], None)


_HANDLERS: dict[str, Callable[[Fold, Mapping[str, Any]], None]] = {
    "run_started": Fold._run_started,  # noqa: SLF001
    "run_finished": Fold._run_finished,  # noqa: SLF001
    "step_started": Fold._step_started,  # noqa: SLF001
    "step_retry": Fold._step_retry,  # noqa: SLF001
    "step_completed": Fold._step_completed,  # noqa: SLF001
    "step_skipped": Fold._step_skipped,  # noqa: SLF001
    "steps_skipped": Fold._steps_skipped,  # noqa: SLF001
    "step_failed": Fold._step_ended,  # noqa: SLF001
    "step_interrupted": Fold._step_ended,  # noqa: SLF001
    "steps_reset": Fold._steps_reset,  # noqa: SLF001
    "snapshot": Fold._snapshot,  # noqa: SLF001
    "steps_removed": Fold._steps_removed,  # noqa: SLF001
    "rollback": Fold._rollback,  # noqa: SLF001
    "batch": Fold._batch,  # noqa: SLF001
    "batch_done": Fold._batch_done,  # noqa: SLF001
}
EVENT_KINDS = frozenset(_HANDLERS)
"""The events the fold applies (others are ignored: written by a newer version)."""
