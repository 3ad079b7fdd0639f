"""Stores: atomic writes, permissions, listing, locks, errors that name the path."""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resumable import Pipeline, ResumableError, StateDirectoryError, StateLockedError, Store
from resumable._stores import _local, key_stamp, open_store
from resumable._stores._local import LocalStore
from resumable._stores._memory import MemoryStore


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each built-in store, empty."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    return MemoryStore()


def test_write_read_list_delete(store: Store):
    """The basic contract every store keeps."""
    store.write("a.msgpack", [b"hello ", memoryview(b"world")], durable=True)
    store.write("step/k.msgpack", [b"x"], durable=False)
    assert b"hello world" == bytes(store.read("a.msgpack"))
    assert b"world" == bytes(store.read("a.msgpack", 6))
    assert b"lo" == bytes(store.read("a.msgpack", 3, 5))
    assert {"a.msgpack", "step/k.msgpack"} == set(store.list())
    assert ["step/k.msgpack"] == store.list("step/")
    store.write("a.msgpack", [b"new"], durable=True)
    assert b"new" == bytes(store.read("a.msgpack"))
    store.delete("a.msgpack", durable=True)
    store.delete("a.msgpack", durable=True)  # absent: no error
    with pytest.raises(FileNotFoundError):
        store.read("a.msgpack")
    with pytest.raises(FileNotFoundError):
        store.read("a.msgpack", 0)


def test_append(store: Store):
    """append adds to the end, creating the object."""
    store.append("log/events.jsonl", b"a\n", durable=False)
    store.append("log/events.jsonl", b"b\n", durable=True)
    assert b"a\nb\n" == bytes(store.read("log/events.jsonl"))


def test_reads_racing_appends(store: Store):
    """A thread reading a log while another appends to it: neither fails, and no append is lost."""
    store.append("events.jsonl", b"", durable=False)
    done = threading.Event()
    reads: list[int] = []
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            while not done.is_set():
                reads.append(len(store.read("events.jsonl", 0, 64)))
        except BaseException as exc:
            errors.append(exc)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: appends land while a read copies
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(20_000):
            store.append("events.jsonl", f"{i}\n".encode(), durable=False)
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert ([], True) == (errors, len(reads) > 0)
    assert "".join(f"{i}\n" for i in range(20_000)).encode() == bytes(store.read("events.jsonl"))


def test_lock_is_exclusive_and_names_holder(store: Store):
    """One holder at a time; the error names the holder; release frees it."""
    held = store.lock({"pid": 1, "host": "h", "since": "t"})
    with pytest.raises(StateLockedError) as info:
        store.lock({"pid": 2, "host": "h2", "since": "t2"})
    assert {"pid": 1, "host": "h", "since": "t"} == info.value.holder
    assert "pid 1 on host h" in str(info.value)
    held.release()
    held.release()
    store.lock({"pid": 3}).release()


def test_store_protocol():
    """The built-in stores satisfy the public Store protocol."""
    assert isinstance(MemoryStore(), Store)
    assert isinstance(LocalStore("x"), Store)


def test_open_store_variants(tmp_path: Path):
    """Paths, file:// and memory:// URLs and Store objects are accepted."""
    assert isinstance(open_store(tmp_path), LocalStore)
    assert str(tmp_path) == open_store(f"file://{tmp_path}").location
    assert open_store("memory://one") is open_store("memory://one")
    assert open_store("memory://") is not open_store("memory://")
    mine = MemoryStore()
    assert mine is open_store(mine)
    with pytest.raises(ResumableError, match="cannot open store 'ftp://x'"):
        open_store("ftp://x")


def test_local_permissions(tmp_path: Path):
    """Files are created 0600 and directories 0700."""
    store = LocalStore(tmp_path / "s")
    store.write("step/key.msgpack", [b"x"], durable=True)
    store.append("events.jsonl", b"x", durable=False)
    for path, mode in [
        (tmp_path / "s", 0o700),
        (tmp_path / "s" / "step", 0o700),
        (tmp_path / "s" / "step" / "key.msgpack", 0o600),
        (tmp_path / "s" / "events.jsonl", 0o600),
    ]:
        assert oct(mode) == oct(stat.S_IMODE(path.stat().st_mode)), path


def _fsynced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths fsynced from now on (a temporary file named as the file it becomes)."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(re.sub(r"/\.([^/]+)\.\d+-\d+-\d+\.tmp$", r"/\1", os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    return synced


def test_local_fsyncs_only_when_durable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """
    durable=False fsyncs nothing. durable=True fsyncs the file, then its directory (and the
    parent of a directory it makes), before the write returns (with no window to share it in).
    """
    monkeypatch.setattr(_local, "_unsynced", {})
    monkeypatch.setattr(_local, "GROUP_WINDOW", 0.0)
    store = LocalStore(tmp_path)
    synced = _fsynced(monkeypatch)
    store.write("a.msgpack", [b"x"], durable=False)
    store.write("manifest.json", [b"x"], durable=False)
    store.append("events.jsonl", b"x", durable=False)
    store.delete("a.msgpack", durable=False)
    assert [] == synced
    store.write("manifest.json", [b"x"], durable=True)
    assert [str(tmp_path / "manifest.json"), str(tmp_path)] == synced
    synced.clear()
    store.write("step/1.msgpack", [b"x"], durable=True)
    # the root as the new directory "step" is made, the file, then its directory
    assert [str(tmp_path), str(tmp_path / "step" / "1.msgpack"), str(tmp_path / "step")] == synced
    synced.clear()
    store.append("events.jsonl", b"y", durable=True)
    assert [str(tmp_path / "events.jsonl")] == synced
    synced.clear()
    store.delete("manifest.json", durable=True)
    assert [str(tmp_path)] == synced


def test_durable_writes_share_their_directory_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """
    A durable write fsyncs its file before it returns; its directory's fsync is shared with
    the durable writes of the next GROUP_WINDOW seconds, or done by ``sync``. A directory
    deleted meanwhile is skipped.
    """
    monkeypatch.setattr(_local, "_unsynced", {})
    clock = [100.0]
    monkeypatch.setattr(_local.time, "monotonic", lambda: clock[0])
    store = LocalStore(tmp_path)
    synced = _fsynced(monkeypatch)
    store.write("step/1.msgpack", [b"x"], durable=True)
    store.write("step/2.msgpack", [b"x"], durable=True)
    store.write("other/1.msgpack", [b"x"], durable=True)
    files = [str(tmp_path / key) for key in ("step/1.msgpack", "step/2.msgpack", "other/1.msgpack")]
    assert [str(tmp_path), files[0], files[1], str(tmp_path), files[2]] == synced  # made dirs' parents
    synced.clear()
    clock[0] += _local.GROUP_WINDOW / 2
    store.write("step/3.msgpack", [b"x"], durable=True)
    assert [str(tmp_path / "step/3.msgpack")] == synced
    synced.clear()
    clock[0] += _local.GROUP_WINDOW / 2
    store.write("step/4.msgpack", [b"x"], durable=True)  # the first rename's window is over
    assert [str(tmp_path / "step/4.msgpack"), str(tmp_path / "step"), str(tmp_path / "other")] == synced
    synced.clear()
    store.write("other/2.msgpack", [b"x"], durable=True)
    store.write("gone/1.msgpack", [b"x"], durable=True)
    store.delete("gone/1.msgpack", durable=False)  # its emptied directory goes too
    synced.clear()
    store.sync()
    assert [str(tmp_path / "other")] == synced
    synced.clear()
    store.sync()
    assert [] == synced


def test_sync_waits_for_a_directory_fsync_under_way(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """
    A sync() while another thread fsyncs a noted directory returns once that fsync is done; a
    directory whose fsync failed stays noted, for the next sync().
    """
    monkeypatch.setattr(_local, "_unsynced", {})
    monkeypatch.setattr(_local, "GROUP_WINDOW", 3600.0)
    store = LocalStore(tmp_path)
    store.write("step/1.msgpack", [b"x"], durable=True)
    started, done = threading.Event(), threading.Event()
    real = _local.fsync_dir

    def slow(path: str) -> None:
        started.set()
        time.sleep(0.2)
        real(path)
        done.set()

    monkeypatch.setattr(_local, "fsync_dir", slow)
    other = threading.Thread(target=store.sync)
    other.start()
    started.wait()
    store.sync()  # nothing left for it to fsync, but the other thread's fsync is under way
    assert done.is_set()
    other.join()

    def failing(path: str) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO), path)

    store.write("step/2.msgpack", [b"x"], durable=True)
    monkeypatch.setattr(_local, "fsync_dir", failing)
    with pytest.raises(OSError, match="Input/output error"):
        store.sync()
    monkeypatch.setattr(_local, "fsync_dir", real)
    synced = _fsynced(monkeypatch)
    store.sync()
    assert [str(tmp_path / "step")] == synced


def test_a_cut_log_is_durable_before_a_step_that_must_not_run_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """After an append to the log failed half-way, the log cut back by rename is in place on disk before an idempotent=False step runs."""
    monkeypatch.setattr(_local, "_unsynced", {})
    monkeypatch.setattr(_local, "GROUP_WINDOW", 3600.0)
    pipe = Pipeline("p", state_dir=tmp_path)

    @pipe.step(key="{x}")
    def a(x: int) -> int:
        return x

    @pipe.step(idempotent=False)
    def charge(x: int) -> int:
        synced.append("charged")
        return x

    real_append = LocalStore.append

    def half_then_full(self: LocalStore, key: str, data: bytes, *, durable: bool) -> None:
        monkeypatch.setattr(LocalStore, "append", real_append)
        real_append(self, key, data[:10], durable=False)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pipe:
        a(0)
        monkeypatch.setattr(LocalStore, "append", half_then_full)
        with pytest.raises(OSError, match="No space left"):
            a(1)
        synced = _fsynced(monkeypatch)
        charge(1)
    events = str(tmp_path / "events.jsonl")
    # the cut log written and renamed, the directories (its own among them), then the start
    # appended and fsynced, and only then the side effect
    charged = synced.index("charged")
    assert events == synced[0]
    assert str(tmp_path) in synced[1 : charged - 1]
    assert events == synced[charged - 1]


def test_local_stamps_follow_versions(tmp_path: Path):
    """A local file's stamp stays while it is unchanged and changes with a new version; other stores have none."""
    store = LocalStore(tmp_path)
    store.write("s.bin", [b"one"], durable=False)
    stamp = key_stamp(store, "s.bin")
    assert stamp is not None
    assert stamp == key_stamp(store, "s.bin")
    store.write("s.bin", [b"two!"], durable=False)
    assert stamp != key_stamp(store, "s.bin")
    with pytest.raises(FileNotFoundError):
        key_stamp(store, "missing.bin")
    memory = MemoryStore()
    memory.write("s.bin", [b"one"], durable=False)
    assert key_stamp(memory, "s.bin") is None


def test_local_failed_write_keeps_previous_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Disk full while saving: the error names the path, the old file and no temp file remain."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"old"], durable=True)

    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left") as info:
        store.write("a.msgpack", [b"new"], durable=True)
    monkeypatch.undo()
    assert errno.ENOSPC == info.value.errno
    assert str(tmp_path / "a.msgpack") == info.value.filename
    assert b"old" == (tmp_path / "a.msgpack").read_bytes()
    assert ["a.msgpack"] == sorted(set(os.listdir(tmp_path)) - {".resumable"})  # no temporary file


def test_permission_denied_names_the_path(pipe: Pipeline, state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A step whose output cannot be saved fails with the path; the earlier output stays."""

    @pipe.step
    def f(x: int) -> int:
        return x

    with pipe:
        f(1)
    real_open = os.open

    def denied(path, flags, mode=0o777, **kw):
        if "/.f.msgpack." in str(path):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", denied)
    with pipe, pytest.raises(PermissionError, match="Permission denied") as info:
        f(2)
    monkeypatch.undo()
    assert info.value.filename.startswith(str(state_dir))
    assert 1 == resumable_load(state_dir / "f.msgpack")
    assert "failed" == pipe.status().steps["f"].status


def resumable_load(path: Path) -> object:
    from resumable import load

    return load(path)


def test_local_list_skips_temp_files(tmp_path: Path):
    """Temporary files left by a crash are never listed as objects."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"x"], durable=False)
    (tmp_path / ".a.msgpack.123-1-0.tmp").write_bytes(b"partial")
    assert ["a.msgpack"] == store.list()


def test_local_delete_removes_empty_step_directory(tmp_path: Path):
    """Deleting the last slot of a keyed step removes its directory."""
    store = LocalStore(tmp_path)
    store.write("step/1.msgpack", [b"x"], durable=False)
    store.delete("step/1.msgpack", durable=True)
    assert not (tmp_path / "step").exists()


def test_local_lock_released_when_holder_dies(tmp_path: Path):
    """A lock held by a process that died does not block the next holder."""
    import subprocess
    import sys

    code = (
        "import sys, os; from resumable._stores._local import LocalStore; "
        "LocalStore(sys.argv[1]).lock({'pid': os.getpid()}); os._exit(9)"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=False)
    LocalStore(tmp_path).lock({"pid": 0}).release()


DATA = bytes(range(256)) * 12_289  # over 3 MiB: copied in several pieces


@pytest.mark.parametrize("code", [errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EMLINK])
def test_local_copy_falls_back_to_a_copy_without_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
):
    """Where a hard link cannot be made (another file system ...), copy makes a real, separate copy, in pieces."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [DATA], durable=True)
    tried: list[str] = []

    def no_link(src: str, dst: str, **kwargs: object) -> None:
        tried.append(os.path.basename(src))
        raise OSError(code, os.strerror(code), src, None, dst)

    def no_read(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("the copy read the whole file into memory")

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(store, "read", no_read)  # a 10 GB output on exFAT would not fit
    store.copy("a.msgpack", ".resumable/objects/v1.msgpack", durable=True)
    monkeypatch.undo()
    kept = tmp_path / ".resumable" / "objects" / "v1.msgpack"
    assert (["a.msgpack"], DATA) == (tried, kept.read_bytes())
    assert (1, 1, 0o600) == (
        (tmp_path / "a.msgpack").stat().st_nlink,
        kept.stat().st_nlink,
        stat.S_IMODE(kept.stat().st_mode),
    )
    assert [] == [p.name for p in kept.parent.iterdir() if p.name.endswith(".tmp")]


def test_local_copy_other_link_errors_propagate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A link error that does not mean "no hard links here" (disk full) is raised, not hidden by a copy."""
    store = LocalStore(tmp_path)
    store.write("a.msgpack", [b"x"], durable=True)

    def full(src: str, dst: str, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", src)

    monkeypatch.setattr(os, "link", full)
    with pytest.raises(OSError, match="No space left") as info:
        store.copy("a.msgpack", "b.msgpack", durable=True)
    listed = sorted(set(os.listdir(tmp_path)) - {".resumable"})
    assert (errno.ENOSPC, ["a.msgpack"]) == (info.value.errno, listed)


def test_history_across_file_systems(state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """With link() failing with EXDEV, outputs are still kept by history and rolled back byte for byte."""

    def cross_device(src: str, dst: str, **kwargs: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link", src, None, dst)

    monkeypatch.setattr(os, "link", cross_device)
    pipe = Pipeline("history", state_dir=state_dir)
    outputs = iter(["first", "second"])

    @pipe.step(version="1")
    def produce(n: int) -> str:
        return next(outputs)

    with pipe:
        produce(1)
    first = (state_dir / "produce.msgpack").read_bytes()
    with pipe:
        produce(2)
        pipe.snapshot("after")
    with pipe:
        pipe.rollback(1)
    assert first == (state_dir / "produce.msgpack").read_bytes()


FORKED_CHILD = """
import os, sys
from resumable._stores._local import LocalStore

store = LocalStore(sys.argv[1])
store.lock({"pid": os.getpid()})
store.write("step/k.msgpack", [b"old"], durable=True)
pid = os.fork()
if pid == 0:  # a step run in a forked child stores a newer output
    store.write("step/k.msgpack", [b"new"], durable=True)
    os._exit(0)
os.waitpid(pid, 0)
print("stored", flush=True)
sys.stdin.read()  # killed here
"""


def test_a_forked_childs_output_survives_a_kill_of_its_parent(tmp_path: Path):
    """
    A parent stores an output, a forked child stores a newer one, then the parent is killed:
    the next holder of the lock finds the child's bytes (nothing writes older ones back).
    """
    script, state = tmp_path / "fork.py", tmp_path / "state"
    script.write_text(FORKED_CHILD)
    popen = subprocess.Popen(
        [sys.executable, str(script), str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert popen.stdout is not None
    with popen:
        assert "stored\n" == popen.stdout.readline()
        popen.send_signal(signal.SIGKILL)
        assert -signal.SIGKILL == popen.wait(60)
    store = LocalStore(state)
    store.lock({"pid": os.getpid()}).release()
    assert b"new" == store.read("step/k.msgpack")
    assert [] == [p.name for p in (state / "step").iterdir() if p.name.endswith(".tmp")]


def test_a_fifo_in_place_of_a_state_file_is_refused_at_once(tmp_path: Path):
    """A FIFO where an output or a log should be is refused with a clear error, never read (it would block)."""
    store = LocalStore(tmp_path)
    os.mkfifo(tmp_path / "a.msgpack")
    os.mkfifo(tmp_path / "events.jsonl")
    for action in (
        lambda: store.read("a.msgpack"),
        lambda: store.read("a.msgpack", 0, 10),
        lambda: store.append("events.jsonl", b"x", durable=False),
    ):
        with pytest.raises(StateDirectoryError, match="not a plain file"):
            action()


def test_a_directory_in_place_of_an_output_is_a_state_directory_error(tmp_path: Path):
    """A directory where an output file should be: StateDirectoryError naming the path, no temp file left."""
    store = LocalStore(tmp_path)
    (tmp_path / "a.msgpack").mkdir()
    with pytest.raises(StateDirectoryError, match=r"a\.msgpack") as info:
        store.write("a.msgpack", [b"x"], durable=True)
    assert errno.EISDIR == info.value.errno
    assert [] == [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_read_only_file_system_is_a_state_directory_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """EROFS while saving becomes a StateDirectoryError that says the file system is read-only."""
    store = LocalStore(tmp_path)

    def read_only(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(StateDirectoryError, match="read-only") as info:
        store.write("a.msgpack", [b"x"], durable=True)
    assert (errno.EROFS, str(tmp_path)) == (info.value.errno, info.value.path)


DIES_HOLDING_THE_LOCK = """
import os, sys
from resumable._stores._local import LocalStore

store = LocalStore(sys.argv[1])
store.lock({"pid": os.getpid()})
open(os.path.join(sys.argv[1], ".a.msgpack.1-1-1.tmp"), "w").close()  # as a killed write leaves it
os._exit(137)
"""


def test_temporary_files_of_a_dead_lock_holder_are_removed_by_the_next(tmp_path: Path):
    """
    A holder killed with the lock (a run, reset, rollback or clean) leaves temporary files:
    the next holder removes them. After a clean release nothing is swept.
    """
    script, state = tmp_path / "dies.py", tmp_path / "state"
    script.write_text(DIES_HOLDING_THE_LOCK)
    assert (
        137 == subprocess.run([sys.executable, str(script), str(state)], check=False, timeout=60).returncode
    )
    assert (state / ".a.msgpack.1-1-1.tmp").exists()
    store = LocalStore(state)
    store.lock({"pid": os.getpid()}).release()
    assert not (state / ".a.msgpack.1-1-1.tmp").exists()
    (state / ".b.msgpack.1-1-2.tmp").touch()  # not a dead holder's: a clean release came last
    store.lock({"pid": os.getpid()}).release()
    assert (state / ".b.msgpack.1-1-2.tmp").exists()


def test_a_durable_step_syncs_its_directory_before_what_must_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """
    When a durable step call returns, its output file is fsynced; its directory's fsync is
    shared with the stores that follow, and comes at once before a non-idempotent step's
    start or completion is fsynced to the log, and when the run closes.
    """
    monkeypatch.setattr(_local, "_unsynced", {})
    monkeypatch.setattr(_local, "GROUP_WINDOW", 3600.0)  # never shared by time here
    pipe = Pipeline("p", state_dir=tmp_path)

    @pipe.step(key="{i}")
    def safe(i: int) -> int:
        return i

    @pipe.step(key="{i}", idempotent=False)
    def charge(i: int) -> int:
        return i

    events, safe_dir, charge_dir = (str(tmp_path / name) for name in ("events.jsonl", "safe", "charge"))
    with pipe:
        safe(0)  # the step directories exist from here on
        charge(0)
        synced = _fsynced(monkeypatch)
        safe(1)
        assert [str(tmp_path / "safe" / "1.msgpack")] == synced
        synced.clear()
        charge(1)
        # its start before it runs (after the directory safe(1) left); its output, its
        # directory, then its completion
        assert [safe_dir, events, str(tmp_path / "charge" / "1.msgpack"), charge_dir, events] == synced
        safe(2)
        synced.clear()
    assert safe_dir in synced  # the close
    assert {} == _local._unsynced
