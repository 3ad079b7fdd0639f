"""
``resumable diff A B``: where two sessions (or checkpoints) diverged, slot by slot, and why.
Reads only. Each completed slot's output header says what made it (fingerprint, code
identity, the digest of each argument, the code record): two slots are the same, differ by
their inputs, by their code, or exist on one side only.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import zip_longest
from typing import Any

import attrs

from . import _sessions
from ._codec import DamagedFileError
from ._history import file_version, find, object_key, replay
from ._journal import read_header, read_state
from ._slots import slot_file
from ._stores import Store
from ._why import Change, code_diff, render_change
from .exceptions import StateFormatError, UsageError


@attrs.frozen
class Side:
    """One side of a diff: its completed slots, in completion order, and where their outputs are."""

    name: str
    store: Store
    files: dict[str, str]
    """slot -> the key of its output file at that point."""


@attrs.frozen
class SlotDiff:
    """How one slot compares: ``same``, ``inputs changed``, ``code changed``, ``only in A``/``B``."""

    slot: str
    verdict: str
    detail: str = ""
    changes: list[Change] = attrs.field(factory=list)


def side_now(name: str, store: Store, secret: bytes | None) -> Side:
    """A session's current state."""
    manifest = read_state(store, secret=secret, records=False)
    return Side(name, store, {s: slot_file(s) for s in manifest.completed_steps})


def side_at(name: str, store: Store, secret: bytes | None, target: int | str) -> Side:
    """A session's state at checkpoint *target*."""
    number = find(replay(store, secret), target)
    if number == 0:
        return Side(name, store, {})
    point = replay(store, secret, restore=number)[-1]
    files: dict[str, str] = {}
    steps = point.steps or {}
    for slot in point.checkpoint.completed_steps:
        rec = steps.get(slot)
        version = rec.file if rec is not None else None
        if version is not None and file_version(store, slot) != version:  # replaced since: kept
            files[slot] = object_key(version)
        else:
            files[slot] = slot_file(slot)
    return Side(name, store, files)


def side(root: Store, text: str, secret: bytes | None) -> Side:
    """
    The side *text* names in *root*: a session id ('.': the default session) for its current
    state, or ``SESSION@CHECKPOINT``. A :class:`UsageError` if there is no such session.
    """
    sid, at = text, None
    if "@" in text and not _sessions.exists(root, text):
        sid, _, at = text.rpartition("@")
    default = sid in {".", ""}
    if not default and not _sessions.exists(root, sid):
        msg = f"no session {sid!r} in {root.location} (see `resumable sessions`; '.' is the default session)"
        raise UsageError(msg)
    store = root if default else _sessions.session_store(root, sid)
    return side_now(text, store, secret) if at is None else side_at(text, store, secret, at)


def header(side: Side, slot: str) -> dict[str, Any] | None:
    """The output header of *slot* on *side* (None if it has no readable output there)."""
    key = side.files.get(slot)
    return None if key is None else _header(side.store, key)


def _header(store: Store, key: str) -> dict[str, Any] | None:
    try:
        header, _ = read_header(store, key)
    except (FileNotFoundError, DamagedFileError, StateFormatError):
        return None
    return header


def compare(a: Side, b: Side) -> tuple[list[SlotDiff], str | None]:
    """Every slot of either side compared, in *a*'s completion order then *b*'s; and the first divergence."""
    found = {slot: _slot(slot, a, b) for slot in {**a.files, **b.files}}
    first = next(
        (x or y for x, y in zip_longest(a.files, b.files) if x != y or found[x].verdict != "same"), None
    )
    return list(found.values()), first


def _slot(slot: str, a: Side, b: Side) -> SlotDiff:
    if slot not in a.files or slot not in b.files:
        return SlotDiff(slot, f"only in {a.name if slot in a.files else b.name}")
    ha, hb = _header(a.store, a.files[slot]), _header(b.store, b.files[slot])
    if ha is None or hb is None:
        missing = a.name if ha is None else b.name
        return SlotDiff(slot, "unreadable", f"its output in {missing} is missing or damaged")
    if ha.get("fingerprint") == hb.get("fingerprint"):
        return SlotDiff(slot, "same")
    if ha.get("identity") == hb.get("identity"):
        pa, pb = _params(ha), _params(hb)
        names = sorted(n for n in pa.keys() | pb.keys() if pa.get(n) != pb.get(n))
        return SlotDiff(slot, "inputs changed", ", ".join(names), [Change("parameter", n) for n in names])
    changes = code_diff(a.store, ha.get("code"), hb.get("code"))  # sessions share their code records
    if changes:
        detail = ", ".join(f"{c.kind} {c.name}" if c.kind != "code" else "its own code" for c in changes)
        return SlotDiff(slot, "code changed", detail, changes)
    return SlotDiff(slot, "code changed", "its version, or code with no recorded difference to show")


def _params(header: Mapping[str, Any]) -> dict[str, Any]:
    params = header.get("params")
    return dict(params) if isinstance(params, dict) else {}


def render(a: Side, b: Side, diffs: list[SlotDiff], first: str | None) -> str:
    """The text ``resumable diff`` prints."""
    out = [f"diff {a.name} {b.name}: {len(diffs)} slot(s)"]
    same = sum(d.verdict == "same" for d in diffs)
    for d in diffs:
        if d.verdict == "same":
            continue
        out.append(f"{d.slot}: {d.verdict}" + (f" ({d.detail})" if d.detail else ""))
        for c in d.changes:
            out.extend(render_change(c))
    out.append(f"{same} slot(s) the same")
    out.append(f"first divergence (completion order): {first}" if first else "no divergence")
    return "\n".join(out)


def as_dict(a: Side, b: Side, diffs: list[SlotDiff], first: str | None) -> dict[str, Any]:
    """Plain data (``--json``)."""
    return {"a": a.name, "b": b.name, "first_divergence": first, "slots": [attrs.asdict(d) for d in diffs]}
