"""Batch helpers: row chunks, resume, input changes, errors, cleanup, the manifest and the log."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from chunk_files import LOG, committed, live_records

from resumable import (
    BatchRecord,
    InputChangedError,
    Pipeline,
    ResumableError,
    ResumableWarning,
    RowFailure,
    SerializationError,
    UsageError,
    checkpointed,
    checkpointed_map,
)
from resumable._batch_input import Digester
from resumable._fingerprint import digest_value
from resumable._stores._local import LocalStore

BATCHES = Path(".resumable") / "batches"


def chunks(state_dir: Path, where: str) -> list[tuple[int, int, int]]:
    """(start, end, failures) of the committed chunks of a batch directory, in order."""
    return committed(state_dir / BATCHES / where)


@pytest.fixture(params=["log", "files"])
def layout(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """
    Chunks as records of the batch's chunk log (stores that append cheaply), or as files of
    their own (object stores, and state directories copied from one).
    """
    if request.param == "files":
        monkeypatch.setattr(LocalStore, "slow_appends", True)
    return str(request.param)


def change_chunk(directory: Path, start: int, change: Callable[[bytes], bytes]) -> None:
    """Replace the bytes of the chunk of rows *start* on (its file, or its record in the log)."""
    for path in directory.iterdir():
        if path.name.startswith(f"{start:012d}-"):
            path.write_bytes(change(path.read_bytes()))
            return
    record = next(r for r in live_records(directory / LOG) if r.header["rows"][0] == start)
    data = (directory / LOG).read_bytes()
    end = record.offset + record.length
    (directory / LOG).write_bytes(data[: record.offset] + change(data[record.offset : end]) + data[end:])


def chunk_bytes(directory: Path, start: int) -> bytes:
    """The bytes of the chunk of rows *start* on (its file, or its record in the log)."""
    found: list[bytes] = []
    change_chunk(directory, start, lambda data: found.append(data) or data)  # type: ignore[func-returns-value]
    return found[0]


def flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


class Counter:
    """A row function that counts its calls, and can raise at one row."""

    def __init__(self, fail_at: int | None = None, exc: type[BaseException] = RuntimeError) -> None:
        self.calls: list[Any] = []
        self.fail_at = fail_at
        self.exc = exc

    def __call__(self, x: Any) -> Any:
        if x == self.fail_at:
            raise self.exc(f"boom at {x}")
        self.calls.append(x)
        return x * 10


# inside a step -------------------------------------------------------------------------


def test_map_in_a_step_resumes_where_it_failed_and_cleans_up(pipe: Pipeline, state_dir: Path):
    """A failed step keeps its committed rows; the rerun does only the rest; completion removes the chunks."""
    fn = Counter(fail_at=57)

    @pipe.step
    def enrich(n: int) -> list[int]:
        return checkpointed_map(fn, list(range(n)), every=10)

    with pipe, pytest.raises(RuntimeError, match="boom at 57"):
        enrich(100)
    assert list(range(57)) == fn.calls
    # five full chunks, and the seven rows finished before the error
    assert [(0, 10, 0), (10, 20, 0), (20, 30, 0), (30, 40, 0), (40, 50, 0), (50, 57, 0)] == chunks(
        state_dir, "steps/enrich"
    )
    assert BatchRecord(done=57, every=10, total=100, failures=0) == pipe.status().batches["enrich"]

    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        assert [x * 10 for x in range(100)] == enrich(100)
    assert list(range(57, 100)) == fn.calls
    assert not (state_dir / BATCHES / "steps" / "enrich").exists()
    assert {} == pipe.status().batches


def test_retries_resume_the_batch(pipe: Pipeline):
    """With retries=, the next attempt resumes at the row that failed."""
    seen: list[int] = []

    def flaky(x: int) -> int:
        seen.append(x)
        if x == 23 and seen.count(23) == 1:
            raise ConnectionError("try again")
        return x

    @pipe.step(retries=1)
    def enrich() -> list[int]:
        return checkpointed_map(flaky, range(40), every=10)

    pipe_module = __import__("resumable._session", fromlist=["RETRY_BASE_DELAY"])
    delay, pipe_module.RETRY_BASE_DELAY = pipe_module.RETRY_BASE_DELAY, 0.0
    try:
        with pipe:
            assert list(range(40)) == enrich()
    finally:
        pipe_module.RETRY_BASE_DELAY = delay
    assert [*range(24), *range(23, 40)] == seen


def test_log_says_where_the_batch_resumes(pipe: Pipeline, caplog: pytest.LogCaptureFixture):
    """The resumed batch logs 'resuming batch ... at row N of TOTAL'."""
    fn = Counter(fail_at=4200)

    @pipe.step
    def enrich() -> list[int]:
        return checkpointed_map(fn, range(10_000), every=100)

    with pipe, pytest.raises(RuntimeError):
        enrich()
    fn.fail_at = None
    caplog.set_level(logging.INFO, logger="resumable")
    with pipe:
        enrich()
    assert "resuming batch 'enrich' at row 4,200 of 10,000" in caplog.messages


def test_chunks_are_written_once_and_never_rewritten(pipe: Pipeline, state_dir: Path, layout: str):
    """Each commit appends one record (or adds one file); earlier commits keep their bytes and inode."""
    fn = Counter(fail_at=35)

    @pipe.step
    def enrich() -> list[int]:
        return checkpointed_map(fn, range(60), every=10)

    with pipe, pytest.raises(RuntimeError):
        enrich()
    directory = state_dir / BATCHES / "steps" / "enrich"
    before = {p.name: (p.stat().st_ino, p.read_bytes()) for p in directory.iterdir()}
    fn.fail_at = 55
    with pipe, pytest.raises(RuntimeError):
        enrich()
    after = {p.name: (p.stat().st_ino, p.read_bytes()) for p in directory.iterdir()}
    if layout == "log":
        (inode, old), (new_inode, new) = before.pop(LOG), after.pop(LOG)
        assert (inode, old) == (new_inode, new[: len(old)])
        assert len(new) > len(old)
    assert before == {name: after[name] for name in before}
    assert [(35, 45, 0), (45, 55, 0)] == [c for c in chunks(state_dir, "steps/enrich") if c[0] >= 35]


def test_several_batches_in_one_step_are_kept_apart(pipe: Pipeline, state_dir: Path):
    """Unnamed batches of a step are told apart by order; named ones by name; all go at completion."""
    fail = {"on": True}

    def second(x: int) -> int:
        if fail["on"] and x == 5:
            raise RuntimeError("second batch fails")
        return -x

    @pipe.step
    def both() -> tuple[list[int], list[int], list[int]]:
        a = checkpointed_map(lambda x: x, range(8), every=4)
        b = checkpointed_map(second, range(8), every=4)
        c = checkpointed_map(lambda x: x + 100, range(3), every=4, name="extra")
        return a, b, c

    with pipe, pytest.raises(RuntimeError):
        both()
    assert [(0, 4, 0), (4, 8, 0)] == chunks(state_dir, "steps/both")
    assert [(0, 4, 0), (4, 5, 0)] == chunks(state_dir, "steps/both/2")
    fail["on"] = False  # a value the step's code reads: its rows are kept, with a warning
    with pipe, pytest.warns(ResumableWarning, match="resuming with (8|5) row"):
        assert ([0, 1, 2, 3, 4, 5, 6, 7], [0, -1, -2, -3, -4, -5, -6, -7], [100, 101, 102]) == both()
    assert [] == [p for p in (state_dir / BATCHES).rglob("*") if p.is_file()]


def test_reset_removes_the_chunks_of_a_failed_step(pipe: Pipeline, state_dir: Path):
    """pipe.reset(step) drops its committed rows: the next run starts the batch over."""
    fn = Counter(fail_at=15)

    @pipe.step
    def enrich() -> list[int]:
        return checkpointed_map(fn, range(20), every=5)

    with pipe, pytest.raises(RuntimeError):
        enrich()
    assert 3 == len(chunks(state_dir, "steps/enrich"))
    pipe.reset("enrich")
    assert [] == chunks(state_dir, "steps/enrich")
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        enrich()
    assert list(range(20)) == fn.calls


def test_code_change_of_the_step_starts_the_batch_over(pipe: Pipeline):
    """Rows committed by another version of the step are not reused."""
    fn = Counter(fail_at=12)

    def make(version: str) -> Callable[[], list[int]]:
        @pipe.step(name="enrich", version=version)
        def enrich() -> list[int]:
            return checkpointed_map(fn, range(20), every=5)

        return enrich

    with pipe, pytest.raises(RuntimeError):
        make("1")()
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        make("1")()
    assert list(range(12, 20)) == fn.calls  # same version: resumed

    fn.fail_at, fn.calls = 12, []
    with pipe, pytest.raises(RuntimeError):
        make("2")()  # a new version reruns the step, which fails again
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        make("3")()
    assert list(range(20)) == fn.calls  # rows of version 2 are not reused by version 3


def test_changed_step_arguments_keep_the_unchanged_rows(pipe: Pipeline):
    """When the step's arguments change, rows whose input is unchanged are kept, the others redone."""
    fn = Counter(fail_at=25)

    @pipe.step
    def enrich(rows: list[int]) -> list[int]:
        return checkpointed_map(fn, rows, every=10)

    rows = list(range(40))
    with pipe, pytest.raises(RuntimeError):
        enrich(rows)
    fn.fail_at = None
    fn.calls.clear()
    changed = [*range(10), 999, *range(11, 30)]  # one row of the second chunk changed, 10 rows fewer
    with pipe:
        assert [x * 10 for x in changed] == enrich(changed)
    assert [999, *range(11, 20), *range(25, 30)] == fn.calls


def test_shorter_step_arguments_drop_the_rows_past_the_end(pipe: Pipeline):
    """Fewer rows in the changed arguments: committed rows past the new end are dropped."""
    fn = Counter(fail_at=25)

    @pipe.step
    def enrich(rows: list[int]) -> list[int]:
        return checkpointed_map(fn, rows, every=10)

    with pipe, pytest.raises(RuntimeError):
        enrich(list(range(40)))
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        assert [x * 10 for x in range(15)] == enrich(list(range(15)))
    assert list(range(10, 15)) == fn.calls


def test_rows_read_inside_the_step_changing_raise(pipe: Pipeline, tmp_path: Path):
    """Same step arguments, different rows (read from a file): InputChangedError, with the way out."""
    data = tmp_path / "rows.txt"
    data.write_text("\n".join(map(str, range(30))))
    fn = Counter(fail_at=17)

    @pipe.step
    def enrich(path: str) -> list[int]:
        return checkpointed_map(fn, [int(x) for x in Path(path).read_text().split()], every=5)

    with pipe, pytest.raises(RuntimeError):
        enrich(str(data))
    fn.fail_at = None
    data.write_text("\n".join(map(str, [0, 1, 2, 3, 4, 5, 6, 7, 8, 99, *range(10, 30)])))
    with pipe, pytest.raises(InputChangedError) as info:
        enrich(str(data))
    assert "enrich" == info.value.batch
    assert "rows 5 to 9 differ" in str(info.value)
    assert "resumable reset enrich" in str(info.value)
    data.write_text("\n".join(map(str, range(31))))
    with pipe, pytest.raises(InputChangedError, match="it had 30 rows, now 31"):
        enrich(str(data))


# named batches, outside a step ---------------------------------------------------------


def test_outside_a_step_a_name_is_required(pipe: Pipeline):
    """Without a step and without name=, the error says to pass name=."""
    with pipe:
        with pytest.raises(ResumableError, match=r"name='\.\.\.'"):
            checkpointed_map(abs, [1, 2])
        with pytest.raises(ResumableError, match="name="):
            checkpointed([1, 2])


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "x" * 101, "a:b", "out.msgpack"])
def test_invalid_names_are_refused(pipe: Pipeline, name: str):
    """A name that cannot be a directory name is refused, saying to pass another name=."""
    with pipe, pytest.raises(ResumableError, match="another name="):
        checkpointed_map(abs, [1], name=name)


def test_digit_names_are_reserved_inside_steps(pipe: Pipeline):
    """Inside a step, digits-only names would collide with unnamed batches."""

    @pipe.step
    def enrich() -> list[int]:
        return checkpointed_map(abs, [1], name="2")

    with pipe, pytest.raises(ResumableError, match="reserved"):
        enrich()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every": 0}, "every must be an int >= 1"),
        ({"every": True}, "every must be an int >= 1"),
        ({"on_error": "ignore"}, "on_error must be"),
        ({"concurrency": 0}, "concurrency must be"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], message: str):
    """Options are checked before anything is read or written."""
    with pytest.raises(ValueError, match=message):
        checkpointed_map(abs, [1], name="x", **kwargs)


def test_named_batch_resumes_and_keeps_its_rows(pipe: Pipeline, state_dir: Path):
    """A named batch resumes; once done, running it again calls nothing and returns the same list."""
    fn = Counter(fail_at=33)
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(fn, range(50), every=10, name="scores")
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        first = checkpointed_map(fn, range(50), every=10, name="scores")
    assert list(range(33, 50)) == fn.calls
    fn.calls.clear()
    with pipe:
        assert first == checkpointed_map(fn, range(50), every=10, name="scores")
    assert [] == fn.calls
    assert [x * 10 for x in range(50)] == first
    assert BatchRecord(done=50, every=10, total=50, failures=0) == pipe.status().batches["scores"]
    assert (state_dir / BATCHES / "named" / "scores" / "batch.msgpack").is_file()


@pytest.mark.parametrize(
    ("new_rows", "detail"),
    [
        ([*range(5), 55, *range(6, 30)], "rows 0 to 9 differ from those committed"),
        (list(range(29)), "it had 30 rows, now 29"),
    ],
)
def test_named_batch_with_changed_input_raises(pipe: Pipeline, new_rows: list[int], detail: str):
    """A different row in a committed chunk, or a different length: InputChangedError naming the batch."""
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(Counter(fail_at=20), range(30), every=10, name="scores")
    with pipe, pytest.raises(InputChangedError) as info:
        checkpointed_map(Counter(), new_rows, every=10, name="scores")
    assert "scores" == info.value.batch
    assert detail in str(info.value)
    assert "resumable reset scores" in str(info.value)  # how to start over
    assert ["scores"] == pipe.reset("scores")
    with pipe:
        assert [r * 2 for r in new_rows] == checkpointed_map(
            lambda r: r * 2, new_rows, every=10, name="scores"
        )


@pytest.mark.parametrize(
    "rows",
    [
        list(range(100)),
        [None, True, 1, -(2**63), 2**64 - 1, 1.5, "a", b"b"],
        [2**64, 1],  # beyond msgpack's ints
        ["\udcff", "x"],  # a lone surrogate (a name from os.listdir)
        [(1, 2), 3],  # not only scalars
        list(range(20_000)),
    ],
)
def test_row_digests_are_the_rows_argument_fingerprints(rows: list[Any]):
    assert Digester("b").digest(rows) == "f" + digest_value(rows)[:24]


def test_iterator_input_resumes_and_detects_changes(pipe: Pipeline):
    """A one-shot iterator works; its committed rows are read again and checked, never re-run."""
    fn = Counter(fail_at=26)
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(fn, (x for x in range(40)), every=10, name="gen")
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        assert [x * 10 for x in range(40)] == checkpointed_map(fn, iter(range(40)), every=10, name="gen")
    assert list(range(26, 40)) == fn.calls
    with pipe, pytest.raises(InputChangedError, match="it had 40 rows, now more"):
        checkpointed_map(fn, iter(range(41)), every=10, name="gen")
    with pipe, pytest.raises(InputChangedError, match="it now ends after 15 rows, but rows 10 to 19 were"):
        checkpointed_map(fn, iter(range(15)), every=10, name="gen")
    with pipe, pytest.raises(InputChangedError, match="it now ends after 36 rows, but rows 36 to 39"):
        checkpointed_map(fn, iter(range(36)), every=5, name="gen")
    # a list's length is recorded: an iterator ending after the committed rows, but too soon
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(Counter(fail_at=12), list(range(40)), every=5, name="gen2")
    with pipe, pytest.raises(InputChangedError, match="it had 40 rows, now 30"):
        checkpointed_map(fn, iter(range(30)), every=5, name="gen2")


def test_iterator_without_known_total_accepts_new_rows(pipe: Pipeline):
    """After an interrupted iterator run (total unknown), more rows than committed are fine."""
    fn = Counter(fail_at=12)
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(fn, iter(range(100)), every=5, name="gen")
    fn.fail_at = None
    with pipe:
        assert [x * 10 for x in range(20)] == checkpointed_map(fn, iter(range(20)), every=5, name="gen")


def test_a_different_every_keeps_committed_rows(pipe: Pipeline, state_dir: Path, caplog):
    """Changing every= between runs keeps the committed chunks; new ones have the new size."""
    fn = Counter(fail_at=20)
    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(fn, range(50), every=10, name="b")
    fn.fail_at = None
    fn.calls.clear()
    caplog.set_level(logging.INFO, logger="resumable")
    with pipe:
        assert [x * 10 for x in range(50)] == checkpointed_map(fn, range(50), every=25, name="b")
    assert list(range(20, 50)) == fn.calls
    assert [(0, 10, 0), (10, 20, 0), (20, 45, 0), (45, 50, 0)] == chunks(state_dir, "named/b")
    assert any("every=25 now" in m for m in caplog.messages)
    assert 25 == pipe.status().batches["b"].every


def test_map_and_each_cannot_share_a_name(pipe: Pipeline):
    """A name used by checkpointed_map cannot be reused by checkpointed."""
    with pipe:
        checkpointed_map(abs, [1, 2], name="shared")
        with pytest.raises(ResumableError, match="started by checkpointed_map"):
            list(checkpointed([1, 2], name="shared"))


def test_empty_input(pipe: Pipeline, state_dir: Path):
    """No rows: an empty list, and no files."""
    with pipe:
        assert [] == checkpointed_map(abs, [], name="empty")
        assert [] == list(checkpointed([], name="empty_each"))
    assert [] == chunks(state_dir, "named/empty")


# errors --------------------------------------------------------------------------------


def test_on_error_record_puts_failures_in_place(pipe: Pipeline, state_dir: Path):
    """Failed rows become RowFailure values, counted in chunk names and in the manifest, also when resumed."""

    def parse(text: str) -> int:
        return int(text)

    rows = ["1", "x", "3", "4", "", "6", "7"]
    with pipe:
        out = checkpointed_map(parse, rows, every=3, name="parse", on_error="record")
    assert [
        1,
        RowFailure(1, "ValueError", "invalid literal for int() with base 10: 'x'"),
        3,
        4,
        RowFailure(4, "ValueError", "invalid literal for int() with base 10: ''"),
        6,
        7,
    ] == out
    assert [(0, 3, 1), (3, 6, 1), (6, 7, 0)] == chunks(state_dir, "named/parse")
    assert 2 == pipe.status().batches["parse"].failures
    with pipe:
        assert out == checkpointed_map(parse, rows, every=3, name="parse", on_error="record")
    assert 2 == pipe.status().batches["parse"].failures


def test_keyboard_interrupt_in_map_commits_finished_rows(pipe: Pipeline, state_dir: Path):
    """Ctrl-C in fn: the rows finished before it are committed, then it propagates."""
    fn = Counter(fail_at=7, exc=KeyboardInterrupt)
    with pipe, pytest.raises(KeyboardInterrupt):
        checkpointed_map(fn, range(20), every=5, name="b", on_error="record")
    assert [(0, 5, 0), (5, 7, 0)] == chunks(state_dir, "named/b")


def test_unstorable_result_names_the_batch(pipe: Pipeline):
    """A result that cannot be stored raises SerializationError naming the batch and its rows."""
    pipeline = Pipeline("nopickle", state_dir=pipe.store.location, allow_pickle=False)
    with pipeline, pytest.raises(SerializationError, match=r"batch 'objs', rows 0 to 1"):
        checkpointed_map(lambda _: object(), range(2), every=5, name="objs")


def test_damaged_chunk_is_redone_with_a_warning(pipe: Pipeline, state_dir: Path, layout: str):
    """A damaged chunk is never returned: it is dropped, warned about, and its rows are done again."""
    fn = Counter()
    with pipe:
        expected = checkpointed_map(fn, range(30), every=10, name="b")
    change_chunk(state_dir / BATCHES / "named" / "b", 10, flip_last_byte)
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="damaged chunk"):
        assert expected == checkpointed_map(fn, range(30), every=10, name="b")
    assert list(range(10, 20)) == fn.calls
    fn.calls.clear()
    with pipe:  # dropped for good: no warning, nothing done again
        assert expected == checkpointed_map(fn, range(30), every=10, name="b")
    assert [] == fn.calls


def test_damaged_chunk_of_an_iterator_batch_is_redone_by_the_next_run(
    pipe: Pipeline, state_dir: Path, layout: str
):
    """With a one-shot iterator the damaged rows cannot be redone at once: an error says to run again."""
    fn = Counter()
    with pipe:
        expected = checkpointed_map(fn, iter(range(30)), every=10, name="b")
    change_chunk(state_dir / BATCHES / "named" / "b", 0, flip_last_byte)
    with pipe, pytest.warns(ResumableWarning), pytest.raises(ResumableError, match="run again"):
        checkpointed_map(fn, iter(range(30)), every=10, name="b")
    fn.calls.clear()
    with pipe:
        assert expected == checkpointed_map(fn, iter(range(30)), every=10, name="b")
    assert list(range(10)) == fn.calls


def test_chunk_files_without_a_record_or_overlapping_are_not_trusted(pipe: Pipeline, state_dir: Path):
    """Chunk files resumable would never leave behind are dropped, and their rows done again."""
    fn = Counter()
    with pipe:
        checkpointed_map(fn, range(20), every=10, name="b")
    directory = state_dir / BATCHES / "named" / "b"
    first = chunk_bytes(directory, 0)
    digest = live_records(directory / LOG)[0].header["digest"]
    overlapping = directory / f"000000000005-000000000010-0-{digest}.msgpack"
    overlapping.write_bytes(first)
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="overlaps"):
        checkpointed_map(fn, range(20), every=10, name="b")
    assert [] == fn.calls
    assert not overlapping.exists()

    (directory / "batch.msgpack").unlink()
    with pipe:
        checkpointed_map(fn, range(20), every=10, name="b")
    assert list(range(20)) == fn.calls
    assert [(0, 10, 0), (10, 20, 0)] == chunks(state_dir, "named/b")  # the old log went with its record


def test_overlapping_records_of_the_log_are_not_trusted(pipe: Pipeline, state_dir: Path):
    """A record for rows another record holds already (never written by resumable) is voided."""
    fn = Counter()
    with pipe:
        checkpointed_map(fn, range(20), every=10, name="b")
    log_file = state_dir / BATCHES / "named" / "b" / LOG
    first = live_records(log_file)[0]
    with log_file.open("ab") as f:
        f.write(log_file.read_bytes()[first.offset : first.offset + first.length])
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="overlaps"):
        assert [x * 10 for x in range(20)] == checkpointed_map(fn, range(20), every=10, name="b")
    assert [] == fn.calls
    assert [(0, 10, 0), (10, 20, 0)] == chunks(state_dir, "named/b")


def test_damaged_record_starts_over(pipe: Pipeline, state_dir: Path):
    """A damaged batch record: a warning, and the batch starts over."""
    fn = Counter()
    with pipe:
        checkpointed_map(fn, range(10), every=5, name="b")
    record = state_dir / BATCHES / "named" / "b" / "batch.msgpack"
    record.write_bytes(record.read_bytes()[:-2])
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="starts over"):
        checkpointed_map(fn, range(10), every=5, name="b")
    assert list(range(10)) == fn.calls


def test_signed_state_refuses_chunks_written_without_the_secret(tmp_path: Path, layout: str):
    """With a secret, a chunk that is not authentic is treated as damaged and redone."""
    fn = Counter()
    signed, unsigned = tmp_path / "signed", tmp_path / "unsigned"
    with Pipeline("p", state_dir=signed, secret="k1"):
        checkpointed_map(fn, range(10), every=5, name="b")
    with Pipeline("p", state_dir=unsigned):
        checkpointed_map(fn, range(10), every=5, name="b")
    forged = chunk_bytes(unsigned / BATCHES / "named" / "b", 0)
    assert forged != chunk_bytes(signed / BATCHES / "named" / "b", 0)
    change_chunk(signed / BATCHES / "named" / "b", 0, lambda _: forged)
    fn.calls.clear()
    with Pipeline("p", state_dir=signed, secret="k1"), pytest.warns(ResumableWarning, match="authentication"):
        assert [x * 10 for x in range(10)] == checkpointed_map(fn, range(10), every=5, name="b")
    assert list(range(5)) == fn.calls


def test_rows_that_cannot_be_fingerprinted_are_compared_by_type(pipe: Pipeline, caplog):
    """Rows without a stable digest still resume (a warning in the log says changes go unnoticed)."""

    class Opaque:
        def __init__(self, n: int) -> None:
            self.n = n

    rows = [Opaque(i) for i in range(12)]
    caplog.set_level(logging.INFO, logger="resumable")
    calls: list[int] = []

    def use(row: Opaque) -> int:
        calls.append(row.n)
        if row.n == 9 and len(calls) == 10:
            raise RuntimeError("stop")
        return row.n

    with pipe, pytest.raises(RuntimeError):
        checkpointed_map(use, rows, every=4, name="opaque")
    with pipe:
        assert list(range(12)) == checkpointed_map(use, rows, every=4, name="opaque")
    assert [*range(10), 9, 10, 11] == calls
    assert any("cannot be fingerprinted" in m for m in caplog.messages)
    with pipe, pytest.raises(InputChangedError):
        checkpointed_map(use, [*rows[:4], "text", *rows[5:]], every=4, name="opaque")
    assert [*range(10), 9, 10, 11] == calls  # refused before any row ran


def test_rows_with_non_msgpack_values_use_the_fingerprint(pipe: Pipeline):
    """Tuples, big ints, sets and dicts are digested like step arguments: order-free where it should be."""
    rows = [(1, 2), 2**80, {3, 4}, {"b": 1, "a": frozenset({1})}, {"y": 1, "x": [2]}]
    calls: list[Any] = []

    def show(row: Any) -> str:
        calls.append(row)
        return repr(row)

    with pipe:
        checkpointed_map(show, rows, every=2, name="mixed")
    assert len(calls) == len(rows)
    calls.clear()
    same = [(1, 2), 2**80, {4, 3}, {"a": frozenset({1}), "b": 1}, {"x": [2], "y": 1}]
    with pipe:
        assert [repr(r) for r in rows] == checkpointed_map(show, same, every=2, name="mixed")
    assert [] == calls  # every row committed already: none ran again
    with pipe, pytest.raises(InputChangedError):
        checkpointed_map(show, [[1, 2], *same[1:]], every=2, name="mixed")
    assert [] == calls


def test_disabled_runs_without_state(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """RESUMABLE_DISABLE=1: rows run normally, no name needed, nothing is written."""
    monkeypatch.setenv("RESUMABLE_DISABLE", "1")
    monkeypatch.chdir(tmp_path)
    assert [RowFailure(0, "ZeroDivisionError", "integer division or modulo by zero"), 1] == checkpointed_map(
        lambda x: 1 // x, [0, 1], on_error="record"
    )
    assert [1, 2] == list(checkpointed([1, 2]))
    assert [] == list(tmp_path.iterdir())


def test_memory_store(tmp_path: Path):
    """Batches work on any store, here memory://."""
    fn = Counter(fail_at=6)
    with Pipeline("m", store="memory://batch-test") as pipe, pytest.raises(RuntimeError):
        checkpointed_map(fn, range(10), every=3, name="b")
    fn.fail_at = None
    fn.calls.clear()
    with pipe:
        assert [x * 10 for x in range(10)] == checkpointed_map(fn, range(10), every=3, name="b")
    assert [6, 7, 8, 9] == fn.calls
    assert not list(tmp_path.iterdir())


# checkpointed --------------------------------------------------------------------------


def test_each_commits_finished_items_when_the_body_raises(pipe: Pipeline, state_dir: Path):
    """An exception in the loop body: the items before it are done, the one it was on is not."""
    done: list[int] = []

    def load() -> None:
        for item in checkpointed(range(30), every=5, name="load"):
            if item == 12:
                raise ValueError(f"bad {item}")
            done.append(item)

    with pipe, pytest.raises(ValueError, match="bad 12"):
        load()
    assert list(range(12)) == done
    assert [(0, 5, 0), (5, 10, 0), (10, 12, 0)] == chunks(state_dir, "named/load")
    with pipe:
        rest = list(checkpointed(range(30), every=5, name="load"))
    assert list(range(12, 30)) == rest


def test_each_commits_on_keyboard_interrupt_and_break(pipe: Pipeline, state_dir: Path):
    """Ctrl-C in the body, or break: finished items are committed; the current one is done again."""
    seen: list[int] = []

    def send() -> None:
        for item in checkpointed(range(20), every=4, name="send"):
            if item == 6:
                raise KeyboardInterrupt
            seen.append(item)

    with pipe, pytest.raises(KeyboardInterrupt):
        send()
    assert [(0, 4, 0), (4, 6, 0)] == chunks(state_dir, "named/send")
    with pipe:
        for item in checkpointed(range(20), every=4, name="send"):
            if item == 9:
                break
            seen.append(item)
    assert [(0, 4, 0), (4, 6, 0), (6, 9, 0)] == chunks(state_dir, "named/send")
    with pipe:
        seen.extend(checkpointed(range(20), every=4, name="send"))
    assert list(range(20)) == seen


def test_each_inside_a_step_is_removed_at_completion(pipe: Pipeline, state_dir: Path):
    """checkpointed inside a step belongs to the step: resumed, then removed when it completes."""
    sent: list[int] = []
    down = [True]

    @pipe.step
    def send(n: int) -> int:
        for item in checkpointed(range(n), every=3):
            if item == 7 and down and down.pop():
                raise ConnectionError("down")
            sent.append(item)
        return len(sent)

    with pipe, pytest.raises(ConnectionError):
        send(10)
    with pipe:
        assert 10 == send(10)
    assert list(range(10)) == sent
    assert not (state_dir / BATCHES / "steps" / "send").exists()


def test_each_reports_progress_to_the_manifest(pipe: Pipeline):
    """While a loop runs, the manifest shows its progress."""
    with pipe:
        it = checkpointed(range(10), every=2, name="slow")
        assert [0, 1, 2] == [next(it), next(it), next(it)]
        assert BatchRecord(done=2, every=2, total=10, failures=0) == pipe.status().batches["slow"]
        assert list(range(3, 10)) == list(it)
        assert BatchRecord(done=10, every=2, total=10, failures=0) == pipe.status().batches["slow"]


def test_async_iterables_are_refused():
    """An async iterable is not a batch input."""

    class Rows:
        def __aiter__(self) -> Iterator[int]:
            return iter([])

    with pytest.raises(UsageError, match="not an async iterable"):
        checkpointed(Rows(), name="x")  # type: ignore[arg-type]


def test_a_loop_still_open_when_its_run_closes_commits_its_finished_rows(pipe: Pipeline, state_dir: Path):
    """A loop kept in a variable past its run: the run commits its finished rows as it closes."""
    with pipe:
        it = checkpointed(range(10), every=5, name="late")
        assert [0, 1, 2] == [next(it), next(it), next(it)]
    assert [(0, 2, 0)] == chunks(state_dir, "named/late")  # row 2 was being worked on: not done
    it.close()  # nothing more: the loop is closed already
    assert [(0, 2, 0)] == chunks(state_dir, "named/late")


def test_a_loop_in_a_variable_commits_its_rows_when_an_exception_leaves_the_step(
    pipe: Pipeline, state_dir: Path
):
    """The traceback keeps the loop alive, but its finished rows are committed as the step fails."""

    @pipe.step
    def send() -> None:
        loop = checkpointed(range(10), every=5)
        for x in loop:
            if x == 7:
                raise RuntimeError("boom")

    with pipe, pytest.raises(RuntimeError) as caught:
        send()
    assert caught.traceback  # the frame, and the loop, are still referenced here
    assert [(0, 5, 0), (5, 7, 0)] == chunks(state_dir, "steps/send")


def test_a_failing_salvage_does_not_hide_the_error(state_dir: Path, caplog):
    """If committing the finished rows fails, that is logged and the original exception propagates."""
    results = iter([object()])

    def fn(x: int) -> object:
        if x == 1:
            raise LookupError("the real error")
        return next(results)

    with Pipeline("p", state_dir=state_dir, allow_pickle=False), pytest.raises(LookupError, match="real"):
        checkpointed_map(fn, range(5), every=5, name="b")
    assert any("could not commit 1 finished rows" in m for m in caplog.messages)


def test_chunks_holding_other_rows_are_damaged(pipe: Pipeline, state_dir: Path, layout: str):
    """A chunk whose header disagrees with its name, or with the wrong number of results, is redone."""
    from resumable._codec import encode, frame

    fn = Counter()
    with pipe:
        checkpointed_map(fn, range(30), every=10, name="b")
    directory = state_dir / BATCHES / "named" / "b"
    digest = {r.header["rows"][0]: r.header["digest"] for r in live_records(directory / LOG)}
    meta = {"slot": "b", "batch": ".resumable/batches/named/b/", "rows": [20, 30], "failures": 0}
    wrong_count = b"".join(
        frame(encode([1, 2], allow_pickle=False), meta | {"digest": digest.get(20)}).chunks()
    )
    if layout == "files":
        first = chunk_bytes(directory, 0)
        change_chunk(directory, 10, lambda _: first)  # rows 0-9 under the name of rows 10-19
        digest = {
            0: "",
            20: next(directory.glob("000000000020-*")).name.split("-")[3].removesuffix(".msgpack"),
        }
        wrong_count = b"".join(
            frame(encode([1, 2], allow_pickle=False), meta | {"digest": digest[20]}).chunks()
        )
    change_chunk(directory, 20, lambda _: wrong_count)
    fn.calls.clear()
    with pipe, pytest.warns(ResumableWarning) as warned:
        assert [x * 10 for x in range(30)] == checkpointed_map(fn, range(30), every=10, name="b")
    text = str(warned[0].message)
    if layout == "files":
        assert "other rows than its name says" in text
    assert "one result per row" in text
    assert list(range(10 if layout == "files" else 20, 30)) == fn.calls


def test_chunks_damaged_again_and_again_give_up(pipe: Pipeline, monkeypatch: pytest.MonkeyPatch):
    """If assembling keeps finding damage, the error says to check the disk."""
    from resumable import _batch_ledger

    def always_damaged(self: Any) -> list[Any]:
        raise _batch_ledger.DamagedChunksError(self.display)

    monkeypatch.setattr(_batch_ledger.StoredLedger, "assemble", always_damaged)
    with pipe, pytest.raises(ResumableError, match="check the disk"):
        checkpointed_map(abs, range(3), name="b")


# code and argument changes -------------------------------------------------------------


def test_a_code_fix_keeps_the_committed_rows_with_one_warning(pipe: Pipeline, state_dir: Path):
    """The most common resume: fix the bug that crashed row 12 and rerun; rows 0-9 are not redone."""
    calls: list[int] = []

    def make(broken: bool) -> Callable[[], list[int]]:
        if broken:

            def f(x: int) -> int:
                if x == 12:
                    raise RuntimeError("bug at 12")
                calls.append(x)
                return x * 10

        else:

            def f(x: int) -> int:
                calls.append(x)
                return x * 10

        @pipe.step(name="enrich")
        def enrich() -> list[int]:
            return checkpointed_map(f, range(20), every=5)

        return enrich

    with pipe, pytest.raises(RuntimeError, match="bug at 12"):
        make(broken=True)()
    calls.clear()
    with pipe, pytest.warns(ResumableWarning, match=r"resuming with 12 row\(s\).*resumable reset enrich"):
        assert [x * 10 for x in range(20)] == make(broken=False)()
    assert list(range(12, 20)) == calls
    assert [] == chunks(state_dir, "steps/enrich")  # completed: its rows went into its output


def test_the_warning_after_a_fix_is_advice_that_works(pipe: Pipeline):
    """Following the warning (reset the step) computes every row again with the new code."""
    fn = Counter(fail_at=7)

    def make(scale: int) -> Callable[[], list[int]]:
        @pipe.step(name="enrich")
        def enrich() -> list[int]:
            return [x * scale for x in checkpointed_map(fn, range(10), every=5)]

        return enrich

    with pipe, pytest.raises(RuntimeError):
        make(1)()
    fn.fail_at = 8  # fails again, after the warning
    with pytest.warns(ResumableWarning, match=r"pipe.reset\('enrich'\)"), pipe, pytest.raises(RuntimeError):
        make(2)()
    pipe.reset("enrich")
    fn.fail_at, fn.calls = None, []
    with pipe:
        assert [x * 20 for x in range(10)] == make(2)()
    assert list(range(10)) == fn.calls


def test_a_code_change_redoes_the_chunks_that_hold_failed_rows(pipe: Pipeline):
    """With on_error='record', the chunks with failures are done again after a fix; the rest is kept."""
    calls: list[int] = []

    def make(bad: int | None) -> Callable[[], list[Any]]:
        def f(x: int) -> int:
            if x == bad:
                raise ValueError(x)
            calls.append(x)
            return x

        @pipe.step(name="enrich")
        def enrich() -> list[Any]:
            out = checkpointed_map(f, range(12), every=4, on_error="record")
            if any(isinstance(r, RowFailure) for r in out):
                raise RuntimeError("some rows failed")
            return out

        return enrich

    with pipe, pytest.raises(RuntimeError, match="some rows failed"):
        make(5)()
    calls.clear()
    with (
        pipe,
        pytest.warns(ResumableWarning, match=r"resuming with 8 row.*the 4 row\(s\) of chunks with failed"),
    ):
        assert list(range(12)) == make(None)()
    assert [4, 5, 6, 7] == calls


def test_rows_made_with_other_arguments_are_not_reused(pipe: Pipeline):
    """A changed argument that is not the items themselves: rows computed with the old one are dropped."""
    fn = Counter(fail_at=15)

    @pipe.step
    def enrich(factor: int) -> list[int]:
        return [r * factor for r in checkpointed_map(fn, range(20), every=5)]

    with pipe, pytest.raises(RuntimeError):
        enrich(2)
    fn.fail_at, fn.calls = None, []
    with pipe, pytest.warns(ResumableWarning, match=r"arguments changed \(factor\), so its 15 committed"):
        assert [x * 30 for x in range(20)] == enrich(3)
    assert list(range(20)) == fn.calls


def test_a_new_version_starts_the_batch_over_silently_a_code_edit_does_not(pipe: Pipeline):
    """A bumped version declares different results: nothing is kept, and nothing warns."""
    fn = Counter(fail_at=7)

    def make(version: str) -> Callable[[], list[int]]:
        @pipe.step(name="enrich", version=version)
        def enrich() -> list[int]:
            return checkpointed_map(fn, range(10), every=5)

        return enrich

    with pipe, pytest.raises(RuntimeError):
        make("1")()
    fn.fail_at, fn.calls = None, []
    with pipe:
        make("2")()
    assert list(range(10)) == fn.calls


# several batches in one step -----------------------------------------------------------


def test_unnamed_batches_after_a_nested_step_keep_their_own_rows(pipe: Pipeline):
    """A step run between two unnamed batches does not make the second one reuse the first's rows."""

    @pipe.step
    def inner(x: int) -> int:
        return x * 2

    @pipe.step
    def outer() -> tuple[list[int], int, list[int]]:
        a = checkpointed_map(lambda x: x + 1, range(5), every=2)
        b = inner(3)
        c = checkpointed_map(lambda x: x * 10, range(5), every=2)
        return a, b, c

    with pipe:
        assert ([1, 2, 3, 4, 5], 6, [0, 10, 20, 30, 40]) == outer()


def test_checkpointed_then_checkpointed_map_in_one_step(pipe: Pipeline):
    """A side-effect loop and a map in one step are two batches, not one shared by two helpers."""
    seen: list[int] = []

    @pipe.step
    def both() -> list[int]:
        seen.extend(checkpointed(range(3), every=2))
        return checkpointed_map(lambda x: -x, range(3), every=2)

    with pipe:
        assert [0, -1, -2] == both()
    assert [0, 1, 2] == seen


# loop state ----------------------------------------------------------------------------


def test_loop_state_is_committed_with_the_rows_and_restored_on_resume(pipe: Pipeline, state_dir: Path):
    """A counter kept in state= comes out right after a resume; resumed rows never reach the body."""
    sent: list[int] = []

    def send_all(fail_at: int | None) -> dict[str, Any]:
        loop = checkpointed(range(20), every=5, name="send", state={"sent": 0, "odd": 0})
        for x in loop:
            if x == fail_at:
                raise RuntimeError(f"network down at {x}")
            sent.append(x)
            loop.state["sent"] += 1
            loop.state["odd"] += x % 2
        return loop.state

    with pipe, pytest.raises(RuntimeError, match="at 13"):
        send_all(13)
    with pipe:
        assert {"sent": 20, "odd": 10} == send_all(None)
    assert list(range(20)) == sent  # each row sent once


def test_loop_state_is_the_dict_passed_in(pipe: Pipeline):
    """state= is restored into the caller's own dict, before the first row."""
    counts = {"n": 0}
    with pipe:
        for _ in checkpointed(range(3), name="a", state=counts):
            counts["n"] += 1
    assert {"n": 3} == counts
    again = {"n": 0}
    with pipe:
        loop = checkpointed(range(3), name="a", state=again)
        assert {"n": 3} == again  # restored at once; every row was already done
        assert [] == list(loop)


def test_loop_state_in_a_step(pipe: Pipeline):
    """Inside a step, the state lives with the step's batch; a rerun after a kill-like failure resumes it."""
    fail = {"at": 7}

    @pipe.step
    def total(n: int) -> int:
        loop = checkpointed(range(n), every=3, state={"sum": 0})
        for x in loop:
            if x == fail["at"]:
                raise RuntimeError("boom")
            loop.state["sum"] += x
        return int(loop.state["sum"])

    with pipe, pytest.raises(RuntimeError):
        total(10)
    fail["at"] = -1
    with pipe, pytest.warns(ResumableWarning, match="resuming with 7 row"):
        assert sum(range(10)) == total(10)


def test_loop_state_must_be_a_dict_of_storable_values(pipe: Pipeline):
    with pytest.raises(UsageError, match="must be a dict"):
        checkpointed(range(3), name="a", state=[0])  # type: ignore[arg-type]
    with pipe, pytest.raises(SerializationError, match="loop state of batch 'b'"):
        for _ in (loop := checkpointed(range(3), name="b", state={"lock": threading.Lock()})):
            pass
    assert loop.state


def test_a_damaged_loop_state_warns_and_starts_from_the_value_passed_in(
    pipe: Pipeline, state_dir: Path, layout: str
):
    with pipe:
        for x in (loop := checkpointed(range(10), every=2, name="a", state={"n": 0})):
            if x == 5:
                break
            loop.state["n"] += 1
    change_chunk(state_dir / BATCHES / "named" / "a", 4, lambda data: data[:-3] + b"xyz")
    with pipe, pytest.warns(ResumableWarning, match="loop state is not restored"):
        loop = checkpointed(range(10), every=2, name="a", state={"n": 0})
    assert {"n": 0} == loop.state


@pytest.mark.parametrize("mode", ["threads", "async"])
def test_a_code_fix_keeps_committed_rows_on_executors_and_async(pipe: Pipeline, mode: str):
    """Rows committed by a thread pool or by async calls are kept across a fix, like sequential ones."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    calls: list[int] = []

    def make(bad: int | None) -> Callable[[], list[int]]:
        def f(x: int) -> int:
            if x == bad:
                raise RuntimeError(f"bug at {x}")
            calls.append(x)
            return x * 10

        async def g(x: int) -> int:
            return f(x)

        @pipe.step(name="enrich")
        def enrich() -> list[int]:
            if mode == "async":
                return asyncio.run(checkpointed_map(g, range(40), every=5, concurrency=1))
            with ThreadPoolExecutor(1) as pool:
                return checkpointed_map(f, range(40), every=5, executor=pool)

        return enrich

    with pipe, pytest.raises(RuntimeError, match="bug at 22"):
        make(22)()
    first = set(calls)
    calls.clear()
    with pipe, pytest.warns(ResumableWarning, match="that earlier code of the step computed"):
        assert [x * 10 for x in range(40)] == make(None)()
    assert len(first) - len(first & set(calls)) >= 20  # rows 0-19 at least were not computed again
    assert set(range(40)) == first | set(calls)
