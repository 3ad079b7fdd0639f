"""The fsspec store: URL routing, segmented appends, the lease, round trips per request, errors."""

from __future__ import annotations

import errno
import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter

import pytest

from resumable import Pipeline, ResumableError, StateLockedError
from resumable._stores import _lease, open_store
from resumable._stores._fsspec import FANOUT, SEGMENTS, FsspecStore, Segment, chain_of
from resumable._stores._lease import LEASE_KEY


def memory_store(**kwargs) -> FsspecStore:
    """A fresh fsspec store on fsspec's in-memory file system."""
    return FsspecStore(f"memory://resumable-remote/{uuid.uuid4().hex}", **kwargs)


def raw_keys(store: FsspecStore) -> list[str]:
    """Every object under the store's root, internal ones included."""
    root = store._path("").rstrip("/")
    store.fs.invalidate_cache()
    return sorted(p[len(root) + 1 :] for p in store.fs.find(root))


def segments(store: FsspecStore, key: str) -> list[str]:
    return [k for k in raw_keys(store) if k.startswith(f"{SEGMENTS}/{key}/")]


def stop_renewing(lock: _lease.Lease) -> None:
    """The holder "dies" or stalls: the renewing thread leaves *lock* alone."""
    with _lease._renewer.wake:
        _lease._renewer.leases.discard(lock)


# opening stores ------------------------------------------------------------------------


def test_open_store_routes_urls_to_fsspec(s3):
    """s3:// and other fsspec URLs open an FsspecStore; memory:// stays resumable's own store."""
    store = open_store(s3.url("routed"))
    assert isinstance(store, FsspecStore)
    assert f"s3://{s3.bucket}/routed" == store.location
    assert store.atomic_put
    assert "FsspecStore" not in type(open_store("memory://x")).__name__


def test_storage_options_reach_fsspec(s3_server, monkeypatch):
    """Without any AWS variable, storage_options alone (endpoint, keys) reach the server."""
    for name in list(s3_server.env()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(s3_server.config_dir / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(s3_server.config_dir / "none"))
    url = s3_server.url()
    pipe = Pipeline("opts", store=url, storage_options=s3_server.storage_options())

    @pipe.step
    def answer() -> int:
        return 42

    with pipe:
        assert 42 == answer()
    store = FsspecStore(url, s3_server.storage_options())
    assert ["answer.msgpack", "events.jsonl", "manifest.json"] == [
        k for k in store.list() if not k.startswith(".resumable/")
    ]


def test_missing_fsspec_says_what_to_install(monkeypatch):
    """Without fsspec the error names the extra to install."""
    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ResumableError, match=r'pip install "resumable\[remote\]"'):
        open_store("s3://bucket/prefix")


def test_unknown_protocol_is_a_clear_error():
    """A URL no fsspec backend knows is refused, naming the URL."""
    with pytest.raises(ResumableError, match="cannot open store 'nosuchscheme://x'"):
        open_store("nosuchscheme://x")


def test_lease_ttl_from_environment(monkeypatch):
    """$RESUMABLE_LEASE_TTL sets the lease time to live; a bad value is a clear error."""
    monkeypatch.setenv("RESUMABLE_LEASE_TTL", "7.5")
    assert 7.5 == memory_store().lease_ttl
    monkeypatch.setenv("RESUMABLE_LEASE_TTL", "soon")
    with pytest.raises(ResumableError, match="RESUMABLE_LEASE_TTL must be a number of seconds > 0"):
        memory_store()


def test_lease_ttl_argument_must_be_positive():
    """lease_ttl=0 (or less) is refused, naming the store."""
    from resumable._stores._fsspec import FsspecStore

    with pytest.raises(
        ResumableError, match=r"lease_ttl must be a number of seconds > 0, got '0' \(store memory://ttl\)"
    ):
        FsspecStore("memory://ttl", lease_ttl=0)


# segmented appends -----------------------------------------------------------------------


def test_chain_prefers_the_longest_segment_and_reports_gaps():
    """The chain from byte 0 takes the merged segment over the pieces it covers; a hole is a gap."""
    small = [Segment(0, 10, 0), Segment(10, 20, 0), Segment(20, 25, 0)]
    merged = Segment(0, 20, 1)
    assert ([merged, small[2]], small[:2], None) == chain_of([*small, merged])
    assert ([small[0]], [], 10) == chain_of([small[0], small[2]])


def test_appends_stay_logarithmic(monkeypatch):
    """1,000 appends leave few segments, and each byte is rewritten only a few times."""
    store = memory_store()
    written = Counter[str]()
    real_pipe = store.fs.pipe_file

    def counting(path, data, **kwargs):
        written["bytes"] += len(data)
        return real_pipe(path, data, **kwargs)

    monkeypatch.setattr(store.fs, "pipe_file", counting)  # the file system object is shared
    expected = b""
    for i in range(1000):
        line = f'{{"event": {i}}}\n'.encode()
        store.append("events.jsonl", line, durable=False)
        expected += line
    assert expected == bytes(store.read("events.jsonl"))
    assert expected[12345:] == bytes(store.read("events.jsonl", 12345))
    # as many segments as the digits of 1,000 in base FANOUT add up to (3 + 14 + 8 for 16)
    digits, n = 0, 1000
    while n:
        digits, n = digits + n % FANOUT, n // FANOUT
    assert digits == len(segments(store, "events.jsonl"))
    assert written["bytes"] <= 3 * len(expected)


def test_plain_object_becomes_a_log(s3):
    """A log copied in as a plain object (from a local state directory) is appended to in place."""
    store = FsspecStore(s3.url())
    store.write("events.jsonl", [b"one\ntwo\n"], durable=True)
    store.append("events.jsonl", b"three\n", durable=False)
    assert b"one\ntwo\nthree\n" == bytes(store.read("events.jsonl"))
    assert b"three\n" == bytes(store.read("events.jsonl", 8))
    assert ["events.jsonl"] == store.list()
    assert 2 == len(segments(store, "events.jsonl"))
    assert "events.jsonl" not in raw_keys(store)


def test_plain_object_wins_over_leftover_segments():
    """A plain object and segments (a write or copy cut short) read as the plain object."""
    store = memory_store()
    for i in range(5):
        store.append("events.jsonl", f"old {i}\n".encode(), durable=False)
    store.fs.pipe_file(store._path("events.jsonl"), b"new\n")  # the write, not yet followed by cleanup
    fresh = FsspecStore(store.location)
    assert b"new\n" == bytes(fresh.read("events.jsonl"))
    fresh.append("events.jsonl", b"more\n", durable=False)
    assert b"new\nmore\n" == bytes(fresh.read("events.jsonl"))
    assert 2 == len(segments(fresh, "events.jsonl"))


def test_merge_leftovers_are_read_once_and_cleaned_up():
    """Pieces a merge left behind (killed before deleting them) are neither read twice nor kept."""
    store = memory_store()
    lines = [f"line {i}\n".encode() for i in range(3)]
    for line in lines:
        store.append("events.jsonl", line, durable=False)
    merged = Segment(0, len(lines[0]) + len(lines[1]), 1)
    store.fs.pipe_file(store._seg_path("events.jsonl", merged), lines[0] + lines[1])
    fresh = FsspecStore(store.location)
    assert b"".join(lines) == bytes(fresh.read("events.jsonl"))
    fresh.append("events.jsonl", b"last\n", durable=False)
    assert b"".join(lines) + b"last\n" == bytes(fresh.read("events.jsonl"))
    assert 3 == len(segments(fresh, "events.jsonl"))


def test_missing_segment_is_an_error_naming_the_key():
    """A segment lost from the middle of a log is reported, not silently skipped."""
    store = memory_store()
    for i in range(3):
        store.append("events.jsonl", f"line {i}\n".encode(), durable=False)
    middle = sorted(segments(store, "events.jsonl"))[1]
    store.fs.rm_file(store._path(middle))
    with pytest.raises(OSError, match="appended segments of this object are incomplete") as info:
        FsspecStore(store.location).read("events.jsonl")
    assert errno.EIO == info.value.errno
    assert f"{store.location}/events.jsonl" == info.value.filename


def test_deleting_a_log_hides_it_at_once(monkeypatch):
    """While a log's segments are deleted, readers see an empty object, never a part of the log."""
    store = memory_store()
    for i in range(20):
        store.append("events.jsonl", f"{i}\n".encode(), durable=False)
    seen: list[bytes] = []
    real_rm = store.fs.rm_file

    def watching(path):
        seen.append(bytes(FsspecStore(store.location).read("events.jsonl")))
        return real_rm(path)

    monkeypatch.setattr(store.fs, "rm_file", watching)
    store.delete("events.jsonl", durable=True)
    assert len(seen) >= 5  # the segments (and the empty placeholder)
    assert {b""} == set(seen)
    assert [] == raw_keys(store)


def test_internal_objects_are_never_listed(s3):
    """The lease, log segments and leftovers of interrupted writes are not keys."""
    store = FsspecStore(s3.url(), lease_ttl=5)
    lock = store.lock({"pid": 1})
    store.write("a.msgpack", [b"x"], durable=True)
    for i in range(20):
        store.append("events.jsonl", f"{i}\n".encode(), durable=False)
    assert ["a.msgpack", "events.jsonl"] == store.list()
    assert LEASE_KEY in raw_keys(store)
    lock.release()
    store.fs.pipe_file(store._path("step/.k.msgpack.0123abcd.tmp"), b"partial")
    assert ["a.msgpack", "events.jsonl"] == FsspecStore(store.location).list()
    assert LEASE_KEY not in raw_keys(store)


def test_temp_objects_removed_by_the_next_run(tmp_path):
    """On a file system written by temp-and-move, the next run removes what a killed writer left."""
    store = FsspecStore(f"file://{tmp_path}/state")
    store.write("a.msgpack", [b"x"], durable=True)
    (tmp_path / "state" / ".a.msgpack.deadbeef.tmp").write_bytes(b"partial")
    assert [".a.msgpack.deadbeef.tmp"] == store.remove_temp_files(dry_run=True)
    assert [".a.msgpack.deadbeef.tmp"] == store.remove_temp_files()
    assert ["a.msgpack"] == sorted(p.name for p in (tmp_path / "state").iterdir())


def test_unfinished_multipart_uploads_aborted(s3):
    """On S3 the next run aborts the multipart uploads a killed writer left under its prefix."""
    store = FsspecStore(s3.url())
    bucket, _, prefix = store._prefix.partition("/")
    store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{prefix}big.msgpack")
    other = store.fs.call_s3("create_multipart_upload", Bucket=bucket, Key="elsewhere/big.msgpack")
    assert ["big.msgpack"] == store.remove_temp_files()
    left = store.fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [other["UploadId"]] == [u["UploadId"] for u in left]
    store.fs.call_s3(
        "abort_multipart_upload", Bucket=bucket, Key="elsewhere/big.msgpack", UploadId=other["UploadId"]
    )


def test_write_errors_name_the_object(monkeypatch):
    """A refused write propagates with the object's location; the previous object stays."""
    store = memory_store()
    store.write("a.msgpack", [b"old"], durable=True)

    def denied(path, data, **kwargs):
        raise PermissionError(errno.EACCES, "Access Denied")

    monkeypatch.setattr(store.fs, "pipe_file", denied)
    with pytest.raises(PermissionError, match="Access Denied") as info:
        store.write("a.msgpack", [b"new"], durable=True)
    monkeypatch.undo()
    assert f"{store.location}/a.msgpack" == info.value.filename
    assert b"old" == bytes(store.read("a.msgpack"))


# the lease ---------------------------------------------------------------------------------


def test_lease_names_holder_and_expiry(s3):
    """A held lease is refused with the holder's pid, host, start and expiry."""
    store = FsspecStore(s3.url(), lease_ttl=30)
    lock = store.lock({"pid": 77, "host": "node-a", "since": "2026-01-01T00:00:00Z"})
    try:
        with pytest.raises(StateLockedError, match=r"pid 77 on host node-a .* lease expires at") as info:
            FsspecStore(store.location).lock({"pid": 78, "host": "node-b", "since": "now"})
        assert {"pid": 77, "host": "node-a", "ttl": 30.0} == {
            k: info.value.holder[k] for k in ("pid", "host", "ttl")
        }
        assert "token" not in info.value.holder
        assert info.value.holder["expires_at"] > time.time() + 25
    finally:
        lock.release()
    assert LEASE_KEY not in raw_keys(store)


def test_lease_is_renewed_while_held(s3):
    """A held lease outlives its time to live: its holder renews it."""
    store = FsspecStore(s3.url(), lease_ttl=0.6)
    lock = store.lock({"pid": 1})
    try:
        first = json.loads(store.fs.cat_file(store._path(LEASE_KEY)))["expires_at"]
        time.sleep(1.5)
        with pytest.raises(StateLockedError):
            FsspecStore(store.location, lease_ttl=0.6).lock({"pid": 2})
        assert json.loads(store.fs.cat_file(store._path(LEASE_KEY)))["expires_at"] > first + 0.8
    finally:
        lock.release()


RENEWER = """
import threading, time, uuid
from resumable._stores._fsspec import FsspecStore

stores = [FsspecStore(f"memory://resumable-remote/{uuid.uuid4().hex}", lease_ttl=0.3) for _ in range(20)]
locks = [store.lock({"pid": n}) for n, store in enumerate(stores)]
first = [lock.expires_at for lock in locks]
time.sleep(0.5)
renewers = [t for t in threading.enumerate() if t.name == "resumable-leases"]
assert 1 == len(renewers), renewers
assert all(lock.expires_at > t for lock, t in zip(locks, first, strict=True))
for lock in locks:
    lock.release()
renewers[0].join(5)
assert not renewers[0].is_alive()
"""


def test_one_thread_renews_every_lease_of_a_process():
    """
    Twenty held leases are renewed by one thread, which ends once none is held. In a fresh
    process: a lease another test left held (a simulated kill) would keep this one's thread alive.
    """
    subprocess.run([sys.executable, "-c", RENEWER], check=True, timeout=60)


def test_expired_lease_is_taken_over(s3, caplog):
    """A lease nobody renews (its holder died) is taken over once expired, with a warning."""
    store = FsspecStore(s3.url(), lease_ttl=0.5)
    lock = store.lock({"pid": 1, "host": "crashed"})
    stop_renewing(lock)  # the holder "dies": nobody renews the lease any more
    with pytest.raises(StateLockedError):
        FsspecStore(store.location).lock({"pid": 2})
    time.sleep(0.6)
    with caplog.at_level(logging.WARNING, logger="resumable"):
        FsspecStore(store.location).lock({"pid": 3}).release()
    assert "took over the expired lease of pid 1 on host crashed" in caplog.text


def test_lost_lease_stops_writes(s3):
    """A holder whose lease was taken over stops writing, and leaves the new lease alone."""
    a = FsspecStore(s3.url(), lease_ttl=0.6)
    lock_a = a.lock({"pid": 1, "host": "a"})
    stop_renewing(lock_a)  # a stalls (a long GC pause, a network partition): no renewals
    time.sleep(0.7)
    b = FsspecStore(a.location, lease_ttl=30)
    lock_b = b.lock({"pid": 2, "host": "b"})
    # a wakes up and writes: its lease is past its expiry, so it renews first, and fails
    with pytest.raises(StateLockedError, match=r"pid 2 on host b.*lost") as info:
        a.write("a.msgpack", [b"late"], durable=True)
    assert lock_a.lost
    assert "b" == info.value.holder["host"]
    with pytest.raises(FileNotFoundError):
        b.read("a.msgpack")
    lock_a.release()
    with pytest.raises(StateLockedError):
        FsspecStore(a.location).lock({"pid": 3})
    lock_b.release()


def test_late_write_renews_a_lease_nobody_took(s3):
    """A write after a stall longer than the lease renews it, if no other run took it meanwhile."""
    store = FsspecStore(s3.url(), lease_ttl=0.5)
    lock = store.lock({"pid": 1, "host": "a"})
    stop_renewing(lock)  # no renewals
    time.sleep(0.6)
    stalled = time.time()  # the lease expired before this
    store.write("a.msgpack", [b"on time after all"], durable=True)
    assert not lock.lost
    assert lock.expires_at > stalled  # renewed by the write (no wall-clock race with a busy machine)
    lease = json.loads(store.fs.cat_file(store._path(LEASE_KEY)))
    assert lease["pid"] == 1  # still this run's: another run would find it held
    assert lease["expires_at"] > stalled
    lock.release()


def test_racing_runs_get_one_lease(s3):
    """Runs taking a free lease at the same moment: exactly one wins (conditional create)."""
    url = s3.url()
    for _ in range(3):
        winners: list = []
        barrier = threading.Barrier(4)

        def contend(n: int) -> None:
            store = FsspecStore(url)
            barrier.wait()
            try:
                winners.append(store.lock({"pid": n}))
            except StateLockedError:
                pass

        threads = [threading.Thread(target=contend, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1 == len(winners)
        winners[0].release()


# round trips ----------------------------------------------------------------------------------


def test_one_request_per_store_and_per_skip(s3):
    """Inside a run, storing an output is one PUT and a skip is one GET (no HEAD, no LIST)."""
    url = s3.url()
    pipe = Pipeline("requests", store=url)

    @pipe.step(key="{i}")
    def part(i: int) -> dict[str, int]:
        return {"i": i}

    with pipe:
        part(-1)  # the first step lists the store once
        store = pipe.store
        assert isinstance(store, FsspecStore)
        ops: list[str] = []
        real = store.fs._call_s3

        async def counting(method, *args, **kwargs):
            if kwargs.get("Key", "").endswith(".msgpack"):
                ops.append(method)
            return await real(method, *args, **kwargs)

        store.fs._call_s3 = counting
        try:
            for i in range(5):
                part(i)
            stores = list(ops)
            ops.clear()
            for i in range(5):
                assert {"i": i} == part(i)
        finally:
            del store.fs._call_s3
    assert ["put_object"] * 5 == stores
    assert ["get_object"] * 5 == ops


def test_journal_reads_segmented_log_in_new_process_view(s3):
    """A second store handle (another machine) sees every event the run logged in segments."""
    url = s3.url()
    pipe = Pipeline("journal", store=url)

    @pipe.step(key="{i}")
    def part(i: int) -> int:
        return i

    with pipe:
        for i in range(40):
            part(i)
    other = Pipeline("journal", store=FsspecStore(url))
    state = other.status()
    assert ("completed", 1, 40) == (state.status, state.runs, len(state.completed_steps))
    assert segments(FsspecStore(url), "events.jsonl")
    assert "events.jsonl" not in raw_keys(FsspecStore(url))


def test_read_copy_is_writable_and_private():
    """Reads return a fresh bytearray, as local files do (NumPy arrays decoded from it are writable)."""
    store = memory_store()
    store.write("a.msgpack", [b"abc"], durable=False)
    data = store.read("a.msgpack")
    assert isinstance(data, bytearray)
    data[0] = 0
    assert b"abc" == bytes(store.read("a.msgpack"))


# copies, edge cases, lease failures ----------------------------------------------------------


def test_copy_is_done_by_the_server(s3):
    """copy() on S3 is one server-side copy; it copies appended keys too, and names a missing source."""
    store = FsspecStore(s3.url())
    store.write("a.msgpack", [b"version 1"], durable=True)
    ops: list[str] = []
    real = store.fs._call_s3

    async def counting(method, *args, **kwargs):
        ops.append(method)
        return await real(method, *args, **kwargs)

    store.fs._call_s3 = counting
    try:
        store.copy("a.msgpack", ".resumable/objects/v1.msgpack", durable=True)
    finally:
        del store.fs._call_s3
    assert "copy_object" in ops
    assert "get_object" not in ops
    assert b"version 1" == bytes(store.read(".resumable/objects/v1.msgpack"))
    for i in range(3):
        store.append("events.jsonl", f"{i}\n".encode(), durable=False)
    store.copy("events.jsonl", "events-copy.jsonl", durable=True)
    assert b"0\n1\n2\n" == bytes(store.read("events-copy.jsonl"))
    with pytest.raises(FileNotFoundError) as info:
        store.copy("missing.msgpack", "b.msgpack", durable=True)
    assert f"{store.location}/missing.msgpack" == info.value.filename


def test_copy_on_a_file_system(tmp_path):
    """Where writes are temp-and-move, copy() reads and writes the object."""
    store = FsspecStore(f"file://{tmp_path}/state")
    store.write("a.msgpack", [b"x" * 100], durable=True)
    store.copy("a.msgpack", "deep/b.msgpack", durable=True)
    assert b"x" * 100 == (tmp_path / "state" / "deep" / "b.msgpack").read_bytes()
    assert ["a.msgpack", "deep/b.msgpack"] == store.list()


def test_empty_appends():
    """An empty append creates an empty object; appending to an empty plain object works."""
    store = memory_store()
    store.append("events.jsonl", b"", durable=False)
    assert b"" == bytes(store.read("events.jsonl"))
    store.append("events.jsonl", b"", durable=False)
    store.append("events.jsonl", b"first\n", durable=False)
    assert b"first\n" == bytes(FsspecStore(store.location).read("events.jsonl"))
    assert ["events.jsonl"] == store.list()


def test_append_after_a_gap_is_refused():
    """A writer never appends after a hole in the log: the next offset would be wrong."""
    store = memory_store()
    for i in range(3):
        store.append("events.jsonl", f"line {i}\n".encode(), durable=False)
    store.fs.rm_file(store._path(sorted(segments(store, "events.jsonl"))[1]))
    with pytest.raises(OSError, match="incomplete") as info:
        FsspecStore(store.location).append("events.jsonl", b"more\n", durable=False)
    assert errno.EIO == info.value.errno


def test_unreadable_lease_is_taken_over():
    """A lease object that is not a lease (damaged, foreign) counts as expired."""
    store = memory_store()
    store.fs.pipe_file(store._path(LEASE_KEY), b"not json")
    lock = store.lock({"pid": 1, "host": "here"})
    assert 1 == json.loads(store.fs.cat_file(store._path(LEASE_KEY)))["pid"]
    lock.release()


def test_failed_renewal_is_retried_and_blocks_late_writes(caplog, monkeypatch):
    """A renewal that fails is retried later; a write past the expiry needs a renewal to succeed."""
    store = memory_store(lease_ttl=0.3)
    lock = store.lock({"pid": 1})
    stop_renewing(lock)  # renewals by hand only
    real_write = store.lease_write

    def unreachable(data, *, expect):
        raise ConnectionError(errno.ECONNRESET, "connection reset")

    monkeypatch.setattr(store, "lease_write", unreachable)
    with caplog.at_level(logging.WARNING, logger="resumable"):
        lock.renew()
    assert "could not renew the run's lease" in caplog.text
    assert not lock.lost
    time.sleep(0.35)
    with pytest.raises(ConnectionError):
        store.write("a.msgpack", [b"x"], durable=True)
    monkeypatch.setattr(store, "lease_write", real_write)
    store.write("a.msgpack", [b"x"], durable=True)  # the lease could be renewed: go on
    assert b"x" == bytes(store.read("a.msgpack"))
    lock.release()


def test_release_without_conditional_deletes(s3, monkeypatch):
    """A server that rejects conditional deletes still gets its lease deleted on release."""
    store = FsspecStore(s3.url())
    lock = store.lock({"pid": 1})
    real = store.fs.call_s3

    def no_conditions(method, **kwargs):
        if "IfMatch" in kwargs:
            raise OSError(
                errno.ENOSYS,
                "NotImplemented: A header you provided implies functionality that is not implemented",
            )
        return real(method, **kwargs)

    monkeypatch.setattr(store.fs, "call_s3", no_conditions)
    lock.release()
    monkeypatch.undo()
    assert LEASE_KEY not in raw_keys(store)
