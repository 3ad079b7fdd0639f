"""
Digests of the files a ``pathlib.Path`` argument names, with a stat cache kept in the state
directory (docs/concepts.md). A file is fingerprinted by its contents, a directory by the
names and contents of the files under it, a missing path by its name. A digest is
remembered with the file's size, mtime, ctime, inode and device, unless the file changed
within the last two seconds (git's "racy clean" rule).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from typing import TYPE_CHECKING, Any

import blake3

from ._codec import encode, frame, read_verified

if TYPE_CHECKING:
    from ._stores import Store

log = logging.getLogger("resumable")

CACHE_KEY = ".resumable/file-digests.msgpack"
_MAX_ENTRIES = 100_000
_READ_SIZE = 1 << 20
_RACY_NS = 2_000_000_000  # "racy clean" (see above): two seconds covers FAT's mtime clock

_Signature = tuple[int, int, int, int, int]  # size, mtime_ns, ctime_ns, inode, device


class FileDigests:
    """The stat cache: absolute path -> (signature, BLAKE3 digest of the contents)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[_Signature, bytes]] = {}
        self._lock = threading.Lock()
        self.dirty = False

    def digest(self, path: os.PathLike[str]) -> bytes | None:
        """
        The digest of the file or directory at *path* (32 bytes, a directory's tagged
        differently), or None if nothing is there (the caller then uses the name).
        """
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:  # unreadable: fingerprinting must not guess
            msg = f"cannot read {os.fspath(path)!r} to fingerprint it: {exc}"
            raise OSError(exc.errno, msg) from None
        if stat.S_ISDIR(st.st_mode):
            return self._directory(os.fspath(path))
        if stat.S_ISREG(st.st_mode):
            return self._file(os.path.abspath(path), st)
        return None  # a device, a FIFO, a socket: never read

    def _file(self, path: str, st: os.stat_result) -> bytes:
        signature = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
        known = self._cache.get(path)
        if known is not None and known[0] == signature:
            return known[1]
        digest = blake3.blake3()
        try:
            with open(path, "rb") as f:
                while block := f.read(_READ_SIZE):
                    digest.update(block)
        except OSError as exc:  # unreadable: fingerprinting must not guess
            msg = f"cannot read {path!r} to fingerprint it: {exc.strerror or exc}"
            raise OSError(exc.errno, msg) from None
        result = digest.digest()
        if time.time_ns() - max(st.st_mtime_ns, st.st_ctime_ns) > _RACY_NS:
            with self._lock:
                self._cache[path] = (signature, result)
                self.dirty = True
        return result

    def _directory(self, root: str) -> bytes:
        digest = blake3.blake3(b"directory")
        # sorted full paths: the order of their paths relative to root, which they all start with
        for full in sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files):
            try:
                st = os.stat(full)
            except OSError:
                continue  # removed while walking, or a dangling link
            if not stat.S_ISREG(st.st_mode):
                continue
            name = os.path.relpath(full, root).encode("utf-8", "surrogateescape")
            digest.update(len(name).to_bytes(8, "little") + name)
            digest.update(self._file(os.path.abspath(full), st))
        return digest.digest()

    def attach(self, store: Store, secret: bytes | None) -> None:
        """Merge the cache kept in *store*, as its run opens (anything malformed in it is ignored)."""
        if _in_memory(store):
            return
        try:
            value = read_verified(store.read(CACHE_KEY), secret).decode(allow_pickle=False)
            entries = [entry for entry in value["files"] if _valid(entry)]
        except Exception as exc:  # noqa: BLE001 - a cache: never worth failing a run for
            log.debug("file digest cache not read: %s", exc)
            return
        with self._lock:
            for path, size, mtime, ctime, ino, dev, digest in entries:
                self._cache.setdefault(path, ((size, mtime, ctime, ino, dev), digest))

    def save(self, store: Store, secret: bytes | None) -> None:
        """Write the cache into *store* if it learned anything (best effort: it is a cache)."""
        if not self.dirty or _in_memory(store):
            return
        with self._lock:
            items = list(self._cache.items())[-_MAX_ENTRIES:]
            self.dirty = False
        files = [[path, *signature, digest] for path, (signature, digest) in items]
        try:
            framed = frame(encode({"files": files}, allow_pickle=False), {"slot": CACHE_KEY}, secret=secret)
            store.write(CACHE_KEY, framed.chunks(), durable=False)
        except Exception as exc:  # noqa: BLE001 - a cache: never worth failing a run for
            log.debug("file digest cache not written: %s", exc)

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()
            self.dirty = False


def _in_memory(store: Store) -> bool:
    # A memory store lives no longer than this process, which has the cache already: keeping
    # a copy there would only hold memory (a service may make a store per request).
    return store.location.startswith("memory://")


def _valid(entry: Any) -> bool:
    return (
        type(entry) is list
        and len(entry) == 7
        and type(entry[0]) is str
        and all(type(n) is int for n in entry[1:6])
        and type(entry[6]) is bytes
        and len(entry[6]) == 32
    )


file_digests = FileDigests()
