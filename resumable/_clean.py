"""``resumable clean``: drop old history and the outputs of steps that no longer exist."""

from __future__ import annotations

import datetime as dt
import functools
from typing import TYPE_CHECKING

from . import _history
from ._session import chunks_of_completed
from ._slots import batch_dir, is_output_file, records_file, slot_file, step_of
from ._stores import Store

if TYPE_CHECKING:
    from ._pipeline import Pipeline


def clean(pipe: Pipeline, *, older_than: dt.timedelta, dry_run: bool = False) -> list[tuple[str, int]]:
    """
    ``resumable clean`` (docs/cli.md), holding the run lock; also the row chunks of steps
    that completed (left when a process died in between). Steps never recorded as defined
    are kept: an output is only removed when runs have shown its step is gone. Returns
    ``("<key> (<what>)", size)`` for each file removed (or, with *dry_run*, to remove).
    """
    removed: list[tuple[str, int]] = []
    cutoff = (dt.datetime.now(dt.UTC) - older_than).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    with pipe._maintenance() as run:  # noqa: SLF001 - the CLI's own pipeline
        store = run.store  # (the run may be one this process has open through another pipeline)
        remove = functools.partial(_remove, store, removed, dry_run=dry_run)
        run.journal.write_pending(durable=False)  # the log must hold every event replayed
        manifest = run.journal.manifest
        for key in _history.unneeded_versions(store, run.secret, pipe.keep_checkpoints, manifest, cutoff):
            remove(key, "old version")
        # gone: not defined by the latest runs, and not defined since the cutoff either
        latest = max(manifest.defined.values(), default="")
        gone = sorted(name for name, when in manifest.defined.items() if when < min(latest, cutoff))
        slots = {k[: -len(".msgpack")] for k in store.list() if is_output_file(k)} | set(manifest.steps)
        dead = sorted(s for s in slots if step_of(s) in gone)
        # a step whose process died between writing its output and deleting its chunks
        for slot, key in chunks_of_completed(store, set(manifest.completed_steps).__contains__):
            remove(key, f"row chunk of completed step {slot!r}")
        for slot in dead:
            what = f"of removed step {step_of(slot)!r}"
            remove(slot_file(slot), f"output {what}")
            for key in store.list(batch_dir(slot)):
                remove(key, f"row chunk {what}")
        # holding the lock: no one is writing these, they are what killed writers left
        for key in store.remove_temp_files(dry_run=True):
            remove(key, "temporary file left by a killed run")
        if not dry_run and (dead or gone):
            run.journal.record("steps_removed", slots=dead, steps=gone)
        for name in gone:  # after the event, which drops their records
            remove(records_file(name), f"records of removed step {name!r}")
    return removed


def _remove(store: Store, removed: list[tuple[str, int]], key: str, what: str, *, dry_run: bool) -> None:
    try:
        size = len(store.read(key, 0, None))
    except FileNotFoundError:
        return
    removed.append((f"{key} ({what})", size))
    if not dry_run:
        store.delete(key, durable=False)
