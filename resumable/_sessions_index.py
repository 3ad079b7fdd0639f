"""
The index of a store's named sessions: one summary per session, for ``sessions`` and
``status``. It is a cache: each session's own files are the truth, and a summary lost to a
crash is read from them again.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import stat
from collections.abc import Iterator, Mapping
from typing import Any

from ._slots import SESSIONS_DIR, decode_key, encode_key
from ._stores import Store
from ._stores._local import LocalStore
from ._stores._prefix import sub_store

INDEX_LOG = f"{SESSIONS_DIR}/.index.jsonl"
INDEX_DIR = f"{SESSIONS_DIR}/.index"
_MIN_COMPACT = 64 * 1024  # a log smaller than this is never compacted
_MAX_NAME = 240  # characters of an index object's name (file systems allow 255 bytes)
_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK


def index_of(store: Store) -> LogIndex | ObjectIndex:
    """The index of *store*'s sessions (*store* is the root: the default session's store)."""
    if isinstance(store, LocalStore):
        return LogIndex(store)
    return ObjectIndex(store)


def _line(record: Mapping[str, Any]) -> bytes:
    # what is None or empty is left out (read back as such): a smaller index reads faster
    kept = {k: v for k, v in record.items() if v is not None and v != {}}
    return json.dumps(kept, separators=(",", ":"), ensure_ascii=False, default=str).encode() + b"\n"


def _parsed(text: bytes) -> Any:
    """The JSON value of *text*, or None if it is not JSON (a kill cut it short, or it is damaged)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


class LogIndex:
    """
    A local directory's ``.sessions/.index.jsonl``: one JSON line per change (a whole summary,
    or a removal), appended under a ``flock`` of the log and compacted (its fold, renamed over
    it) when it has grown to twice its folded size. A line cut by a kill is skipped.
    """

    def __init__(self, store: LocalStore) -> None:
        self.store = store
        self.log = store.path(INDEX_LOG)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[tuple[int, int]]:
        """The log open for appending under its ``flock`` (reopened if compaction replaced it), its size."""
        while True:
            try:
                fd = os.open(self.log, _APPEND, 0o600)
            except FileNotFoundError:
                os.makedirs(os.path.dirname(self.log), mode=0o700, exist_ok=True)
                fd = os.open(self.log, _APPEND, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                held = os.fstat(fd)
                if held.st_ino == os.stat(self.log).st_ino:
                    yield fd, held.st_size
                    return
            finally:
                os.close(fd)  # drops the flock

    def put(self, summary: Mapping[str, Any], *, durable: bool = False) -> None:
        """Record *summary* (a dict with an ``id``) as the session's current one."""
        data = _line(summary)
        with self._locked() as (fd, size):
            if size and os.pread(fd, 1, size - 1) != b"\n":
                data = b"\n" + data  # the last append was cut by a kill: start a new line
            os.write(fd, data)
            if durable:
                os.fsync(fd)
            if size > _MIN_COMPACT and size + len(data) > 2 * max(_folded_size(fd), _MIN_COMPACT // 2):
                self._compact(durable=durable)

    def drop(self, session: str, *, durable: bool = False) -> None:
        """Forget *session* (deleted)."""
        self.put({"id": session, "deleted": True}, durable=durable)

    def read(self) -> dict[str, dict[str, Any]]:
        """Every session's summary, by id (the log folded); reads only, takes no lock."""
        try:
            fd = os.open(self.log, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
        except (FileNotFoundError, NotADirectoryError):
            return {}
        with open(fd, "rb") as f:
            data = f.read() if stat.S_ISREG(os.fstat(fd).st_mode) else b""  # not a file: no summaries
        found: dict[str, dict[str, Any]] = {}
        for rec in map(_parsed, data.splitlines()):  # a line cut short by a kill, or damaged, is None
            if type(rec) is not dict or type(sid := rec.get("id")) is not str:
                continue
            if rec.get("deleted"):
                found.pop(sid, None)
            else:
                found[sid] = rec
        return found

    def compact(self) -> None:
        """Rewrite the log as its fold."""
        if os.path.exists(self.log):
            with self._locked():
                self._compact(durable=False)

    def _compact(self, *, durable: bool) -> None:
        summaries = self.read()
        body = b"".join(_line(s) for s in summaries.values())
        head = _line({"id": "", "deleted": True, "folded": len(body)})  # says how large the fold was
        self.store.write(INDEX_LOG, [head, body], durable=durable)


def _folded_size(fd: int) -> int:
    """The size of the fold the log starts with, as its first line says (0 if it says none)."""
    rec = _parsed(os.pread(fd, 128, 0).split(b"\n", 1)[0])
    if isinstance(rec, dict) and rec.get("id") == "" and isinstance(rec.get("folded"), int):
        return int(rec["folded"])
    return 0


class ObjectIndex:
    """
    Other stores: an object per session, ``.sessions/.index/<id encoded>/<name>``, written by
    the holder of the session's lock (the new one, then the old one deleted). Its name is its
    summary (base64 of the JSON) where that fits in :data:`_MAX_NAME` characters, so a listing
    (on S3 a request per 1,000 sessions) reads the index; the other objects are read.
    """

    def __init__(self, store: Store) -> None:
        self.store = sub_store(store, INDEX_DIR)

    def put(self, summary: Mapping[str, Any], *, durable: bool = False) -> None:
        sid = summary["id"]
        old = self.store.list(f"{encode_key(sid)}/")
        name = base64.urlsafe_b64encode(_line({**summary, "id": None})[:-1]).rstrip(b"=").decode()
        if len(name) > _MAX_NAME:
            name = f"~{os.urandom(8).hex()}"  # not a summary: read
        key = f"{encode_key(sid)}/{name}"
        self.store.write(key, [_line(summary)], durable=durable)
        for k in old:
            if k != key:
                self.store.delete(k, durable=durable)

    def drop(self, session: str, *, durable: bool = False) -> None:
        for key in self.store.list(f"{encode_key(session)}/"):
            self.store.delete(key, durable=durable)

    def compact(self) -> None:
        """Nothing to do: no log."""

    def read(self) -> dict[str, dict[str, Any]]:
        """The summaries: from the objects' names, else read (on a remote store in threads)."""
        found: list[dict[str, Any]] = []
        unread: list[str] = []
        for key in self.store.list():
            folder, _, name = key.partition("/")
            sid = decode_key(folder) or None  # (no session has the empty id)
            summary = _named(name)
            if sid is not None and isinstance(summary, dict):
                found.append({**summary, "id": sid})
            elif name:
                unread.append(key)

        def one(key: str) -> bytes:
            try:
                return bytes(self.store.read(key))
            except FileNotFoundError:
                return b""  # replaced meanwhile: its successor is listed too, or it was deleted

        if len(unread) > 8 and self.store.slow_appends:  # a remote store: a round trip each
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - kept out of import resumable

            with ThreadPoolExecutor(16) as pool:
                datas = list(pool.map(one, unread))
        else:
            datas = [one(k) for k in unread]
        found += [s for s in map(_parsed, datas) if isinstance(s, dict) and isinstance(s.get("id"), str)]
        # two objects of one session (a writer killed between writing one and deleting the other): the newer
        found.sort(key=lambda s: str(s.get("updated_at", "")))
        return {s["id"]: s for s in found}


def _named(name: str) -> Any:
    """The summary an index object's name holds (None if it holds none)."""
    if not name or name.startswith("~"):
        return None
    try:
        return _parsed(base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)))
    except ValueError:  # not base64
        return None
