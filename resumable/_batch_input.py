"""
A batch's input: read once, front to back, in slices; and how its rows are identified.

A chunk's file name carries a digest of its *input* rows, so that a resume can check,
without reading any chunk, that the rows it would skip are the rows that were committed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sized
from typing import Any

import blake3

from ._codec_types import qualified_name
from ._fingerprint import _Unhashable, digest_value
from .exceptions import UsageError

log = logging.getLogger("resumable")

DIGEST_BYTES = 12


class Source:
    """The batch's input, read once, front to back, in slices."""

    def __init__(self, items: Iterable[Any]) -> None:
        if hasattr(items, "__aiter__") and not hasattr(items, "__iter__"):
            msg = "batch input must be an iterable (a list, a range, a generator ...), not an async iterable"
            raise UsageError(msg)
        self.items = items
        self.pos = 0
        self._iter = iter(items)
        self.total: int | None = len(items) if isinstance(items, Sized) else None
        # a sized container that is not an iterator can be iterated again
        self.rereadable = self.total is not None and self._iter is not items

    def take(self, n: int) -> list[Any]:
        """The next *n* rows (fewer at the end of the input)."""
        rows = list(itertools.islice(self._iter, n))
        self.pos += len(rows)
        return rows


class Digester:
    """Digests of input rows, for one batch (which it names in its one warning)."""

    def __init__(self, batch: str) -> None:
        self.batch = batch
        self._noted = False

    def digest(self, rows: list[Any]) -> str:
        """A digest of a chunk's input rows: their argument fingerprint (dict order does not count)."""
        try:
            return "f" + digest_value(rows)[: 2 * DIGEST_BYTES]
        except (_Unhashable, RecursionError):
            pass
        # Rows without a stable digest are compared by their type only: a change inside
        # them is not noticed (they would need __resumable_fingerprint__).
        parts = []
        for row in rows:
            try:
                parts.append(digest_value(row))
            except (_Unhashable, RecursionError):
                parts.append("?" + qualified_name(type(row)))
                if not self._noted:
                    self._noted = True
                    log.warning(
                        "batch %r: rows of type %s cannot be fingerprinted, so a change to them "
                        "between runs is not detected (give the class a __resumable_fingerprint__() method)",
                        self.batch, qualified_name(type(row)),
                    )  # fmt: skip
        return "f" + blake3.blake3("\n".join(parts).encode()).hexdigest()[: 2 * DIGEST_BYTES]
