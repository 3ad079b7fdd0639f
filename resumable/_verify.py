"""Checking a state directory for damage (``resumable verify``)."""

from __future__ import annotations

import contextlib

from ._chunklog import LOG, resolve, scan
from ._codec import DamagedFileError, read_verified
from ._history import check_bytes
from ._journal import LINE_PROBLEMS, Journal, parse_event
from ._slots import BATCHES, EVENTS, MANIFEST, OUTPUT_SUFFIX, records_file
from ._stores import Store
from .exceptions import StateDirectoryError, StateFormatError


def find_damage(store: Store, *, secret: bytes | None) -> tuple[int, list[tuple[str, str]]]:
    """
    Check the manifest, the event log, every output file and every batch's chunk log; return
    the number of files checked and ``(location, problem)`` for each problem found.
    """
    problems: list[tuple[str, str]] = []
    checked = _check_manifest(store, secret, problems) + _check_events(store, secret, problems)
    # outputs, and the files behind history and batches: kept versions and row chunks
    for key in sorted(k for k in store.list() if k.endswith(OUTPUT_SUFFIX)):
        checked += 1
        try:
            problem = check_bytes(store.read(key), key, secret)
        except OSError as exc:
            problem = f"unreadable: {exc}"
        if problem is not None:
            problems.append((f"{store.location}/{key}", problem))
    for key in sorted(k for k in store.list(f"{BATCHES}/") if k.rpartition("/")[2] == LOG):
        checked += 1
        problems.extend((f"{store.location}/{key}", p) for p in _check_chunk_log(store, key, secret))
    return checked, problems


def _check_chunk_log(store: Store, key: str, secret: bytes | None) -> list[str]:
    """Damage in a batch's chunk log that no void record covers yet (a record cut short at the end is not)."""
    try:
        data = memoryview(store.read(key))
    except OSError as exc:
        return [f"unreadable: {exc}"]

    def read(start: int, end: int) -> bytes:
        return bytes(data[start:end])

    try:
        found = scan(read, key[: -len(LOG)])
        records, damaged = resolve(found, read, secret)
    except StateFormatError as exc:
        return [str(exc)]
    problems = [f"bytes {d.offset:,} to {d.end:,}: {d.problem}" for d in damaged]
    for record in records:
        try:
            read_verified(read(record.offset, record.end), secret).check_decodes()
        except (DamagedFileError, StateFormatError) as exc:
            start, end = record.header["rows"]  # two ints: the scan checked them
            problems.append(f"the chunk at byte {record.offset:,} (rows {start:,} to {end - 1:,}): {exc}")
    return problems


def _check_manifest(store: Store, secret: bytes | None, problems: list[tuple[str, str]]) -> int:
    journal = Journal(store, pipeline="", secret=secret, readonly=True)
    try:
        manifest, problem = journal._read_manifest()  # noqa: SLF001 - the same check a run makes
    except (StateFormatError, StateDirectoryError) as exc:
        manifest, problem = None, str(exc)
    if problem == "missing":
        return 0
    where = f"{store.location}/{MANIFEST}"
    if manifest is None:
        problems.append((where, str(problem)))
        return 1
    with contextlib.suppress(StateDirectoryError):  # (the check of the log reports it)
        if journal._read_log(manifest.events_offset) is None:  # noqa: SLF001
            offset = f"events_offset {manifest.events_offset} is not the end of a line of {EVENTS}"
            problems.append((where, f"{offset} (the next run rebuilds the manifest from the log)"))
            return 1
    # a keyed step's records are checked when a run first uses them (it rebuilds a damaged
    # file then; a run that only skips leaves it as it is): here, all of them
    for step in manifest.steps.deferred():
        _, damage = journal.records_problem(step)
        if damage is not None:
            mend = "the next run that uses its records rebuilds them from the output files"
            problems.append((f"{store.location}/{records_file(step)}", f"{damage}; {mend}"))
    return 1


_SHOWN_LINES = 10  # damaged log lines listed one by one; the rest are counted


def _check_events(store: Store, secret: bytes | None, problems: list[tuple[str, str]]) -> int:
    try:
        log = bytes(store.read(EVENTS))
    except FileNotFoundError:
        return 0
    except OSError as exc:  # a directory, a FIFO ... in its place
        problems.append((f"{store.location}/{EVENTS}", f"unreadable: {exc.strerror or exc}"))
        return 1
    where = f"{store.location}/{EVENTS}"
    found: list[str] = []
    # A last line without its newline is not damage: it is being written, or a kill cut it
    # short and the next run drops it.
    for number, line in enumerate(log[: log.rfind(b"\n") + 1].split(b"\n")[:-1], 1):
        event = parse_event(line, secret)
        if isinstance(event, str):
            found.append(f"line {number} is {LINE_PROBLEMS[event]}")
    problems.extend((where, p) for p in found[:_SHOWN_LINES])
    if len(found) > _SHOWN_LINES:
        problems.append((where, f"and {len(found) - _SHOWN_LINES} more line(s) that runs skip"))
    return 1
