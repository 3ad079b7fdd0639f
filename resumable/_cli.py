"""
The ``resumable`` command: look at and repair a state directory from the shell.

Exit codes: 0 success, 1 ``verify`` found damage (or a command failed), 2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from ._codec import secret_bytes
from ._journal import read_state
from ._manifest import Manifest
from ._run import human_size
from ._stores import Store, open_store
from ._verify import find_damage
from .exceptions import ResumableError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resumable",
        description="Inspect and manage the state of resumable pipelines.",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="state directory or store URL (default: $RESUMABLE_STATE_DIR, else ./state)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    status = commands.add_parser("status", help="where the pipeline stands, step by step")
    status.add_argument("--json", action="store_true", help="print the manifest as JSON")
    commands.add_parser("verify", help="check every file; exit 1 if any is damaged")
    return parser


def _store(args: argparse.Namespace) -> Store:
    location = args.state_dir or os.environ.get("RESUMABLE_STATE_DIR") or "state"
    return open_store(location)


def _ago(stamp: str | None) -> str:
    if not stamp:
        return ""
    try:
        then = datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    seconds = (datetime.now(UTC) - then).total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit} ago"
    return f"{max(seconds, 0):.0f}s ago"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 120:
        return f"{seconds:.1f}s"
    return f"{seconds / 60:.1f}min"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def render_status(manifest: Manifest, location: str) -> str:
    """The human-readable ``resumable status`` report."""
    m = manifest
    lines = [
        f"pipeline {m.pipeline!r} in {location}: {m.status} (run {m.runs}, updated {_ago(m.last_update)})"
    ]
    if m.current_step:
        lines.append(f"current step: {m.current_step}")
    rows = [["STEP", "STATE", "WHY IT RAN", "FINISHED", "DURATION", "SIZE", "BATCH"]]
    ordered = list(m.completed_steps) + [s for s in m.steps if s not in set(m.completed_steps)]
    for slot in ordered:
        rec = m.steps[slot]
        batch = m.batches.get(slot)
        progress = ""
        if batch is not None:
            total = f"/{batch.total:,}" if batch.total is not None else ""
            progress = f"{batch.done:,}{total} rows"
            progress += f", {batch.failures} failed" if batch.failures else ""
        rows.append(
            [
                slot,
                rec.status,
                rec.reason or "",
                _ago(rec.finished_at),
                _duration(rec.duration_s),
                human_size(rec.bytes) if rec.bytes is not None else "",
                progress,
            ]
        )
    for name, batch in m.batches.items():
        if name not in m.steps:
            total = f"/{batch.total:,}" if batch.total is not None else ""
            rows.append([name, "batch", "", "", "", "", f"{batch.done:,}{total} rows"])
    lines.append(_table(rows) if len(rows) > 1 else "no steps yet")
    if m.error is not None:
        where = f" in step {m.error.step!r}" if m.error.step else ""
        lines.append(f"last error{where}: {m.error.type}: {m.error.message}")
        lines.append(m.error.traceback.rstrip())
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    store = _store(args)
    manifest = read_state(store, secret=secret_bytes(None))
    if args.json:
        print(json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False))  # noqa: T201
    else:
        print(render_status(manifest, store.location))  # noqa: T201
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = _store(args)
    checked, problems = find_damage(store, secret=secret_bytes(None))
    for where, problem in problems:
        print(f"DAMAGED {where}: {problem}")  # noqa: T201
    if problems:
        print(  # noqa: T201
            f"{len(problems)} damaged of {checked} file(s); damaged outputs are recomputed on the next "
            "run (or remove them with `resumable reset STEP`)."
        )
        return 1
    print(f"ok: {checked} file(s) checked in {store.location}")  # noqa: T201
    return 0


_COMMANDS: dict[str, Any] = {"status": _status, "verify": _verify}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        code: int = _COMMANDS[args.command](args)
    except ResumableError as exc:
        print(f"resumable: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    return code
