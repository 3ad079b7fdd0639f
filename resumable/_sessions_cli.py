"""
The command line's session commands: ``sessions [fork|delete]``, ``diff``, the summary
``status`` prints, ``clean --sessions``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs

from . import _diff, _render, _sessions
from ._codec import secret_bytes
from ._pipeline import Pipeline
from ._sessions_index import index_of
from ._stores import Store
from ._units import human_size

Out = Callable[[str], None]


def summary(root: Store) -> dict[str, Any] | None:
    """Counts by status, the latest session, the failed ones; None if the store has no sessions."""
    infos = _sessions.list_sessions(root)
    if not infos:
        return None
    statuses = Counter(i.status for i in infos)
    latest = infos[0]
    failed = [i.id for i in infos if i.status == "failed"]
    return {
        "count": len(infos),
        "by_status": dict(statuses.most_common()),
        "latest": {"id": latest.id, "status": latest.status, "updated_at": latest.updated_at},
        "failed": failed[:10],
        "failed_count": len(failed),
    }


def render_summary(info: dict[str, Any], *, default: bool) -> str:
    """The lines ``status`` adds about the sessions."""
    counts = ", ".join(f"{n} {status}" for status, n in info["by_status"].items())
    latest = info["latest"]
    lines = [
        ("" if not default else "\n")
        + f"sessions: {info['count']} ({counts}); latest: {latest['id']!r}, {latest['status']} "
        + _render.ago(latest["updated_at"]),
    ]
    if info["failed"]:
        more = info["failed_count"] - len(info["failed"])
        lines.append(
            "failed: " + ", ".join(map(repr, info["failed"])) + (f" and {more} more" if more else "")
        )
    lines.append("see `resumable sessions` (and `resumable --session ID status` for one)")
    return "\n".join(lines)


def sessions_cmd(args: argparse.Namespace, root: Store, out: Out) -> int:
    """``resumable sessions [fork SRC DST | delete ID...]``."""
    pipe = Pipeline("resumable-cli", store=root)
    if args.action == "fork":
        info = pipe.fork(args.src, args.dst, at=args.at)
        out(f"forked {args.src!r} into {info.id!r}: {info.completed} slot(s) completed")
        return 0
    if args.action == "delete":
        for sid in args.ids:
            pipe.delete_session(sid)
            out(f"deleted session {sid!r}")
        return 0
    infos = pipe.sessions(status=args.status, prefix=args.prefix, limit=args.limit)
    if args.json:
        out(json.dumps([attrs.asdict(s) for s in infos], indent=2, ensure_ascii=False))
        return 0
    if not infos:
        out(f"no sessions in {root.location}")
        return 0
    rows = [["SESSION", "STATUS", "UPDATED", "RUNS", "DONE", "SIZE", "PARENT"]]
    rows.extend(
        [
            s.id,
            s.status,
            _render.ago(s.updated_at),
            str(s.runs),
            str(s.completed),
            human_size(s.bytes),
            s.parent or "",
        ]
        for s in infos
    )
    out(_render.table(rows))
    return 0


def diff_cmd(args: argparse.Namespace, root: Store, out: Out) -> int:
    """``resumable diff A B``."""
    a, b = (_diff.side(root, text, secret_bytes(None)) for text in (args.a, args.b))
    diffs, first = _diff.compare(a, b)
    if args.json:
        out(json.dumps(_diff.as_dict(a, b, diffs, first), indent=2, ensure_ascii=False))
    else:
        out(_diff.render(a, b, diffs, first))
    return 0


def clean_sessions(root: Store, idle: dt.timedelta, *, dry_run: bool, out: Out) -> int:
    """``resumable clean --sessions --idle AGE``: delete completed and failed sessions idle that long."""
    cutoff = (dt.datetime.now(dt.UTC) - idle).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    pipe = Pipeline("resumable-cli", store=root)
    old = [s for s in pipe.sessions() if s.status in {"completed", "failed"} and s.updated_at < cutoff]
    verb = "would delete" if dry_run else "deleted"
    for s in old:
        if not dry_run:
            pipe.delete_session(s.id)
        out(f"{verb} session {s.id!r} ({s.status}, {_render.ago(s.updated_at)})")
    if not dry_run:
        index_of(root).compact()
    out(f"{verb} {len(old)} session(s)" if old else "no idle sessions to delete")
    return 0
