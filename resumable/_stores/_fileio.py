"""Low-level file writing for the local store."""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from ._base import Buffer

_WRITE_MAX = 1 << 30  # bytes per write() call; Linux caps a single write just below 2 GiB


def fsync_dir(path: str) -> None:
    """fsync a directory, so that the names created or renamed in it survive a power loss."""
    fsync_path(path, os.O_DIRECTORY)


def fsync_path(path: str, flags: int = os.O_NOFOLLOW) -> None:
    """Open *path* read-only (with *flags*), fsync it and close it; an error names *path*."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
    except OSError as exc:
        raise with_path(exc, path) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise with_path(exc, path) from exc
    finally:
        os.close(fd)


def with_path(exc: OSError, path: str) -> OSError:
    """The same kind of error, naming *path* (os.write errors carry no file name)."""
    if exc.filename is not None:
        return exc
    return type(exc)(exc.errno, exc.strerror, path)


def write_all(fd: int, chunks: Sequence[Buffer]) -> None:
    """Write every byte of *chunks*, going on after short writes; complete or raise."""
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            written = os.write(fd, view[:_WRITE_MAX])
            if written <= 0:  # no progress: the disk is full (a regular file never returns 0 else)
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            view = view[written:]


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of *data* at *offset*, going on after short writes; complete or raise."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[written:], offset + written
