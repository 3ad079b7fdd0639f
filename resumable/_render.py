"""How the command line shows state: tables, times, sizes and (summarised) values."""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import enum
import json
import pathlib
import pprint
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._units import human_size

if TYPE_CHECKING:
    from ._history import Checkpoint
    from ._manifest import Manifest

MAX_ITEMS = 20  # longer containers show their first items and a count
MAX_TEXT = 2000  # longer strings show their beginning and their length
MAX_DEPTH = 8


def ago(stamp: str | None, now: dt.datetime | None = None) -> str:
    """``5m ago`` for an ISO 8601 time."""
    if not stamp:
        return ""
    try:
        then = dt.datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    seconds = ((now or dt.datetime.now(dt.UTC)) - then).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def duration(seconds: float | None) -> str:
    """``12ms``, ``3.4s``, ``2.5min`` or ``3.1h``."""
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}min"
    return f"{seconds / 3600:.1f}h"


def table(rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def status(manifest: Manifest, location: str) -> str:
    """The ``resumable status`` report."""
    m = manifest
    lines = [
        f"pipeline {m.pipeline!r} in {location}: {m.status} (run {m.runs}, updated {ago(m.last_update)})"
    ]
    if m.current_step:
        lines.append(f"current step: {m.current_step}")
    rows = [["STEP", "STATE", "WHY IT RAN", "FINISHED", "DURATION", "SIZE", "BATCH"]]
    done = set(m.completed_steps)
    for slot in list(m.completed_steps) + [s for s in m.steps if s not in done]:
        rec = m.steps[slot]
        batch = m.batches.get(slot)
        rows.append(
            [
                slot,
                rec.status,
                rec.reason or "",
                ago(rec.finished_at),
                duration(rec.duration_s),
                human_size(rec.bytes),
                _progress(batch.done, batch.total, batch.failures) if batch is not None else "",
            ]
        )
    for name, batch in m.batches.items():
        if name not in m.steps:
            rows.append([name, "batch", "", "", "", "", _progress(batch.done, batch.total, batch.failures)])
    lines.append(table(rows) if len(rows) > 1 else "no steps yet")
    if m.error is not None:
        where = f" in step {m.error.step!r}" if m.error.step else ""
        lines.append(f"last error{where}: {m.error.type}: {m.error.message}")
        lines.append(m.error.traceback.rstrip())
    return "\n".join(lines)


def _progress(done: int, total: int | None, failures: int) -> str:
    text = f"{done:,}/{total:,} rows" if total is not None else f"{done:,} rows"
    return text + (f", {failures:,} failed" if failures else "")


def history(points: Sequence[Checkpoint], location: str) -> str:
    """The ``resumable history`` report."""
    if not points:
        return f"no checkpoints in {location} yet"
    rows = [["ID", "WHEN", "MADE BY", "COMPLETED"]]
    rows += [
        [
            str(c.id),
            ago(c.created_at),
            f"snapshot {c.label!r}" if c.label is not None else f"step {c.slot}",
            f"{len(c.completed_steps)} slot(s)",
        ]
        for c in points
    ]
    return f"checkpoints in {location} (rollback with: resumable rollback ID):\n" + table(rows)


def summarise(value: Any, depth: int = 0) -> Any:
    """A copy of *value* small enough to show: long containers and texts are cut."""
    if depth > MAX_DEPTH:
        return "…"
    if isinstance(value, str):
        return clip(value, MAX_TEXT)
    if isinstance(value, bytes | bytearray) and len(value) > 64:
        return f"{bytes(value[:64])!r}… ({len(value):,} bytes)"
    if isinstance(value, Mapping):
        items = list(value.items())
        out = {k: summarise(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            out["…"] = f"{len(items) - MAX_ITEMS:,} more keys"
        return out
    if isinstance(value, list | tuple | set | frozenset):
        items = list(value)
        shown = [summarise(v, depth + 1) for v in items[:MAX_ITEMS]]
        if len(items) > MAX_ITEMS:
            shown.append(f"… {len(items) - MAX_ITEMS:,} more items")
        return tuple(shown) if isinstance(value, tuple) else shown
    return value


def clip(text: str, size: int) -> str:
    """*text*, or its first *size* characters and its length."""
    return text if len(text) <= size else f"{text[:size]}… ({len(text):,} characters)"


def pretty(value: Any) -> str:
    """A summarised value, pretty-printed (NumPy and pandas summarise themselves)."""
    return pprint.pformat(summarise(value), width=100, sort_dicts=False, compact=True)


def as_json(value: Any) -> str:
    """A summarised value as JSON (docs/cli.md, ``show --json``); what JSON cannot hold as text."""
    return _dump(_jsonable(summarise(value)), 0)


JSON_WIDTH = 100


def _dump(value: Any, depth: int) -> str:
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [
            f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dump(v, depth + 1)}" for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value:
        if not any(isinstance(v, dict | list) for v in value):
            flat = json.dumps(value, ensure_ascii=False)
            if len(flat) <= JSON_WIDTH:
                return flat
        return "[\n" + ",\n".join(f"{inner}{_dump(v, depth + 1)}" for v in value) + f"\n{pad}]"
    return json.dumps(value, ensure_ascii=False, default=repr)


def _jsonable(value: Any, depth: int = 0) -> Any:  # noqa: C901, PLR0911 - one dispatch
    if depth > MAX_DEPTH:
        return "…"
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v, depth + 1) for v in value]
    if isinstance(value, bytes | bytearray):
        return {"__bytes__": base64.b64encode(bytes(value[:48])).decode(), "length": len(value)}
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return _jsonable(value.value, depth + 1)
    if isinstance(value, decimal.Decimal | uuid.UUID | pathlib.PurePath | dt.timedelta):
        return str(value)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.generic):
        return value.item()
    if np is not None and isinstance(value, np.ndarray):
        return {
            "__ndarray__": str(value.dtype),
            "shape": list(value.shape),
            "head": value.ravel()[:10].tolist(),
        }
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(value, pd.DataFrame):
        head = json.loads(value.head(10).to_json(orient="records", date_format="iso", default_handler=str))
        return {"__dataframe__": list(value.shape), "columns": [str(c) for c in value.columns], "head": head}
    fields = getattr(value, "__dict__", None)
    if isinstance(fields, dict):
        return {"__class__": type(value).__qualname__, **_jsonable(fields, depth + 1)}
    return repr(value)
