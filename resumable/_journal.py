"""
The event log and the manifest it folds into.

Every state change is one line appended to ``events.jsonl`` (a single ``write``; no
rename, no fsync unless the change must survive a power loss before the step runs).
``manifest.json`` is rewritten atomically by a background thread at most every
:data:`FLUSH_INTERVAL` seconds, and synchronously (and durably) when a run closes. A
reader loads the manifest and replays the events written after it, so a killed process
loses nothing the log holds, and a lost or damaged manifest is rebuilt from the log and
the step files.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from ._codec import DamagedFileError, parse_header, utcnow
from ._manifest import FORMAT, Fold, Manifest, StepRecord
from ._manifest import dumps as dumps_manifest
from ._slots import EVENTS, MANIFEST, OUTPUT_SUFFIX, is_output_file
from ._stores import Store
from .exceptions import ResumableError, ResumableWarning, StateFormatError

FLUSH_INTERVAL = 0.2
_MAX_INTERVAL = 10.0
_MAX_PENDING = 1000  # skips kept in memory before they are appended to the log


_Skip = tuple[float, str, str, int, str | None, str | None]


def _skip_event(skip: _Skip, stamp: str) -> dict[str, Any]:
    _, slot, fingerprint, size, created_at, file = skip
    return {
        "t": stamp,
        "event": "step_skipped",
        "slot": slot,
        "fingerprint": fingerprint,
        "bytes": size,
        "created_at": created_at,
        "file": file,
    }


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_HEAD = 4096


def _mac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def _dumps(data: Mapping[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def _signed(data: Mapping[str, Any], secret: bytes | None) -> dict[str, Any]:
    out = dict(data)
    out.pop("mac", None)
    if secret is not None:
        out["mac"] = _mac(secret, _dumps(out).encode())
    return out


def _authentic(data: dict[str, Any], secret: bytes | None) -> bool:
    """Check (and remove) the ``mac`` of signed data; without a secret nothing can be checked."""
    mac = data.pop("mac", None)
    if secret is None:
        return True
    return isinstance(mac, str) and hmac.compare_digest(mac, _mac(secret, _dumps(data).encode()))


def read_header(store: Store, key: str) -> tuple[dict[str, Any], int]:
    """Read just the header of a stored output (a few KB at most)."""
    size = _HEAD
    while True:
        head = store.read_range(key, 0, size)
        try:
            return parse_header(head)
        except DamagedFileError:
            if len(head) < size:
                raise
            size *= 4


class Journal:
    """Owns the manifest of an open run: applies events, logs them, writes the manifest."""

    def __init__(self, store: Store, *, pipeline: str, secret: bytes | None, readonly: bool = False) -> None:
        self.store = store
        self.readonly = readonly
        self.pipeline = pipeline
        self.secret = secret
        self.lock = threading.RLock()
        self.fold = Fold(Manifest(workflow_id=uuid.uuid4().hex, pipeline=pipeline))
        self._offset = 0
        # events not yet appended: dicts, and skips as tuples (turned into dicts when written)
        self._pending: list[dict[str, Any] | _Skip] = []
        self._flush_lock = threading.Lock()
        self._wake = threading.Condition()
        self._dirty = False
        self._stopping = False
        self._stop = threading.Event()
        self._manifest_interval = FLUSH_INTERVAL
        self._append_is_slow = bool(getattr(store, "slow_appends", False))
        self._writer: threading.Thread | None = None

    @property
    def manifest(self) -> Manifest:
        return self.fold.manifest

    # loading -----------------------------------------------------------------------------

    def load(self) -> Manifest:
        """Load the manifest, replay the log after it, rebuild it if it is lost or damaged."""
        manifest, problem = self._read_manifest()
        start = 0 if manifest is None else manifest.events_offset
        if manifest is None:
            manifest = Manifest(workflow_id=uuid.uuid4().hex, pipeline=self.pipeline)
        self.fold = Fold(manifest)
        self._offset = self._replay(start)
        manifest.events_offset = self._offset
        if problem is not None:
            restored = self._reconcile()
            if problem != "missing" or restored or self._offset:
                warnings.warn(
                    ResumableWarning(
                        f"{self.store.location}/{MANIFEST} was {problem}; rebuilt it from the "
                        f"event log and {restored} step file(s)."
                    ),
                    stacklevel=2,
                )
        return manifest

    def _read_manifest(self) -> tuple[Manifest | None, str | None]:
        try:
            raw = self.store.read(MANIFEST)
        except FileNotFoundError:
            return None, "missing"
        try:
            data = json.loads(raw)
        except ValueError:
            return None, "damaged"
        if not isinstance(data, dict):
            return None, "damaged"
        found = data.get("format")
        if isinstance(found, int) and found > FORMAT:
            raise StateFormatError(f"{self.store.location}/{MANIFEST}", found, FORMAT)
        if not _authentic(data, self.secret):
            return None, "not authentic (written without the secret, or tampered with)"
        try:
            return Manifest.from_dict(data), None
        except (ValueError, TypeError, KeyError):
            return None, "damaged"

    def _replay(self, start: int) -> int:
        try:
            tail = self.store.read_range(EVENTS, start)
        except FileNotFoundError:
            return 0
        damaged = forged = 0
        for line in tail.splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                damaged += 1
                continue
            if not isinstance(event, dict):
                damaged += 1
            elif not _authentic(event, self.secret):
                forged += 1
            else:
                self.fold.apply(event)
        if self.readonly:
            return start + len(tail)
        if damaged or forged:
            problems = [f"{damaged} damaged (e.g. cut short by a power loss)"] if damaged else []
            if forged:
                problems.append(f"{forged} not authentic (written without the secret, or tampered with)")
            warnings.warn(
                ResumableWarning(f"{self.store.location}/{EVENTS}: skipped lines: {'; '.join(problems)}."),
                stacklevel=3,
            )
        if tail and not tail.endswith(b"\n"):
            # a line cut short: end it, so the next event starts on a line of its own
            self.store.append(EVENTS, b"\n", durable=False)
            return start + len(tail) + 1
        return start + len(tail)

    def _reconcile(self) -> int:
        """Add completed slots found in step files; drop completed slots whose file is gone."""
        m = self.manifest
        files = {k[: -len(OUTPUT_SUFFIX)]: k for k in self.store.list() if is_output_file(k)}
        restored: list[tuple[str, str]] = []
        for slot, key in files.items():
            rec = m.steps.get(slot)
            if rec is not None and rec.status == "completed":
                continue
            try:
                header, _ = read_header(self.store, key)
            except (DamagedFileError, OSError):
                continue  # a damaged file is recomputed when its step is called
            if header.get("slot") != slot:
                continue
            created = str(header.get("created_at", ""))
            m.steps[slot] = StepRecord(
                status="completed",
                fingerprint=header.get("fingerprint"),
                finished_at=created,
                bytes=header.get("size"),
            )
            restored.append((created, slot))
        gone = [s for s in m.completed_steps if s not in files]
        for slot in gone:
            m.steps.pop(slot, None)
        known = [s for s in m.completed_steps if s in files]
        m.completed_steps[:] = known + [slot for _, slot in sorted(restored)]
        self.fold = Fold(m)
        return len(restored)

    # recording ---------------------------------------------------------------------------

    def record(self, event: str, *, sync: bool = False, defer: bool = False, **fields: Any) -> None:
        """
        Apply an event to the manifest and append it to the log (with the events pending).

        *sync* events are fsynced before this returns (they must survive a power loss).
        *defer*red events are appended with the next event, or by the background writer
        within :data:`FLUSH_INTERVAL`: many events share one write.
        """
        data = {"t": utcnow(), "event": event, **fields}
        with self.lock:
            self.fold.apply(data)
            self._pending.append(data)
            # Stores where an append costs a round trip (object stores) get events in batches
            # from the background writer, except those that must be on disk before going on.
            if sync or not (defer or self._append_is_slow):
                self._write_pending(durable=sync)
        self._mark_dirty()

    def record_skip(
        self, slot: str, fingerprint: str, size: int, created_at: str | None, file: str | None
    ) -> None:
        """
        Note a skip: written to the log with the next event (skips change no state, and this
        keeps skipping cheap); applied at once only if the manifest had lagged behind.
        """
        skip = (time.time(), slot, fingerprint, size, created_at, file)
        rec = self.manifest.steps.get(slot)
        if rec is None or rec.status != "completed":
            with self.lock:
                self.fold.apply(_skip_event(skip, utcnow()))
            self._mark_dirty()
        self._pending.append(skip)  # list.append is atomic: no lock on this hot path
        if len(self._pending) >= _MAX_PENDING:
            with self.lock:
                self._write_pending(durable=False)

    def _write_pending(self, *, durable: bool) -> None:
        if self._pending:
            lines = []
            pending, self._pending = self._pending, []
            for item in pending:
                data = _skip_event(item, _stamp(item[0])) if isinstance(item, tuple) else item
                lines.append(_dumps(_signed(data, self.secret)) + "\n")
            chunk = "".join(lines).encode()
            try:
                self.store.append(EVENTS, chunk, durable=durable)
            except BaseException:
                self._pending[:0] = pending  # nothing is lost: retried with the next write
                raise
            self._offset += len(chunk)
            self.manifest.events_offset = self._offset

    def _mark_dirty(self) -> None:
        # Only the first change after a flush wakes the writer; later ones ride along.
        if self._writer is not None and not self._dirty:
            with self._wake:
                self._dirty = True
                self._wake.notify()

    # writing the manifest ----------------------------------------------------------------

    def flush(self, *, durable: bool) -> None:
        """Write ``manifest.json`` now (and the pending log lines before it)."""
        with self._flush_lock:
            with self.lock:
                self._write_pending(durable=durable)
                snapshot = self.manifest.to_dict()
            # encoded outside the lock: steps keep running while a large manifest is written
            text = dumps_manifest(_signed(snapshot, self.secret)).encode()
            self.store.write(MANIFEST, [text], durable=durable)
            # A large manifest is rewritten less often: every rewrite also makes the next
            # fsync of a step's output flush it. Readers replay the log, so none sees it stale.
            self._manifest_interval = min(_MAX_INTERVAL, FLUSH_INTERVAL * max(1.0, len(text) / 65536))

    def start_writer(self) -> None:
        """Start the thread that keeps ``manifest.json`` at most a moment behind."""
        self._stopping = False
        self._stop.clear()
        self._writer = threading.Thread(target=self._write_loop, name="resumable-manifest", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        last_manifest = 0.0
        while True:
            with self._wake:
                while not self._dirty and not self._stopping:
                    self._wake.wait()
            # let a burst of events gather into one write (only stopping cuts this short)
            if self._stop.wait(FLUSH_INTERVAL):
                return
            try:
                with self.lock:
                    self._write_pending(durable=False)  # deferred events: cheap, never late
                if time.monotonic() - last_manifest < self._manifest_interval:
                    continue  # still dirty: come back after the next interval
                with self._wake:
                    self._dirty = False
                self.flush(durable=False)
                last_manifest = time.monotonic()
            except (OSError, ResumableError):  # retried later; a lost lease stops the steps
                continue

    def stop_writer(self) -> None:
        """Stop the background writer (the caller flushes afterwards)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            with self._wake:
                self._stopping = True
                self._stop.set()
                self._wake.notify()
            writer.join()


def read_state(store: Store, *, pipeline: str = "", secret: bytes | None = None) -> Manifest:
    """The current manifest of a store, without locking it or writing anything."""
    journal = Journal(store, pipeline=pipeline, secret=secret, readonly=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumableWarning)
        return journal.load()
