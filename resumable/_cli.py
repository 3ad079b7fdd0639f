"""
The ``resumable`` command: look at and manage a state directory from the shell.

Every command works on ``--state-dir`` (a directory or a store URL), else
``$RESUMABLE_STATE_DIR``, else ``./state``. Commands that change state take the run lock
and refuse, naming the holder, while a run is using the directory.
Exit codes: 0 success, 1 a command failed (or ``verify`` found damage), 2 usage errors.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Callable, Sequence

from . import _history, _render
from ._codec import DamagedFileError, decode, parse_header, secret_bytes, verify
from ._journal import read_state
from ._pipeline import Pipeline
from ._slots import slot_file, slot_id
from ._stores import Store, open_store
from ._verify import find_damage
from .exceptions import ResumableError

_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _age(text: str) -> dt.timedelta:
    match = _AGE.match(text.strip().lower())
    if match is None:
        msg = f"invalid age {text!r}: use a number and a unit, e.g. 90s, 30m, 12h, 7d, 2w"
        raise argparse.ArgumentTypeError(msg)
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="resumable",
        description="Inspect and manage the state of resumable pipelines.",
        epilog="The state directory is --state-dir, else $RESUMABLE_STATE_DIR, else ./state.",
    )
    parser.add_argument("--state-dir", default=None, help="state directory or store URL")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    status = commands.add_parser("status", help="where the pipeline stands, step by step")
    status.add_argument("--json", action="store_true", help="print the manifest as JSON")

    show = commands.add_parser("show", help="show a step's stored output")
    show.add_argument("step", help="the step's name (or a slot such as fetch_page/3)")
    show.add_argument("--key", help="the key of a keyed step's slot")
    show.add_argument("--json", action="store_true", help="print the value as JSON")
    show.add_argument(
        "--allow-pickle", action="store_true", help="load pickled values (only for state you trust)"
    )

    reset = commands.add_parser("reset", help="forget steps so that they run again")
    reset.add_argument("steps", nargs="*", metavar="STEP", help="step names or slots")
    reset.add_argument("--all", action="store_true", help="forget every step")
    reset.add_argument(
        "--only", action="store_true", help="forget only these, not the steps completed after them"
    )

    history = commands.add_parser("history", help="list the checkpoints rollback can restore")
    history.add_argument("--json", action="store_true", help="print the checkpoints as JSON")
    history.add_argument(
        "--limit", type=int, default=20, metavar="N", help="look at the N newest checkpoints (default 20)"
    )

    rollback = commands.add_parser("rollback", help="restore the state of a checkpoint")
    rollback.add_argument("target", metavar="ID|LABEL|STEP", help="a checkpoint id, label or step")

    export = commands.add_parser("export", help="write the whole state to one file")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")

    import_ = commands.add_parser("import", help="replace the state with an exported file")
    import_.add_argument("file", metavar="FILE", help="a file written by `resumable export`")

    commands.add_parser("verify", help="check every file; exit 1 if any is damaged")

    clean = commands.add_parser("clean", help="drop old history and outputs of removed steps")
    clean.add_argument(
        "--older-than",
        type=_age,
        default=_age("7d"),
        metavar="AGE",
        help="history older than this goes, and outputs of steps no run defined since (default 7d)",
    )
    clean.add_argument(
        "--keep", type=int, default=None, metavar="N", help="always keep the N newest checkpoints"
    )
    clean.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    return parser


def _store(args: argparse.Namespace) -> Store:
    location = args.state_dir or os.environ.get("RESUMABLE_STATE_DIR") or "state"
    return open_store(location)


def _pipeline(args: argparse.Namespace, **options: int) -> Pipeline:
    return Pipeline("resumable-cli", store=_store(args), **options)  # type: ignore[arg-type]


def _out(text: str) -> None:
    print(text)  # noqa: T201 - the command line's output


def _status(args: argparse.Namespace) -> int:
    store = _store(args)
    manifest = read_state(store, secret=secret_bytes(None))
    if args.json:
        _out(json.dumps(manifest.to_dict(), indent=2, ensure_ascii=False))
    else:
        _out(_render.status(manifest, store.location))
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _store(args)
    slot = slot_id(args.step, args.key) if args.key is not None else args.step
    where = f"{store.location}/{slot_file(slot)}"
    try:
        data = store.read(slot_file(slot))
    except FileNotFoundError:
        manifest = read_state(store, secret=secret_bytes(None))
        known = ", ".join(manifest.completed_steps[:10]) or "none"
        raise ResumableError(f"no stored output for {slot!r} at {where} (completed: {known})") from None
    try:
        header, head_len = parse_header(data)
        verify(data, header, head_len, secret_bytes(None))
        value = decode(data, header, head_len, allow_pickle=args.allow_pickle, stand_ins=True)
    except DamagedFileError as exc:
        raise ResumableError(f"{where} is damaged: {exc}") from None
    if args.json:
        _out(_render.as_json(value))
        return 0
    size = _render.human_size(head_len + header["size"])
    _out(f"{slot}: stored {header.get('created_at')}, {size}, fingerprint {header.get('fingerprint')}")
    _out(_render.pretty(value))
    return 0


def _reset(args: argparse.Namespace) -> int:
    if args.all == bool(args.steps):
        raise ResumableError("name the steps to reset, or pass --all (not both)")
    forgotten = _pipeline(args).reset(*args.steps, downstream=not args.only)
    _out(f"forgot {len(forgotten)} slot(s): {', '.join(forgotten)}" if forgotten else "nothing to forget")
    return 0


def _history_cmd(args: argparse.Namespace) -> int:
    pipe = _pipeline(args, keep_checkpoints=max(args.limit, 0))
    points = pipe.checkpoints()
    if args.json:
        _out(json.dumps([_checkpoint_dict(c) for c in points], indent=2))
    else:
        _out(_render.history(points, pipe.store.location))
    return 0


def _checkpoint_dict(c: _history.Checkpoint) -> dict[str, object]:
    return {
        "id": c.id,
        "created_at": c.created_at,
        "slot": c.slot,
        "label": c.label,
        "completed_steps": c.completed_steps,
    }


def _rollback(args: argparse.Namespace) -> int:
    checkpoint = _pipeline(args).rollback(args.target)
    what = f"snapshot {checkpoint.label!r}" if checkpoint.label else f"after step {checkpoint.slot}"
    if checkpoint.id == 0:
        what = "the empty state"
    done = len(checkpoint.completed_steps)
    _out(f"rolled back to checkpoint {checkpoint.id} ({what}): {done} slot(s) completed")
    return 0


def _export(args: argparse.Namespace) -> int:
    import msgpack  # noqa: PLC0415 - only this command needs it here

    state = _pipeline(args).save_state()
    data = msgpack.packb(state, use_bin_type=True)
    path = os.path.abspath(args.output)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _out(f"exported {len(state['files'])} file(s), {_render.human_size(len(data))}, to {path}")
    return 0


def _import(args: argparse.Namespace) -> int:
    import msgpack  # noqa: PLC0415 - only this command needs it here

    from .exceptions import DamagedStateError  # noqa: PLC0415 - keeps the import list short

    try:
        with open(args.file, "rb") as f:
            state = msgpack.unpackb(f.read(), raw=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DamagedStateError(f"{args.file} is not an export of resumable state ({exc})") from None
    pipe = _pipeline(args)
    pipe.load_state(state)
    _out(f"imported {len(state['files'])} file(s) from {args.file} into {pipe.store.location}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = _store(args)
    checked, problems = find_damage(store, secret=secret_bytes(None))
    for where, problem in problems:
        _out(f"DAMAGED {where}: {problem}")
    if problems:
        _out(
            f"{len(problems)} damaged of {checked} file(s); damaged outputs are recomputed on the next "
            "run (or remove them with `resumable reset STEP`)."
        )
        return 1
    _out(f"ok: {checked} file(s) checked in {store.location}")
    return 0


def _clean(args: argparse.Namespace) -> int:
    from ._clean import clean  # noqa: PLC0415 - the one command that needs it

    keep = args.keep if args.keep is not None else 20
    if keep < 0:
        raise ResumableError("--keep must be 0 or more")
    pipe = _pipeline(args, keep_checkpoints=keep)
    report = clean(pipe, older_than=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for line in report.lines:
        _out(f"{verb} {line}")
    _out(
        f"{verb} {report.count} file(s), {_render.human_size(report.bytes)}"
        if report.count
        else "nothing to clean"
    )
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": _status,
    "show": _show,
    "reset": _reset,
    "history": _history_cmd,
    "rollback": _rollback,
    "export": _export,
    "import": _import,
    "verify": _verify,
    "clean": _clean,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ResumableError as exc:
        print(f"resumable: {exc}", file=sys.stderr)  # noqa: T201
        return 1
    except OSError as exc:
        print(f"resumable: {exc}", file=sys.stderr)  # noqa: T201
        return 1
