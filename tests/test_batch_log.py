"""
The chunk log: a batch's committed chunks appended to one file, cut where a crash tore it,
read back with damage stepped over, and the one-file-per-chunk layout still read.
"""

from __future__ import annotations

import contextlib
import errno
import io
import itertools
import os
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from chunk_files import LOG, committed, log_records
from test_batch import BATCHES, Counter

from resumable import (
    InputChangedError,
    Pipeline,
    ResumableWarning,
    _batch_ledger,
    _journal,
    checkpointed,
    checkpointed_map,
)
from resumable._chunklog import scan
from resumable._cli import main
from resumable._stores import _local
from resumable._stores._local import AppendFile, LocalStore
from resumable._stores._memory import MemoryStore

ROWS = 50
EVERY = 5
EXPECTED = [x * 10 for x in range(ROWS)]


def run_batch(pipe: Pipeline, fn: Counter, rows: int = ROWS, **kwargs: Any) -> list[Any]:
    with pipe:
        return checkpointed_map(fn, range(rows), every=EVERY, name="b", **kwargs)


def log_path(state_dir: Path) -> Path:
    return state_dir / BATCHES / "named" / "b" / LOG


def cli(state_dir: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["--state-dir", str(state_dir), *args])
    return code, out.getvalue()


def test_a_batch_appends_its_chunks_to_one_log(pipe: Pipeline, state_dir: Path):
    """One record per commit, in commit order, holding the rows, their digest and results."""
    run_batch(pipe, Counter())
    directory = state_dir / BATCHES / "named" / "b"
    assert ["batch.msgpack", LOG] == sorted(p.name for p in directory.iterdir())
    records = log_records(directory / LOG)
    assert [[i, i + EVERY] for i in range(0, ROWS, EVERY)] == [r.header["rows"] for r in records]
    assert [x * 10 for x in range(5, 10)] == records[1].value
    assert {"format", "slot", "batch", "rows", "digest", "failures", "checksum", "size", "hsum"} <= set(
        records[0].header
    )
    assert os.path.getsize(directory / LOG) == sum(r.length for r in records)


@pytest.mark.parametrize("seed", range(6))
def test_a_torn_tail_is_cut_and_its_rows_done_again(pipe: Pipeline, state_dir: Path, seed: int):
    """Cut anywhere (as a crash mid-write or a full disk leaves it): whole records are kept, the rest redone."""
    fn = Counter()
    run_batch(pipe, fn)
    path = log_path(state_dir)
    data = path.read_bytes()
    records = log_records(path)
    cut = random.Random(seed).randrange(records[1].offset, len(data))  # noqa: S311 - test data
    path.write_bytes(data[:cut])
    kept = [r for r in records if r.offset + r.length <= cut]
    fn.calls.clear()
    assert EXPECTED == run_batch(pipe, fn)  # no warning: a torn tail is what a kill leaves
    assert list(range(kept[-1].header["rows"][1], ROWS)) == fn.calls
    assert data[: kept[-1].offset + kept[-1].length] == path.read_bytes()[: kept[-1].offset + kept[-1].length]
    assert [(i, i + EVERY, 0) for i in range(0, ROWS, EVERY)] == committed(path.parent)


def test_garbage_after_the_last_record_is_cut(pipe: Pipeline, state_dir: Path):
    fn = Counter()
    run_batch(pipe, fn)
    path = log_path(state_dir)
    data = path.read_bytes()
    with path.open("ab") as f:
        f.write(b"\x00" * 3000)
    fn.calls.clear()
    assert EXPECTED == run_batch(pipe, fn)
    assert [] == fn.calls
    assert data == path.read_bytes()


@pytest.mark.parametrize("where", ["header", "value"])
def test_a_damaged_record_in_the_middle_is_stepped_over(pipe: Pipeline, state_dir: Path, where: str):
    """A flipped bit in the middle: that chunk alone is redone, with one warning, once."""
    fn = Counter()
    run_batch(pipe, fn)
    path = log_path(state_dir)
    data = bytearray(path.read_bytes())
    victim = log_records(path)[4]  # rows 20 to 24
    data[victim.offset + (30 if where == "header" else victim.length - 2)] ^= 0x10
    path.write_bytes(bytes(data))
    fn.calls.clear()
    with pytest.warns(ResumableWarning, match="damaged"):
        assert EXPECTED == run_batch(pipe, fn)
    assert list(range(20, 25)) == fn.calls
    assert [] == _open_logs()  # the void record went through the log kept open, which is closed
    fn.calls.clear()
    assert EXPECTED == run_batch(pipe, fn)  # voided: no second warning, nothing redone
    assert [] == fn.calls
    assert 0 == cli(state_dir, "verify")[0]


def test_verify_reports_damage_in_a_log_but_not_a_torn_tail(pipe: Pipeline, state_dir: Path):
    run_batch(pipe, Counter())
    path = log_path(state_dir)
    data = path.read_bytes()
    path.write_bytes(data[:-7])
    assert (0, "") == (cli(state_dir, "verify")[0], "")
    flipped = bytearray(data)
    flipped[log_records(path)[2].offset + 40] ^= 0x01
    path.write_bytes(bytes(flipped))
    code, out = cli(state_dir, "verify")
    assert 1 == code
    assert LOG in out


def test_old_chunk_files_resume_into_a_log(pipe: Pipeline, state_dir: Path, monkeypatch: pytest.MonkeyPatch):
    """A state directory holding one file per chunk (copied from an object store) resumes; new chunks go to the log."""
    fn = Counter(fail_at=23)
    with monkeypatch.context() as m:
        m.setattr(LocalStore, "slow_appends", True)
        with pytest.raises(RuntimeError):
            run_batch(pipe, fn)
    directory = state_dir / BATCHES / "named" / "b"
    assert not (directory / LOG).exists()
    assert 5 == len(committed(directory))  # four files of 5 rows, one of the 3 finished before the error
    fn.fail_at = None
    fn.calls.clear()
    assert EXPECTED == run_batch(pipe, fn)
    assert list(range(23, ROWS)) == fn.calls
    assert [[23, 28], *[[i, i + EVERY] for i in range(28, ROWS - 2, EVERY)], [48, 50]] == [
        r.header["rows"] for r in log_records(directory / LOG)
    ]


def test_a_step_removes_its_log_when_it_completes(pipe: Pipeline, state_dir: Path):
    fn = Counter(fail_at=12)

    @pipe.step
    def enrich() -> list[int]:
        return checkpointed_map(fn, range(ROWS), every=EVERY)

    with pipe, pytest.raises(RuntimeError):
        enrich()
    assert (state_dir / BATCHES / "steps" / "enrich" / LOG).is_file()
    fn.fail_at = None
    with pipe:
        assert EXPECTED == enrich()
    assert [] == [p for p in (state_dir / BATCHES).rglob("*") if p.is_file()]


def test_one_sync_per_committed_chunk(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """
    A durable commit is one write and one fsync of the log: no new file, no directory
    fsync, no rename (counted on this thread: nothing else may add to the count).
    """
    calls = {"fsync": 0, "fdatasync": 0, "replace": 0, "write": 0, "pwrite": 0, "open": 0}
    originals = {name: getattr(os, name) for name in calls}
    me = threading.get_ident()
    # manifest.json waits for its interval and the batch's progress is reported at its start and
    # end only, however slow the machine
    monkeypatch.setattr(_journal, "FLUSH_INTERVAL", 3600.0)
    monkeypatch.setattr(_batch_ledger, "REPORT_INTERVAL", 3600.0)
    monkeypatch.setattr(_local, "_unsynced", {})
    monkeypatch.setattr(_local, "GROUP_WINDOW", 3600.0)  # directory fsyncs are shared by the close

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    with pipe:
        checkpointed_map(abs, range(EVERY), every=EVERY, name="a")  # opens the run outside the count
        for name in calls:
            monkeypatch.setattr(os, name, counting(name))
        checkpointed_map(Counter(), range(100 * EVERY), every=EVERY, name="b")
        for name, original in originals.items():
            monkeypatch.setattr(os, name, original)
    # 100 chunks; once, the batch record (its new directory, the file) and the log's directory
    # entry (the batch record's directory is fsynced by the close)
    assert (103, 0) == (calls["fsync"], calls["fdatasync"])
    assert 1 == calls["replace"]
    assert 0 == calls["pwrite"]
    assert 104 == calls["write"]  # one per chunk, the batch record in two pieces, two progress events
    # the log is opened once (after a try that finds it missing), beside the batch record and
    # the directories fsynced
    assert 8 == calls["open"]


def _open_logs() -> list[str]:
    """The chunk logs this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            found += [path] if (path := os.readlink(f"/proc/self/fd/{fd}")).endswith(LOG) else []
    return found


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
@pytest.mark.parametrize("exc", [None, RuntimeError, KeyboardInterrupt])
def test_a_batch_call_closes_its_log_however_it_ends(pipe: Pipeline, exc: type[BaseException] | None):
    seen: list[list[str]] = []

    def fn(x: int) -> int:
        seen.append(_open_logs())
        if exc is not None and x == 12:
            raise exc("stop")
        return x

    with pipe, pytest.raises(exc) if exc is not None else contextlib.nullcontext():
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    assert [[]] * EVERY == seen[:EVERY]
    assert all(len(logs) == 1 for logs in seen[EVERY:])  # kept open from the first commit on
    assert [] == _open_logs()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="lists open files through /proc")
def test_a_batch_refused_at_its_start_leaves_no_log_open(pipe: Pipeline, state_dir: Path):
    """Reading the log at the start may append to it (a damaged record is voided) before a check refuses."""

    def fn(x: int) -> int:
        if x == 25:
            raise KeyboardInterrupt
        return x

    with pipe, pytest.raises(KeyboardInterrupt):
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    path = log_path(state_dir)
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pipe, pytest.warns(ResumableWarning), pytest.raises(InputChangedError):
        checkpointed_map(fn, range(ROWS + 1), every=EVERY, name="b")
    assert [] == _open_logs()


def test_a_failed_append_is_cut_before_the_next_one(
    pipe: Pipeline, state_dir: Path, monkeypatch: pytest.MonkeyPatch
):
    """An append that wrote part of a record (a full disk) is cut off before the next record goes on."""
    original = AppendFile.append
    failed: list[int] = []

    def flaky(self: AppendFile, data: bytes, *, durable: bool) -> None:
        if self.path.endswith(LOG) and len(failed) == 0 and os.path.getsize(self.path):
            failed.append(len(data))
            original(self, data[: len(data) // 2], durable=durable)
            raise OSError(errno.ENOSPC, "No space left on device", self.path)
        original(self, data, durable=durable)

    monkeypatch.setattr(AppendFile, "append", flaky)
    fn = Counter()
    with pipe, ThreadPoolExecutor(2) as pool, pytest.raises(OSError, match="No space"):
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b", executor=pool, concurrency=4)
    records = log_records(log_path(state_dir))
    assert os.path.getsize(log_path(state_dir)) == sum(r.length for r in records)  # nothing torn left
    fn.calls.clear()
    assert EXPECTED == run_batch(pipe, fn)  # no warning: no damage
    assert set(range(ROWS)) - {x for r in records for x in range(*r.header["rows"])} == set(fn.calls)


def test_loop_state_comes_from_the_newest_record(pipe: Pipeline, state_dir: Path):
    with pipe:
        for x in (loop := checkpointed(range(20), every=3, name="b", state={"n": 0})):
            if x == 10:
                break
            loop.state["n"] += x
    with pipe:
        loop = checkpointed(range(20), every=3, name="b", state={"n": 0})
        assert {"n": sum(range(10))} == loop.state
        for x in loop:
            loop.state["n"] += x
    assert {"n": sum(range(20))} == loop.state


def test_memory_stores_use_a_log_too(tmp_path: Path):
    store = MemoryStore()
    fn = Counter(fail_at=17)
    with Pipeline("m", store=store), pytest.raises(RuntimeError):
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    keys = store.list(".resumable/batches/")
    assert [".resumable/batches/named/b/batch.msgpack", f".resumable/batches/named/b/{LOG}"] == sorted(keys)
    fn.fail_at = None
    fn.calls.clear()
    with Pipeline("m", store=store):
        assert EXPECTED == checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    assert list(range(17, ROWS)) == fn.calls


def test_export_and_import_carry_an_unfinished_log(pipe: Pipeline, state_dir: Path, tmp_path: Path):
    fn = Counter(fail_at=33)
    with pytest.raises(RuntimeError):
        run_batch(pipe, fn)
    exported = tmp_path / "state.msgpack"
    assert 0 == cli(state_dir, "export", "-o", str(exported))[0]
    other = tmp_path / "other"
    assert 0 == cli(other, "import", str(exported))[0]
    fn.fail_at = None
    fn.calls.clear()
    assert EXPECTED == run_batch(Pipeline("test", state_dir=other), fn)
    assert list(range(33, ROWS)) == fn.calls


def test_scan_reads_headers_only(pipe: Pipeline, state_dir: Path):
    """Opening a batch reads no chunk's value: a log of large records is scanned with a few small reads."""
    big = "x" * 300_000
    with pipe:
        checkpointed_map(lambda _: big, range(20), every=2, name="b")
    path = log_path(state_dir)
    data = path.read_bytes()
    read: list[int] = []

    def read_range(start: int, end: int) -> bytes:
        chunk = data[start:end]
        read.append(len(chunk))
        return chunk

    found = scan(read_range, ".resumable/batches/named/b/")
    assert [[i, i + 2] for i in range(0, 20, 2)] == [r.header["rows"] for r in found.records]
    assert (len(data), 0) == (found.end, found.tail)
    assert sum(read) < len(data)


# object stores -------------------------------------------------------------------------------


def test_object_stores_keep_one_object_per_chunk(s3: Any):
    """On S3 (objects written whole) each commit is one object; the batch resumes and cleans up the same."""
    from resumable._stores._fsspec import FsspecStore

    url = s3.url("batch-objects")
    fn = Counter(fail_at=23)
    with Pipeline("s3", store=url), pytest.raises(RuntimeError):
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    keys = FsspecStore(url).list(".resumable/batches/named/b/")
    assert not any(k.endswith(LOG) for k in keys)
    assert 5 == sum(k.endswith(".msgpack") and "-" in k.rpartition("/")[2] for k in keys)
    fn.fail_at = None
    fn.calls.clear()
    with Pipeline("s3", store=url):
        assert EXPECTED == checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    assert list(range(23, ROWS)) == fn.calls


def test_a_log_copied_to_an_object_store_is_read(s3: Any, state_dir: Path):
    """A local state copied into a bucket as it is resumes there, torn tail included; new chunks are objects."""
    from resumable._stores._fsspec import FsspecStore

    fn = Counter(fail_at=33)
    with pytest.raises(RuntimeError):
        run_batch(Pipeline("p", state_dir=state_dir), fn)
    path = log_path(state_dir)
    path.write_bytes(path.read_bytes()[:-5])  # the last record (rows 30 to 32) cut short
    url = s3.url("batch-copied")
    target = FsspecStore(url)
    for file in sorted(state_dir.rglob("*")):
        if file.is_file() and file.name != "lock":
            target.write(file.relative_to(state_dir).as_posix(), [file.read_bytes()], durable=True)
    fn.fail_at = None
    fn.calls.clear()
    with Pipeline("p", store=url):
        assert EXPECTED == checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    assert list(range(30, ROWS)) == fn.calls
    keys = FsspecStore(url).list(".resumable/batches/named/b/")
    assert f".resumable/batches/named/b/{LOG}" in keys
    assert 4 == sum(k.rpartition("/")[2].startswith("0000000000") for k in keys)


# the scan on its own -------------------------------------------------------------------------

BATCH_DIR = ".resumable/batches/named/b/"


def framed_records(n: int, value: Any) -> list[bytes]:
    from resumable._codec import encode, frame

    out = []
    for i in range(n):
        meta = {"slot": "b", "batch": BATCH_DIR, "rows": [i, i + 1], "digest": "f" + "0" * 24, "failures": 0}
        out.append(b"".join(frame(encode([value(i)], allow_pickle=False), meta).chunks()))
    return out


def checked_chunks(data: bytes) -> list[bytes]:
    """The bytes of every chunk record the scan finds (and that passes its checksum) in *data*."""
    from resumable._chunklog import resolve
    from resumable._codec import DamagedFileError, read_verified

    def read(start: int, end: int) -> bytes:
        return data[start:end]

    records, _ = resolve(scan(read, BATCH_DIR), read, None)
    out = []
    for record in records:
        raw = data[record.offset : record.end]
        with contextlib.suppress(DamagedFileError):
            read_verified(raw, None)
            out.append(raw)
    return out


@pytest.mark.parametrize("seed", range(40))
def test_damage_anywhere_never_yields_a_record_that_was_not_written(seed: int):
    """Flips, cuts, inserted garbage: every record found is one written, and records away from the damage are found."""
    rng = random.Random(seed)  # noqa: S311 - test data
    records = framed_records(30, lambda i: {"format": i, "text": "format" * (i % 4)})
    data = bytearray(b"".join(records))
    at = rng.randrange(len(data))
    how = seed % 3
    if how == 0:
        for _ in range(rng.randrange(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif how == 1:
        del data[at : at + rng.randrange(1, 200)]
    else:
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    found = checked_chunks(bytes(data))
    assert set(found) <= set(records)
    assert len(found) == len(set(found))
    # a record at least 300 bytes after the damage, and whole, is found
    ends = list(itertools.accumulate(len(r) for r in records))
    far = [r for r, end in zip(records, ends, strict=True) if end - len(r) > at + 300 and how != 0]
    assert set(far) <= set(found)


def test_a_whole_log_is_read_back_exactly():
    records = framed_records(50, lambda i: "x" * (i * 997 % 5000))
    assert records == checked_chunks(b"".join(records))


def test_a_forged_void_record_is_ignored_with_a_secret(tmp_path: Path):
    """With a secret, a void record written without it cancels nothing: it is damage, warned about once."""
    from resumable._codec import encode, frame

    state = tmp_path / "state"
    fn = Counter()
    with Pipeline("p", state_dir=state, secret="k1"):
        checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    meta = {"slot": "b", "batch": BATCH_DIR, "void": [0]}
    with log_path(state).open("ab") as f:
        f.write(b"".join(frame(encode(None, allow_pickle=False), meta).chunks()))
    fn.calls.clear()
    with Pipeline("p", state_dir=state, secret="k1"), pytest.warns(ResumableWarning, match="a void record"):
        assert EXPECTED == checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    with Pipeline("p", state_dir=state, secret="k1"):
        assert EXPECTED == checkpointed_map(fn, range(ROWS), every=EVERY, name="b")
    assert [] == fn.calls


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_linked_chunk_log_is_never_followed(pipe: Pipeline, state_dir: Path, tmp_path: Path, link: str):
    """A chunk log planted as a link to a file elsewhere is neither read through nor appended to."""
    from resumable import StateDirectoryError

    fn = Counter(fail_at=12)
    with pytest.raises(RuntimeError):
        run_batch(pipe, fn)
    path = log_path(state_dir)
    precious = tmp_path / "precious.bin"
    precious.write_bytes(path.read_bytes())
    path.unlink()
    if link == "symlink":
        path.symlink_to(precious)
    else:
        os.link(precious, path)
    before = precious.read_bytes()
    fn.fail_at = None
    with pytest.raises(StateDirectoryError, match="remove it"):
        run_batch(pipe, fn)
    assert before == precious.read_bytes()


KILLED_BEFORE_CHUNKS_GO = """
import os, sys
from resumable import Pipeline, checkpointed_map
from resumable._session import RunState

if sys.argv[2] == "kill":  # die right after the step's output is stored, before its chunks go
    RunState.forget_batches = lambda self, slot, name=None: os._exit(137)

pipe = Pipeline("p", state_dir=sys.argv[1])

@pipe.step
def enrich() -> list[int]:
    return checkpointed_map(lambda x: x * 10, range(50), every=5)

with pipe:
    print("RESULT", sum(enrich()), flush=True)
"""


def test_chunks_a_kill_left_after_the_output_are_removed_by_the_next_run(tmp_path: Path):
    """
    Killed between storing a batch step's output and deleting its row chunks: the next run
    removes the chunks, skips the step without a warning, and returns the same result.
    """
    script, state = tmp_path / "p.py", tmp_path / "state"
    script.write_text(KILLED_BEFORE_CHUNKS_GO)
    argv = [sys.executable, str(script), str(state)]
    killed = subprocess.run([*argv, "kill"], capture_output=True, text=True, check=False, timeout=60)
    assert 137 == killed.returncode
    assert (state / "enrich.msgpack").is_file()
    assert (state / BATCHES / "steps" / "enrich" / LOG).is_file()
    rerun = subprocess.run([*argv, "go"], capture_output=True, text=True, check=False, timeout=60)
    assert (0, "RESULT 12250\n", "") == (rerun.returncode, rerun.stdout, rerun.stderr)
    assert [] == [p for p in (state / BATCHES).rglob("*") if p.is_file()]
