"""Checksums of stored values: BLAKE3, on several threads for large values."""

from __future__ import annotations

import os

import blake3

Buffer = bytes | bytearray | memoryview
PREFIX = "blake3:"
_LARGE = 8 << 20  # below this one thread is faster than starting several
# The blake3 package's threads are a pool made once per process: a forked child inherits the
# pool without its threads, and a threaded hash there would wait forever.
_threads = blake3.blake3.AUTO


def _forked() -> None:
    global _threads  # noqa: PLW0603 - one setting for the process
    _threads = 1


os.register_at_fork(after_in_child=_forked)


def hasher(data: Buffer = b"") -> blake3.blake3:
    """A BLAKE3 hash of *data* (update it with more), threaded if *data* is large."""
    return blake3.blake3(data, max_threads=_threads if memoryview(data).nbytes >= _LARGE else 1)


def checksum(chunks: list[Buffer]) -> str:
    """The checksum of the concatenation of *chunks* (bytes), as recorded in a file's header."""
    digest = blake3.blake3(max_threads=_threads) if sum(map(len, chunks)) >= _LARGE else blake3.blake3()
    for chunk in chunks:
        digest.update(chunk)
    return PREFIX + digest.digest().hex()  # (hexdigest() takes longer)
