"""
The :class:`StoreConformance` suite: the guarantees of the :class:`~resumable.Store`
protocol as pytest tests, exported by :mod:`resumable.testing`.
"""

from __future__ import annotations

import abc
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._pipeline import Pipeline
from ._stores import Store
from .exceptions import ResumableWarning, StateLockedError

_KILLED_WRITER = """
import sys
from resumable._stores import open_store

store = open_store(sys.argv[1])
size = int(sys.argv[2])
for i in range(1_000_000):
    print("writing", i, flush=True)
    store.write("big.bin", [(b"ab"[i % 2 : i % 2 + 1]) * size], durable=True)
"""

_DYING_HOLDER = """
import os, sys
from resumable._stores import open_store

open_store(sys.argv[1]).lock({"pid": os.getpid(), "host": "dying", "since": "then"})
print("locked", flush=True)
os._exit(0)
"""


class _WriterDiedError(Exception):
    """Raised by :class:`_DyingChunks` in the middle of a write."""


class _DyingChunks(Sequence[bytes]):
    """Chunks whose second one can never be read: the writer "dies" half-way."""

    def __init__(self, first: bytes) -> None:
        self._first = first

    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(2))]
        if index in {0, -2}:
            return self._first
        raise _WriterDiedError


def _expect(expected: object, actual: object, what: str) -> None:
    if expected != actual:
        msg = f"{what}: expected {expected!r}, got {actual!r}"
        raise AssertionError(msg)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def _whole(data: bytes | bytearray, size: int, what: str) -> None:
    """*data* is one of the objects written whole: *size* copies of one byte."""
    if len(data) != size or data != bytes(data[:1]) * size:
        msg = f"{what}: read a partial or mixed object ({len(data)} bytes, expected {size} of one kind)"
        raise AssertionError(msg)


class StoreConformance(abc.ABC):
    """
    The guarantees of a :class:`~resumable.Store` (primitives and optional methods), as a test suite.

    Subclass it in a test module under a name pytest collects and say how to make an empty
    store; every built-in store passes it, and so must a custom one::

        from resumable.testing import StoreConformance

        class TestMyStore(StoreConformance):
            def make_store(self):
                return MyStore(f"mybackend://tests/{uuid.uuid4().hex}")

            def reopen(self, store):
                return MyStore(store.url)  # a second handle on the same storage

    Optional hooks: :meth:`reopen` (another handle on the same storage, as a second process
    would have; default: the same object), :meth:`subprocess_location` (a location that
    ``open_store`` opens in another process; enables the tests that kill a writer and a lock
    holder), :meth:`subprocess_env` (extra environment for those processes). Class
    attributes tune sizes and times for slow backends.
    """

    big_object_size = 4 * 1024 * 1024
    """Bytes in each object of the atomicity tests."""
    concurrency_seconds = 1.0
    """How long the concurrent readers test runs."""
    lock_recovery_seconds = 10.0
    """How long after its holder died the lock must be free again (a lease's time to live)."""
    listed_internal_keys: frozenset[str] = frozenset()
    """Keys of the store's own bookkeeping that ``list`` may show (e.g. a lock file)."""

    @abc.abstractmethod
    def make_store(self) -> Store:
        """A new, empty store (a fresh prefix or directory per call)."""

    def reopen(self, store: Store) -> Store:
        """Another handle on the storage of *store*, as another process would open it."""
        return store

    def subprocess_location(self, store: Store) -> str | None:  # noqa: ARG002 - a hook
        """A location ``open_store`` in another process opens as *store*; None if impossible."""
        return None

    def subprocess_env(self) -> dict[str, str]:
        """Extra environment variables for the processes started by the tests."""
        return {}

    def _child(self, store: Store, program: str, *args: str) -> list[str]:
        """The command running *program* on *store* in another process; skips the test if impossible."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        location = self.subprocess_location(store)
        if location is None:
            pytest.skip("this store cannot be opened from another process")
        return [sys.executable, "-c", program, location, *args]

    def test_copy_is_a_whole_independent_copy(self) -> None:
        """copy() makes dst hold what src holds; src changing later leaves dst as it was."""
        store = self.make_store()
        store.write("a/src.bin", [b"version 1"], durable=True)
        store.copy("a/src.bin", "b/dst.bin", durable=True)  # history and forks call it with no fallback
        store.write("a/src.bin", [b"version 2"], durable=True)
        _expect(b"version 1", bytes(store.read("b/dst.bin")), "the copy after its source changed")

    def test_no_temporary_files_after_completed_writes(self) -> None:
        """remove_temp_files() finds nothing after completed writes, and keeps the objects."""
        store = self.make_store()
        store.write("x.bin", [b"x"], durable=True)
        _expect([], store.remove_temp_files(dry_run=True), "temporary files after a completed write")
        _expect([], store.remove_temp_files(), "temporary files removed after a completed write")
        _expect(b"x", bytes(store.read("x.bin")), "an object after remove_temp_files()")

    def test_sync_keeps_every_object(self) -> None:
        """sync() after durable writes, a copy and a delete changes none of the objects."""
        store = self.make_store()
        store.write("a/1.bin", [b"one"], durable=True)
        store.copy("a/1.bin", "b/1.bin", durable=True)
        store.write("a/2.bin", [b"two"], durable=True)
        store.delete("a/2.bin", durable=True)
        store.sync()
        store.sync()  # with nothing left to do
        _expect(["a/1.bin", "b/1.bin"], sorted(store.list()), "the objects after sync()")
        _expect(b"one", bytes(store.read("b/1.bin")), "a copy after sync()")

    def test_write_then_read_whole_object(self) -> None:
        """write joins its chunks (bytes, bytearray, memoryview) into one object; read returns it."""
        store = self.make_store()
        big = os.urandom(self.big_object_size)
        store.write("a.msgpack", [b"hello ", bytearray(b"big "), memoryview(big)], durable=True)
        _expect(b"hello big " + big, bytes(store.read("a.msgpack")), "read after write")
        _expect(b"hello", bytes(self.reopen(store).read("a.msgpack")[:5]), "read from another handle")

    def test_read_returns_a_private_buffer(self) -> None:
        """Changing the buffer read changes neither the object nor the next read."""
        store = self.make_store()
        store.write("a.msgpack", [b"abc"], durable=False)
        data = store.read("a.msgpack")
        if isinstance(data, bytearray):
            data[0:1] = b"X"
        _expect(b"abc", bytes(store.read("a.msgpack")), "read after changing an earlier read")

    def test_missing_object_is_file_not_found(self) -> None:
        """read of a missing key, whole or a range, raises FileNotFoundError."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        with pytest.raises(FileNotFoundError):
            store.read("missing.msgpack")
        with pytest.raises(FileNotFoundError):
            store.read("missing.msgpack", 0, 10)

    def test_overwrite_and_empty_object(self) -> None:
        """A write replaces the whole object; an empty object reads as empty."""
        store = self.make_store()
        store.write("a.msgpack", [b"a much longer first version"], durable=True)
        store.write("a.msgpack", [b"short"], durable=True)
        _expect(b"short", bytes(store.read("a.msgpack")), "read after overwrite")
        store.write("empty.msgpack", [], durable=True)
        _expect(b"", bytes(store.read("empty.msgpack")), "empty object")
        _expect(b"", bytes(store.read("empty.msgpack", 0, 4096)), "range of an empty object")

    def test_read_a_range(self) -> None:
        """read(key, start, end) returns bytes start to end (exclusive), clipped to the object."""
        store = self.make_store()
        store.write("a.msgpack", [b"0123456789"], durable=False)
        cases = {(0, None): b"0123456789", (3, None): b"3456789", (3, 5): b"34", (8, 100): b"89"}
        cases |= {(10, None): b"", (12, None): b"", (0, 0): b""}
        for (start, end), expected in cases.items():
            _expect(expected, bytes(store.read("a.msgpack", start, end)), f"read({start}, {end})")

    def test_append_creates_and_extends(self) -> None:
        """append creates the object, then adds to its end; a ranged read sees byte offsets."""
        store = self.make_store()
        expected = b""
        for i in range(40):
            line = f"event {i}\n".encode()
            store.append("log/events.jsonl", line, durable=i % 10 == 0)
            expected += line
        _expect(expected, bytes(store.read("log/events.jsonl")), "the appended object")
        for start, end in [
            (0, None),
            (7, None),
            (100, 250),
            (len(expected) - 3, None),
            (len(expected), None),
        ]:
            got = bytes(store.read("log/events.jsonl", start, end))
            _expect(expected[start:end], got, f"read({start}, {end}) of the appended object")
        _expect(expected, bytes(self.reopen(store).read("log/events.jsonl")), "read from another handle")

    def test_write_and_delete_appended_object(self) -> None:
        """write replaces an appended object, append goes on after a write, delete removes it."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        for i in range(20):
            store.append("events.jsonl", f"{i}\n".encode(), durable=False)
        store.write("events.jsonl", [b"replaced\n"], durable=True)
        _expect(b"replaced\n", bytes(store.read("events.jsonl")), "appended object after write")
        store.append("events.jsonl", b"more\n", durable=False)
        _expect(b"replaced\nmore\n", bytes(store.read("events.jsonl")), "append after write")
        _expect(["events.jsonl"], store.list("events"), "the appended object is listed once")
        store.delete("events.jsonl", durable=True)
        with pytest.raises(FileNotFoundError):
            store.read("events.jsonl")
        _expect([], store.list("events"), "listed after delete")
        store.append("events.jsonl", b"new\n", durable=False)
        _expect(b"new\n", bytes(store.read("events.jsonl")), "append after delete starts afresh")

    def test_delete_is_idempotent(self) -> None:
        """delete removes an object; deleting a missing key is no error."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        store.write("step/1.msgpack", [b"x"], durable=True)
        store.delete("step/1.msgpack", durable=True)
        store.delete("step/1.msgpack", durable=True)
        store.delete("never/there.msgpack", durable=False)
        with pytest.raises(FileNotFoundError):
            store.read("step/1.msgpack")
        _expect([], store.list("step/"), "list after delete")

    def test_list_prefixes(self) -> None:
        """list(prefix) returns every key starting with prefix, at any depth, and nothing else."""
        store = self.make_store()
        keys = [
            "a.msgpack",
            "step/1.msgpack",
            "step/2.msgpack",
            "step2.msgpack",
            ".resumable/batches/x/0.msgpack",
        ]
        for key in keys:
            store.write(key, [b"x"], durable=False)
        store.append("events.jsonl", b"e\n", durable=False)
        expected = {
            "": {*keys, "events.jsonl"},
            "step/": {"step/1.msgpack", "step/2.msgpack"},
            "step": {"step/1.msgpack", "step/2.msgpack", "step2.msgpack"},
            ".resumable/batches/": {".resumable/batches/x/0.msgpack"},
            "nothing/": set(),
        }
        for prefix, wanted in expected.items():
            got = set(store.list(prefix)) - self.listed_internal_keys
            _expect(sorted(wanted), sorted(got), f"list({prefix!r})")

    def test_list_hides_internal_objects(self) -> None:
        """After writes, appends, a lock and a failed write, list shows exactly the keys written."""
        store = self.make_store()
        store.write("a.msgpack", [b"x"], durable=True)
        for i in range(40):
            store.append("events.jsonl", f"{i}\n".encode(), durable=False)
        with contextlib.suppress(_WriterDiedError):
            store.write("b.msgpack", _DyingChunks(b"partial"), durable=True)
        lock = store.lock({"pid": os.getpid(), "host": "conformance", "since": "now"})
        try:
            store.write("c/d.msgpack", [b"y"], durable=True)
            got = set(store.list()) - self.listed_internal_keys
        finally:
            lock.release()
        _expect(["a.msgpack", "c/d.msgpack", "events.jsonl"], sorted(got), "list()")

    def test_interrupted_write_keeps_previous_object(self) -> None:
        """A writer dying in the middle of a write leaves the previous object, whole."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        store.write("a.msgpack", [b"previous"], durable=True)
        with pytest.raises(_WriterDiedError):
            store.write("a.msgpack", _DyingChunks(b"half of the new"), durable=True)
        _expect(b"previous", bytes(store.read("a.msgpack")), "object after an interrupted write")
        with pytest.raises(_WriterDiedError):
            store.write("new.msgpack", _DyingChunks(b"half"), durable=True)
        with pytest.raises(FileNotFoundError):
            store.read("new.msgpack")

    def test_concurrent_readers_see_whole_objects(self) -> None:
        """Readers running while a writer replaces an object see one whole version each time."""
        store, size = self.make_store(), self.big_object_size
        store.write("big.bin", [b"a" * size], durable=False)
        stop = threading.Event()
        reads: list[int] = []
        errors: list[BaseException] = []

        def reader() -> None:
            other = self.reopen(store)
            try:
                while not stop.is_set():
                    _whole(other.read("big.bin"), size, "concurrent read")
                    reads.append(1)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        writes, deadline = 0, time.monotonic() + self.concurrency_seconds
        try:
            while time.monotonic() < deadline or writes < 4:
                writes += 1
                store.write("big.bin", [(b"ba"[writes % 2 : writes % 2 + 1]) * size], durable=False)
        finally:
            stop.set()
            for t in threads:
                t.join()
        if errors:
            raise errors[0]
        _check(len(reads) > 0, "no read completed while the writer ran")

    def test_killed_writer_leaves_a_whole_object(self) -> None:
        """A writer process killed (SIGKILL) during writes leaves one whole version, no debris."""
        store, size = self.make_store(), self.big_object_size
        store.write("big.bin", [b"b" * size], durable=True)
        with subprocess.Popen(  # noqa: S603 - runs this interpreter on our own program
            self._child(store, _KILLED_WRITER, str(size)),
            stdout=subprocess.PIPE,
            env={**os.environ, **self.subprocess_env()},
            text=True,
        ) as proc:
            assert proc.stdout is not None  # noqa: S101 - for the type checker
            for line in proc.stdout:
                if line.startswith("writing 3"):
                    time.sleep(random.uniform(0, 0.05))  # noqa: S311 - a moment, not a secret
                    proc.send_signal(signal.SIGKILL)
                    break
            _expect(-signal.SIGKILL, proc.wait(60), "the writer's exit status")
        _whole(store.read("big.bin"), size, "object after the writer was killed")
        _expect(["big.bin"], sorted(set(store.list()) - self.listed_internal_keys), "list() after the kill")

    def test_lock_is_exclusive_and_names_its_holder(self) -> None:
        """A second lock is refused with StateLockedError naming the holder; release frees it."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        holder = {"pid": 4242, "host": "conformance", "since": "2026-01-01T00:00:00Z"}
        lock = store.lock(holder)
        try:
            for other in (store, self.reopen(store)):
                with pytest.raises(StateLockedError) as info:
                    other.lock({"pid": 1, "host": "intruder", "since": "later"})
                _expect(holder, {k: info.value.holder.get(k) for k in holder}, "holder in the error")
                message = str(info.value)
                _check("pid 4242 on host conformance" in message, f"holder not in the message: {message}")
        finally:
            lock.release()
        lock.release()  # twice is harmless
        self.reopen(store).lock({"pid": 2, "host": "next", "since": "later"}).release()
        store.lock({"pid": 3, "host": "again", "since": "later"}).release()

    def test_lock_of_a_dead_holder_is_freed(self) -> None:
        """A lock whose holder process died is taken by the next run (after a lease expires)."""
        store = self.make_store()
        done = subprocess.run(  # noqa: S603 - runs this interpreter on our own program
            self._child(store, _DYING_HOLDER),
            capture_output=True,
            text=True,
            env={**os.environ, **self.subprocess_env()},
            timeout=60,
            check=False,
        )
        _expect("locked", done.stdout.strip(), f"the holder's output (stderr: {done.stderr[-2000:]})")
        deadline = time.monotonic() + self.lock_recovery_seconds + 5
        while True:
            try:
                store.lock({"pid": os.getpid(), "host": "next", "since": "now"}).release()
            except StateLockedError as exc:
                _expect("dying", exc.holder.get("host"), "the holder named while it is locked")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
            else:
                return

    def test_pipeline_round_trip(self) -> None:
        """Outputs stored, skipped by a new Pipeline, a damaged or forged object recomputed."""
        import pytest  # noqa: PLC0415 - only test runs need pytest

        store = self.make_store()
        calls: list[int] = []

        def pipeline(
            secret: str = "conformance secret",  # noqa: S107 - a test key
        ) -> tuple[Pipeline, Callable[[int], dict[str, int]]]:
            pipe = Pipeline("conformance", store=self.reopen(store), secret=secret)

            @pipe.step(key="{n}")
            def square(n: int) -> dict[str, int]:
                calls.append(n)
                return {"n": n, "square": n * n}

            return pipe, square

        pipe, square = pipeline()
        with pipe:
            first = [square(n) for n in range(3)]
        pipe, square = pipeline()
        with pipe:
            _expect(first, [square(n) for n in range(3)], "outputs skipped in a new pipeline")
        _expect([0, 1, 2], calls, "calls after a second run")
        damaged = bytearray(store.read("square/1.msgpack"))
        damaged[-1] ^= 0xFF
        store.write("square/1.msgpack", [damaged], durable=True)
        pipe, square = pipeline()
        with pipe, pytest.warns(ResumableWarning, match="square/1"):
            _expect({"n": 1, "square": 1}, square(1), "a damaged output, recomputed")
        _expect("corrupt", pipe.status().steps["square/1"].reason, "why the damaged output ran")
        pipe, square = pipeline(secret="another secret")  # noqa: S106 - a test key
        # with another secret nothing is trusted: the log and manifest are distrusted too
        with pytest.warns(ResumableWarning) as caught, pipe:
            _expect({"n": 2, "square": 4}, square(2), "an output signed with another secret, recomputed")
        refused = [str(w.message) for w in caught if "square/2" in str(w.message)]
        _check(len(refused) == 1, f"one warning names the refused output: {[str(w.message) for w in caught]}")
        _expect([0, 1, 2, 1, 2], calls, "calls after the damaged and forged outputs")
