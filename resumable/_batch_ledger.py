"""
Which rows of a batch are committed, and committing more: the batch's record and chunks
(the layout is in docs/batches.md, "On-disk layout"; where chunks are kept, in
:mod:`resumable._batch_chunks`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

from ._batch_chunks import RECORD, Chunk, ChunkStore
from ._batch_input import Digester, Source
from ._codec import DamagedFileError, encode, frame, read_verified
from ._codec_types import qualified_name
from ._session import RunState
from ._warn import warn
from .exceptions import InputChangedError, ResumableError, SerializationError

log = logging.getLogger("resumable")

# The manifest's batch progress is written at most this often (and at the end).
REPORT_INTERVAL = 0.5


@attrs.frozen
class RowFailure:
    """
    What ``checkpointed_map(..., on_error="record")`` puts in place of a row that raised.

    ``type`` is the exception's class name (qualified with its module unless built in) and
    ``message`` its text; ``index`` is the row's position in the input.
    """

    index: int
    type: str
    message: str

    @classmethod
    def of(cls, index: int, exc: BaseException) -> RowFailure:
        """The failure of row *index*, which raised *exc*."""
        return cls(index, qualified_name(type(exc)), str(exc)[:2000])


@attrs.define(kw_only=True)
class Where:
    """Where a batch lives, what it is called, and (inside a step) whose it is."""

    run: RunState
    directory: str
    label: str  # the manifest's key: the step's slot, or the batch's name
    display: str  # the batch's name in messages
    remedy: str  # how to start over, for InputChangedError
    identity: str | None = None  # the owning step's code or version identity
    args: str | None = None  # the digest of the owning step's arguments
    params: dict[str, str] | None = None  # and a digest per parameter, to tell which ones changed
    items_params: frozenset[str] = frozenset()  # the parameters that are the batch's items themselves


class DamagedChunksError(Exception):
    """Some committed chunks were damaged (and have been deleted): their rows must be redone."""


class Ledger:
    """The commits of one batch call, in memory only (``RESUMABLE_DISABLE=1``)."""

    def __init__(self, *, kind: str, every: int, total: int | None, record_failures: bool = False) -> None:
        self.kind = kind
        self.every = every
        self.total = total
        self.record_failures = record_failures
        self.chunks: list[Chunk] = []  # committed, sorted by start once opened
        self.fresh: dict[int, Any] = {}  # start -> results committed by this call
        self.done = 0
        self.failures = 0
        self.resumed = 0
        self.failure: dict[str, Any] | None = None  # the first row failure seen: a sample for reports
        self.display = "batch"  # its name in messages
        self.durable = False  # whether commits are fsynced (then worth committing from another thread)
        self._lock = threading.Lock()

    def open(self) -> None:
        """Find what earlier runs committed (nothing, in memory)."""

    def restore_state(self, state: dict[str, Any]) -> None:
        """Put the loop state committed with the newest chunk into *state* (none, in memory)."""

    def pieces(self, source: Source) -> Iterator[tuple[int, list[Any]]]:
        """Yield ``(start, rows)`` for the rows still to do, at most :attr:`every` at a time."""
        yield from self._gap(source, source.total)
        self.total = source.pos

    def _gap(self, source: Source, until: int | None) -> Iterator[tuple[int, list[Any]]]:
        every = self.every
        while until is None or source.pos < until:
            n = every if until is None else min(every, until - source.pos)
            start = source.pos
            rows = source.take(n)
            if rows:
                yield start, rows
            if len(rows) < n:
                return

    def commit(self, start: int, rows: list[Any], results: Any) -> None:
        """Keep the results of ``rows`` (input rows ``start`` on)."""
        failures = sum(type(r) is RowFailure for r in results) if self.record_failures else 0
        with self._lock:
            self.fresh[start] = results
            self.done += len(rows)
            self.failures += failures

    def salvage(self, start: int, rows: list[Any], results: Any) -> None:
        """Commit the rows finished before an exception; a failure here is only logged."""
        if rows:
            try:
                self.commit(start, rows, results)
            except Exception as exc:  # noqa: BLE001 - the exception being raised matters more
                log.warning("batch %r: could not commit %d finished rows: %s", self.display, len(rows), exc)
        self.report(force=True)

    def finish(self) -> None:
        """The input is exhausted and every piece committed."""

    def report(self, *, force: bool = False) -> None:
        """Record the batch's progress (nowhere, in memory)."""

    def close(self) -> None:
        """Release what committing holds open (called when the batch call ends, however it ends)."""

    def assemble(self) -> list[Any]:
        """The results of every row, in input order."""
        out: list[Any] = []
        for start in sorted(self.fresh):
            out.extend(self.fresh[start])
        return out


def ledger_for(where: Where | None, *, keep_open: bool = False, **options: Any) -> Ledger:
    """The ledger of a batch (``Ledger`` options): in the store where it has a place, else in memory only."""
    return Ledger(**options) if where is None else StoredLedger(where, keep_open=keep_open, **options)


class StoredLedger(Ledger):
    """
    The committed chunks of one batch in the store, and the commits of one call. With
    *keep_open*, a local chunk log stays open from the first commit to :meth:`close`.
    """

    def __init__(self, where: Where, *, keep_open: bool, **options: Any) -> None:
        super().__init__(**options)
        self.where = where
        self.display = where.display
        self.durable = where.run.durable
        self._stored: dict[str, Any] | None = None  # the batch record as stored
        self._lenient = False  # the owning step's arguments changed: drop what no longer matches
        self._carries_state = False  # a loop state was restored from the committed chunks
        self._reported = 0.0
        self._digester = Digester(where.display)
        self._chunks = ChunkStore(
            where.run, where.directory, label=where.label, display=where.display, keep_open=keep_open
        )

    # opening -----------------------------------------------------------------------------

    def open(self) -> None:
        """List the committed chunks, and drop them if they belong to something else."""
        with self._writing():
            where = self.where
            has_record, chunks = self._chunks.find()
            record = self._read_record() if has_record else None
            stale = self._stale(record, has_record=has_record, chunks=chunks)
            if stale is not None:
                log.info("batch %r: starting over (%s)", where.display, stale)
                self._chunks.drop_all(chunks)
                if has_record:
                    where.run.store.delete(where.directory + RECORD, durable=False)
                chunks, record = [], None
            self._stored = record
            self.chunks = self._without_overlaps(sorted(chunks))
            self.done = self.resumed = sum(c.end - c.start for c in self.chunks)
            self.failures = sum(c.failures for c in self.chunks)
            if self.done:
                self._log_resume()
                self.report(force=True)

    def _read_record(self) -> dict[str, Any] | None:
        where = self.where
        key = where.directory + RECORD
        try:
            record = read_verified(where.run.store.read(key), where.run.secret).decode(allow_pickle=False)
        except (DamagedFileError, FileNotFoundError) as exc:
            warn(
                f"{where.run.store.location}/{key} cannot be used ({exc}); "
                f"batch {where.display!r} starts over."
            )
            return None
        return record if isinstance(record, dict) else None

    def _stale(self, record: dict[str, Any] | None, *, has_record: bool, chunks: list[Chunk]) -> str | None:
        """Why the committed chunks cannot be used at all (None if they can)."""
        where = self.where
        if record is None:
            if has_record:
                return "its batch record was damaged"
            return f"{len(chunks)} chunk(s) without a batch record" if chunks else None
        if record.get("kind") != self.kind:
            old, new = (_API.get(str(k), str(k)) for k in (record.get("kind"), self.kind))
            msg = (
                f"batch {where.display!r} was started by {old}() and is now used by {new}(); "
                "they cannot share rows: give one of them another name=."
            )
            raise ResumableError(msg)
        stale = self._arguments_changed(record, chunks) or self._code_changed(record, chunks)
        if stale is not None:
            return stale
        if self._lenient:
            return None
        old_total = record.get("total")
        if self.total is not None and old_total is not None and old_total != self.total:
            raise InputChangedError(
                where.display, f"it had {old_total:,} rows, now {self.total:,}", where.remedy
            )
        if record.get("every") != self.every and chunks:
            log.info(
                "batch %r: every=%s now (committed chunks have every=%s); committed rows are kept",
                where.display, self.every, record.get("every"),
            )  # fmt: skip
        return None

    def _code_changed(self, record: dict[str, Any], chunks: list[Chunk]) -> str | None:
        """Keep the rows earlier code computed, except chunks with failed rows (none after a new version)."""
        where = self.where
        identity = str(record.get("identity"))
        if identity == str(where.identity):
            return None
        if identity.startswith("version:") and str(where.identity).startswith("version:"):
            return "the step's version changed: its results are declared different"
        failed = [c for c in chunks if c.failures]
        if failed:
            self._chunks.drop(failed)
            chunks[:] = [c for c in chunks if not c.failures]
        redo = f"; the {_rows(failed)} row(s) of chunks with failed rows are done again" if failed else ""
        if chunks:
            warn(
                f"batch {where.display!r}: resuming with {_rows(chunks)} row(s) that earlier code "
                f"of the step computed (its code or version changed since){redo}. To compute them "
                f"again with the current code: resumable reset {where.label} "
                f"(or pipe.reset({where.label!r}))."
            )
        elif failed:
            log.info("batch %r: its code changed%s", where.display, redo)
        return None

    def _arguments_changed(self, record: dict[str, Any], chunks: list[Chunk]) -> str | None:
        """Why rows made with the step's other arguments cannot be used (None: only the items changed)."""
        where = self.where
        if record.get("args") == where.args:
            return None
        changed = _changed(record.get("params"), where.params)
        if changed is None or not changed <= where.items_params:
            what = f" ({', '.join(sorted(changed))})" if changed else ""
            if chunks:
                warn(
                    f"batch {where.display!r}: the step's arguments changed{what}, so its "
                    f"{_rows(chunks)} committed row(s), computed with the old ones, are not reused."
                )
            return f"the step's arguments changed{what}"
        self._lenient = True  # only the items changed: pieces() keeps the chunks whose input is unchanged
        log.info(
            "batch %r: its items changed; committed rows whose input is unchanged are kept", where.display
        )
        return None

    def _without_overlaps(self, chunks: list[Chunk]) -> list[Chunk]:
        kept: list[Chunk] = []
        end = 0
        for chunk in chunks:
            if chunk.start < end or chunk.end <= chunk.start:
                warn(
                    f"batch {self.display!r}: chunk {chunk.label} overlaps another one; "
                    f"it is dropped and its rows are done again."
                )
                self._chunks.drop([chunk])
                continue
            kept.append(chunk)
            end = chunk.end
        return kept

    def _log_resume(self) -> None:
        where = self.where
        first = 0
        for chunk in self.chunks:
            if chunk.start != first:
                break
            first = chunk.end
        if self.total is not None and first >= self.total:
            log.info("batch %r: all %s rows were already done", where.display, f"{self.total:,}")
            return
        of = f" of {self.total:,}" if self.total is not None else ""
        extra = f" ({self.done:,} rows done)" if self.done != first else ""
        log.info("resuming batch %r at row %s%s%s", where.display, f"{first:,}", of, extra)

    # walking the input -------------------------------------------------------------------

    def pieces(self, source: Source) -> Iterator[tuple[int, list[Any]]]:
        """
        Yield ``(start, rows)`` for the rows still to do, checking that the committed rows'
        input has not changed (raising InputChangedError, unless only a step's items did).
        """
        where, committed = self.where, list(self.chunks)
        limit = source.total
        if limit is None and not self._lenient and self._stored is not None:
            limit = self._stored.get("total")
        for i, chunk in enumerate(committed):
            yield from self._gap(source, chunk.start)
            rows = source.take(chunk.end - chunk.start) if source.pos == chunk.start else []
            if len(rows) == chunk.end - chunk.start and self._digester.digest(rows) == chunk.digest:
                continue
            short = len(rows) < chunk.end - chunk.start
            if not self._lenient:
                detail = (
                    f"it now ends after {source.pos:,} rows, but {chunk.rows} were committed"
                    if short
                    else f"{chunk.rows} differ from those committed"
                )
                raise InputChangedError(where.display, detail, where.remedy)
            self._drop(committed[i:] if short else [chunk])
            yield from ((chunk.start + j, rows[j : j + self.every]) for j in range(0, len(rows), self.every))
            if short:
                break
        yield from self._gap(source, limit)
        if limit is not None and not self._lenient:
            more = source.pos == limit and source.total is None and source.take(1)
            if source.pos != limit or more:
                detail = f"it had {limit:,} rows, now {'more' if more else f'{source.pos:,}'}"
                raise InputChangedError(where.display, detail, where.remedy)
        self.total = source.pos

    # committing --------------------------------------------------------------------------

    def commit(self, start: int, rows: list[Any], results: Any) -> None:
        """Store the results of ``rows`` (input rows ``start`` on) as one new chunk."""
        size = len(rows)
        where = self.where
        failures = sum(type(r) is RowFailure for r in results) if self.record_failures else 0
        run = where.run
        digest = self._digester.digest(rows)
        end = start + size
        try:
            encoded = encode(results, allow_pickle=run.allow_pickle)
        except SerializationError:  # again, for a message naming the rows
            what = f"the {_WHAT[self.kind]} of batch {where.display!r}, rows {start:,} to {end - 1:,}"
            encode(results, allow_pickle=run.allow_pickle, what=what)
            raise
        meta = {
            "slot": where.label,
            "batch": where.directory,
            "rows": [start, end],
            "digest": digest,
            "failures": failures,
        }
        framed = frame(encoded, meta, secret=run.secret, dated=False)
        if failures and self.failure is None:
            first = next(r for r in results if type(r) is RowFailure)
            self.failure = {"row": first.index, "type": first.type, "message": first.message[:300]}
        with self._lock, self._writing():
            if self._stored is None:
                self._save_record()  # before the first chunk: chunks never exist without it
            chunk = self._chunks.add(start, end, failures, digest, framed)
            self.chunks.append(chunk)
            self.fresh[start] = results
            self.done += size
            self.failures += failures
            self.report()

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Hold the run open while writing; ResumableError once it has begun to close."""
        return self.where.run.writing(f"batch {self.display!r}")

    def salvage(self, start: int, rows: list[Any], results: Any) -> None:
        """Commit the rows finished before an exception; a failure here is only logged."""
        if self.where.run.closing:  # a generator closed late (at interpreter exit) writes nothing
            if rows:
                log.warning(
                    "batch %r: the run was already closed; %d finished rows are not committed",
                    self.display, len(rows),
                )  # fmt: skip
            return
        super().salvage(start, rows, results)

    def finish(self) -> None:
        """The input is exhausted and every piece committed: update the record and the manifest."""
        wanted = self._record()
        with self._lock, self._writing():
            if self._stored is not None and self._stored != wanted and self.done:
                self._save_record()
            self.report(force=True)
        if self.failures:
            log.info(
                "batch %r: %s of %s rows failed (RowFailure values in the result)",
                self.display, f"{self.failures:,}", f"{self.total:,}",
            )  # fmt: skip

    def _record(self) -> dict[str, Any]:
        where = self.where
        return {
            "kind": self.kind,
            "every": self.every,
            "total": self.total,  # None until an iterator's end is reached
            "identity": where.identity,
            "args": where.args,
            "params": where.params,
        }

    def _save_record(self) -> None:
        where = self.where
        record = self._record()
        run = where.run
        encoded = encode(record, allow_pickle=False, what="a batch record")
        framed = frame(encoded, {"slot": where.label, "batch": where.directory}, secret=run.secret)
        run.store.write(where.directory + RECORD, framed.chunks(), durable=run.durable)
        self._stored = record

    def report(self, *, force: bool = False) -> None:
        """Record the batch's progress in the manifest (at most every :data:`REPORT_INTERVAL`)."""
        where = self.where
        now = time.monotonic()
        if (not force and now - self._reported < REPORT_INTERVAL) or where.run.closing:
            return
        self._reported = now
        progress = {"done": self.done, "every": self.every, "total": self.total, "failures": self.failures}
        extra: dict[str, Any] = {"resumed": self.resumed}  # and a sample failure: for `resumable report`
        if self.failure is not None:
            extra["failure"] = self.failure
        with self._writing():
            where.run.journal.record("batch", batch=where.label, progress=progress, **extra)

    def close(self) -> None:
        self._chunks.close()

    def _drop(self, chunks: list[Chunk]) -> None:
        if self._carries_state and chunks:
            warn(
                f"batch {self.display!r}: {_rows(chunks)} committed row(s) are done again because "
                "its items changed, but the loop state restored already counts them."
            )
        with self._lock, self._writing():
            self._chunks.drop(chunks)
            dropped = set(chunks)
            self.chunks = [c for c in self.chunks if c not in dropped]
            self.done -= sum(c.end - c.start for c in chunks)
            self.failures -= sum(c.failures for c in chunks)

    # assembling --------------------------------------------------------------------------

    def assemble(self) -> list[Any]:
        """The results of every row, in input order (DamagedChunksError: damaged chunks were dropped)."""
        earlier = [c for c in self.chunks if c.start not in self.fresh]
        stored: dict[Chunk, list[Any]] = {}
        damaged: list[str] = []
        allow_pickle = self.where.run.allow_pickle
        for chunk in earlier:
            try:
                stored[chunk] = _results(self._chunks.read(chunk).decode(allow_pickle=allow_pickle), chunk)
            except DamagedFileError as exc:
                damaged.append(f"{chunk.label} ({exc})")
        if damaged:
            self._drop([c for c in earlier if c not in stored])
            where = self.where
            warn(
                f"batch {where.display!r}: damaged chunk(s) in {where.run.store.location}/"
                f"{where.directory}: {'; '.join(damaged)}. Their rows are done again."
            )
            raise DamagedChunksError(where.display)
        out: list[Any] = []
        for chunk in sorted(self.chunks):
            results = self.fresh.get(chunk.start)
            out.extend(stored[chunk] if results is None else results)
        return out

    def restore_state(self, state: dict[str, Any]) -> None:
        if not self.chunks:
            return
        self._carries_state = True
        newest = max(self.chunks, key=lambda c: c.end)
        try:
            value = self._chunks.read(newest).decode(allow_pickle=self.where.run.allow_pickle)
        except (DamagedFileError, FileNotFoundError) as exc:
            value, why = None, f"{newest.label} cannot be used ({exc})"
        else:
            why = f"{newest.label} holds no loop state"
        if type(value) is not dict:
            warn(
                f"batch {self.display!r}: its loop state is not restored: {why}; "
                f"state= starts from the value passed in."
            )
            return
        state.clear()
        state.update(value)


_API = {"map": "checkpointed_map", "each": "checkpointed"}
_WHAT = {"map": "results", "each": "loop state"}  # what a chunk holds


def _changed(old: object, new: dict[str, str] | None) -> set[str] | None:
    """The parameters whose digests differ (None if the record has none)."""
    if not isinstance(old, dict) or new is None:
        return None
    return {name for name in old.keys() | new.keys() if old.get(name) != new.get(name)}


def _results(value: Any, chunk: Chunk) -> list[Any]:
    if not isinstance(value, list) or len(value) != chunk.end - chunk.start:
        msg = "it does not hold one result per row"
        raise DamagedFileError(msg)
    return value


def _rows(chunks: list[Chunk]) -> str:
    return f"{sum(c.end - c.start for c in chunks):,}"
