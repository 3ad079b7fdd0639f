"""
Why a step ran or was skipped: ``resumable why STEP`` and ``Pipeline.why``.

When a step starts running, the code it runs is recorded once per code digest in
``.resumable/code/<digest>.json``: the digest of each component (the function, its
helpers, the steps and values it uses), their normalized source and a short repr of each
value. The ``step_started`` event says why it ran and which code it replaces (``was``), so
the explanation of a rerun is a diff between two such records, whatever happened since.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import re
from typing import TYPE_CHECKING, Any

import attrs

from ._codehash import short_repr
from ._manifest import skip_fields
from ._slots import slot_id
from ._stores._prefix import root_of

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from ._plan import Identity
    from ._stores import Store

log = logging.getLogger("resumable")

CODE_DIR = ".resumable/code/"
_DIGEST = re.compile(r"[0-9a-f]{32}")


def record_code(store: Store, step: str, identity: Identity) -> bool:
    """
    Keep the components of the code a step is about to run, once per code digest, in the
    store its sessions share; False if they could not be written.
    """
    store = root_of(store)
    key = f"{CODE_DIR}{identity.code}.json"
    with contextlib.suppress(OSError):  # already there
        store.read(key, 0, 0)
        return True
    record = {
        "step": step,
        "components": identity.components,
        "sources": identity.sources,
        "values": {label: short_repr(value) for label, value in identity.values().items()},
        "left_out": identity.left_out,
    }
    data = json.dumps(record, indent=1, sort_keys=True, ensure_ascii=False).encode()
    try:
        store.write(key, [data], durable=False)
    except OSError as exc:  # an explanation is not worth failing a step for
        log.debug("code record of step %r not written: %s", step, exc)
        return False
    return True


def read_code(store: Store, code: object) -> dict[str, Any] | None:
    """The code record *code* names, or None if there is none (or it is malformed)."""
    if not isinstance(code, str) or not _DIGEST.fullmatch(code):
        return None
    try:
        record = json.loads(bytes(root_of(store).read(f"{CODE_DIR}{code}.json")))
    except (FileNotFoundError, ValueError, RecursionError):  # nested too deep: damaged
        return None
    if not isinstance(record, dict):
        return None
    return {key: _strings(record.get(key)) for key in ("components", "sources", "values", "left_out")}


def _strings(value: object) -> dict[str, str]:
    return {str(k): v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


@attrs.frozen
class Decision:
    """
    What the last run did with one slot, and why.

    ``outcome`` is ``"ran"``, ``"skipped"`` or ``"not called"`` (in the last run; ``run`` then
    says which run last decided it). A run logs the skips of the 32 slots completed last
    (and of any the manifest did not know), so an older slot reused as it was is ``"not
    called"`` since the run that last logged it. For a step that ran, ``reason`` is one of
    ``new``, ``inputs changed``, ``code changed``, ``version changed``, ``reset``,
    ``corrupt``; ``changes`` lists what differs from the stored output it replaced: code
    components with a unified diff of their source, values (old -> new) and parameters.
    """

    slot: str
    outcome: str
    run: int | None
    at: str | None
    reason: str | None = None
    detail: str | None = None
    changes: list[Change] = attrs.field(factory=list)
    left_out: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen
class Change:
    """One thing that differs between the code (or arguments) of two calls."""

    kind: str  # "code", "function", "step", "table", "value", "parameter"
    name: str
    old: str | None = None
    new: str | None = None
    diff: str | None = None


def _slot_matches(slot: str, step: str, key: str | None) -> bool:
    if key is not None:
        return slot == slot_id(step, key)
    return slot == step or slot.startswith(step + "/")


def one_per_slot(events: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """The events, with skips logged together (``steps_skipped``) as one ``step_skipped`` each."""
    for event in events:
        if event.get("event") != "steps_skipped":
            yield event
            continue
        for row in event["skips"]:
            yield {"t": event.get("t"), "event": "step_skipped", **skip_fields(row)}


def explain(
    events: Iterable[dict[str, Any]], store: Store, step: str, key: str | None = None
) -> list[Decision]:
    """The last decision about every slot of *step* (or its slot for *key*), from the event log."""
    run = 0
    last: dict[str, tuple[int, dict[str, Any]]] = {}
    kept: dict[str, tuple[int, dict[str, Any]]] = {}
    for event in one_per_slot(events):
        kind = event.get("event")
        if kind == "run_started":
            number = event.get("run")
            run = number if isinstance(number, int) else run + 1
        elif kind in {"step_started", "step_skipped", "step_kept"}:
            slot = event.get("slot")
            if isinstance(slot, str) and _slot_matches(slot, step, key):
                (kept if kind == "step_kept" else last)[slot] = (run, event)
    decisions = []
    for slot, (when, event) in sorted(last.items()):
        at = event.get("t") if isinstance(event.get("t"), str) else None
        if event.get("event") == "step_skipped":
            decision = Decision(slot, "skipped" if when == run else "not called", when, at)
            pinned = kept.get(slot)
            if pinned is not None and pinned[0] == when:  # another code's output, kept by a pinned version
                changes = code_diff(store, pinned[1].get("was"), pinned[1].get("code"))
                decision = attrs.evolve(decision, reason="kept: version pinned", changes=changes)
        else:
            decision = _ran(store, slot, when, at, event)
            if when != run:
                decision = attrs.evolve(decision, outcome="not called")
        decisions.append(decision)
    return decisions


def _ran(store: Store, slot: str, run: int, at: str | None, event: dict[str, Any]) -> Decision:
    reason = event.get("reason") if isinstance(event.get("reason"), str) else None
    detail = event.get("detail") if isinstance(event.get("detail"), str) else None
    changes = code_diff(store, event.get("was"), event.get("code")) if reason == "code changed" else []
    params = event.get("params")
    if isinstance(params, list):
        changes += [Change("parameter", str(p)) for p in params]
    new = read_code(store, event.get("code"))
    left_out = new["left_out"] if new is not None else {}
    return Decision(slot, "ran", run, at, reason, detail, changes, left_out)


_KINDS = {"code": "code", "fn": "function", "step": "step", "table": "table", "const": "value"}


def code_diff(store: Store, was: object, code: object) -> list[Change]:
    """What differs between the recorded codes *was* and *code* ([] if either is not recorded)."""
    old, new = read_code(store, was), read_code(store, code)
    if old is None or new is None:
        return []
    changes = []
    before, after = old["components"], new["components"]
    for label in sorted(before.keys() | after.keys()):
        if before.get(label) == after.get(label):
            continue
        prefix, _, name = label.partition(" ")
        kind = _KINDS.get(prefix, prefix)
        name = name or "its own code"
        if kind == "value":
            changes.append(Change(kind, name, old["values"].get(label), new["values"].get(label)))
            continue

        a, b = old["sources"].get(label, ""), new["sources"].get(label, "")
        lines = difflib.unified_diff(a.splitlines(), b.splitlines(), "before", "after", lineterm="", n=2)
        diff = "\n".join(lines) or None
        changes.append(Change(kind, name, before.get(label), after.get(label), diff))
    return changes


def render(decisions: list[Decision]) -> str:
    """The text `resumable why` prints."""
    out: list[str] = []
    for d in decisions:
        when = f" (run {d.run}, {d.at})" if d.run is not None else ""
        if d.outcome == "skipped" and d.reason:
            out.append(f"{d.slot}: skipped{when}: its code changed, but its version is pinned")
        elif d.outcome == "skipped":
            out.append(f"{d.slot}: skipped{when}: the stored output matches its code and arguments")
        elif d.outcome == "not called":
            out.append(
                f"{d.slot}: not run in the last run (its stored output was reused, or it was not "
                f"called); last decided in run {d.run}"
            )
        else:
            detail = f" ({d.detail})" if d.detail else ""
            out.append(f"{d.slot}: ran{when}: {d.reason}{detail}")
        for c in d.changes:
            out.extend(render_change(c))
        if d.left_out:
            names = ", ".join(f"{n} ({t})" for n, t in sorted(d.left_out.items()))
            out.append(f"  not part of its identity (cannot be fingerprinted): {names}")
    return "\n".join(out)


def render_change(c: Change) -> list[str]:
    if c.kind == "value":
        return [f"  value {c.name}: {c.old or '(none)'} -> {c.new or '(none)'}"]
    if c.kind == "parameter":
        return []  # the reason's detail names them already
    head = f"  {c.kind} {c.name} changed" if c.kind != "code" else "  its own code changed"
    if c.old is None:
        head = f"  {c.kind} {c.name} added"
    elif c.new is None:
        head = f"  {c.kind} {c.name} removed"
    lines = [head]
    if c.diff:
        lines += [f"    {line}" for line in c.diff.splitlines()]
    return lines
