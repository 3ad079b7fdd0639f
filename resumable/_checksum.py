"""Checksums of stored values: BLAKE3, which the ``blake3`` package threads for large values."""

from __future__ import annotations

from collections.abc import Iterable

import blake3

Buffer = bytes | bytearray | memoryview
PREFIX = "blake3:"


def checksum(chunks: Iterable[Buffer]) -> str:
    """The checksum of the concatenation of *chunks*, as recorded in a file's header."""
    digest = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for chunk in chunks:
        digest.update(chunk)
    return PREFIX + digest.hexdigest()


def short_digest(data: Buffer) -> str:
    """A 32-character digest (a header's own ``hsum``)."""
    return blake3.blake3(data).hexdigest()[:32]
