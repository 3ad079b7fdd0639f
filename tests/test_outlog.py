"""
The local store's output log: a durable output is one fsync on the caller's thread, the
file is in place at once, and whatever a killed (or powered-off) run had only in the log is
written by the next holder of the lock. The log is untrusted input.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

import resumable
import resumable._codec
from resumable import StateDirectoryError
from resumable._stores import _outlog
from resumable._stores._fileio import ALLOC_ROOM, ALLOC_STEP
from resumable._stores._local import LocalStore
from resumable._stores._outlog import LOG_KEY, LOG_MAX, parse
from resumable.exceptions import ResumableWarning

TIMEOUT = 60


def _log_bytes(*records: tuple[str, bytes], salt: bytes = b"01234567") -> bytes:
    """A log as the store writes it: a start with *salt*, then one record per (key, bytes)."""
    out = b"RSMLOG01" + salt
    for key, data in records:
        name = key.encode()
        body = struct.pack("<IH", len(data), len(name)) + name + data
        out += struct.pack("<I", zlib.crc32(body, zlib.crc32(salt))) + body
    return out


def _fsynced_paths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Record (thread name, path) of every fsync and fdatasync from now on."""
    seen: list[tuple[str, str]] = []

    def counting(real: Callable[[int], None]) -> Callable[[int], None]:
        def sync(fd: int) -> None:
            seen.append((threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
            real(fd)

        return sync

    for name in ("fsync", "fdatasync"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, counting(getattr(os, name)))
    return seen


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors through /proc")
def test_a_durable_output_is_one_fsync_on_the_callers_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """
    The caller fsyncs the log only; the file is in place when write returns; it is made
    durable in the background, and closing empties the log.
    """
    store = LocalStore(tmp_path)
    store.write("step/first.msgpack", [b"creates the log and the directory"], durable=True)
    store.close_appends()
    seen = _fsynced_paths(monkeypatch)
    framed = resumable._codec.frame(
        resumable._codec.encode({"a": 1}, allow_pickle=False), {"slot": "a"}, secret=None
    )
    store.write("step/a.msgpack", framed.chunks(), durable=True)
    mine = [path for thread, path in seen if thread == threading.current_thread().name]
    assert [str(tmp_path / LOG_KEY)] == mine  # the write's only fsync
    assert {"a": 1} == resumable.load(tmp_path / "step" / "a.msgpack")  # there at once
    assert bytes(store.read("step/a.msgpack")) == b"".join(bytes(c) for c in framed.chunks())
    store.close_appends()
    assert 0 == (tmp_path / LOG_KEY).stat().st_size


def test_records_are_written_within_the_allocated_log(tmp_path: Path):
    """
    The log is allocated ahead, a step at a time: a record leaves the file's size as it is
    (so its fdatasync flushes the record only), a record past the end allocates the next
    step, and the next lock holder reads the records, not the zeros after them, as a log.
    """
    store = LocalStore(tmp_path)
    log = tmp_path / LOG_KEY
    store.write("first.msgpack", [b"a"], durable=True)
    size = log.stat().st_size
    assert ALLOC_STEP <= size
    for i in range(10):
        store.write(f"k/{i}.msgpack", [b"x" * 1000], durable=True)
    assert size == log.stat().st_size
    big = b"y" * LOG_MAX
    for i in range(size // LOG_MAX + 1):
        store.write(f"big/{i}.msgpack", [big], durable=True)
    outputs, end = parse(log.read_bytes())
    assert 1 + 10 + size // LOG_MAX + 1 == len(outputs)
    assert size < end <= log.stat().st_size
    (tmp_path / "k" / "3.msgpack").unlink()  # as a power loss could leave it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the allocated rest is no damaged tail
        LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"x" * 1000 == (tmp_path / "k" / "3.msgpack").read_bytes()
    assert 0 == log.stat().st_size


def test_a_record_whose_write_stopped_is_dropped_quietly_and_damage_is_warned_about(tmp_path: Path):
    """
    A record whose end never reached the log (a kill or power loss during its write, into
    the allocated zeros) was never promised: dropped without a warning. A record damaged
    otherwise (its end written) is warned about. Either way the records before it apply.
    """
    _write_and_die(tmp_path, ("a.msgpack", b"a"), ("b.msgpack", b"b" * 100))
    log = tmp_path / LOG_KEY
    data = log.read_bytes()
    _, end = parse(data)
    log.write_bytes(data[: end - 50] + bytes(len(data) - end + 50))  # the last 50 bytes never written
    (tmp_path / "a.msgpack").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"a" == (tmp_path / "a.msgpack").read_bytes()
    _write_and_die(tmp_path, ("a.msgpack", b"a"), ("b.msgpack", b"b" * 100))
    data = bytearray(log.read_bytes())
    data[parse(bytes(data))[1] - 50] ^= 0x01  # a bit flipped inside the last record
    log.write_bytes(bytes(data))
    (tmp_path / "a.msgpack").unlink()
    with pytest.warns(ResumableWarning, match="not a whole record"):
        LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"a" == (tmp_path / "a.msgpack").read_bytes()


def _no_fallocate(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(os, "posix_fallocate", refuse)


def _fallocate_fills_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    def fill(fd: int, offset: int, length: int) -> None:
        os.ftruncate(fd, offset + length // 2)  # as ext4 keeps what it allocated before failing
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", fill)


def _little_room(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fstatvfs

    def nearly_full(fd: int) -> Any:
        found = real(fd)
        return mock.Mock(f_bavail=(ALLOC_ROOM - 1) // found.f_frsize, f_frsize=found.f_frsize)

    monkeypatch.setattr(os, "fstatvfs", nearly_full)
    monkeypatch.setattr(os, "posix_fallocate", mock.Mock(side_effect=AssertionError("allocated")))


@pytest.mark.parametrize("disk", [_no_fallocate, _fallocate_fills_the_disk, _little_room])
def test_the_log_is_not_allocated_where_it_cannot_be_or_room_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, disk: Callable[[pytest.MonkeyPatch], None]
):
    """
    A file system without fallocate, one that fills up while it allocates, or one with less
    than ALLOC_ROOM free (the space near a full disk is the user's): the records extend the
    log as they are written, and nothing is held past them.
    """
    disk(monkeypatch)
    _write_and_die(tmp_path, ("a.msgpack", b"a"), ("b.msgpack", b"b"))
    log = tmp_path / LOG_KEY
    outputs, end = parse(log.read_bytes())
    assert {"a.msgpack": b"a", "b.msgpack": b"b"} == outputs
    assert end == log.stat().st_size
    (tmp_path / "b.msgpack").unlink()
    LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"b" == (tmp_path / "b.msgpack").read_bytes()


def test_what_does_not_go_through_the_log(tmp_path: Path):
    """Non-durable writes, files that are not outputs and outputs over LOG_MAX are written in place."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"x"], durable=False)
    store.write("manifest.json", [b"{}"], durable=True)
    store.write(".resumable/history/v.msgpack", [b"v"], durable=True)
    store.write("big.msgpack", [b"b" * (LOG_MAX + 1)], durable=True)
    assert not (tmp_path / LOG_KEY).exists()
    store.write("small.msgpack", [b"s"], durable=True)
    assert (tmp_path / LOG_KEY).exists()
    assert LOG_KEY not in store.list()  # the log is the store's own, like its lock


def _write_and_die(root: Path, *writes: tuple[str, bytes]) -> None:
    """Write durably, then leave as a killed process would: the log never emptied."""
    store = LocalStore(root)
    for key, data in writes:
        store.write(key, [data], durable=True)


def test_the_next_lock_holder_applies_the_log(tmp_path: Path):
    """Files a power loss took (missing, torn, an older version) are written from the log."""
    _write_and_die(tmp_path, ("a.msgpack", b"old a"), ("a.msgpack", b"new a"), ("k/1.msgpack", b"one"))
    assert 0 < (tmp_path / LOG_KEY).stat().st_size
    (tmp_path / "a.msgpack").write_bytes(b"")  # torn by the power loss
    (tmp_path / "k" / "1.msgpack").unlink()  # its rename lost
    lock = LocalStore(tmp_path).lock({"pid": 1})
    lock.release()
    assert b"new a" == (tmp_path / "a.msgpack").read_bytes()
    assert b"one" == (tmp_path / "k" / "1.msgpack").read_bytes()
    assert 0 == (tmp_path / LOG_KEY).stat().st_size


def test_a_file_that_made_it_is_only_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """After a kill the files are all there: recovery rewrites none of them."""
    _write_and_die(tmp_path, ("a.msgpack", b"a"))
    inode = (tmp_path / "a.msgpack").stat().st_ino
    replaced: list[object] = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda *a, **k: (replaced.append(a), real(*a, **k)))
    LocalStore(tmp_path).lock({"pid": 1}).release()
    assert ([], inode) == (replaced, (tmp_path / "a.msgpack").stat().st_ino)


def test_a_changed_key_leaves_the_log_first(tmp_path: Path):
    """A delete or an in-place write after a logged one: the log cannot bring the old bytes back."""
    store = LocalStore(tmp_path)
    store.write("gone.msgpack", [b"logged"], durable=True)
    store.write("lazy.msgpack", [b"logged"], durable=True)
    store.write("kept.msgpack", [b"logged"], durable=True)
    store.delete("gone.msgpack", durable=True)
    store.write("lazy.msgpack", [b"not durable"], durable=False)
    store.write("kept.msgpack", [b"logged again"], durable=True)
    # killed here: nothing empties the log
    LocalStore(tmp_path).lock({"pid": 1}).release()
    assert not (tmp_path / "gone.msgpack").exists()
    assert b"not durable" == (tmp_path / "lazy.msgpack").read_bytes()
    assert b"logged again" == (tmp_path / "kept.msgpack").read_bytes()


def test_parse_keeps_the_last_record_of_each_key_and_stops_at_a_bad_one():
    """A record of another salt, cut short or with a wrong CRC ends the log."""
    good = _log_bytes(("a.msgpack", b"1"), ("b.msgpack", b"2"), ("a.msgpack", b"3"))
    assert ({"b.msgpack": b"2", "a.msgpack": b"3"}, len(good)) == parse(good)
    assert ({"b.msgpack": b"2", "a.msgpack": b"3"}, len(good)) == parse(good + b"\x00" * 9)
    stale = _log_bytes(("c.msgpack", b"4"), salt=b"another!")[16:]
    assert ({"b.msgpack": b"2", "a.msgpack": b"3"}, len(good)) == parse(good + stale)
    cut = _log_bytes(("a.msgpack", b"1"), ("b.msgpack", b"2"))
    assert {"a.msgpack": b"1"} == parse(cut[:-1])[0]
    flipped = bytearray(cut)
    flipped[-1] ^= 1
    assert {"a.msgpack": b"1"} == parse(flipped)[0]
    assert ({}, 0) == parse(b"not a log at all")


def test_a_damaged_tail_is_dropped_with_a_warning(tmp_path: Path):
    """The whole records before it are applied; the warning names the log and says what follows."""
    log = tmp_path / LOG_KEY
    log.parent.mkdir(parents=True)
    log.write_bytes(_log_bytes(("a.msgpack", b"a"), ("b.msgpack", b"b"))[:-1])
    with pytest.warns(ResumableWarning, match=r"outputs\.log: the last \d+ bytes .* computed again"):
        LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"a" == (tmp_path / "a.msgpack").read_bytes()
    assert not (tmp_path / "b.msgpack").exists()
    assert 0 == log.stat().st_size


def test_hostile_records_write_nothing_outside(tmp_path: Path):
    """Records for keys that are not output files are ignored, each with a warning."""
    state = tmp_path / "state"
    log = state / LOG_KEY
    log.parent.mkdir(parents=True)
    hostile = [
        "../outside.msgpack",
        "/tmp/abs.msgpack",
        ".resumable/lock",
        "a/b/c.msgpack",
        "x.json",
        "a/../y.msgpack",
    ]
    log.write_bytes(_log_bytes(*[(k, b"evil") for k in hostile], ("fine.msgpack", b"ok")))
    with pytest.warns(ResumableWarning, match="not an output file") as caught:
        LocalStore(state).lock({"pid": 1}).release()
    assert len(hostile) == len(caught)
    assert b"ok" == (state / "fine.msgpack").read_bytes()
    assert ["state"] == os.listdir(tmp_path)
    assert sorted(["fine.msgpack", ".resumable"]) == sorted(os.listdir(state))


def test_a_log_that_is_a_symlink_is_refused(tmp_path: Path):
    """The lock is not taken through a linked log, and the link's target is left alone."""
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere.log"
    elsewhere.write_bytes(_log_bytes(("a.msgpack", b"a")))
    (state / ".resumable").mkdir(parents=True)
    (state / LOG_KEY).symlink_to(elsewhere)
    with pytest.raises(StateDirectoryError, match=r"outputs\.log is a symbolic link"):
        LocalStore(state).lock({"pid": 1})
    assert not (state / "a.msgpack").exists()
    assert _log_bytes(("a.msgpack", b"a")) == elsewhere.read_bytes()
    LocalStore(tmp_path / "other").lock({"pid": 1}).release()  # the lock was released


def test_a_failed_background_sync_is_reported_and_the_log_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """
    The next write (and the close) raises an error that says the outputs are safe in the log;
    the next holder of the lock writes them.
    """
    store = LocalStore(tmp_path)
    lock = store.lock({"pid": 1})

    def failing(root: str) -> bool:
        raise OSError(errno.EIO, "Input/output error", root)

    monkeypatch.setattr(_outlog, "sync_filesystem", failing)
    monkeypatch.setattr(_outlog, "_fsync_each", lambda files: failing(str(tmp_path)))
    monkeypatch.setattr(_outlog, "SYNC_DELAY", 0.0)
    store.write("a.msgpack", [b"a"], durable=True)
    deadline = time.monotonic() + 10
    while store._log is not None and store._log._error is None and time.monotonic() < deadline:
        time.sleep(0.01)  # until the thread has failed
    with pytest.raises(OSError, match=r"safe in .*outputs\.log, and the next run"):
        store.write("b.msgpack", [b"b"], durable=True)  # a later store
    with pytest.raises(OSError, match=r"safe in .*outputs\.log, and the next run") as info:
        store.close_appends()
    assert errno.EIO == info.value.errno
    monkeypatch.undo()
    lock.release()
    assert 0 < (tmp_path / LOG_KEY).stat().st_size
    (tmp_path / "a.msgpack").unlink()  # as if the power had gone
    store.lock({"pid": 1}).release()
    assert b"a" == (tmp_path / "a.msgpack").read_bytes()
    store.write("b.msgpack", [b"b"], durable=True)  # the failed log is gone with the lock
    store.close_appends()


def test_threads_writing_at_once(tmp_path: Path):
    """Many threads, some on the same keys: each file ends as one of its writes, the log empty."""
    store = LocalStore(tmp_path)

    def work(t: int) -> None:
        for i in range(40):
            store.write(f"k/{i % 10}.msgpack", [f"{t}:{i}".encode()], durable=True)
            store.write(f"t{t}.msgpack", [str(i).encode()], durable=True)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    store.close_appends()
    assert all(b"39" == (tmp_path / f"t{t}.msgpack").read_bytes() for t in range(6))
    assert all(
        (tmp_path / "k" / f"{i}.msgpack").read_bytes().endswith(b":3" + str(i).encode()) for i in range(10)
    )
    assert 0 == (tmp_path / LOG_KEY).stat().st_size
    assert [] == store.temp_files()


def test_a_forked_child_writes_in_place(tmp_path: Path):
    """A child process does not use its parent's log (nor wait for the parent's thread)."""
    store = LocalStore(tmp_path)
    store.write("parent.msgpack", [b"p"], durable=True)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            store.write("child.msgpack", [b"c"], durable=True)
            store.close_appends()
        finally:
            os._exit(0)
    assert (pid, 0) == os.waitpid(pid, 0)
    assert b"c" == (tmp_path / "child.msgpack").read_bytes()
    store.close_appends()
    assert 0 == (tmp_path / LOG_KEY).stat().st_size


# --- a real kill: outputs only in the log ------------------------------------------------

STEPS = """
import sys, threading
from resumable import Pipeline
from resumable._stores import _outlog

if sys.argv[3] == "stall":  # the background thread never syncs: the log is never emptied
    _outlog.OutputLog._make_durable = lambda self: threading.Event().wait()

pipe = Pipeline("outlog", state_dir=sys.argv[1])

@pipe.step(key="{i}")
def square(i: int) -> dict:
    with open(sys.argv[2], "a") as f:
        f.write(f"{i}\\n")
    return {"i": i, "square": i * i}

print("RESULT", [square(i)["square"] for i in range(5)], flush=True)
if sys.argv[3] == "stall":
    threading.Event().wait()
"""


def _verify(state: Path) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "resumable", "--state-dir", str(state), "verify"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def test_killed_with_outputs_only_in_the_log(tmp_path: Path):
    """
    SIGKILL while no output is durable but through the log, then lose the files as a power
    loss could: verify says which damaged files the log holds intact, the rerun recomputes
    nothing and returns what an uninterrupted run does, and verify passes on the state that
    results.
    """
    script, state, ran = tmp_path / "steps.py", tmp_path / "state", tmp_path / "ran"
    script.write_text(textwrap.dedent(STEPS))
    argv = [sys.executable, str(script), str(state), str(ran)]
    popen = subprocess.Popen([*argv, "stall"], stdout=subprocess.PIPE, text=True)
    assert popen.stdout is not None
    assert popen.stdout.readline().startswith("RESULT [0, 1, 4, 9, 16]")
    popen.send_signal(signal.SIGKILL)
    assert -signal.SIGKILL == popen.wait(TIMEOUT)
    popen.stdout.close()
    assert 0 < (state / LOG_KEY).stat().st_size
    outputs = sorted((state / "square").iterdir())
    assert 5 == len(outputs)
    outputs[0].unlink()  # the rename lost
    outputs[1].write_bytes(b"")  # the bytes lost
    outputs[2].write_bytes(outputs[2].read_bytes()[:-3])  # cut short
    before = _verify(state)
    assert 1 == before.returncode
    restorable = [
        line for line in before.stdout.splitlines() if "an intact copy is in .resumable/outputs.log" in line
    ]
    assert [outputs[1].name, outputs[2].name] == [
        line.split(":")[0].rpartition("/")[2] for line in restorable
    ]
    rerun = subprocess.run([*argv, "go"], capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert (0, "RESULT [0, 1, 4, 9, 16]\n") == (rerun.returncode, rerun.stdout)
    assert Counter(range(5)) == Counter(int(line) for line in ran.read_text().split())
    assert [{"i": 0, "square": 0}] == [resumable.load(outputs[0])]
    verify = _verify(state)
    assert 0 == verify.returncode, verify.stdout + verify.stderr
    assert 0 == (state / LOG_KEY).stat().st_size


BLOBS = """
import hashlib, sys
from resumable import Pipeline

pipe = Pipeline("blobs", state_dir=sys.argv[1])

@pipe.step(key="{i}")
def blob(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest() * 1900  # 60 KB: through the log, a long write

with pipe:
    for i in range(400):
        blob(i)
        if i == 5:
            print("storing", flush=True)
print("RESULT", hashlib.sha256(b"".join(blob(i) for i in range(400))).hexdigest(), flush=True)
"""


def test_kills_during_long_durable_stores_leave_no_warning(tmp_path: Path):
    """
    SIGKILL at random moments of a loop of 60 KB durable outputs (a kill can stop a
    record's write part-way in the allocated log): verify passes on each state, no rerun
    warns, and the result is an uninterrupted run's.
    """
    script, state = tmp_path / "blobs.py", tmp_path / "state"
    script.write_text(BLOBS)
    argv = [sys.executable, str(script)]
    reference = subprocess.run(
        [*argv, str(tmp_path / "reference")], capture_output=True, text=True, check=True
    )
    rng = random.Random(7)  # noqa: S311 - when to kill, not a secret
    for _ in range(4):
        popen = subprocess.Popen(
            [*argv, str(state)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert popen.stdout is not None
        popen.stdout.readline()
        time.sleep(rng.uniform(0, 0.1))
        popen.send_signal(signal.SIGKILL)
        _, err = popen.communicate(timeout=TIMEOUT)
        assert "Warning" not in err, err
        verify = _verify(state)
        assert 0 == verify.returncode, verify.stdout + verify.stderr
    rerun = subprocess.run([*argv, str(state)], capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert (0, "") == (rerun.returncode, "Warning" if "Warning" in rerun.stderr else ""), rerun.stderr
    assert reference.stdout == rerun.stdout


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors through /proc")
def test_without_syncfs_each_file_and_directory_is_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Where there is no syncfs, the thread fsyncs every file written, then each directory once."""
    monkeypatch.setattr(_outlog, "sync_filesystem", lambda root: False)
    store = LocalStore(tmp_path)
    seen = _fsynced_paths(monkeypatch)
    for i in range(3):
        store.write(f"k/{i}.msgpack", [b"x"], durable=True)
    store.close_appends()
    synced = [path for thread, path in seen if thread == "resumable-outputs"]
    assert sorted([*(str(tmp_path / "k" / f"{i}.msgpack") for i in range(3)), str(tmp_path / "k")]) == sorted(
        synced
    )


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names descriptors through /proc")
def test_a_link_to_a_logged_file_is_fsynced_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A kept version (a hard link) must not point at bytes only the log holds: the file is fsynced first."""
    monkeypatch.setattr(_outlog, "SYNC_DELAY", 60.0)  # left alone, the thread would wait a minute
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"v1"], durable=True)
    seen = _fsynced_paths(monkeypatch)
    store.copy("a.msgpack", ".resumable/versions/a.1", durable=True)
    assert str(tmp_path / "a.msgpack") in [path for _, path in seen]
    monkeypatch.undo()
    store.close_appends()


def test_an_interrupt_during_the_fsync_keeps_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Ctrl-C while the record is fsynced: the previous file stays, no temporary file, the log can be emptied."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"old"], durable=True)
    real = os.fdatasync

    def interrupted(fd: int) -> None:
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        real(fd)

    monkeypatch.setattr(os, "fdatasync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        store.write("a.msgpack", [b"new"], durable=True)
    monkeypatch.undo()
    store.close_appends()
    assert b"old" == (tmp_path / "a.msgpack").read_bytes()
    assert [] == store.temp_files()
    assert 0 == (tmp_path / LOG_KEY).stat().st_size


def test_a_record_under_a_linked_directory_is_skipped(tmp_path: Path):
    """A link planted on a logged output's way: the lock is taken, nothing is written through it."""
    state, outside = tmp_path / "state", tmp_path / "outside"
    outside.mkdir()
    (outside / "1.msgpack").write_bytes(b"theirs")
    log = state / LOG_KEY
    log.parent.mkdir(parents=True)
    log.write_bytes(_log_bytes(("k/1.msgpack", b"ours"), ("fine.msgpack", b"ok")))
    (state / "k").symlink_to(outside)
    with pytest.warns(ResumableWarning, match=r"did not write 'k/1\.msgpack'.*symbolic link"):
        LocalStore(state).lock({"pid": 1}).release()
    assert b"theirs" == (outside / "1.msgpack").read_bytes()
    assert b"ok" == (state / "fine.msgpack").read_bytes()
    assert 0 == log.stat().st_size


def test_threads_storing_their_first_outputs_at_once_share_one_log(tmp_path: Path):
    """The store makes one log however many threads write its first outputs together."""
    for attempt in range(5):
        store = LocalStore(tmp_path / str(attempt))
        barrier = threading.Barrier(8)

        def first(t: int, store: LocalStore = store, barrier: threading.Barrier = barrier) -> None:
            barrier.wait()
            store.write(f"t{t}.msgpack", [b"x"], durable=True)

        threads = [threading.Thread(target=first, args=(t,)) for t in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        outputs, end = parse((tmp_path / str(attempt) / LOG_KEY).read_bytes())
        assert ({f"t{t}.msgpack" for t in range(8)}, True) == (set(outputs), end > 0)
        store.close_appends()


def test_a_delete_while_other_threads_store_still_empties_the_log(tmp_path: Path):
    """The log is emptied before a delete even while other keys are being stored: a kill cannot bring it back."""
    store = LocalStore(tmp_path)
    store.write("gone.msgpack", [b"logged"], durable=True)
    stop = threading.Event()

    def busy() -> None:
        i = 0
        while not stop.is_set():
            store.write(f"busy/{i % 50}.msgpack", [b"x"], durable=True)
            i += 1

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        store.delete("gone.msgpack", durable=True)
        assert "gone.msgpack" not in parse((tmp_path / LOG_KEY).read_bytes())[0]
    finally:
        stop.set()
        thread.join()
    LocalStore(tmp_path).lock({"pid": 1}).release()  # as after a kill: apply the log
    assert not (tmp_path / "gone.msgpack").exists()
    store.close_appends()


def test_a_busy_run_keeps_its_log_short(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """With records coming all the time, the log is still emptied once it is past EMPTY_AT."""
    monkeypatch.setattr(_outlog, "EMPTY_AT", 4096)
    monkeypatch.setattr(_outlog, "SYNC_DELAY", 0.001)
    store = LocalStore(tmp_path)
    sizes = []
    for i in range(400):
        store.write(f"k/{i}.msgpack", [b"x" * 100], durable=True)
        sizes.append(parse((tmp_path / LOG_KEY).read_bytes())[1])  # where its records end
    assert max(sizes) < 400 * 100 / 4  # emptied again and again, not only at the close
    store.close_appends()
    assert 0 == (tmp_path / LOG_KEY).stat().st_size
    LocalStore(tmp_path).lock({"pid": 1}).release()
    assert all(b"x" * 100 == (tmp_path / "k" / f"{i}.msgpack").read_bytes() for i in range(400))


def test_a_huge_log_is_read_only_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A log longer than any resumable writes (planted, or filled with garbage) is not read whole."""
    monkeypatch.setattr(_outlog, "READ_MAX", 1000)
    log = tmp_path / LOG_KEY
    log.parent.mkdir(parents=True)
    log.write_bytes(_log_bytes(("a.msgpack", b"a"), ("b.msgpack", b"b" * 2000)) + b"\0" * 5000)
    with pytest.warns(
        ResumableWarning, match=r"more than any output log resumable writes: only its first 1000 bytes"
    ):
        LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"a" == (tmp_path / "a.msgpack").read_bytes()
    assert not (tmp_path / "b.msgpack").exists()
    assert 0 == log.stat().st_size


def test_a_link_over_a_logged_key_leaves_the_log_first(tmp_path: Path):
    """A kept version linked back over a logged output (a rollback): the log cannot bring the later bytes back."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"first"], durable=True)
    store.copy("a.msgpack", ".resumable/objects/v1.msgpack", durable=True)
    store.write("a.msgpack", [b"second"], durable=True)
    store.copy(".resumable/objects/v1.msgpack", "a.msgpack", durable=True)
    # killed here: nothing empties the log
    LocalStore(tmp_path).lock({"pid": 1}).release()
    assert b"first" == (tmp_path / "a.msgpack").read_bytes()
