"""
Reading a batch directory's committed chunks the way any msgpack reader could, without the
library's own code (not a test module): the chunk log is a stream of msgpack objects, a
header then a value per record; chunk files are named by their rows.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, NamedTuple

import msgpack

CHUNK = re.compile(r"(\d{12})-(\d{12})-(\d+)-[mf][0-9a-f]{24}\.msgpack")
LOG = "chunks.log"


class LogRecord(NamedTuple):
    offset: int
    length: int
    header: dict[str, Any]
    value: Any


def log_records(path: Path) -> list[LogRecord]:
    """Every whole record of a chunk log, voids included, up to the first one that does not parse."""
    if not path.is_file():
        return []
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(path.read_bytes())
    out = []
    while True:
        offset = unpacker.tell()
        try:
            header = unpacker.unpack()
            value = unpacker.unpack()  # no out-of-band array buffers in these tests
        except (msgpack.OutOfData, ValueError, TypeError):  # TypeError: garbage with a list as a map key
            return out
        if not isinstance(header, dict):
            return out
        out.append(LogRecord(offset, unpacker.tell() - offset, header, value))


def live_records(path: Path) -> list[LogRecord]:
    """The chunk records of a log that no void record cancels."""
    records = log_records(path)
    voided = {o for r in records for o in r.header.get("void", ())}
    return [r for r in records if "rows" in r.header and r.offset not in voided]


def committed(directory: Path) -> list[tuple[int, int, int]]:
    """(start, end, failures) of the chunks directly in a batch directory (files and log), in order."""
    if not directory.is_dir():
        return []
    found = [CHUNK.fullmatch(p.name) for p in directory.iterdir() if p.is_file()]
    out = [(int(m[1]), int(m[2]), int(m[3])) for m in found if m is not None]
    out += [(*r.header["rows"], r.header["failures"]) for r in live_records(directory / LOG)]
    return sorted(out)
