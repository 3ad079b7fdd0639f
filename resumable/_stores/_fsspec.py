"""
Stores reached through fsspec: ``s3://bucket/prefix`` and any other fsspec URL.

Every object is written whole: one PUT on object stores, elsewhere a temporary object moved
over its key. Appended keys are kept as segments, the run lock is a lease, and the listing
is kept up to date while the lease is held (docs/storage.md, "S3 and other fsspec URLs":
its layout, "The event log on an object store", "One run at a time: the lease").
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import re
import threading
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from .._slots import INTERNAL_DIR, SESSIONS_DIR
from ..exceptions import ResumableError
from ._base import Buffer, Store, check_key, is_temp, with_path
from ._lease import LEASE_KEY, Lease, LeaseConflict, ttl_seconds

# Protocols where writing an object in one request is atomic.
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"})
_SESSIONS = SESSIONS_DIR + "/"
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


def _is_precondition_failure(exc: OSError) -> bool:
    if isinstance(exc, FileExistsError):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    if code in {"PreconditionFailed", "ConditionalRequestConflict"}:
        return True
    return "pre-condition" in str(exc).lower() or "precondition" in str(exc).lower()


class FsspecStore(Store):
    """
    A store at any fsspec URL (``s3://bucket/prefix``, ``gs://...``, ``memory://...``).

    Args:
        url: where the state lives.
        storage_options: passed to fsspec (endpoint, credentials, ...).
        lease_ttl: seconds the run's lease lives without renewal (default
            ``$RESUMABLE_LEASE_TTL``, else 30); it is renewed every third of that.
    """

    slow_appends = True  # the journal appends in batches: each append is one PUT

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, *, lease_ttl: float | None = None
    ) -> None:
        try:
            import fsspec  # noqa: PLC0415 - an optional dependency, imported when used

            fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except ImportError as exc:  # fsspec itself, or the package of the URL's protocol (s3fs ...)
            msg = f'cannot open store {url!r}: {exc}; pip install "resumable[remote]"'
            raise ResumableError(msg) from None
        except (ValueError, OSError, TypeError) as exc:
            msg = f"cannot open store {url!r}: {type(exc).__name__}: {exc}"
            raise ResumableError(msg) from None
        self.fs: Any = fs
        self.location = url.rstrip("/") or url
        self._prefix = root if root.endswith("/") else f"{root}/"
        protocols = {fs.protocol} if isinstance(fs.protocol, str) else set(fs.protocol)
        self.atomic_put = bool(protocols & _OBJECT_STORES)
        self._s3 = bool(protocols & {"s3", "s3a"})
        self._one_request: dict[str, Any] = {"max_concurrency": 1} if self._s3 else {}
        self._fresh: dict[str, Any] = {"refresh": True} if self._s3 else {}  # not from s3fs's cache
        self.lease_ttl = ttl_seconds(lease_ttl, self.location)
        self._mutex = threading.RLock()
        self._append_lock = threading.Lock()
        self._lease: Lease | None = None
        self._index: Index | None = None

    def __repr__(self) -> str:
        return f"FsspecStore({self.location!r})"

    def _path(self, key: str) -> str:
        return self._prefix + check_key(key, self.location)

    def _where(self, key: str) -> str:
        return f"{self.location}/{key}"

    def _find(self, directory: str) -> builtins.list[str]:
        """The paths of every object under *directory* ("" for all), listed afresh."""
        path = self._path(directory).rstrip("/")
        self.fs.invalidate_cache(path)
        try:
            return builtins.list(self.fs.find(path))
        except FileNotFoundError:
            return []

    def _scan(self, *dirs: str) -> Index:
        """The objects under the directories *dirs*, and the segments of appended keys there."""
        index = Index()
        for d in dirs:
            for path in self._find(d):
                rel = path.removeprefix(self._prefix)
                if rel.startswith(SEGMENTS + "/"):
                    key, _, name = rel[len(SEGMENTS) + 1 :].rpartition("/")
                    m = _SEGMENT_NAME.fullmatch(name)
                    if key and m is not None:
                        seg = Segment(int(m[1], 16), int(m[2], 16), int(m[3]))
                        index.logs.setdefault(key, set()).add(seg)
                # (named sessions are stores of their own)
                elif not (rel.startswith(_SESSIONS) or rel == LEASE_KEY or is_temp(rel)):
                    index.objects.add(rel)
        return index

    def _known(self) -> Index | None:
        """The listing kept while this store holds the lease (built on first use), else None."""
        with self._mutex:
            lease = self._lease
            if lease is None or lease.lost:
                return None
            if self._index is None:
                self._index = self._scan("")
            return self._index

    def _note(self, key: str, *, present: bool) -> None:
        """Keep the listing held with the lease true after *key* was written or deleted."""
        with self._mutex:
            if self._index is not None:
                (self._index.objects.add if present else self._index.objects.discard)(key)

    def _check_fence(self) -> None:
        lease = self._lease
        if lease is not None:
            lease.check()

    def _cat(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes *start* to *end* of the plain object at *key*."""
        path, where = self._path(key), self._where(key)
        try:
            # (a whole object in one GET: s3fs would send a HEAD first to split a large one into parts)
            return bytes(self.fs.cat_file(path, start=start or None, end=end, **self._one_request))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such object", where) from None
        except OSError as exc:
            if start == 0 and end is None:
                raise with_path(exc, where) from exc
            # a range past the end is an error on S3; locally it reads nothing
            try:
                size = int(self.fs.info(path, **self._fresh)["size"])
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "No such object", where) from None
            if start >= size:
                return b""
            raise with_path(exc, where) from exc

    def _plain(self, key: str, start: int = 0, end: int | None = None) -> bytes | None:
        """Bytes *start* to *end* of the plain object at *key*; None if there is none."""
        known = self._known()
        with self._mutex:
            if known is not None and key not in known.objects:
                return None  # (no request: the listing held with the lease knows)
        try:
            return self._cat(key, start, end)
        except FileNotFoundError:
            return None

    def read(self, key: str, start: int = 0, end: int | None = None) -> bytes | bytearray:
        if end is not None and end <= start:
            self.read(key, 0, 1)  # nothing to read, but a missing key is still an error
            return b""
        data = self._plain(key, start, end)
        if data is None:
            data = self._read_log(key, start, end)  # (no segments either: FileNotFoundError)
        # a whole object in a fresh writable buffer, as from a local file: arrays decoded from it are writable
        return bytearray(data) if start == 0 and end is None else data

    def _put(self, path: str, data: bytes | bytearray, where: str) -> None:
        """Write one object atomically: one PUT on object stores, else a temp object and a move."""
        try:
            if self.atomic_put:
                self.fs.pipe_file(path, data)
                return
            directory, _, name = path.rpartition("/")
            tmp = f"{directory}/.{name}.{uuid.uuid4().hex[:16]}.tmp"
            try:
                self.fs.pipe_file(tmp, data)
            except FileNotFoundError:
                self.fs.makedirs(directory, exist_ok=True)
                self.fs.pipe_file(tmp, data)
            try:
                self.fs.mv(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    self.fs.rm_file(tmp)
                raise
        except OSError as exc:
            raise with_path(exc, where) from exc

    def _rm(self, paths: Sequence[str]) -> None:
        """Delete objects; absent ones are no error."""
        if not paths:
            return
        if self._s3:
            self.fs.rm(list(paths))  # one bulk request per 1,000 keys; missing keys are fine
            return
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(p)

    def write(self, key: str, chunks: Sequence[Buffer], *, durable: bool) -> None:  # noqa: ARG002 - a PUT is durable once it returns
        self._check_fence()
        data = b"".join(chunks)
        self._put(self._path(key), data, self._where(key))
        self._note(key, present=True)
        # the plain object now wins over any segments: drop them
        self._drop_log(key)

    def copy(self, src: str, dst: str, *, durable: bool) -> None:
        """Make *dst* a copy of *src*, atomically; on object stores the server copies it."""
        self._check_fence()
        if not self.atomic_put or self._segments(src):
            self.write(dst, [self.read(src)], durable=durable)
            return
        try:
            self.fs.cp_file(self._path(src), self._path(dst))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such object", self._where(src)) from None
        except OSError as exc:
            raise with_path(exc, self._where(dst)) from exc
        self._note(dst, present=True)
        self._drop_log(dst)

    def delete(self, key: str, *, durable: bool) -> None:  # noqa: ARG002 - a DELETE is durable once it returns
        self._check_fence()
        if self._segments(key):
            # an empty plain object wins over the segments while they are deleted, so no
            # reader ever sees some of them
            self._put(self._path(key), b"", self._where(key))
            self._drop_log(key)
        try:
            self._rm([self._path(key)])
        except OSError as exc:
            raise with_path(exc, self._where(key)) from exc
        self._note(key, present=False)

    def list(self, prefix: str = "") -> list[str]:
        known = self._known()
        if known is not None:
            with self._mutex:
                keys = known.keys()
        else:
            base = prefix.rpartition("/")[0]
            keys = (self._scan(base, f"{SEGMENTS}/{base}") if base else self._scan("")).keys()
        return sorted(k for k in keys if k.startswith(prefix))

    def remove_temp_files(self, *, dry_run: bool = False) -> builtins.list[str]:
        """Delete what a killed writer left: temp objects, unfinished S3 multipart uploads."""
        temps = [] if self.atomic_put else [p for p in self._find("") if is_temp(p)]
        if not dry_run:
            self._rm(temps)
        removed = [p.removeprefix(self._prefix) for p in temps]
        if self._s3:
            removed += self._abort_uploads(dry_run=dry_run)
        return removed

    def _abort_uploads(self, *, dry_run: bool) -> builtins.list[str]:
        """The keys of unfinished multipart uploads under the prefix, aborted unless *dry_run*."""
        bucket, _, prefix = self._prefix.partition("/")
        try:
            found = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
            uploads = found.get("Uploads", [])
            for up in uploads if not dry_run else ():
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"]
                )
        except OSError:
            return []  # e.g. not allowed by the bucket policy: a lifecycle rule cleans them up
        return [str(up["Key"])[len(prefix) :] for up in uploads]

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
                return self._cat_ranges(paths, starts, ends)
            except FileNotFoundError:
                continue  # merged and deleted since the listing: look again
            except OSError as exc:
                raise with_path(exc, where) from exc
        raise self._damaged_log(key, gap)

    def _cat_ranges(self, paths: Sequence[str], starts: Sequence[int], ends: Sequence[int | None]) -> bytes:
        """Byte ranges of several objects, fetched concurrently and joined."""
        parts = self.fs.cat_ranges(paths, starts, ends)
        for p in parts:
            if isinstance(p, BaseException):
                raise p
        return b"".join(parts)

    def _damaged_log(self, key: str, gap: int | None) -> OSError:
        return OSError(
            errno.EIO,
            f"the appended segments of this object are incomplete (missing bytes from offset {gap}); "
            f"delete the objects under {self._where(SEGMENTS)}/{key}/ to drop it",
            self._where(key),
        )

    def _rm_segments(self, key: str, segments: Iterable[Segment]) -> None:
        segments = builtins.list(segments)
        self._rm([self._seg_path(key, s) for s in segments])
        with self._mutex:
            if self._index is not None:
                self._index.logs.get(key, set()).difference_update(segments)

    def _drop_log(self, key: str) -> None:
        self._rm_segments(key, self._segments(key))

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
                if not chain:  # (_tail turned a plain object into segments)
                    self._put(self._path(key), b"", self._where(key))
                    self._note(key, present=True)
                return
            start = chain[-1].end if chain else 0
            seg = Segment(start, start + len(data), 0)
            self._add_segment(key, seg, bytes(data))
            chain.append(seg)
            self._merge(key, chain)

    def _tail(self, key: str) -> builtins.list[Segment]:
        """The chain of segments *key* consists of, turning a plain object into one first."""
        segments = self._segments(key)
        data = self._plain(key)
        if data is not None:
            # the plain object is the content, its segments leftovers of an interrupted write
            # or conversion: copy it into a segment, then delete it
            self._rm_segments(key, segments)
            chain = [Segment(0, len(data), _COPY_LEVEL)] if data else []
            for seg in chain:
                self._add_segment(key, seg, data)
            self._rm([self._path(key)])
            self._note(key, present=False)
            return chain
        chain, stale, gap = chain_of(segments)
        if gap is not None:
            raise self._damaged_log(key, gap)
        if stale:  # leftovers of a merge cut short
            self._rm_segments(key, stale)
        return chain

    def _merge(self, key: str, chain: builtins.list[Segment]) -> None:
        """Merge every FANOUT segments of one level at the end of *chain* into one."""
        while len(chain) >= FANOUT:
            group = chain[-FANOUT:]
            level = group[-1].level
            if level >= _COPY_LEVEL or any(s.level != level for s in group):
                return
            paths = [self._seg_path(key, s) for s in group]
            merged = Segment(group[0].start, group[-1].end, level + 1)
            self._add_segment(key, merged, self._cat_ranges(paths, [0] * FANOUT, [None] * FANOUT))
            chain[-FANOUT:] = [merged]
            self._rm_segments(key, group)

    def lock(self, holder: Mapping[str, Any]) -> Lease:
        lease = Lease(self, holder, ttl=self.lease_ttl)
        lease.acquire()
        with self._mutex:
            self._lease, self._index = lease, None
        return lease

    def lease_released(self, lease: Lease) -> None:
        """*lease* was given up: forget the listing kept while it was held."""
        with self._mutex:
            if self._lease is lease:
                self._lease, self._index = None, None

    def lease_read(self) -> bytes | None:
        """The lease object, or None if there is none."""
        try:
            return self._cat(LEASE_KEY)
        except FileNotFoundError:
            return None

    def lease_tag(self) -> str | None:
        """The version tag (ETag) of the lease object now, or None if there is none."""
        path = self._path(LEASE_KEY)
        try:
            if self._s3:
                return str(self.fs.info(path, **self._fresh)["ETag"])
            return bytes(self.fs.cat_file(path)).hex()  # (no versions here: the content is the version)
        except FileNotFoundError:
            return None

    def lease_write(self, data: bytes, *, expect: str | None) -> str:
        """Write the lease if its version (tag) is *expect* (None: if there is none); return the new tag."""
        path = self._path(LEASE_KEY)
        if not self._s3:
            # no conditional writes: check, then write (the lease reads its write back)
            if self.lease_tag() != expect:
                raise LeaseConflict
            self._put(path, data, self._where(LEASE_KEY))
            return data.hex()
        try:
            if expect is None:
                out = self.fs.pipe_file(path, data, mode="create")
            else:
                out = self.fs.pipe_file(path, data, IfMatch=expect)
        except FileNotFoundError:
            raise LeaseConflict from None  # deleted since: If-Match has nothing to match
        except OSError as exc:
            if _is_precondition_failure(exc):
                raise LeaseConflict from None
            raise with_path(exc, self._where(LEASE_KEY)) from exc
        return str(out["ETag"])

    def lease_delete(self, *, expect: str) -> None:
        """Delete the lease if its version is *expect*; raise :class:`LeaseConflict` otherwise."""
        path = self._path(LEASE_KEY)
        if self.lease_tag() != expect:
            raise LeaseConflict
        if self._s3:
            bucket, _, key = path.partition("/")
            try:
                self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=expect)
            except FileNotFoundError:
                return
            except OSError as exc:
                if _is_precondition_failure(exc):
                    raise LeaseConflict from None
                # a server without conditional deletes: checked just above, delete plainly
                self._rm([path])
            return
        self._rm([path])
