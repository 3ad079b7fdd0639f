"""
Where a batch's committed chunks are: records of one chunk log (:mod:`resumable._chunklog`)
on stores that append cheaply, else an object per chunk, named by its rows. Both are read on
every store, so a state copied between kinds of stores resumes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, NamedTuple

from ._chunklog import LOG, Record, resolve, scan
from ._codec import DamagedFileError, Framed, Verified, encode, frame, read_verified
from ._stores._local import AppendFile, LocalStore
from ._warn import warn

if TYPE_CHECKING:
    from ._session import RunState

log = logging.getLogger("resumable")

RECORD = "batch.msgpack"
_CHUNK = re.compile(r"(\d{12})-(\d{12})-(\d+)-(f[0-9a-f]{24})\.msgpack")


class Chunk(NamedTuple):
    """Committed rows ``start`` to ``end`` (exclusive), and where their results are."""

    start: int
    end: int
    failures: int
    digest: str
    offset: int = -1  # where its record starts in the chunk log; -1: a file of its own
    length: int = 0  # the record's bytes

    @property
    def file_name(self) -> str:
        return f"{self.start:012d}-{self.end:012d}-{self.failures}-{self.digest}.msgpack"

    @property
    def label(self) -> str:
        """The chunk in messages: its file, or its place in the log."""
        return self.file_name if self.offset < 0 else f"{LOG} at byte {self.offset:,}"

    @property
    def rows(self) -> str:
        """``rows 100 to 199`` style, for messages."""
        return f"rows {self.start:,} to {self.end - 1:,}"


class ChunkStore:
    """The committed chunks of the batch in *directory* (not thread-safe: its ledger serializes calls)."""

    def __init__(self, run: RunState, directory: str, *, label: str, display: str, keep_open: bool) -> None:
        self.run = run
        self.directory = directory
        self.label = label  # the slot (or name) written in each record's header
        self.display = display
        self.log_key = directory + LOG
        self._end = 0  # where the log's whole records end: the next record goes there
        self._torn = False  # an append failed: the log may end with part of a record
        self.keep_open = keep_open  # keep a local log open from its first append to close()
        self._file: AppendFile | None = None

    def find(self) -> tuple[bool, list[Chunk]]:
        """Whether the batch record exists, and the committed chunks (a torn log tail is cut)."""
        has_record = has_log = False
        chunks: list[Chunk] = []
        prefix = self.directory
        for key in self.run.store.list(prefix):
            name = key[len(prefix) :]
            if name == RECORD:
                has_record = True
            elif name == LOG:
                has_log = True
            elif (m := _CHUNK.fullmatch(name)) is not None:
                chunks.append(Chunk(int(m[1]), int(m[2]), int(m[3]), m[4]))
        if has_log:
            chunks += self._scan()
        return has_record, chunks

    def _read_log(self, start: int, end: int) -> bytes | bytearray:
        return self.run.store.read(self.log_key, start, end)

    def _scan(self) -> list[Chunk]:
        found = scan(self._read_log, self.directory)
        records, damaged = resolve(found, self._read_log, self.run.secret)
        self._end = found.end
        if found.tail:
            self._cut(found.end)
            log.info(
                "batch %r: cut the last %d bytes of %s/%s, a record cut short by a crash; "
                "its rows are done again",
                self.display, found.tail, self.run.store.location, self.log_key,
            )  # fmt: skip
        if damaged:
            spans = "; ".join(f"bytes {d.offset:,} to {d.end:,}: {d.problem}" for d in damaged[:5])
            if len(damaged) > 5:
                spans += f"; and {len(damaged) - 5} more"
            warn(
                f"batch {self.display!r}: damaged records in {self.run.store.location}/{self.log_key} "
                f"({spans}). They are skipped, and the rows they held are done again."
            )
            self._void([d.offset for d in damaged])
        return [_chunk_of(r) for r in records]

    # changing ----------------------------------------------------------------------------

    def add(self, start: int, end: int, failures: int, digest: str, framed: Framed) -> Chunk:
        run = self.run
        if run.store.slow_appends:
            chunk = Chunk(start, end, failures, digest)
            run.store.write(self.directory + chunk.file_name, framed.chunks(), durable=run.durable)
            return chunk
        data = b"".join(framed.chunks())
        return Chunk(start, end, failures, digest, self._append(data, durable=run.durable), len(data))

    def _append(self, data: bytes, *, durable: bool) -> int:
        """Append one record to the log; return where it starts."""
        store = self.run.store
        if self._torn:
            self._cut(self._end)
            self._torn = False
        try:
            if isinstance(store, LocalStore) and self.keep_open:
                if self._file is None:
                    self._file = store.open_append(self.log_key, durable=durable)
                self._file.append(data, durable=durable)
            else:
                store.append(self.log_key, data, durable=durable)
        except BaseException:
            self._torn = True  # the append may have written part of the record
            raise
        offset = self._end
        self._end += len(data)
        return offset

    def _cut(self, size: int) -> None:
        """Keep only the log's first *size* bytes."""
        self.close()  # the log is replaced
        store = self.run.store
        store.write(self.log_key, [store.read(self.log_key, 0, size)], durable=self.run.durable)

    def _void(self, offsets: list[int]) -> None:
        """Append a void record: the records (or damaged bytes) at *offsets* no longer count."""
        meta = {"slot": self.label, "batch": self.directory, "void": sorted(offsets)}
        framed = frame(encode(None, allow_pickle=False), meta, secret=self.run.secret, dated=False)
        # not fsynced: the next durable append syncs it, and a lost one is found again next run
        self._append(b"".join(framed.chunks()), durable=False)

    def drop(self, chunks: Iterable[Chunk]) -> None:
        offsets = []
        for chunk in chunks:
            if chunk.offset < 0:
                self.run.store.delete(self.directory + chunk.file_name, durable=False)
            else:
                offsets.append(chunk.offset)
        if offsets:
            self._void(offsets)

    def drop_all(self, chunks: Iterable[Chunk]) -> None:
        self.drop(c for c in chunks if c.offset < 0)
        self.close()
        self.run.store.delete(self.log_key, durable=False)
        self._end, self._torn = 0, False

    def close(self) -> None:
        """Close the log if it is kept open."""
        file, self._file = self._file, None
        if file is not None:
            file.close()

    # reading -----------------------------------------------------------------------------

    def read(self, chunk: Chunk) -> Verified:
        """The chunk's verified contents (DamagedFileError: damaged, forged, or other rows)."""
        if chunk.offset < 0:
            data = self.run.store.read(self.directory + chunk.file_name)
        else:
            data = self._read_log(chunk.offset, chunk.offset + chunk.length)
            if len(data) != chunk.length:
                msg = "the chunk log ends inside it"
                raise DamagedFileError(msg)
        # a writable buffer, as from a file: arrays decoded from it are writable
        checked = read_verified(data if type(data) is bytearray else bytearray(data), self.run.secret)
        if (
            checked.header.get("rows") != [chunk.start, chunk.end]
            or checked.header.get("digest") != chunk.digest
        ):
            msg = (
                "it holds other rows than its name says"
                if chunk.offset < 0
                else "it holds other rows than the log said"
            )
            raise DamagedFileError(msg)
        return checked


def _chunk_of(record: Record) -> Chunk:
    header = record.header
    start, end = header["rows"]
    return Chunk(start, end, header["failures"], header["digest"], record.offset, record.length)
