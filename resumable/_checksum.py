"""
Checksums of stored values: SHA-256, and for large values a tree of SHA-256 computed in
parallel (also while the value is being written, or read).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

Buffer = bytes | bytearray | memoryview
CHECKSUM_PREFIX = "sha256:"
TREE_PREFIX = "sha256-tree:"

# Values this large get a tree checksum: SHA-256 over the SHA-256 of each 4 MiB piece, the
# pieces hashed in parallel (and, when writing, while the value is being written).
TREE_MIN = 8 * 1024 * 1024
_TREE_PIECE = 4 * 1024 * 1024
_pool: Any = None
_pool_lock = threading.Lock()


def _hash_pool() -> Any:
    global _pool  # noqa: PLW0603 - one pool per process, created on first use
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor  # noqa: PLC0415 - only for large values

            workers = min(4, os.cpu_count() or 1)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="resumable-hash")
        return _pool


def _forget_pool() -> None:
    global _pool  # noqa: PLW0603 - a forked child cannot use its parent's threads
    _pool = None


os.register_at_fork(after_in_child=_forget_pool)


def _pieces(chunks: Sequence[Buffer]) -> list[list[memoryview]]:
    """Cut the concatenation of *chunks* into pieces of _TREE_PIECE bytes (views, no copies)."""
    pieces: list[list[memoryview]] = [[]]
    room = _TREE_PIECE
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            if not room:
                pieces.append([])
                room = _TREE_PIECE
            part, view = view[:room], view[room:]
            pieces[-1].append(part)
            room -= len(part)
    return pieces


def _hash_piece(parts: list[memoryview]) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part)  # releases the GIL: pieces are hashed in parallel
    return digest.digest()


def start_checksum(chunks: Sequence[Buffer], size: int) -> Callable[[], str]:
    """Start checksumming the value; the returned function waits for and returns the result."""
    if size < TREE_MIN:

        def plain() -> str:
            digest = hashlib.sha256()
            for chunk in chunks:
                digest.update(chunk)
            return CHECKSUM_PREFIX + digest.hexdigest()

        return plain
    futures = [_hash_pool().submit(_hash_piece, parts) for parts in _pieces(chunks)]

    def tree() -> str:
        top = hashlib.sha256()
        for future in futures:
            top.update(future.result())
        return TREE_PREFIX + top.hexdigest()

    return tree


# Each piece of a file being read is read and hashed in steps this large by one thread, so
# its bytes are hashed while they are still in the CPU cache (about 20 % faster than
# hashing 4 MiB that were read before).
_READ_STEP = 256 * 1024


def fill_and_checksum(
    read_at: Callable[[memoryview, int], int], view: memoryview, start: int, filled: int
) -> tuple[str, int]:
    """
    Fill ``view[filled:]`` with positional reads and compute the tree checksum of
    ``view[start:]`` (*start* <= *filled*), piece by piece on the pool: each piece is read and hashed by one
    thread, so reading and hashing run in parallel. ``read_at(part, offset)`` fills *part*
    with the bytes at *offset* and returns how many it read (fewer only at the end of the
    file); it is called from several threads at once.

    Returns the checksum and how many bytes of *view* were filled: ``len(view)`` unless the
    file ended early (then the checksum is of no use, and the size check says so).
    """
    from concurrent.futures import wait  # noqa: PLC0415 - only for large values, like the pool

    end = len(view)
    starts = range(start, end, _TREE_PIECE) if start < end else [start]
    pool = _hash_pool()
    futures = [pool.submit(_fill_piece, read_at, view, s, min(s + _TREE_PIECE, end), filled) for s in starts]
    wait(futures)  # all of them, even if one failed: none may write into *view* afterwards
    top = hashlib.sha256()
    reached = end
    for future in futures:
        digest, short = future.result()
        top.update(digest)
        if short is not None:
            reached = min(reached, short)
    return TREE_PREFIX + top.hexdigest(), reached


def _fill_piece(
    read_at: Callable[[memoryview, int], int], view: memoryview, start: int, end: int, filled: int
) -> tuple[bytes, int | None]:
    """
    Read ``view[start:end]`` (what is not filled yet) and hash it: the digest, and where the
    file ended if it ended early.
    """
    digest = hashlib.sha256()
    position = start
    while position < end:
        step_end = min(end, position + _READ_STEP)
        if step_end > filled:
            low = max(position, filled)
            stop = low + read_at(view[low:step_end], low)
            if stop < step_end:  # the end of the file came early
                return digest.digest(), stop
        digest.update(view[position:step_end])  # releases the GIL
        position = step_end
    return digest.digest(), None
