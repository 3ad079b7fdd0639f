"""
A batch's chunk log: one record after another, each framed like a file of its own
(:func:`resumable._codec.frame`), so every record is checked on its own. A record's header
holds either a chunk (``rows``, ``digest``, ``failures``; its value: the results) or a void
(``void``: offsets of earlier records or damaged bytes that no longer count).

:func:`scan` reads headers only and says where the whole records end (what follows is a
torn tail, to be cut); a damaged header is stepped over by looking for the next one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs

from ._codec import DamagedFileError, parse_header, read_verified

LOG = "chunks.log"
DIGEST = re.compile(r"f[0-9a-f]{24}")
_SIGNATURE = b"\xa6format"  # the first key of every header, after a fixmap byte
_BLOCK = 1 << 20  # bytes read at once while scanning
_HEAD_WINDOW = 1 << 16  # bytes a header is looked for in first (more if it needs more)
_HEAD_MAX = 64 * 1024 * 1024

ReadRange = Callable[[int, int], bytes | bytearray]


class Record(NamedTuple):
    """A record whose header is whole and valid: where it is and what its header says."""

    offset: int
    length: int
    header: dict[str, Any]

    @property
    def end(self) -> int:
        return self.offset + self.length


class Damage(NamedTuple):
    """Bytes of the log that are no record (between records, or a record that fails its checks)."""

    offset: int
    end: int
    problem: str


@attrs.define
class Scan:
    """What :func:`scan` found: records, damage between them, and where the whole records end."""

    records: list[Record] = attrs.Factory(list)
    damaged: list[Damage] = attrs.Factory(list)
    end: int = 0  # the end of the last record
    tail: int = 0  # the bytes after it: a record cut short, or damage with no record after it


class _Reader:
    """Reads a log in blocks through *read_range*, learning its size on the way (from a short read)."""

    def __init__(self, read_range: ReadRange) -> None:
        self._read = read_range
        self._buf: bytes | bytearray = b""
        self._start = 0
        self.size: int | None = None

    def view(self, pos: int, n: int) -> memoryview:
        """*n* bytes from *pos*, fewer only at the end of the log."""
        start, buf = self._start, self._buf
        have = start + len(buf)
        if not (start <= pos and (pos + n <= have or have == self.size)):
            want = max(n, _BLOCK)
            buf = self._read(pos, pos + want)
            if len(buf) < want:
                self.size = pos + len(buf)
            self._buf = buf
            self._start = start = pos
        return memoryview(buf)[pos - start : pos - start + n]

    def find(self, pattern: bytes, pos: int) -> int:
        """The offset of the next *pattern* at or after *pos*, or -1."""
        while True:
            n = len(self.view(pos, _BLOCK))  # makes the buffer hold bytes pos on
            buf, start = self._buf, self._start
            found = buf.find(pattern, pos - start, pos - start + n)
            if found >= 0:
                return start + found
            if n < _BLOCK:
                return -1
            pos += n - len(pattern) + 1


def scan(read_range: ReadRange, batch: str) -> Scan:
    """
    Read the headers of a chunk log (of the batch in directory *batch*) from its start.

    Raises:
        StateFormatError: a record was written by a newer version.
    """
    reader = _Reader(read_range)
    out = Scan()
    pos = 0
    while True:
        found = _record_at(reader, pos, batch)
        if isinstance(found, Record):
            out.records.append(found)
            pos = out.end = found.end
            continue
        if found is None:
            break  # the end of the log
        after = _next_record(reader, pos, batch)
        if after is None:
            break  # nothing whole after it: a torn tail
        out.damaged.append(Damage(pos, after, found))
        pos = after
    out.tail = (reader.size or 0) - out.end  # a scan stops only after a short read, which sets the size
    return out


def _record_at(reader: _Reader, pos: int, batch: str) -> Record | str | None:
    """The record at *pos*; None at the end of the log; else what is wrong there."""
    window = _HEAD_WINDOW
    while True:
        view = reader.view(pos, window)
        if not view:
            return None
        try:
            header, head_len = parse_header(view)
        except DamagedFileError as exc:
            if str(exc) == "truncated header" and len(view) == window and window < _HEAD_MAX:
                window *= 4  # a long header (many array buffers): look further
                continue
            return str(exc)
        break
    del view
    if header["size"] < 0:
        return "a record of negative size"
    length = head_len + header["size"]
    if not reader.view(pos + length - 1, 1):
        return "a record cut short"
    problem = record_problem(header, batch)
    if problem is not None:
        return problem
    return Record(pos, length, header)


def _next_record(reader: _Reader, damaged: int, batch: str) -> int | None:
    """Where the first whole record after the damaged one at *damaged* starts, if any."""
    search = damaged + 2  # a header at offset p has its signature at p + 1
    while (at := reader.find(_SIGNATURE, search)) >= 0:
        candidate = at - 1
        if reader.view(candidate, 1)[0] & 0xF0 == 0x80 and isinstance(
            _record_at(reader, candidate, batch), Record
        ):
            return candidate
        search = at + 1
    return None


def record_problem(header: dict[str, Any], batch: str) -> str | None:
    """What makes *header* no record of this batch's log (None if it is one)."""
    if header.get("batch") != batch:
        return "a record of another batch"
    if "void" in header:
        offsets = header["void"]
        if type(offsets) is list and all(type(o) is int and o >= 0 for o in offsets):
            return None
        return "a void record with bad offsets"
    rows, digest, failures = header.get("rows"), header.get("digest"), header.get("failures")
    if not (
        type(rows) is list
        and len(rows) == 2
        and all(type(r) is int for r in rows)
        and 0 <= rows[0] < rows[1]
        and type(digest) is str
        and DIGEST.fullmatch(digest)
        and type(failures) is int
        and 0 <= failures <= rows[1] - rows[0]
    ):
        return "not a chunk record (bad rows, digest or failures)"
    return None


def resolve(found: Scan, read_range: ReadRange, secret: bytes | None) -> tuple[list[Record], list[Damage]]:
    """
    The chunk records that count (not voided by a later void record), and the damage no
    void record covers yet. Void records are read whole and checked (small).
    """
    voided: set[int] = set()
    damaged = list(found.damaged)
    for record in found.records:
        if "void" not in record.header:
            continue
        try:
            read_verified(read_range(record.offset, record.end), secret)
        except DamagedFileError as exc:
            damaged.append(Damage(record.offset, record.end, f"a void record: {exc}"))
            continue
        voided.update(o for o in record.header["void"] if o < record.offset)
    chunks = [r for r in found.records if "void" not in r.header and r.offset not in voided]
    return chunks, sorted(d for d in damaged if d.offset not in voided)
