"""
What ``resumable report`` shows, as plain data: one pass over the event log gives, per run,
what each slot did, batches' progress, and the state after each run (to compare runs; a
checkpoint or another session is compared as ``resumable diff`` does). Reads only.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from typing import Any, NamedTuple

import attrs

from . import _diff, _history, _render, _why
from ._codec import DamagedFileError, read_verified
from ._journal import read_state
from ._slots import decode_key, slot_file, step_of
from ._stores import Store
from .exceptions import UsageError

SLOT_ROWS = 400  # slots listed one per row; past that, big keyed steps are summarised
GROUP_SLOTS = 120  # slots drawn one by one when a keyed step's timeline row is expanded
VALUES = 60  # outputs read for a preview
PREVIEW = 300  # characters of a value's preview
TIMELINES = 12  # runs drawn as timelines (the newest)
SERIES = 200  # points of a batch's rate chart per run


def when(stamp: object) -> float | None:
    """Seconds since the epoch of an ISO 8601 stamp (None if there is none)."""
    try:
        return dt.datetime.fromisoformat(stamp).timestamp() if isinstance(stamp, str) else None
    except ValueError:
        return None


class _Run:
    def __init__(self, number: int, start: float | None) -> None:
        self.number = number
        self.start = start
        self.end: float | None = None
        self.end_max: float | None = None  # a killed run ended between end and end_max
        self.last_seen = start
        self.status = "running"
        self.bars: dict[str, dict[str, Any]] = {}  # slot -> what it did in this run
        self.skips: dict[str, dict[str, Any]] = {}
        self.batches: dict[str, dict[str, Any]] = {}

    def bar(self, slot: str) -> dict[str, Any]:
        """What *slot* did in this run (a bar with no start if its start was not logged)."""
        return self.bars.get(slot) or self.bars.setdefault(slot, _bar(slot, None, {}))


class _Version(NamedTuple):
    """A slot's output at some point: its fingerprint, file version, code, and the run that made it."""

    fingerprint: object
    file: object
    code: object
    run: int


class _Scan:
    """One pass over the event log."""

    def __init__(self) -> None:
        self.runs: list[_Run] = []
        self.versions: dict[str, _Version] = {}  # the state now: slot -> its version
        self.after_run: dict[int, dict[str, _Version]] = {}
        self.durations: dict[tuple[str, object], float | None] = {}  # (slot, file) -> seconds it took
        self.computed_in: dict[tuple[str, object], int] = {}  # (slot, file) -> run that made it
        self.created: dict[tuple[str, object], float | None] = {}  # (slot, file) -> when its file was made
        self.keys: dict[str, str] = {}
        self.parents: dict[str, str] = {}
        self.last_error: dict[str, Any] | None = None

    def feed(self, event: dict[str, Any]) -> None:  # noqa: C901, PLR0912 - one dispatch
        kind = event["event"]
        t = when(event.get("t"))
        if kind == "run_started":
            if self.runs and self.runs[-1].status == "running":  # it died, and no run said so
                self._finish(self.runs[-1], {"detected": True}, t)
            number = event.get("run")
            number = number if isinstance(number, int) else (self.runs[-1].number + 1 if self.runs else 1)
            self.runs.append(_Run(number, t))
            return
        if not self.runs:  # a damaged log whose first run_started is gone
            self.runs.append(_Run(0, t))
        run = self.runs[-1]
        if kind == "run_finished":
            self._finish(run, event, t)
            return
        if not event.get("recovered") and t is not None:  # (a recovery is logged by the next run)
            run.last_seen = t if run.last_seen is None else max(run.last_seen, t)
        if kind == "step_started":
            self._started(run, event, t)
        elif kind == "step_retry":
            run.bar(event["slot"])["retries"].append([t, *_error_text(event.get("error"))])
        elif kind == "step_completed":
            self._completed(run, event, t)
        elif kind in {"step_failed", "step_interrupted"}:
            self._failed(run, event, t)
        elif kind == "step_skipped":
            self._skipped(run, event)
        elif kind == "batch":
            self._batch(run, event, t)
        elif kind in {"steps_reset", "steps_removed"}:
            for slot in event.get("slots") or []:
                self.versions.pop(slot, None)
        elif kind == "rollback":  # the slots it changed hold the records it restored
            for slot, rec in event["changes"]["steps"].items():
                if rec is None or rec.get("status") != "completed":
                    self.versions.pop(slot, None)
                else:
                    self.versions[slot] = _Version(rec.get("fingerprint"), rec.get("file"), None, 0)

    def _finish(self, run: _Run, event: dict[str, Any], t: float | None) -> None:
        run.status = str(event.get("status") or "completed")
        if event.get("detected"):  # written by the next run: the process died
            run.end, run.end_max = run.last_seen, t
            run.status = "killed"
        else:
            run.end = t
        for bar in run.bars.values():
            if bar["outcome"] == "running":
                bar["outcome"] = "interrupted"
        self.after_run[run.number] = dict(self.versions)

    def _started(self, run: _Run, event: dict[str, Any], t: float | None) -> None:
        slot = event["slot"]
        if isinstance(event.get("key"), str):
            self.keys[slot] = event["key"]
        if isinstance(event.get("parent"), str):
            self.parents[slot] = event["parent"]
        run.bars[slot] = _bar(slot, t, event)

    def _completed(self, run: _Run, event: dict[str, Any], t: float | None) -> None:
        slot = event["slot"]
        file = event.get("file")
        bar = run.bar(slot)  # (its code is the one its start logged)
        self.versions[slot] = _Version(event.get("fingerprint"), file, bar["code"], run.number)
        self.computed_in[slot, file] = run.number
        took = event.get("duration_s")
        self.durations[slot, file] = took
        bar.update(outcome="ran", file=file, bytes=event.get("bytes"))
        bar["attempts"] = event.get("attempts", bar["attempts"])
        if event.get("recovered"):  # it finished before the kill; when is learnt from its file
            bar.update(end=None, recovered=True)
        else:
            bar.update(end=t, duration=took)

    def _failed(self, run: _Run, event: dict[str, Any], t: float | None) -> None:
        bar = run.bar(event["slot"])
        failed = event["event"] == "step_failed"
        bar.update(
            outcome="failed" if failed else "interrupted", end=t, error=list(_error_text(event.get("error")))
        )
        bar["attempts"] = event.get("attempts", bar["attempts"])
        if failed:
            kind, message, trace = bar["error"]
            self.last_error = {
                "step": event["slot"], "type": kind, "message": message, "traceback": trace, "run": run.number
            }  # fmt: skip

    def _skipped(self, run: _Run, skip: dict[str, Any]) -> None:
        slot = skip["slot"]
        file = skip.get("file")
        self.created[slot, file] = when(skip.get("created_at"))
        run.skips[slot] = {"file": file, "bytes": skip.get("bytes")}
        if slot not in self.versions:
            self.versions[slot] = _Version(skip.get("fingerprint"), file, None, 0)

    def _batch(self, run: _Run, event: dict[str, Any], t: float | None) -> None:
        progress = event["progress"]
        batch = run.batches.setdefault(event["batch"], {"points": [], "resumed": None, "failure": None})
        batch["points"].append([t, progress.get("done", 0), progress.get("failures", 0)])
        batch["total"] = progress.get("total")
        batch["every"] = progress.get("every")
        if isinstance(event.get("resumed"), int):
            batch["resumed"] = event["resumed"]
        if isinstance(event.get("failure"), dict):
            batch["failure"] = event["failure"]

    def finish(self) -> None:
        if self.runs and self.runs[-1].status == "running":  # still going, or died unnoticed so far
            self.runs[-1].end = self.runs[-1].last_seen
        for run in self.runs:
            for bar in run.bars.values():
                if bar.pop("recovered", False):
                    bar["end"] = self.created.get((bar["slot"], bar.get("file")))
                if run.end is not None and bar["end"] is not None and run.end_max is not None:
                    run.end = min(max(run.end, bar["end"]), run.end_max)


def _bar(slot: str, t: float | None, started: dict[str, Any]) -> dict[str, Any]:
    """What a slot did in a run, as far as its ``step_started`` event (if any) tells."""
    return {
        "slot": slot,
        "start": t,
        "end": None,
        "outcome": "running",
        "attempts": 1,
        "retries": [],
        **{k: started.get(k) for k in ("reason", "detail", "code", "was", "params")},
    }


def _error_text(error: object) -> tuple[str, str, str]:
    if not isinstance(error, dict):
        return "", "", ""
    return str(error.get("type", "")), str(error.get("message", "")), str(error.get("traceback", ""))


def _selected(runs: list[_Run], which: int | str) -> list[_Run]:
    if which == "all":
        return list(runs)
    if which == "last":
        return runs[-1:]
    chosen = [r for r in runs if str(r.number) == str(which)]  # --run 3 or run=3
    if not chosen:
        numbers = ", ".join(str(r.number) for r in runs) or "none"
        msg = f"no run {which} in the event log (runs: {numbers}): pass --run N, last or all"
        raise UsageError(msg)
    return chosen


def collect(  # noqa: PLR0913 - what to show, and where the state is
    store: Store,
    secret: bytes | None,
    *,
    run: int | str = "all",
    compare: int | str | None = None,
    root: Store | None = None,
    session: str | None = None,
) -> dict[str, Any]:
    """
    The report's data for the state root *store* (session *session* of the store *root*, if
    given): plain, JSON-serialisable, deterministic. *compare* is a run (``3``, ``run3``), a
    checkpoint (``checkpoint12``) or another session of *root* (``ID``, ``ID@CHECKPOINT``, ``.``
    for the default session).
    """
    manifest = read_state(store, secret=secret)
    scan = _Scan()
    for event in _why.one_per_slot(_history.events(store, secret)):
        scan.feed(event)
    scan.finish()
    chosen = _selected(scan.runs, run)
    data: dict[str, Any] = {
        "pipeline": manifest.pipeline or "(no pipeline has run here yet)",
        "location": store.location,
        "status": manifest.status if scan.runs or manifest.runs else "empty",
        "runs_total": manifest.runs,
        "which": {"all": "all runs", "last": "the last run"}.get(str(run), f"run {run}"),
        "state": {"slots": len(manifest.steps), "completed": len(manifest.completed_steps)},
        "runs": [_run_row(scan, r) for r in scan.runs],
    }
    counted = [row for row, r in zip(data["runs"], scan.runs, strict=True) if r in chosen]
    data["counts"] = {k: sum(r[k] for r in counted) for k in ("ran", "skipped", "failed", "retried")}
    data["counts"]["saved_s"] = round(sum(r["saved_s"] for r in counted), 6)
    data["timelines"] = [_timeline(scan, r) for r in chosen[-TIMELINES:]]
    data["timelines_left_out"] = max(0, len(chosen) - TIMELINES)
    data["slots"], data["groups"] = _slots(store, secret, scan, chosen, manifest)
    data["batches"] = _batches(chosen)
    against = None if run in {"all", "last"} else chosen[0].number  # --run N: compare with after it
    data["compare"] = _comparison(
        store, secret, scan, manifest, compare=compare, against=against, root=root, session=session
    )
    if manifest.error is not None:
        run_number = scan.runs[-1].number if scan.runs else None
        data["error"] = {**attrs.asdict(manifest.error), "run": run_number, "resolved": False}
    else:  # the last a log holds: a later run got past it
        data["error"] = scan.last_error and {**scan.last_error, "resolved": True}
    return data


def _run_row(scan: _Scan, run: _Run) -> dict[str, Any]:
    bars = run.bars.values()
    took = [scan.durations.get((slot, skip["file"])) for slot, skip in run.skips.items()]
    made = {scan.computed_in.get((slot, skip["file"])) for slot, skip in run.skips.items()}
    return {
        "run": run.number,
        "start": run.start,
        "end": run.end,
        "end_max": run.end_max,
        "status": run.status,
        "ran": sum(b["outcome"] == "ran" for b in bars),
        "skipped": len(run.skips),
        "failed": sum(b["outcome"] in {"failed", "interrupted"} for b in bars),
        "retried": sum(bool(b["retries"]) or b["attempts"] > 1 for b in bars),
        "saved_s": round(sum((t for t in took if t is not None), 0.0), 6),
        "saved_unknown": took.count(None),
        "skipped_from": sorted(n for n in made if n is not None),
    }


def _timeline(scan: _Scan, run: _Run) -> dict[str, Any]:
    """The bars of one run, grouped by step (a keyed step's slots share a row)."""
    times = [t for b in run.bars.values() for t in (b["start"], b["end"]) if t is not None]
    start = run.start if run.start is not None else min(times, default=0.0)
    end = max([start, *times, *([] if run.end is None else [run.end])])
    by_step: dict[str, list[dict[str, Any]]] = {}
    for slot, bar in run.bars.items():
        by_step.setdefault(step_of(slot), []).append(bar)
    rows = []
    for step, bars in by_step.items():
        row: dict[str, Any] = {"step": step, "keyed": "/" in bars[0]["slot"], "count": len(bars)}
        kept = bars
        if row["keyed"]:  # one row: its shape over time, and a sample of its slots (notable ones first)
            ends = [(end if b["end"] is None else b["end"]) - start for b in bars]
            starts = [b["start"] for b in bars if b["start"] is not None]
            row["hist"] = _histogram(ends, end - start)
            row["span"] = [round(min(starts, default=start) - start, 6), round(max(ends), 6)]
            row["failed"] = sum(b["outcome"] in {"failed", "interrupted"} for b in bars)
            row["retried"] = sum(bool(b["retries"]) for b in bars)
            kept = sorted(bars, key=lambda b: b["outcome"] == "ran" and not b["retries"])[:GROUP_SLOTS]
        row["bars"] = sorted((_drawn(scan, b, start, end) for b in kept), key=lambda b: (b["s"], b["slot"]))
        rows.append(row)
    return {
        "run": run.number,
        "status": run.status,
        "start": start,
        "span": round(max(end - start, 1e-6), 6),
        "unknown_until": (round(run.end_max - start, 6) if run.end_max is not None else None),
        "rows": rows,
        "skipped": dict(Counter(step_of(slot) for slot in run.skips)),
    }


def _drawn(scan: _Scan, bar: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """*bar* with its times in seconds since the run's *start* (one with no end drawn up to *end*)."""
    b0 = start if bar["start"] is None else bar["start"]
    b1 = end if bar["end"] is None else max(bar["end"], b0)  # no end: killed while running, or running
    return {
        **bar,
        "s": round(b0 - start, 6),
        "e": round(b1 - start, 6),
        "open": bar["end"] is None,
        "retries": [[round((r[0] or b0) - start, 6), r[1], _render.clip(r[2], 300)] for r in bar["retries"]],
        "error": _error_pair(bar),
        "parent": scan.parents.get(bar["slot"]),
    }


def _error_pair(info: dict[str, Any]) -> list[str] | None:
    """The type and (clipped) message of the error a slot failed with."""
    return [info["error"][0], _render.clip(info["error"][1], 300)] if info.get("error") else None


HIST_BINS = 80


def _histogram(ends: list[float], span: float) -> list[int]:
    """How many slots ended in each of :data:`HIST_BINS` equal slices of the run."""
    bins = [0] * HIST_BINS
    width = max(span, 1e-9) / HIST_BINS
    for t in ends:
        bins[min(HIST_BINS - 1, max(0, int(t / width)))] += 1
    return bins


def _slots(
    store: Store, secret: bytes | None, scan: _Scan, chosen: list[_Run], manifest: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """One row per slot the chosen runs touched (big keyed steps summarised), and per step."""
    last: dict[str, tuple[_Run, str, dict[str, Any]]] = {}
    for run in chosen:
        for slot, skip in run.skips.items():
            last[slot] = (run, "skipped", skip)
        for slot, bar in run.bars.items():
            last[slot] = (run, bar["outcome"], bar)
    groups: dict[str, dict[str, Any]] = {}
    for slot, (_, outcome, info) in last.items():  # a skip has no reason
        step = step_of(slot)
        group = groups.setdefault(
            step, {"step": step, "slots": 0, "outcomes": Counter(), "reasons": Counter()}
        )
        group["slots"] += 1
        group["outcomes"][outcome] += 1
        if info.get("reason"):
            group["reasons"][info["reason"]] += 1
    listed = _listed(last, groups)
    rows = []
    values_left = VALUES
    code_cache: dict[tuple[object, object], list[dict[str, Any]]] = {}
    for slot in listed:
        run, outcome, info = last[slot]
        rec = manifest.steps.get(slot)
        file = info.get("file")
        made = scan.computed_in.get((slot, file))
        took = info.get("duration") if outcome != "skipped" else scan.durations.get((slot, file))
        changes: list[dict[str, Any]] = []
        if info.get("reason") == "code changed":
            pair = (info.get("was"), info.get("code"))
            if pair not in code_cache:
                code_cache[pair] = [_change_row(c) for c in _why.code_diff(store, *pair)]
            changes = code_cache[pair]
        changes = changes + [{"kind": "parameter", "name": p} for p in info.get("params") or []]
        row = {
            "slot": slot,
            "step": step_of(slot),
            "key": scan.keys.get(slot, decode_key(slot.split("/", 1)[1]) if "/" in slot else None),
            "run": run.number,
            "outcome": outcome,
            "reason": info.get("reason"),
            "detail": info.get("detail"),
            "changes": changes,
            "computed_in": made,
            "duration": took,
            "bytes": info.get("bytes") if info.get("bytes") is not None else (rec.bytes if rec else None),
            "attempts": info.get("attempts", 1) if outcome != "skipped" else None,
            "error": _error_pair(info),
            "parent": scan.parents.get(slot),
            "value": None,
        }
        if values_left > 0 and rec is not None and rec.status == "completed":
            values_left -= 1
            row["value"] = _preview(store, secret, slot)
        rows.append(row)
    return rows, sorted(groups.values(), key=lambda g: g["step"])


def _listed(last: dict[str, Any], groups: dict[str, dict[str, Any]]) -> list[str]:
    """The slots given a row each: all when few; else every unkeyed slot and notable keyed ones."""
    slots = list(last)
    if len(slots) <= SLOT_ROWS:
        return slots
    picked = set([s for s in slots if "/" not in s or last[s][1] not in {"skipped", "ran"}][:SLOT_ROWS])
    room = SLOT_ROWS - len(picked)
    share, taken = max(1, room // len(groups)), Counter[str]()
    for slot in slots:
        if room > 0 and slot not in picked and taken[step_of(slot)] < share:
            taken[step_of(slot)] += 1
            picked.add(slot)
            room -= 1
    return [s for s in slots if s in picked]


def _change_row(c: _why.Change) -> dict[str, Any]:
    return {**attrs.asdict(c), "diff": _render.clip(c.diff or "", 4000) or None}


def _preview(store: Store, secret: bytes | None, slot: str) -> str | None:
    try:
        checked = read_verified(store.read(slot_file(slot)), secret)
        value = checked.decode(allow_pickle=False, stand_ins=True)  # never unpickled
    except (FileNotFoundError, DamagedFileError):
        return None
    except Exception as exc:  # noqa: BLE001 - a value that cannot be shown is named, not raised
        return f"(cannot be shown: {type(exc).__name__})"
    return _render.clip(_render.pretty(value), PREVIEW)


def _batches(chosen: list[_Run]) -> list[dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for run in chosen:
        for name, batch in run.batches.items():
            entry = out.setdefault(name, {"batch": name, "runs": []})
            points = batch["points"]  # one at least: a batch is seen by its progress events
            t0 = run.start if run.start is not None else (points[0][0] or 0.0)
            _, done, failures = points[-1]
            entry.update(total=batch["total"], every=batch["every"])
            n = len(points)
            kept = points if n <= SERIES else [points[i * n // SERIES] for i in range(SERIES)] + points[-1:]
            entry["runs"].append(
                {
                    "run": run.number,
                    "points": [[round((p[0] or t0) - t0, 3), p[1], p[2]] for p in kept],
                    "done": done,
                    "resumed": batch["resumed"],
                    "failures": failures,
                    "failure": batch["failure"],
                }
            )
    return [out[k] for k in sorted(out)]


def _comparison(  # noqa: PLR0913 - the state, what to compare, and where the other side is
    store: Store,
    secret: bytes | None,
    scan: _Scan,
    manifest: Any,
    *,
    compare: int | str | None,
    against: int | None,
    root: Store | None,
    session: str | None,
) -> dict[str, Any] | None:
    """The state now (or after run *against*) against what *compare* names (see :func:`collect`)."""
    if compare is None:
        return None
    number = re.fullmatch(r"(run|checkpoint)?[\s:=]*(\d+)", str(compare).strip().lower())
    if number is not None and number[1] != "checkpoint":
        return _against_run(store, scan, manifest, int(number[2]), against)
    name = "." if session is None else session  # checkpoints and sessions are read as `resumable diff` does
    this = _diff.side_now(name, store, secret)
    if number is not None:
        other = _diff.side_at(name, store, secret, int(number[2]))
        a, b = f"checkpoint {number[2]}", "now"
    else:
        other = _diff.side(root or store, str(compare), secret)
        a, b = f"session {compare}", f"session {name}"
    diffs, first = _diff.compare(other, this)
    rows = [
        {
            "slot": d.slot,
            "verdict": "removed"
            if d.slot not in this.files
            else "added"
            if d.slot not in other.files
            else d.verdict,
            "a": _header_side(other, d.slot),
            "b": _header_side(this, d.slot),
            "changes": [_change_row(c) for c in d.changes],
        }
        for d in diffs
    ]
    return _rows(a, b, first, rows)


def _rows(a: str, b: str, first: str | None, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The comparison of states *a* and *b*: the first rows that differ and 50 that do not, in order."""
    same = [r for r in rows if r["verdict"] == "same"]
    shown = {r["slot"] for r in [r for r in rows if r["verdict"] != "same"][:SLOT_ROWS] + same[:50]}
    kept = [r for r in rows if r["slot"] in shown]
    return {"a": a, "b": b, "first": first, "same": len(same), "total": len(rows), "rows": kept}


def _header_side(side: _diff.Side, slot: str) -> dict[str, Any] | None:
    header = _diff.header(side, slot)
    return None if header is None else {"fingerprint": str(header.get("fingerprint") or "")[:12], "run": None}


def _against_run(
    store: Store, scan: _Scan, manifest: Any, number: int, against: int | None
) -> dict[str, Any]:
    other = scan.after_run.get(number)
    if other is None:
        msg = f"--compare: run {number} has not finished in this log (runs: {len(scan.runs)})"
        raise UsageError(msg)
    now, now_label = scan.versions, "now"
    if against is not None and against in scan.after_run:
        now, now_label = scan.after_run[against], f"after run {against}"
    rows = []
    first = None
    for slot in dict.fromkeys([*manifest.completed_steps, *now, *other]):
        a, b = other.get(slot), now.get(slot)
        if a is None and b is None:  # (a slot completed after both)
            continue
        verdict = _verdict(a, b)
        row = {"slot": slot, "verdict": verdict, "a": _side(a), "b": _side(b), "changes": []}
        if verdict == "code changed" and a is not None and b is not None:
            row["changes"] = [_change_row(c) for c in _why.code_diff(store, a.code, b.code)]
        if first is None and verdict != "same":
            first = slot
        rows.append(row)
    return _rows(f"after run {number}", now_label, first, rows)


def _side(v: _Version | None) -> dict[str, Any] | None:
    return None if v is None else {"fingerprint": str(v.fingerprint or "")[:12], "run": v.run}


def _verdict(a: _Version | None, b: _Version | None) -> str:
    if a is None:
        return "added"
    if b is None:
        return "removed"
    if a.file == b.file:
        return "same"
    if a.code is not None and b.code is not None and a.code != b.code:
        return "code changed"
    if a.fingerprint != b.fingerprint:
        return "inputs changed"
    return "output differs"
