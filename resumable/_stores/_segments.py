"""
Appended keys of the fsspec store, kept as segments.

Object stores cannot append, so an appended key (the event log) is kept as numbered
*segments*, ``.resumable/segments/<key>/<start>-<end>.<level>``: each append writes one
segment named by the byte range it holds, and reading the key joins the segments from
byte 0. Every 16 segments of one level at the end of the log are merged into one of the
next level, so a log of *n* appends has O(log n) segments and each byte is rewritten
O(log n) times. While two segments cover the same bytes (a merge not yet cleaned up),
the longer one is read. If the key also exists as a plain object (written with ``write``,
or a log copied from a local state directory), that object is the key's content and its
segments are leftovers; the first append copies it into a segment and then deletes it.

:class:`SegmentedLogs` is the part of :class:`~resumable._stores._fsspec.FsspecStore`
that does this, on top of the store's whole-object operations and its listing.
"""

from __future__ import annotations

import errno
import re
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from .._slots import INTERNAL_DIR
from ._base import with_path

SEGMENTS = f"{INTERNAL_DIR}/segments"
FANOUT = 16  # segments of one level merged into one of the next
_COPY_LEVEL = 99  # a plain object turned into a segment: never merged again
_READ_ATTEMPTS = 4
_SEGMENT_NAME = re.compile(r"([0-9a-f]{16})-([0-9a-f]{16})\.(\d+)")


class Segment(NamedTuple):
    """Bytes ``start`` to ``end`` of an appended key; merged ``level`` times."""

    start: int
    end: int
    level: int

    @property
    def name(self) -> str:
        return f"{self.start:016x}-{self.end:016x}.{self.level}"

    @classmethod
    def parse(cls, name: str) -> Segment | None:
        m = _SEGMENT_NAME.fullmatch(name)
        if m is None:
            return None
        return cls(int(m[1], 16), int(m[2], 16), int(m[3]))


def chain_of(segments: Iterable[Segment]) -> tuple[list[Segment], list[Segment], int | None]:
    """
    The segments that make up the key from byte 0 (the longest one at each offset), the
    leftovers they cover, and the offset of a gap if some segment lies beyond it.
    """
    segments = list(segments)
    best: dict[int, Segment] = {}
    for s in segments:
        if s.end > s.start and (s.start not in best or s.end > best[s.start].end):
            best[s.start] = s
    chain: list[Segment] = []
    pos = 0
    while pos in best:
        chain.append(best[pos])
        pos = best[pos].end
    used = set(chain)
    stale = [s for s in segments if s not in used and s.end <= pos]
    gap = any(s not in used and s.end > pos for s in segments)
    return chain, stale, pos if gap else None


class Index:
    """What the store holds: plain objects, and the segments of appended keys."""

    def __init__(self) -> None:
        self.objects: set[str] = set()
        self.logs: dict[str, set[Segment]] = {}

    def keys(self) -> set[str]:
        return self.objects | {k for k, segs in self.logs.items() if segs}


class SegmentedLogs:
    """
    The appended keys of a store, each kept as a chain of segment objects.

    A base of :class:`~resumable._stores._fsspec.FsspecStore`, which sets the attributes
    declared here in its ``__init__`` and provides the whole-object operations and the
    listing declared under ``TYPE_CHECKING``. While the store holds the run's lease, its
    listing (``_index``) knows every segment, so an append costs one PUT.
    """

    fs: Any
    _mutex: threading.RLock
    _append_lock: threading.Lock
    _index: Index | None
    _fresh: dict[str, Any]

    if TYPE_CHECKING:

        def _path(self, key: str) -> str: ...
        def _where(self, key: str) -> str: ...
        def _scan(self, *dirs: str) -> Index: ...
        def _known(self) -> Index | None: ...
        def _note(self, key: str, *, present: bool) -> None: ...
        def _check_fence(self) -> None: ...
        def _cat(self, path: str, where: str, start: int = 0, end: int | None = None) -> bytes: ...
        def _put(self, path: str, data: bytes | bytearray, where: str) -> None: ...
        def _rm(self, paths: Sequence[str]) -> None: ...

    def _seg_path(self, key: str, seg: Segment) -> str:
        return self._path(f"{SEGMENTS}/{key}/{seg.name}")

    def _segments(self, key: str) -> set[Segment]:
        known = self._known()
        if known is not None:
            with self._mutex:
                return set(known.logs.get(key, ()))
        # only this key's segments: one narrow listing, not the key's whole directory
        return self._scan(f"{SEGMENTS}/{key}").logs.get(key, set())

    def _read_log(self, key: str, start: int, end: int | None) -> bytes:
        where = self._where(key)
        for _ in range(_READ_ATTEMPTS):
            segments = self._segments(key)
            if not segments:
                raise FileNotFoundError(errno.ENOENT, "No such object", where)
            chain, _, gap = chain_of(segments)
            if gap is not None:
                continue  # listed while a merge was being cleaned up, or damaged: look again
            paths, starts, ends = [], [], []
            for seg in chain:
                if seg.end <= start or (end is not None and seg.start >= end):
                    continue
                paths.append(self._seg_path(key, seg))
                starts.append(max(start - seg.start, 0))
                ends.append(None if end is None or end >= seg.end else end - seg.start)
            if not paths:
                return b""
            try:
                return b"".join(self._cat_many(paths, starts, ends))
            except FileNotFoundError:
                continue  # merged and deleted since the listing: look again
            except OSError as exc:
                raise with_path(exc, where) from exc
        raise self._damaged_log(key, gap)

    def _cat_many(self, paths: list[str], starts: list[int], ends: list[int | None]) -> list[bytes]:
        """Byte ranges of several objects, fetched concurrently."""
        if not paths:
            return []
        parts = self.fs.cat_ranges(paths, starts, ends)
        for p in parts:
            if isinstance(p, BaseException):
                raise p
        return [bytes(p) for p in parts]

    def _damaged_log(self, key: str, gap: int | None) -> OSError:
        return OSError(
            errno.EIO,
            f"the appended segments of this object are incomplete (missing bytes from offset {gap}); "
            f"delete the objects under {self._where(SEGMENTS)}/{key}/ to drop it",
            self._where(key),
        )

    def _drop_log(self, key: str) -> None:
        segments = self._segments(key)
        if segments:
            self._rm([self._seg_path(key, s) for s in segments])
            self._forget_segments(key, segments)

    def _delete_log(self, key: str) -> None:
        """Delete *key*'s segments, if it has any, leaving an empty plain object in their place."""
        segments = self._segments(key)
        if segments:
            # an empty plain object wins over the segments while they are deleted, so no
            # reader ever sees some of them
            self._put(self._path(key), b"", self._where(key))
            self._drop_log(key)

    def _forget_segments(self, key: str, segments: Iterable[Segment]) -> None:
        with self._mutex:
            if self._index is not None:
                self._index.logs.get(key, set()).difference_update(segments)

    def _add_segment(self, key: str, seg: Segment, data: bytes) -> None:
        self._put(self._seg_path(key, seg), data, self._where(key))
        with self._mutex:
            if self._index is not None:
                self._index.logs.setdefault(key, set()).add(seg)

    def append(self, key: str, data: bytes, *, durable: bool) -> None:  # noqa: ARG002 - a PUT is durable once it returns
        self._check_fence()
        with self._append_lock:
            chain = self._tail(key)
            if not data:
                if not chain and not self._exists_plain(key):
                    self._put(self._path(key), b"", self._where(key))
                    self._note(key, present=True)
                return
            start = chain[-1].end if chain else 0
            seg = Segment(start, start + len(data), 0)
            self._add_segment(key, seg, bytes(data))
            chain.append(seg)
            self._merge(key, chain)

    def _exists_plain(self, key: str) -> bool:
        known = self._known()
        if known is not None:
            with self._mutex:
                return key in known.objects
        try:
            self.fs.info(self._path(key), **self._fresh)
        except FileNotFoundError:
            return False
        return True

    def _tail(self, key: str) -> list[Segment]:
        """The chain of segments *key* consists of, turning a plain object into one first."""
        segments = self._segments(key)
        if self._exists_plain(key):
            # the plain object is the content: its segments are leftovers of an interrupted
            # write or conversion; copy it into a segment, then delete it
            self._rm([self._seg_path(key, s) for s in segments])
            self._forget_segments(key, segments)
            data = self._cat(self._path(key), self._where(key))
            chain = []
            if data:
                chain = [Segment(0, len(data), _COPY_LEVEL)]
                self._add_segment(key, chain[0], data)
            self._rm([self._path(key)])
            self._note(key, present=False)
            return chain
        chain, stale, gap = chain_of(segments)
        if gap is not None:
            raise self._damaged_log(key, gap)
        if stale:  # leftovers of a merge cut short
            self._rm([self._seg_path(key, s) for s in stale])
            self._forget_segments(key, stale)
        return chain

    def _merge(self, key: str, chain: list[Segment]) -> None:
        """Merge every FANOUT segments of one level at the end of *chain* into one."""
        while len(chain) >= FANOUT:
            group = chain[-FANOUT:]
            level = group[-1].level
            if level >= _COPY_LEVEL or any(s.level != level for s in group):
                return
            paths = [self._seg_path(key, s) for s in group]
            data = b"".join(self._cat_many(paths, [0] * len(paths), [None] * len(paths)))
            merged = Segment(group[0].start, group[-1].end, level + 1)
            self._add_segment(key, merged, data)
            chain[-FANOUT:] = [merged]
            self._rm(paths)
            self._forget_segments(key, group)
