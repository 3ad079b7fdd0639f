"""Checking a state directory for damage (``resumable verify``)."""

from __future__ import annotations

import json

from ._codec import DamagedFileError, parse_header, verify
from ._journal import Journal, _authentic
from ._slots import EVENTS, MANIFEST, OUTPUT_SUFFIX, is_output_file
from ._stores import Store
from .exceptions import StateFormatError


def find_damage(store: Store, *, secret: bytes | None) -> tuple[int, list[tuple[str, str]]]:
    """
    Check the manifest, the event log and every output file.

    Returns the number of files checked and ``(location, problem)`` for each damaged one.
    """
    problems: list[tuple[str, str]] = []
    checked = _check_manifest(store, secret, problems) + _check_events(store, secret, problems)
    # outputs, and the files behind history and batches: kept versions and row chunks
    for key in sorted(k for k in store.list() if k.endswith(OUTPUT_SUFFIX) and not _temporary(k)):
        checked += 1
        problem = _check_output(store, key, secret)
        if problem is not None:
            problems.append((f"{store.location}/{key}", problem))
    return checked, problems


def _check_manifest(store: Store, secret: bytes | None, problems: list[tuple[str, str]]) -> int:
    journal = Journal(store, pipeline="", secret=secret, readonly=True)
    try:
        _, problem = journal._read_manifest()  # noqa: SLF001 - the same check a run makes
    except StateFormatError as exc:
        problem = str(exc)
    if problem == "missing":
        return 0
    if problem is not None:
        problems.append((f"{store.location}/{MANIFEST}", problem))
    return 1


def _check_events(store: Store, secret: bytes | None, problems: list[tuple[str, str]]) -> int:
    try:
        log = store.read(EVENTS)
    except FileNotFoundError:
        return 0
    where = f"{store.location}/{EVENTS}"
    for number, line in enumerate(bytes(log).splitlines(), 1):
        try:
            event = json.loads(line)
        except ValueError:
            problems.append((where, f"line {number} is not valid JSON"))
            continue
        if not isinstance(event, dict) or not _authentic(event, secret):
            problems.append((where, f"line {number} is not authentic"))
    return 1


def _check_output(store: Store, key: str, secret: bytes | None) -> str | None:
    try:
        data = store.read(key)
        header, head_len = parse_header(data)
        verify(data, header, head_len, secret)
    except (DamagedFileError, StateFormatError) as exc:
        return str(exc)
    except OSError as exc:
        return f"unreadable: {exc}"
    if is_output_file(key) and header["slot"] + OUTPUT_SUFFIX != key:
        return f"holds slot {header['slot']!r}, not the one its path names"
    return None


def _temporary(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return name.startswith(".") and name.endswith(".tmp")
