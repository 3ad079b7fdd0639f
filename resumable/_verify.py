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
    checked = 0
    journal = Journal(store, pipeline="", secret=secret, readonly=True)
    try:
        _, problem = journal._read_manifest()  # noqa: SLF001 - same check the run uses
    except StateFormatError as exc:
        problem = str(exc)
    if problem not in {None, "missing"}:
        problems.append((f"{store.location}/{MANIFEST}", str(problem)))
    checked += problem != "missing"
    try:
        log = store.read(EVENTS)
    except FileNotFoundError:
        pass
    else:
        checked += 1
        for number, line in enumerate(bytes(log).splitlines(), 1):
            try:
                event = json.loads(line)
            except ValueError:
                problems.append((f"{store.location}/{EVENTS}", f"line {number} is not valid JSON"))
                continue
            if not isinstance(event, dict) or (secret is not None and not _authentic(dict(event), secret)):
                problems.append((f"{store.location}/{EVENTS}", f"line {number} is not authentic"))
    for key in sorted(k for k in store.list() if is_output_file(k)):
        checked += 1
        where = f"{store.location}/{key}"
        try:
            data = store.read(key)
            header, head_len = parse_header(data)
            verify(data, header, head_len, secret)
        except (DamagedFileError, StateFormatError) as exc:
            problems.append((where, str(exc)))
            continue
        except OSError as exc:
            problems.append((where, f"unreadable: {exc}"))
            continue
        if header["slot"] + OUTPUT_SUFFIX != key:
            problems.append((where, f"holds slot {header['slot']!r}, not the one its path names"))
    return checked, problems

