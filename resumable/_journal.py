"""
The event log and the manifest it folds into.

Every state change is an event appended to ``events.jsonl`` on the caller's thread (see
:meth:`Journal.record`); ``manifest.json`` is rewritten by that thread when it is older than
its interval, and durably when a run closes. A reader loads the manifest and replays the
events written after it: a killed process loses nothing the log holds, and a lost or
damaged manifest is rebuilt from the log and the step files.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import hashlib
import hmac
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import msgpack

from ._codec import DamagedFileError, parse_header, utcnow
from ._codec import _sign as sign_header
from ._manifest import (
    FORMAT,
    Deferred,
    Fold,
    Manifest,
    StepRecord,
    dumps,
    is_step_name,
    records_of,
    valid_event,
)
from ._slots import EVENTS, MANIFEST, OUTPUT_SUFFIX, is_output_file, records_file
from ._stores import Store, unchanged_since
from ._stores._base import with_path
from ._warn import warn
from .exceptions import StateDirectoryError, StateFormatError

FLUSH_INTERVAL = 0.2
_MAX_INTERVAL = 10.0
# Files changed up to this long before the manifest's last event are checked for outputs it
# does not know (clocks of the file system and of the event stamps may differ a little).
_RECONCILE_SLACK = 10.0
_HEAD = 4096


def _mac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


# one encoder for every line: json.dumps with options builds a new one per call
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def _signed(data: Mapping[str, Any], secret: bytes | None) -> Mapping[str, Any]:
    return data if secret is None else {**data, "mac": _mac(secret, _dumps(data).encode())}


def _packed(data: dict[str, Any], secret: bytes | None) -> bytes:
    """*data* as msgpack, with the ``mac`` of that if there is a secret."""
    packed: bytes = msgpack.packb(data)
    return packed if secret is None else msgpack.packb({**data, "mac": _mac(secret, packed)})


def _authentic(
    data: dict[str, Any], secret: bytes | None, pack: Callable[[dict[str, Any]], bytes] | None = None
) -> bool:
    """Check (and remove) the ``mac`` of data signed as JSON (or packed by *pack*); no secret: True."""
    mac = data.pop("mac", None)
    if secret is None:
        return True
    payload = _dumps(data).encode() if pack is None else pack(data)
    return isinstance(mac, str) and hmac.compare_digest(mac, _mac(secret, payload))


# errors that say the state directory cannot be used as it is (read-only, not accessible,
# something else in a state file's place), not that this write failed (a full disk)
_UNUSABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR})


def state_error(exc: OSError, store: Store, key: str) -> OSError:
    """*exc*, met at *key*, naming the file: a :class:`StateDirectoryError` if the directory is unusable."""
    where = f"{store.location}/{key}"
    if isinstance(exc, StateDirectoryError):
        return exc
    if exc.errno in _UNUSABLE:
        problem = f"{where} cannot be used ({exc.strerror or exc})"
        return StateDirectoryError(str(store.location), problem, errno=exc.errno)
    return with_path(exc, where)


# why a line of the log holds no event (see parse_event)
LINE_PROBLEMS = {
    "damaged": "damaged (not a JSON object)",
    "forged": "not authentic (written without the secret, or tampered with)",
    "invalid": "not a valid event (a missing or wrong field, an unknown event)",
}


def parse_event(line: bytes | bytearray, secret: bytes | None) -> dict[str, Any] | str:
    """The event a line of the log holds, or why it holds none (a key of :data:`LINE_PROBLEMS`)."""
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to be an event
        return "damaged"
    if not isinstance(event, dict):
        return "damaged"
    if not _authentic(event, secret):
        return "forged"
    return event if valid_event(event) else "invalid"


def parse_manifest(
    raw: bytes | bytearray, secret: bytes | None, where: str
) -> tuple[Manifest, dict[str, Any]] | str:
    """The manifest in *raw* and its keyed steps' summaries, or what is wrong with it (newer: raises)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return "damaged"
    found = data.get("format")
    if isinstance(found, int) and found > FORMAT:
        raise StateFormatError(where, found, FORMAT)
    if not _authentic(data, secret):
        return LINE_PROBLEMS["forged"]
    try:
        return Manifest.from_dict(data), data.get("keyed", {})
    except (ValueError, TypeError, KeyError) as exc:
        return f"damaged ({exc})"


def header_authentic(header: Mapping[str, Any], secret: bytes) -> bool:
    mac = header.get("mac")
    return isinstance(mac, str) and hmac.compare_digest(mac, sign_header(header, secret))


def read_header(store: Store, key: str) -> tuple[dict[str, Any], int]:
    """Read just the header of a stored output (a few KB at most)."""
    size = _HEAD
    while True:
        head = store.read(key, 0, size)
        try:
            return parse_header(head)
        except DamagedFileError:
            if len(head) < size:
                raise
            size *= 4


class Journal:
    """Owns the manifest of an open run: applies events, logs them, writes the manifest."""

    def __init__(
        self,
        store: Store,
        *,
        pipeline: str,
        secret: bytes | None,
        readonly: bool = False,
        durable: bool = True,
    ) -> None:
        self.store = store
        self.durable = durable  # False: sync events are written at once, but not fsynced
        self.readonly = readonly
        self.pipeline = pipeline
        self.secret = secret
        # held while the manifest changes and while the log is written (steps may run in threads)
        self.lock = threading.RLock()
        self.fold = Fold(Manifest(workflow_id=uuid.uuid4().hex, pipeline=pipeline))
        self._offset = 0
        # events not yet appended (under the lock): on a store with slow appends, or after an error
        self._pending: list[dict[str, Any]] = []
        self._flush_lock = threading.Lock()  # one manifest write at a time
        self._manifest_interval = FLUSH_INTERVAL
        self._manifest_written = time.monotonic()  # when manifest.json was last read or written
        self._torn = False  # an append failed: the log may end with part of a line
        self._log_entry_durable = True
        self.rebuilt = False  # load found no usable manifest.json and rebuilt it
        self.large = False  # the manifest read was over LARGE_MANIFEST bytes
        self.unsaved = False  # the manifest holds something manifest.json does not
        self.saved_offset = 0  # how much of the log manifest.json (as read or last written) covers

    @property
    def manifest(self) -> Manifest:
        return self.fold.manifest

    def copy(self) -> Manifest:
        """A copy of the manifest (the lock is held for the copy only: steps wait while it is taken)."""
        with self.lock:
            data = self.manifest.to_dict()
        return Manifest.from_dict(data)

    def load(self) -> Manifest:
        """
        Load the manifest and replay the log after it; rebuild it from the log and the step
        files if it is lost, damaged or out of step with the log (see :meth:`_reconcile`).
        """
        with self.lock:
            self._pending = []  # events not written yet were of the state this load replaces
        manifest, problem = self._read_manifest()
        self.rebuilt = problem is not None
        tail = None if manifest is None else self._read_log(manifest.events_offset)
        if manifest is not None and tail is None:
            problem = "out of step with the event log (its events_offset is not a line end of the log)"
        if manifest is None or tail is None:
            workflow = manifest.workflow_id if manifest is not None else uuid.uuid4().hex
            manifest = Manifest(workflow_id=workflow, pipeline=self.pipeline)
            tail = self._read_log(0)
        elif manifest.status == "running":
            manifest.steps.parse_all()  # the fold needs the records of running slots
        self.fold = Fold(manifest)
        before = manifest.events_offset
        self._offset = manifest.events_offset = self._replay(*(tail or (0, b"")))
        self.unsaved = problem is not None or self._offset != before
        self.saved_offset = 0 if problem is not None else before
        # a log this journal creates: its directory entry is made durable with the first sync
        self._log_entry_durable = self._offset > 0
        if problem is not None or manifest.status == "running":
            # a run that did not close may have stored outputs whose events it never wrote
            restored = self._reconcile()
            noticed = problem != "missing" or restored or self._offset  # (a new state is not news)
            if problem is not None and noticed and not self.readonly:
                warn(
                    f"{self.store.location}/{MANIFEST} was {problem}; rebuilt it from the "
                    f"event log and {restored} step file(s)."
                )
        return self.manifest

    def _read(self, key: str, start: int = 0) -> bytes | bytearray | None:
        """*key* from *start*, None if it is missing; a :class:`StateDirectoryError` if it cannot be read."""
        try:
            return self.store.read(key, start)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise state_error(exc, self.store, key) from exc

    def _read_manifest(self) -> tuple[Manifest | None, str | None]:
        raw = self._read(MANIFEST)
        if raw is None:
            return None, "missing"
        # a large manifest is rewritten less often (see flush)
        self._manifest_interval = _rewrite_interval(len(raw))
        self.large = len(raw) > LARGE_MANIFEST
        parsed = parse_manifest(raw, self.secret, f"{self.store.location}/{MANIFEST}")
        if isinstance(parsed, str):
            return None, parsed
        manifest, keyed = parsed
        manifest.steps.lock = self.lock
        completed = frozenset(manifest.completed_steps)
        for step, summary in keyed.items():
            read = functools.partial(self._keyed_records, manifest, step)
            manifest.steps.defer(step, Deferred(read, completed, summary))
        return manifest, None

    def records_problem(self, step: str) -> tuple[dict[str, StepRecord] | None, str | None]:
        """The records of keyed *step* in its file, or what is wrong with that file."""
        data = self._read(records_file(step))
        return (None, "missing") if data is None else parse_records(step, data, self.secret)

    def _keyed_records(self, manifest: Manifest, step: str) -> dict[str, StepRecord]:
        """The records of keyed *step*: from its file, or rebuilt from its outputs if that is damaged."""
        records, problem = self.records_problem(step)
        if records is not None:
            return records
        records = {}
        prefix = step + "/"
        for slot in [s for s in manifest.completed_steps if s.startswith(prefix)]:
            event = self._recovered(slot, slot + OUTPUT_SUFFIX)
            if event is None:  # its output is gone or damaged too: it runs again
                if self.fold.manifest is manifest:
                    self.fold.uncomplete(slot)
                else:
                    manifest.completed_steps.remove(slot)  # read before its fold was made
                continue
            records[slot] = StepRecord(
                status="completed",
                fingerprint=event["fingerprint"],
                finished_at=event["created_at"] or None,
                bytes=event["bytes"],
                file=event["file"],
            )
        if not self.readonly:  # (a look at the state: damage is handled quietly)
            warn(
                f"{self.store.location}/{records_file(step)} was {problem}; rebuilt the records of "
                f"{len(records)} completed slot(s) of {step} from their output files."
            )
        return records

    def _read_log(self, start: int) -> tuple[int, bytes | bytearray] | None:
        """The log from *start*, with *start*; None if no line of the log begins at *start*."""
        # from one byte before: it must end a line
        tail = self._read(EVENTS, max(start - 1, 0))
        if tail is None:
            return 0, b""  # no log (yet, or deleted): the manifest is all there is
        if start == 0:
            return 0, tail
        return (start, tail[1:]) if tail[:1] == b"\n" else None

    def _replay(self, start: int, tail: bytes | bytearray) -> int:
        """Apply the complete lines of *tail*; return where they end in the log."""
        end = tail.rfind(b"\n") + 1
        problems: collections.Counter[str] = collections.Counter()
        for line in tail[:end].split(b"\n")[:-1]:
            event = parse_event(line, self.secret)
            if isinstance(event, str):
                problems[event] += 1
            else:
                self.fold.apply(event)
        if self.readonly:
            return start + end  # a line being written now, or cut short by a kill: not yet an event
        if problems:
            warn(
                f"{self.store.location}/{EVENTS}: skipped {problems.total()} line(s): "
                + "; ".join(f"{n} {LINE_PROBLEMS[kind]}" for kind, n in problems.items())
                + " (`resumable verify` lists them)."
            )
        if end < len(tail):
            # The last line was cut short (a kill, a full disk): drop it, so that the next
            # event is not glued to it.
            self._cut_log(start + end)
        return start + end

    def _cut_log(self, size: int) -> None:
        """Make the log its first *size* bytes (which end a line), atomically and durably."""
        try:
            kept = self.store.read(EVENTS, 0, size)
            self.store.write(EVENTS, [kept], durable=True)
        except OSError as exc:
            raise state_error(exc, self.store, EVENTS) from exc
        self._log_entry_durable = True

    def _reconcile(self) -> int:
        """
        Fold in the outputs a killed run stored without logging their completion (a writing
        journal logs a ``step_completed`` marked ``recovered`` for each), and drop completed
        slots whose file is gone; return how many were recovered. Only the headers of files
        the manifest does not know, or (on a local disk) changed since its last event, are read.
        """
        m = self.manifest
        files = {k[: -len(OUTPUT_SUFFIX)]: k for k in self.store.list() if is_output_file(k)}
        changed_since = self._known_until()
        found: list[tuple[str, dict[str, Any]]] = []
        for slot, key in files.items():
            rec = m.steps.get(slot)
            known = rec is not None and (rec.file is not None or rec.status == "completed")
            if known and changed_since is not None and unchanged_since(self.store, key, changed_since):
                continue
            event = self._recovered(slot, key)
            if event is None or (
                rec is not None
                and (rec.file == event["file"] or (rec.status == "completed" and rec.file is None))
            ):
                continue
            found.append((str(event.pop("created_at")), event))
        self.fold.remove([s for s in m.completed_steps if s not in files])
        found.sort(key=lambda item: item[0])  # in the order the outputs were stored
        with self.lock:
            for _, event in found:
                self.fold.apply(event)
                if not self.readonly:
                    self._pending.append(event)
            if not self.readonly:
                self._write_pending(durable=False)
        return len(found)

    def _known_until(self) -> int | None:
        """Nanoseconds since the epoch before which the manifest knows every local file."""
        try:
            last = datetime.fromisoformat(self.manifest.last_update or "")
        except ValueError:  # none, or not a time
            return None
        return int((last.timestamp() - _RECONCILE_SLACK) * 1e9)

    def _recovered(self, slot: str, key: str) -> dict[str, Any] | None:
        """The completion event the header of *key* proves, or None if it proves none."""
        try:
            header, head_len = read_header(self.store, key)
        except (DamagedFileError, StateFormatError, OSError):
            return None  # a damaged file is recomputed when its step is called
        if header["slot"] != slot or type(header.get("hsum")) is not str:
            return None
        if self.secret is not None and not header_authentic(header, self.secret):
            return None
        fingerprint = header.get("fingerprint")
        return {
            "t": utcnow(),
            "event": "step_completed",
            "slot": slot,
            "fingerprint": fingerprint if type(fingerprint) is str else None,
            "file": header["hsum"],
            "bytes": head_len + header["size"],
            "recovered": True,
            "created_at": header.get("created_at") or "",
        }

    def record(self, event: str, *, sync: bool = False, defer: bool = False, **fields: Any) -> None:
        """
        Apply an event (its time ``t`` is now unless given) and append it to the log, then
        rewrite ``manifest.json`` if it is older than its interval.

        A *sync* event is in the log when this returns, with every event before it, fsynced if
        the journal is :attr:`durable`: what must precede a side effect. On a store with slow
        appends other events wait for the next sync event or manifest rewrite. A *defer* event
        (a skip: a kill may lose it, the files say the same) waits for the next event written,
        and does not make the manifest due for a rewrite.

        Raises:
            OSError: the log could not be written (naming it); the event stays pending.
        """
        data = {"t": fields.pop("t", None) or utcnow(), "event": event, **fields}
        with self.lock:
            self.fold.apply(data)
            self._pending.append(data)
            if defer:
                return
            self.unsaved = True
            if sync or not self.store.slow_appends:
                self._write_pending(durable=sync and self.durable)
        if time.monotonic() - self._manifest_written < self._manifest_interval or not self.unsaved:
            return
        try:
            self.flush(durable=False)
        except OSError:
            # the events are in the log (the record); the manifest is tried again after the
            # next interval, and the close of the run reports what still fails then
            self._manifest_written = time.monotonic()

    def _write_pending(self, *, durable: bool) -> None:
        """
        Append the pending events in one write. It is complete or raises: after an error
        the events stay pending, and the next write first cuts off what this one may have
        left of them, so no line is ever lost or glued to a partial one.
        """
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        lines = [_dumps(_signed(event, self.secret)) + "\n" for event in pending]
        chunk = "".join(lines).encode()
        try:
            if self._torn:
                self._cut_log(self._offset)
                self._torn = False
            if durable:  # what the events record (outputs just stored, a log just cut) is durable first
                self.store.sync()
            self.store.append(EVENTS, chunk, durable=durable)
        except BaseException as exc:
            self._pending[:0] = pending  # nothing is lost: retried with the next write
            self._torn = True  # the append may have written part of the chunk
            if isinstance(exc, OSError):
                raise state_error(exc, self.store, EVENTS) from exc
            raise
        self._offset += len(chunk)
        self.manifest.events_offset = self._offset
        if durable and not self._log_entry_durable:
            # A log this run created is fsynced, but its name may not be: a durable write
            # of the manifest fsyncs the directory the two share.
            self._write_state(*self.manifest.dump(), durable=True)
            self.store.sync()
            self._log_entry_durable = True

    def write_pending(self, *, durable: bool) -> None:
        """Append the events not yet in the log (the manifest is rewritten in its time)."""
        with self.lock:
            self._write_pending(durable=durable)

    def flush(self, *, durable: bool) -> None:
        """Write ``manifest.json`` now (and the pending log lines before it)."""
        with self._flush_lock:
            with self.lock:
                self._write_pending(durable=durable)
                data, records = self.manifest.dump()
                self.unsaved = False
                offset = self._offset
            # encoded outside the lock: steps keep running while a large manifest is written
            size = self._write_state(data, records, durable=durable)
            if durable:
                self.store.sync()
            self.saved_offset = offset
            # A large manifest is rewritten less often: a rewrite costs the step that makes
            # it. Readers replay the log, so none sees it stale.
            self._manifest_interval = _rewrite_interval(size)
            self._manifest_written = time.monotonic()

    def _write_state(
        self, data: dict[str, Any], records: dict[str, dict[str, list[Any]]], *, durable: bool
    ) -> int:
        """Write the keyed steps' records files, then ``manifest.json``; return the bytes written."""
        files = {records_file(step): _packed(columns, self.secret) for step, columns in records.items()}
        files[MANIFEST] = dumps(_signed(data, self.secret))
        for key, text in files.items():
            try:
                self.store.write(key, [text], durable=durable)
            except OSError as exc:
                raise state_error(exc, self.store, key) from exc
        return sum(map(len, files.values()))


LARGE_MANIFEST = 1 << 20  # bytes (about 3,000 slots): not rewritten just to say a run started


def _rewrite_interval(size: int) -> float:
    """How long a manifest of *size* bytes is left unwritten: 0.2 s per 64 KB, at most 10 s."""
    return min(_MAX_INTERVAL, FLUSH_INTERVAL * max(1.0, size / 65536))


def parse_records(
    step: str, data: bytes | bytearray, secret: bytes | None
) -> tuple[dict[str, StepRecord] | None, str | None]:
    """The records of keyed *step* in the bytes of its records file, or what is wrong with them."""
    try:
        unpacked = msgpack.unpackb(data)
    except (ValueError, TypeError):  # msgpack's errors: FormatError, StackError, ExtraData ...
        return None, "damaged (not msgpack)"
    if type(unpacked) is dict and not _authentic(unpacked, secret, msgpack.packb):
        return None, LINE_PROBLEMS["forged"]
    records = records_of(step, unpacked)
    return (records, None) if records is not None else (None, "damaged (a missing or wrong field)")


def read_head(store: Store) -> dict[str, bytes]:
    """
    Read first: the manifest, the records files it names, and the event log up to its last
    whole line: what a copy made without the lock starts with (outputs are written before the
    events that name them). Returned in the order to write them, the manifest after its records.
    """
    try:
        manifest = bytes(store.read(MANIFEST))
    except FileNotFoundError:
        manifest = None
    keys = []
    with contextlib.suppress(ValueError, RecursionError, TypeError, AttributeError):
        # names from a file that may be damaged: only plain step names (the others are skipped)
        keys = [records_file(s) for s in json.loads(manifest or b"{}").get("keyed", {}) if is_step_name(s)]
    files: dict[str, bytes] = {}
    for key in keys:
        with contextlib.suppress(FileNotFoundError):
            files[key] = bytes(store.read(key))
    if manifest is not None:
        files[MANIFEST] = manifest
    with contextlib.suppress(FileNotFoundError):
        log = bytes(store.read(EVENTS))
        files[EVENTS] = log[: log.rfind(b"\n") + 1]
    return files


def read_state(
    store: Store, *, pipeline: str = "", secret: bytes | None = None, records: bool = True
) -> Manifest:
    """
    The current manifest of a store, without locking it or writing anything (damage is handled
    quietly). Without *records*, keyed steps' records are read when first used.
    """
    manifest = Journal(store, pipeline=pipeline, secret=secret, readonly=True).load()
    if records:
        manifest.steps.parse_all()
    return manifest
