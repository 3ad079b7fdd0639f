"""
The run lock of remote stores: a lease with an owner and an expiry, renewed by one thread
per process (docs/storage.md, "One run at a time: the lease").
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Protocol

from .._slots import INTERNAL_DIR
from ..exceptions import ResumableError, StateLockedError

log = logging.getLogger("resumable")

LEASE_KEY = f"{INTERNAL_DIR}/lease.json"
DEFAULT_TTL = 30.0
TTL_VARIABLE = "RESUMABLE_LEASE_TTL"


class LeaseConflict(Exception):  # noqa: N818 - an outcome, not an error to show anyone
    """A conditional write or delete of the lease found another version than expected."""


def ttl_seconds(value: float | None, location: str) -> float:
    """The lease time to live: *value*, else ``$RESUMABLE_LEASE_TTL``, else :data:`DEFAULT_TTL` seconds."""
    text = os.environ.get(TTL_VARIABLE) if value is None else str(value)
    if not text:
        return DEFAULT_TTL
    try:
        ttl = float(text)
    except ValueError:
        ttl = 0.0
    if not ttl > 0:
        what = f"${TTL_VARIABLE}" if value is None else "lease_ttl"
        msg = f"{what} must be a number of seconds > 0, got {text!r} (store {location})"
        raise ResumableError(msg)
    return ttl


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_lease(data: bytes | None) -> dict[str, Any] | None:
    """The lease's fields; ``{}`` for an unreadable lease (treated as expired)."""
    if data is None:
        return None
    try:
        info = json.loads(data)
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def expired(info: Mapping[str, Any]) -> bool:
    """True if the lease described by *info* may be taken over."""
    expires_at = info.get("expires_at")
    if isinstance(expires_at, bool) or not isinstance(expires_at, int | float):
        return True
    return float(expires_at) <= time.time()


def locked_error(location: str, info: Mapping[str, Any]) -> StateLockedError:
    """:class:`StateLockedError` naming the holder and when its lease expires."""
    holder = {k: v for k, v in info.items() if k != "token"}
    exc = StateLockedError(location, holder)
    expires_at = info.get("expires_at")
    if isinstance(expires_at, int | float) and not isinstance(expires_at, bool):
        left = max(0.0, float(expires_at) - time.time())
        when = info.get("expires", _iso(float(expires_at)))
        msg = (
            f"{exc} Its lease expires at {when} (in {left:.0f} s) unless that run renews it: "
            "if that process died, the next run after then takes over."
        )
        exc.args = (msg,)
    return exc


class LeaseIO(Protocol):
    """A store's lease object, read and written conditionally (see ``FsspecStore``)."""

    location: str

    def lease_read(self) -> bytes | None: ...
    def lease_tag(self) -> str | None: ...
    def lease_write(self, data: bytes, *, expect: str | None) -> str: ...
    def lease_delete(self, *, expect: str) -> None: ...
    def lease_released(self, lease: Lease) -> None: ...


class Lease:
    """A held (or lost) lease on *io*'s lease object; :meth:`release` gives it up."""

    def __init__(self, io: LeaseIO, holder: Mapping[str, Any], *, ttl: float) -> None:
        self._io = io
        self.holder = dict(holder)
        self.ttl = float(ttl)
        self.token = uuid.uuid4().hex
        self.expires_at = 0.0
        self._tag: str | None = None  # the lease object's version while we hold it
        self.next_renewal = 0.0
        self._mutex = threading.Lock()
        # who holds the lease after we lost it (None while we hold it)
        self.taken_by: dict[str, Any] | None = None

    @property
    def lost(self) -> bool:
        """True once another run holds the lease (or ours expired without renewal)."""
        return self.taken_by is not None

    def _write(self, expect: str | None) -> None:
        """Write the lease with a new expiry, if its current version is *expect*."""
        # the expiry counts from before the request: the lease is surely valid until then
        now = time.time()
        info = {
            **self.holder,
            "token": self.token,
            "ttl": self.ttl,
            "renewed": _iso(now),
            "expires": _iso(now + self.ttl),
            "expires_at": now + self.ttl,
        }
        self._tag = self._io.lease_write(json.dumps(info).encode(), expect=expect)
        self.expires_at = now + self.ttl

    def acquire(self) -> None:
        """Take the lease, or raise :class:`StateLockedError` naming its holder."""
        for _ in range(5):
            info = parse_lease(self._io.lease_read())
            expect: str | None = None
            if info is not None:
                if not expired(info):
                    raise locked_error(self._io.location, info)
                # the tag first, then the content: a condition on this tag can only be met
                # by the version read now or an older one, never a newer, renewed lease
                expect = self._io.lease_tag()
                info = parse_lease(self._io.lease_read())
                if expect is None or info is None:
                    continue  # released meanwhile: look again
                if not expired(info):
                    raise locked_error(self._io.location, info)
            try:
                self._write(expect)
            except LeaseConflict:
                continue  # another run moved first: look again
            mine = parse_lease(self._io.lease_read())
            if mine is None or mine.get("token") != self.token:
                if mine and not expired(mine):
                    raise locked_error(self._io.location, mine)
                continue
            if info:
                log.warning(
                    "%s: took over the expired lease of pid %s on host %s (expired %s)",
                    self._io.location, info.get("pid", "?"), info.get("host", "?"), info.get("expires", "?"),
                )  # fmt: skip
            self.next_renewal = time.monotonic() + self.ttl / 3
            _renewer.add(self)
            return
        info = parse_lease(self._io.lease_read()) or {}
        raise locked_error(self._io.location, info)

    def check(self) -> None:
        """
        Before a write: raise :class:`StateLockedError` if the lease is lost. A lease past its
        expiry (the renewing thread was held up) is renewed first, which shows whether
        another run took it over meanwhile.
        """
        if not self.lost and time.time() >= self.expires_at:
            self.renew(strict=True)
        if self.lost:
            exc = locked_error(self._io.location, self.taken_by or {})
            msg = (
                f"{exc.args[0]} This run's lease on it could not be renewed in time and was lost, so "
                "this run stops writing to keep the state consistent; run the script again once "
                "the other run is done."
            )
            exc.args = (msg,)
            raise exc

    def renew(self, *, strict: bool = False) -> None:
        """
        Push the expiry forward; on a conflict the lease is lost. A failed request is
        retried at the next renewal, or raised if *strict* (a write waits on it).
        """
        with self._mutex:
            if self.lost or self._tag is None:  # (lost, released, or never taken)
                return
            try:
                self._write(self._tag)
            except LeaseConflict:
                self._lose()
            except OSError as exc:
                if strict:
                    raise
                log.warning("%s: could not renew the run's lease (%s); retrying", self._io.location, exc)

    def _lose(self) -> None:
        try:
            info = parse_lease(self._io.lease_read()) or {}
        except OSError:
            info = {}
        self.taken_by = {k: v for k, v in info.items() if k != "token"}
        log.error(
            "%s: this run lost its lease (now held by pid %s on host %s); it stops writing",
            self._io.location, info.get("pid", "?"), info.get("host", "?"),
        )  # fmt: skip

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Calling it twice is harmless."""
        with _renewer.wake:
            _renewer.leases.discard(self)
            _renewer.wake.notify()
        with self._mutex:
            tag, self._tag = self._tag, None
            if tag is not None and not self.lost:
                try:
                    self._io.lease_delete(expect=tag)
                except LeaseConflict:
                    pass  # taken over after it expired: it is not ours to delete
                except OSError as exc:
                    log.warning(
                        "%s: could not delete the lease (%s); it expires by itself", self._io.location, exc
                    )
        self._io.lease_released(self)


class _Renewer:
    """The thread that renews the leases this process holds, started while it holds any."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Hold no lease (a forked child holds none of its parent's)."""
        self.leases: set[Lease] = set()
        self.wake = threading.Condition()
        self.running = False

    def add(self, lease: Lease) -> None:
        with self.wake:
            self.leases.add(lease)
            if not self.running:
                self.running = True
                threading.Thread(target=self._run, name="resumable-leases", daemon=True).start()
            self.wake.notify()

    def _run(self) -> None:
        while True:
            with self.wake:
                self.leases = {x for x in self.leases if not x.lost}
                if not self.leases:
                    self.running = False
                    return
                lease = min(self.leases, key=lambda x: x.next_renewal)
                wait = lease.next_renewal - time.monotonic()
                if wait > 0:
                    self.wake.wait(wait)
                    continue
                lease.next_renewal = time.monotonic() + lease.ttl / 3
            try:
                lease.renew()  # outside the condition: a request, while leases are added and released
            except Exception:  # the other leases must still be renewed
                log.exception("renewing a lease failed; retrying")


_renewer = _Renewer()
os.register_at_fork(after_in_child=_renewer.reset)
