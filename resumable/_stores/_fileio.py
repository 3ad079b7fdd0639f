"""Low-level file writing shared by the local store and its output log."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence

from ._base import Buffer

_WRITE_MAX = 1 << 30  # bytes per write() call; Linux caps a single write just below 2 GiB
ALLOC_STEP = 1024 * 1024
"""A log is allocated this much at a time: a record written within it leaves the file's size as
it is, so the fdatasync that makes it durable has only the record to flush."""
ALLOC_ROOM = 64 * ALLOC_STEP
"""A log is allocated ahead only while its file system has this much free: near a full disk,
the space is the user's (and a file system may hold what it allocates while it fails)."""


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


def allocate_ahead(fd: int, allocated: int, end: int) -> int:
    """
    Allocate the file *fd* (allocated up to *allocated*) at least up to *end*, a step further;
    return how far it is allocated. Where the file system cannot, or has less than
    :data:`ALLOC_ROOM` free, nothing is: the records then extend the file as they are written.
    """
    fallocate = getattr(os, "posix_fallocate", None)  # not on macOS
    if fallocate is None:
        return end
    upto = max(end, allocated + ALLOC_STEP)
    try:
        room = os.fstatvfs(fd)
        if room.f_bavail * room.f_frsize < ALLOC_ROOM:
            return end
        fallocate(fd, allocated, upto - allocated)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, allocated)  # what a failed allocation kept (ext4 keeps a part)
        return end
    return upto


def datasync(fd: int) -> None:
    """Make what was written to *fd* durable, and the metadata needed to read it (not its times)."""
    getattr(os, "fdatasync", os.fsync)(fd)  # (macOS has no fdatasync)
