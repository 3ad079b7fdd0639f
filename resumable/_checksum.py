"""
Checksums of stored values: SHA-256, and for large values a tree of SHA-256 computed in
parallel (also while the value is being written).
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
