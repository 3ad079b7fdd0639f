"""
A step call resolved: the identity of the code it runs (:class:`Identity`), its slot and
fingerprint (:class:`Plan`), and what the session needs to know of a step
(:class:`StepView`). Plain data, below the session and above the fingerprints.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import attrs


class StepView(Protocol):
    """What running and looking up a step needs of it (a ``StepSpec`` is one)."""

    name: str
    version: str | None
    idempotent: bool
    retries: int
    retry_on: tuple[type[BaseException], ...]
    signature: inspect.Signature


@attrs.define(eq=False)
class Identity:
    """What a step's outputs are tied to: its version, or else its code (as of one call)."""

    identity: str
    code: str
    components: dict[str, str]
    _sources: dict[str, str] | Callable[[], dict[str, str]] = attrs.field(factory=dict)
    left_out: dict[str, str] = attrs.field(factory=dict)
    """Names the code reads that cannot be fingerprinted."""
    _reads: list[tuple[str, Callable[[], object]]] = attrs.field(factory=list)

    @property
    def sources(self) -> dict[str, str]:
        """Component -> normalized source, for `resumable why` (made when first asked for)."""
        sources = self._sources
        return sources() if callable(sources) else sources

    def values(self) -> dict[str, object]:
        """The values this identity's ``const`` components stand for, as they are now."""
        return {label: read() for label, read in self._reads if label in self.components}


@attrs.define(eq=False)
class Plan:
    """One call of a step, resolved: its slot and fingerprint."""

    slot: str
    key: str | None
    fingerprint: str
    args: str
    params: dict[str, str]
    """A short digest per parameter, to tell which ones changed."""
    identity: Identity
    """The step's identity as of this call."""
    bound: dict[str, Any] | None = None
    """The arguments by name (None for a memoized call)."""
    output_digest: str | None = attrs.field(default=None, init=False)
    """Set once the output is stored (and ``output_plain_digest`` for a plain value)."""
    output_plain_digest: str | None = attrs.field(default=None, init=False)
    replaces: str | None = attrs.field(default=None, init=False)
    """The version of the output a rerun replaces."""
