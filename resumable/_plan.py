"""
A step call resolved: the identity of the code it runs (:class:`Identity`), its slot and
fingerprint (:class:`Plan`), and what the session needs to know of a step
(:class:`StepView`). Plain data, below the session and above the fingerprints.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol


class StepView(Protocol):
    """What running and looking up a step needs of it (a ``StepSpec`` is one)."""

    name: str
    version: str | None
    idempotent: bool
    retries: int
    retry_on: tuple[type[BaseException], ...]
    signature: inspect.Signature


class Identity(NamedTuple):
    """
    What a step's outputs are tied to: its version, or else its code (as of one call); the
    names the code reads that cannot be fingerprinted (``left_out``).
    """

    identity: str
    code: str
    components: dict[str, str]
    all_sources: Callable[[], dict[str, str]]
    left_out: dict[str, str]
    reads: list[tuple[str, Callable[[], object]]]

    @property
    def sources(self) -> dict[str, str]:
        """Component -> normalized source, for `resumable why` (made when first asked for)."""
        return self.all_sources()

    def values(self) -> dict[str, object]:
        """The values this identity's ``const`` components stand for, as they are now."""
        return {label: read() for label, read in self.reads if label in self.components}


class Plan:
    """
    One call of a step, resolved: its slot, fingerprint, a short digest per parameter (to
    tell which ones changed), the step's identity as of this call and the arguments by name
    (None for a memoized call). Once the output is stored: its digest (and plain digest for
    a plain value) and the version of the output a rerun replaced.
    """

    __slots__ = (
        "args",
        "bound",
        "fingerprint",
        "identity",
        "key",
        "output_digest",
        "output_plain_digest",
        "params",
        "replaces",
        "slot",
    )

    def __init__(  # noqa: PLR0913, PLR0917 - made by StepSpec from a resolved call
        self,
        slot: str,
        key: str | None,
        fingerprint: str,
        args: str,
        params: dict[str, str],
        identity: Identity,
        bound: dict[str, Any] | None = None,
    ) -> None:
        self.slot = slot
        self.key = key
        self.fingerprint = fingerprint
        self.args = args
        self.params = params
        self.identity = identity
        self.bound = bound
        self.output_digest: str | None = None
        self.output_plain_digest: str | None = None
        self.replaces: str | None = None
