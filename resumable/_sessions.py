"""
Sessions (SPEC §13): a named session is a store of its own under ``.sessions/<id encoded>/``,
in the default session's layout, with its own lock. This module adds what is about sessions
as a whole: the ``session`` event (id, creation time, parent, metadata), the ``incomplete``
marker of a fork or delete (whoever takes the session's lock next empties it, so a kill never
leaves half a session), the index of summaries, fork, delete, listing, and reading outputs.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ._codec import DamagedFileError, read_verified, utcnow
from ._fingerprint import Outputs, StoredOutput
from ._journal import read_head, read_header
from ._manifest import Record
from ._sessions_index import index_of
from ._slots import (
    INTERNAL_DIR,
    LOCK,
    OBJECTS,
    decode_key,
    is_output_file,
    session_prefix,
    slot_file,
    step_of,
)
from ._stores import Store, check_key
from ._stores._local import NO_LINK, LocalStore
from ._stores._prefix import sub_store
from .exceptions import ResumableError, SessionBusyError, StateLockedError, UsageError

if TYPE_CHECKING:
    from ._journal import Journal
    from ._manifest import Manifest

INCOMPLETE = f"{INTERNAL_DIR}/incomplete"


@attrs.frozen(eq=False, repr=False)
class SessionInfo(Record):
    """One session, as ``pipe.sessions()`` and ``resumable sessions`` list it."""

    id: str
    status: str
    """``running``, ``completed``, ``failed``, ``interrupted``, or ``new`` (never run)."""
    created_at: str
    updated_at: str
    runs: int
    completed: int
    """How many slots are completed."""
    current_step: str | None
    """The slot running, or that failed, when the session was last written."""
    error: str | None
    """The message of the error the last run failed with."""
    bytes: int
    """The size of its completed outputs."""
    parent: str | None
    """The session it was forked from."""
    metadata: dict[str, Any]

    @classmethod
    def of(cls, summary: Mapping[str, Any]) -> SessionInfo:
        """From an index summary: a field left out or of the wrong type (damaged) is None, 0 or empty."""

        def text(key: str) -> str | None:
            value = summary.get(key)
            return value if isinstance(value, str) and value else None

        def count(key: str) -> int:
            value = summary.get(key)
            return value if type(value) is int else 0

        created = text("created_at") or ""
        metadata = summary.get("metadata")
        return cls(
            summary["id"],
            text("status") or "new",
            created,
            text("updated_at") or created,
            count("runs"),
            count("completed"),
            text("current_step"),
            text("error"),
            count("bytes"),
            text("parent"),
            metadata if isinstance(metadata, dict) else {},
        )


# one session's files ---------------------------------------------------------------------


def session_store(root: Store, session: str) -> Store:
    """The store of named session *session* of the store *root*."""
    return sub_store(root, session_prefix(session))


def incomplete(store: Store) -> bool:
    """True if a fork or delete of the session did not finish (its files are garbage)."""
    try:
        store.read(INCOMPLETE, 0, 0)
    except FileNotFoundError:
        return False
    return True


def prepare(store: Store, *, durable: bool) -> None:
    """
    Called holding the session's lock, before its state is read: finish what a killed fork
    or delete left. Every file of the session but its lock goes, the ``incomplete`` marker last.
    """
    if not incomplete(store):
        return
    store.remove_temp_files()
    for key in sorted(store.list(), key=lambda k: -k.count("/")):  # deepest first
        if key not in {INCOMPLETE, LOCK}:
            store.delete(key, durable=False)
    store.delete(INCOMPLETE, durable=durable)


def claim(
    journal: Journal,
    session: str,
    *,
    metadata: Mapping[str, Any] | None = None,
    known: Mapping[str, Any] | None = None,
) -> None:
    """
    Make the manifest of *journal* (an open run's) name *session*, with a ``session`` event if
    it names none or another one (keeping *known* if that was this session's: its state was
    replaced), or if *metadata* is given and differs from what is kept.
    """
    meta: Mapping[str, Any] | None = journal.manifest.session
    if meta is not None and meta.get("id") == session:
        if metadata is None or meta.get("metadata") == metadata:
            return  # (the common case: an open of a session that exists)
    elif known is not None and known.get("id") == session:
        meta = known
    else:
        meta = {"id": session, "created_at": utcnow(), "parent": None, "metadata": {}}
    journal.record("session", **{**meta, **({} if metadata is None else {"metadata": dict(metadata)})})
    # in the log at once, on every store: until a manifest or index is written, nothing else holds it
    journal.write_pending(durable=False)


def record(root: Store, session: str, manifest: Manifest) -> None:
    """Put a session's summary in the index (a cache: a failure to write it is not an error)."""
    meta = manifest.session or {}
    created = meta.get("created_at")
    summary = {
        "id": session,
        "created_at": created,
        "parent": meta.get("parent"),
        "metadata": meta.get("metadata") or {},
        "status": manifest.status if manifest.runs or manifest.completed_steps else "new",
        "updated_at": max(str(manifest.last_update or ""), str(created or "")),
        "runs": manifest.runs,
        "completed": len(manifest.completed_steps),
        "current_step": manifest.current_step,
        "error": f"{manifest.error.type}: {manifest.error.message}"[:500]
        if manifest.error is not None and manifest.status == "failed"
        else None,
        "bytes": manifest.steps.completed_bytes(),
    }
    with contextlib.suppress(OSError):
        index_of(root).put(summary)


# listing ---------------------------------------------------------------------------------


def list_sessions(
    root: Store, *, status: str | None = None, prefix: str | None = None, limit: int | None = None
) -> list[SessionInfo]:
    """The sessions of *root*, newest first (by last update), filtered; reads only."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise UsageError(f"limit must be an int >= 0 or None, got {limit!r}")
    found = [SessionInfo.of(s) for s in index_of(root).read().values()]
    if status is not None:
        found = [s for s in found if s.status == status]
    if prefix is not None:
        found = [s for s in found if s.id.startswith(prefix)]
    found.sort(key=lambda s: (s.updated_at, s.id), reverse=True)
    return found if limit is None else found[:limit]


def exists(root: Store, session: str) -> bool:
    """True if session *session* holds anything (and is not half deleted)."""
    store = session_store(root, session)
    return not incomplete(store) and bool(store.list())


# fork and delete -------------------------------------------------------------------------


def delete(root: Store, session: str, *, durable: bool) -> None:
    """Remove session *session*: the ``incomplete`` marker goes first, whoever opens it next finishes."""
    store = session_store(root, session)
    if not store.list():  # (a half-deleted session lists its marker)
        with contextlib.suppress(OSError):  # the index is a cache (see record)
            index_of(root).drop(session)
        msg = f"no session {session!r} in {root.location} (see `resumable sessions`)"
        raise UsageError(msg)
    try:
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": utcnow(), "argv": ["delete"]}
        lock = store.lock(holder)
    except StateLockedError as exc:
        raise SessionBusyError(session, store.location, exc.holder) from None
    try:
        store.write(INCOMPLETE, [b"delete\n"], durable=True)
        prepare(store, durable=durable)
        with contextlib.suppress(OSError):
            index_of(root).drop(session, durable=durable)
        _remove_dirs(store)
    finally:
        lock.release()


def _remove_dirs(store: Store) -> None:
    """What is left of a deleted local session (files no listing shows, directories), its lock last."""
    if not isinstance(store, LocalStore) or not os.path.isdir(store.root):
        return
    root = store.root
    lock = f"{root}/{LOCK}"
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            if f"{directory}/{name}" != lock:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{directory}/{name}")
        if directory == os.path.dirname(lock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)  # a run waiting for it finds it gone, and takes a new one
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _local_linker(src: Store, dst: Store) -> Callable[[str], bool] | None:
    """
    Between two local session directories: a hard link per file, made straight at its name
    (the new session is empty, locked and marked incomplete: nothing there to replace, no one
    to see a file half made); False where the file system cannot link (then it is copied).
    """
    if not (isinstance(src, LocalStore) and isinstance(dst, LocalStore)):
        return None
    src_root, dst_root = src.root, dst.root
    made: set[str] = set()

    def link(key: str) -> bool:
        check_key(key, dst_root)
        directory = key.rpartition("/")[0]
        if directory and directory not in made:
            path = f"{dst_root}/{directory}"
            os.makedirs(path, mode=0o700, exist_ok=True)
            if os.path.realpath(path) != os.path.join(os.path.realpath(dst_root), directory):
                return False  # a symbolic link on the way: the store's own copy refuses it
            made.add(directory)
        try:
            os.link(f"{src_root}/{key}", f"{dst_root}/{key}", follow_symlinks=False)
        except OSError as exc:
            if exc.errno in NO_LINK:
                return False
            raise
        return True

    return link


def fill_fork(root: Store, src: str, dst: str, store: Store) -> None:
    """
    Holding *dst*'s lock (its store: *store*), before its state is read: finish what a killed
    fork or delete left, mark it incomplete, and copy *src*'s state into it as a run writes it
    (the manifest and the log's whole lines first), linking the outputs (hard links,
    server-side copies). The marker stays until the fork is complete.
    """
    prepare(store, durable=False)
    if store.list():
        msg = f"session {dst!r} already exists in {root.location}: delete it first, or fork into a new id"
        raise UsageError(msg)
    store.write(INCOMPLETE, [b"fork\n"], durable=True)
    source = session_store(root, src)
    link = _local_linker(source, store)
    firsts = read_head(source)
    for key in sorted(source.list()):
        if key in firsts or key in {INCOMPLETE, LOCK}:
            continue
        try:
            if not (is_output_file(key) or key.startswith(f"{OBJECTS}/")):
                store.write(key, [bytes(source.read(key))], durable=False)
            elif link is None or not link(key):
                root.copy(f"{session_prefix(src)}/{key}", f"{session_prefix(dst)}/{key}", durable=False)
        except FileNotFoundError:
            continue  # removed meanwhile (a running source pruned an old version)
    for key, data in firsts.items():
        store.write(key, [data], durable=False)


# reading a session without running it ----------------------------------------------------


def outputs(
    manifest: Manifest, store: Store, step: str, *, secret: bytes | None, allow_pickle: bool
) -> Outputs:
    """The completed outputs of keyed step *step* in a session's *manifest*, key → value, lazily."""

    def load(key: str, slot: str) -> Any:
        try:
            data = store.read(slot_file(slot))
            return read_verified(data, secret).decode(allow_pickle=allow_pickle)
        except FileNotFoundError:
            raise KeyError(key) from None
        except DamagedFileError as exc:
            raise ResumableError(f"{store.location}/{slot_file(slot)} is damaged: {exc}") from None

    found: dict[str, Any] = {}
    for slot in manifest.completed_steps:
        if step_of(slot) == step and "/" in slot and (key := _original_key(store, slot)) is not None:
            found[key] = StoredOutput(slot, "", functools.partial(load, key, slot))
    return Outputs(found)


def _original_key(store: Store, slot: str) -> str | None:
    key = decode_key(slot.split("/", 1)[1])
    if key is not None:
        return key
    try:  # a long key is shortened in its file name: the header has it
        header, _ = read_header(store, slot_file(slot))
    except (FileNotFoundError, DamagedFileError):
        return None
    found = header.get("key")
    return found if isinstance(found, str) else None
