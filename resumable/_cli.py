"""
The ``resumable`` command: look at and manage a state directory from the shell (docs/cli.md).

Commands that change state take the run lock; commands that only read it take no lock and
create nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Callable, Sequence

import attrs
import msgpack

from . import _history, _render, _sessions, _sessions_cli, _why
from ._clean import clean as clean_state
from ._codec import DamagedFileError, read_verified, secret_bytes
from ._journal import read_state
from ._pipeline import Pipeline, describe_slots, snapshot
from ._report import write_file
from ._slots import (
    EVENTS,
    MANIFEST,
    OUTPUT_SUFFIX,
    check_session_id,
    is_output_file,
    slot_file,
    slot_id,
)
from ._stores import Store, open_store
from ._stores._local import LocalStore
from ._units import human_size
from ._verify import find_damage
from .exceptions import DamagedStateError, ResumableError, StateLockedError, UsageError

EXIT_OK = 0
EXIT_FAILED = 1  # the reason is on stderr; also: verify found damage
EXIT_USAGE = 2  # bad arguments, or a step, slot or checkpoint the state does not hold
EXIT_NO_STATE = 3  # nothing has run with that state directory

_AGE = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def _count(text: str) -> int:
    if not text.isdigit():
        msg = f"invalid count {text!r}: use a whole number, 0 or more"
        raise argparse.ArgumentTypeError(msg)
    return int(text)


def _age(text: str) -> dt.timedelta:
    match = _AGE.match(text.strip().lower())
    if match is None:
        msg = f"invalid age {text!r}: use a number and a unit, e.g. 90s, 30m, 12h, 7d, 2w"
        raise argparse.ArgumentTypeError(msg)
    return dt.timedelta(seconds=float(match.group(1)) * _UNITS[match.group(2)])


class _NoState(Exception):  # noqa: N818 - a signal turned into EXIT_NO_STATE; its argument: where
    pass


class _StdoutClosed(Exception):  # noqa: N818 - a signal: the reader of our output went away
    pass


def _parser() -> argparse.ArgumentParser:  # noqa: PLR0915 - one statement per option
    parser = argparse.ArgumentParser(
        prog="resumable",
        description="Inspect and manage the state of resumable pipelines.",
        epilog=(
            "The state directory is --state-dir, else $RESUMABLE_STATE_DIR, else ./state. "
            "Exit codes: 0 ok, 1 failed (or verify found damage), 2 usage, 3 no state."
        ),
    )
    parser.add_argument("--state-dir", help="state directory or store URL")
    parser.add_argument("--session", metavar="ID", help=_SESSION_HELP)
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

    why = commands.add_parser("why", help="why a step last ran or was skipped, with a diff of its code")
    why.add_argument("step", help="the step's name (or a slot such as fetch_page/3)")
    why.add_argument("--key", help="only the slot of this key")
    why.add_argument("--json", action="store_true", help="print the decisions as JSON")

    history = commands.add_parser("history", help="list the checkpoints rollback can restore")
    history.add_argument("--json", action="store_true", help="print the checkpoints as JSON")
    history.add_argument(
        "--limit", type=_count, default=20, metavar="N", help="look at the N newest checkpoints (default 20)"
    )

    rollback = commands.add_parser("rollback", help="restore the state of a checkpoint")
    rollback.add_argument("target", metavar="ID|LABEL|STEP", help="a checkpoint id, label or step")

    export = commands.add_parser("export", help="write the whole state to one file")
    export.add_argument("-o", "--output", required=True, metavar="FILE", help="the file to write")

    import_ = commands.add_parser("import", help="replace the state with an exported file")
    import_.add_argument("file", metavar="FILE", help="a file written by `resumable export`")

    report = commands.add_parser("report", help="write one HTML file showing the runs (offline, no lock)")
    report.add_argument("-o", "--output", default="report.html", metavar="FILE", help="default report.html")
    report.add_argument("--run", default="all", metavar="N|last|all", help="the runs to show (default all)")
    report.add_argument(
        "--compare",
        metavar="RUN|CHECKPOINT|SESSION[@CKPT]",
        help="compare now with run N, checkpointN, or another session ('.': the default one)",
    )
    report.add_argument("--open", action="store_true", help="open the file in a browser")

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
        "--keep", type=_count, default=20, metavar="N", help="always keep the N newest checkpoints"
    )
    clean.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    clean.add_argument(
        "--sessions", action="store_true", help="delete completed and failed sessions idle for --idle"
    )
    clean.add_argument("--idle", type=_age, metavar="AGE", help="with --sessions: idle this long")

    sessions = commands.add_parser("sessions", help="list the sessions (or fork, delete them)")
    sessions.add_argument("--status", metavar="S", help="only sessions with this status")
    sessions.add_argument("--prefix", metavar="P", help="only ids starting with P")
    sessions.add_argument("--limit", type=_count, metavar="N", help="at most N, newest first")
    sessions.add_argument("--json", action="store_true", help="print the sessions as JSON")
    actions = sessions.add_subparsers(dest="action", metavar="ACTION")
    fork = actions.add_parser("fork", help="create session DST from SRC's state, sharing its files")
    fork.add_argument("src", metavar="SRC")
    fork.add_argument("dst", metavar="DST")
    fork.add_argument("--at", metavar="ID|LABEL|STEP", help="SRC's state at this checkpoint")
    delete = actions.add_parser("delete", help="delete sessions and all their files")
    delete.add_argument("ids", nargs="+", metavar="ID")

    diff = commands.add_parser("diff", help="where two sessions (or checkpoints) diverged, and why")
    diff.add_argument(
        "a", metavar="A", help="a session id, '.' for the default session, or SESSION@CHECKPOINT"
    )
    diff.add_argument("b", metavar="B")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    for command in commands.choices.values():
        # also accepted after the command; SUPPRESS keeps one given before it when absent here
        command.add_argument("--state-dir", default=argparse.SUPPRESS, help="state directory or store URL")
        command.add_argument("--session", default=argparse.SUPPRESS, metavar="ID", help=_SESSION_HELP)
    return parser


_SESSION_HELP = "a named session of the store (default $RESUMABLE_SESSION, else the default session)"


def _state(args: argparse.Namespace) -> Store:
    """The session's store, which must hold state: :class:`_NoState` otherwise. Creates nothing."""
    store = args.root if args.session is None else _sessions.session_store(args.root, args.session)
    if isinstance(store, LocalStore):
        store.check_root()
    if args.session is not None and _sessions.incomplete(store):
        raise _NoState(store.location)  # a fork or delete was killed: it holds nothing
    for key in (MANIFEST, EVENTS):
        try:
            store.read(key, 0, 0)
        except FileNotFoundError:
            continue
        except OSError:
            return store  # something is there: the command says what is wrong with it
        return store
    if not any(is_output_file(k) for k in store.list()):
        raise _NoState(store.location)
    return store


def _pipeline(args: argparse.Namespace, keep_checkpoints: int = 20) -> Pipeline:
    """The pipeline of the session, which must hold state."""
    _state(args)
    return Pipeline("resumable-cli", store=args.root, session=args.session, keep_checkpoints=keep_checkpoints)


def _out(text: str) -> None:
    try:
        print(text)  # noqa: T201 - the command line's output
    except BrokenPipeError:
        raise _StdoutClosed from None


def _status(args: argparse.Namespace) -> int:
    summary = None if args.session is not None else _sessions_cli.summary(args.root)
    manifest = None
    try:
        store = _state(args)
        manifest = read_state(store, secret=secret_bytes(None))
    except _NoState:
        if not summary:
            raise
    if args.json:
        data = {} if manifest is None else manifest.to_dict()
        _out(json.dumps(data | ({"sessions": summary} if summary else {}), indent=2, ensure_ascii=False))
        return 0
    if manifest is not None:
        _out(_render.status(manifest, store.location))
    if summary:
        _out(_sessions_cli.render_summary(summary, default=manifest is not None))
    return 0


def _show(args: argparse.Namespace) -> int:
    store = _state(args)
    slot = slot_id(args.step, args.key) if args.key is not None else args.step
    # Only a slot the state holds is read: a name is never made into a path of its own.
    stored = {k[: -len(OUTPUT_SUFFIX)] for k in store.list() if is_output_file(k)}
    if slot not in stored:
        keyed = sorted(s for s in stored if s.startswith(f"{slot}/"))
        if keyed:
            msg = f"{slot!r} is a keyed step: pass --key K, or one of its slots: {', '.join(keyed[:10])}"
        else:
            msg = f"no stored output for {slot!r} in {store.location} (it holds {describe_slots(stored)})"
        raise UsageError(msg)
    try:
        checked = read_verified(store.read(slot_file(slot)), secret_bytes(None))
        value = checked.decode(allow_pickle=args.allow_pickle, stand_ins=True)
    except DamagedFileError as exc:
        raise ResumableError(f"{store.location}/{slot_file(slot)} is damaged: {exc}") from None
    if args.json:
        _out(_render.as_json(value))
        return 0
    header, size = checked.header, human_size(checked.size)
    _out(f"{slot}: stored {header.get('created_at')}, {size}, fingerprint {header.get('fingerprint')}")
    _out(_render.pretty(value))
    return 0


def _why_cmd(args: argparse.Namespace) -> int:
    decisions = _pipeline(args).why(args.step, args.key)
    if args.json:
        _out(json.dumps([attrs.asdict(d) for d in decisions], indent=2, ensure_ascii=False))
    else:
        _out(_why.render(decisions))
    return 0


def _reset(args: argparse.Namespace) -> int:
    if args.all == bool(args.steps):
        raise UsageError("name the steps to reset, or pass --all (not both)")
    forgotten = _pipeline(args).reset(*args.steps, downstream=not args.only)
    _out(f"forgot {len(forgotten)} slot(s): {', '.join(forgotten)}" if forgotten else "nothing to forget")
    return 0


def _history_cmd(args: argparse.Namespace) -> int:
    store, secret = _state(args), secret_bytes(None)
    points = _history.checkpoints(store, secret, args.limit, read_state(store, secret=secret))
    if args.json:
        _out(json.dumps([attrs.asdict(c) for c in points], indent=2))
    else:
        _out(_render.history(points, store.location))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    checkpoint = _pipeline(args).rollback(args.target)
    what = f"snapshot {checkpoint.label!r}" if checkpoint.label else f"after step {checkpoint.slot}"
    if checkpoint.id == 0:
        what = "the empty state"
    done = len(checkpoint.completed_steps)
    _out(f"rolled back to checkpoint {checkpoint.id} ({what}): {done} slot(s) completed")
    return 0


def _export(args: argparse.Namespace) -> int:
    state = snapshot(_state(args))
    data = msgpack.packb(state, use_bin_type=True)
    path = write_file(args.output, data)
    _out(f"exported {len(state['files'])} file(s), {human_size(len(data))}, to {path}")
    return 0


def _import(args: argparse.Namespace) -> int:
    try:
        with open(args.file, "rb") as f:
            state = msgpack.unpackb(f.read(), raw=False)
    except ValueError as exc:  # (msgpack's errors are ValueErrors)
        raise DamagedStateError(f"{args.file} is not an export of resumable state ({exc})") from None
    pipe = Pipeline("resumable-cli", store=args.root, session=args.session)
    pipe.load_state(state)
    _out(f"imported {len(state['files'])} file(s) from {args.file} into {pipe.store.location}")
    return 0


def _report(args: argparse.Namespace) -> int:
    path = _pipeline(args).report(args.output, run=args.run, compare=args.compare)
    _out(f"wrote {path}")
    if args.open:
        import webbrowser  # noqa: PLC0415 - only `report --open`; slow to import

        webbrowser.open(f"file://{path}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    store = _state(args)
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
    if args.sessions != (args.idle is not None):
        raise UsageError("clean --sessions needs --idle AGE (e.g. --idle 30d), and --idle needs --sessions")
    if args.sessions:
        return _sessions_cli.clean_sessions(args.root, args.idle, dry_run=args.dry_run, out=_out)

    pipe = _pipeline(args, keep_checkpoints=args.keep)
    removed = clean_state(pipe, older_than=args.older_than, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for line, _size in removed:
        _out(f"{verb} {line}")
    size = human_size(sum(size for _line, size in removed))
    _out(f"{verb} {len(removed)} file(s), {size}" if removed else "nothing to clean")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": _status,
    "show": _show,
    "reset": _reset,
    "why": _why_cmd,
    "history": _history_cmd,
    "rollback": _rollback,
    "export": _export,
    "import": _import,
    "verify": _verify,
    "clean": _clean,
    "report": _report,
    "sessions": lambda args: _sessions_cli.sessions_cmd(args, args.root, _out),
    "diff": lambda args: _sessions_cli.diff_cmd(args, args.root, _out),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = _parser().parse_args(argv)
    try:
        # every command works on one store, and on one session of it (None: the default one)
        args.session = args.session or os.environ.get("RESUMABLE_SESSION") or None
        args.session = None if args.session is None else check_session_id(args.session)
        args.root = open_store(args.state_dir or os.environ.get("RESUMABLE_STATE_DIR") or "state")
        code = _COMMANDS[args.command](args)
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            raise _StdoutClosed from None
    except _StdoutClosed:
        # `resumable history | head`: the reader has all it wanted. End quietly, and keep
        # the interpreter's own flush at exit from failing again (as the Python docs advise).
        with contextlib.suppress(AttributeError, OSError, ValueError):  # (no real file: nothing to flush)
            fd = sys.stdout.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)
        return EXIT_OK
    except _NoState as exc:
        return _fail(f"no state in {exc.args[0]} (nothing has run with this state directory)", EXIT_NO_STATE)
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except StateLockedError as exc:
        return _fail(f"{exc} {_LIVE_RUN}", EXIT_FAILED)
    except (ResumableError, OSError) as exc:
        return _fail(str(exc), EXIT_FAILED)
    return code


# A process whose steps ran outside `with Pipeline(...)` holds its run until it exits.
_LIVE_RUN = (
    "If that process is a notebook, a REPL or a service that called steps, its run lasts until "
    "it exits: make the change from inside it (Pipeline().reset('STEP'), .rollback(...)), or end it."
)


def _fail(message: str, code: int) -> int:
    print(f"resumable: {message}", file=sys.stderr)  # noqa: T201
    return code
