"""
Path arguments: a file by its contents, a directory by its files, a missing path by its name;
the stat cache that spares reading an unchanged file, kept in the state directory.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path, PurePosixPath

import pytest

from resumable import Pipeline, Store
from resumable._files import CACHE_KEY, FileDigests, file_digests
from resumable._fingerprint import digest_value


def _age(path: Path, seconds: int = 10) -> None:
    """Move *path*'s mtime into the past (its ctime stays: see _settled)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - seconds * 1_000_000_000))


@pytest.fixture
def _settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """
    Files written by the test count as changed long ago: their digests are cached at once
    (a file's ctime cannot be moved back, and waiting two seconds would slow the suite).
    """
    monkeypatch.setattr("resumable._files._RACY_NS", 0)


def test_a_file_is_fingerprinted_by_its_contents(tmp_path: Path):
    """The same name with other contents is another digest; other names with equal contents match."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one\ntwo\n")
    b.write_text("one\ntwo\n")
    first = digest_value(a)
    assert first == digest_value(b)
    a.write_text("one\ntwo\nthree\n")
    assert first != digest_value(a)


def test_a_directory_by_the_names_and_contents_of_its_files(tmp_path: Path):
    """Adding, renaming or changing a file under a directory changes its digest."""
    root = tmp_path / "data"
    (root / "sub").mkdir(parents=True)
    (root / "x.csv").write_text("1")
    (root / "sub" / "y.csv").write_text("2")
    first = digest_value(root)
    (root / "sub" / "y.csv").write_text("3")
    changed = digest_value(root)
    (root / "sub" / "y.csv").rename(root / "sub" / "z.csv")
    renamed = digest_value(root)
    (root / "new.csv").write_text("")
    added = digest_value(root)
    assert 4 == len({first, changed, renamed, added})


def test_a_missing_path_by_its_name(tmp_path: Path):
    """A path with nothing there is fingerprinted by its name, like a pure path."""
    missing = tmp_path / "nothing-here"
    assert digest_value(PurePosixPath(missing)) == digest_value(missing)
    assert digest_value(tmp_path / "other") != digest_value(missing)


@pytest.mark.usefixtures("_settled")
def test_an_unchanged_file_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The stat cache answers for a file whose size, mtime, ctime and inode are unchanged."""
    path = tmp_path / "big.bin"
    path.write_bytes(b"x" * 10_000)
    _age(path)
    cache = FileDigests()
    first = cache.digest(path)
    reads: list[str] = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda *a, **k: reads.append(str(a[0])) or real_open(*a, **k))
    assert first == cache.digest(path)
    assert [] == reads


def test_same_contents_with_a_new_mtime_is_no_change(tmp_path: Path):
    """Touching a file makes it be read again, and it gives the same digest."""
    path = tmp_path / "f.txt"
    path.write_text("same")
    _age(path, 20)
    cache = FileDigests()
    first = cache.digest(path)
    _age(path, 10)  # a new mtime, the same contents
    assert first == cache.digest(path)


def test_a_recently_modified_file_is_not_cached(tmp_path: Path):
    """A file written within the last two seconds is read again next time (its mtime may not move)."""
    path = tmp_path / "fresh.txt"
    path.write_text("v1")
    cache = FileDigests()
    cache.digest(path)
    assert {} == cache._cache
    _age(path, 3600)  # an old mtime (`cp -p`) does not hide a recent change: the ctime tells
    cache.digest(path)
    assert {} == cache._cache


def test_a_step_with_a_path_argument_reruns_when_the_file_changes(tmp_path: Path):
    """count_lines(Path("input.txt")) returns the new count after the file changes."""
    state = tmp_path / "state"
    source = tmp_path / "input.txt"
    calls: list[int] = []

    def run() -> int:
        with Pipeline("files", state_dir=state) as pipe:

            @pipe.step
            def count_lines(path: Path) -> int:
                n = len(path.read_text().splitlines())
                calls.append(n)
                return n

            return count_lines(source)

    source.write_text("a\nb\n")
    assert [2, 2] == [run(), run()]
    source.write_text("a\nb\nc\n")
    assert 3 == run()
    assert [2, 3] == calls


@pytest.mark.usefixtures("_settled")
def test_the_stat_cache_is_kept_in_the_state(tmp_path: Path):
    """A run stores what it learned; a new process (a fresh cache) reads it instead of the file."""
    state = tmp_path / "state"
    source = tmp_path / "input.txt"
    source.write_text("hello")
    _age(source)
    with Pipeline("files", state_dir=state) as pipe:

        @pipe.step
        def size(path: Path) -> int:
            return len(path.read_text())

        assert 5 == size(source)
    assert (state / CACHE_KEY).exists()
    file_digests.clear()  # as in a new process
    with Pipeline("files", state_dir=state) as pipe:
        assert size.is_cached(source)
        assert str(source.resolve()) in file_digests._cache


def test_a_damaged_stat_cache_is_ignored(tmp_path: Path):
    """Garbage in the cache file is not trusted: files are read again and the run goes on."""
    state = tmp_path / "state"
    source = tmp_path / "input.txt"
    source.write_text("hello")
    with Pipeline("files", state_dir=state) as pipe:

        @pipe.step
        def size(path: Path) -> int:
            return len(path.read_text())

        assert 5 == size(source)
    (state / CACHE_KEY).parent.mkdir(parents=True, exist_ok=True)
    (state / CACHE_KEY).write_bytes(b"\x93garbage")
    file_digests.clear()
    with Pipeline("files", state_dir=state):
        assert size.is_cached(source)


def test_runs_opened_again_and_again_keep_no_reference_to_their_store(tmp_path: Path):
    """Each run merges the store's digest cache as it opens; the store is freed with its pipeline."""

    def fifty_runs() -> weakref.ref[Store]:
        pipe = Pipeline("p", state_dir=tmp_path / "state")

        @pipe.step
        def one() -> int:
            return 1

        for _ in range(50):
            with pipe:
                one()
        return weakref.ref(pipe.store)

    store = fifty_runs()
    gc.collect()
    assert store() is None


def test_only_a_run_reads_the_file_digest_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reset, rollback and the other maintenance opens fingerprint nothing: they leave the cache unread."""
    from resumable import _session

    attached: list[object] = []
    monkeypatch.setattr(_session.file_digests, "attach", lambda store, secret: attached.append(store))
    pipe = Pipeline(state_dir=tmp_path / "state")

    @pipe.step
    def f(x: int) -> int:
        return x

    with pipe:
        f(1)
    assert 1 == len(attached)
    pipe.reset("f")
    pipe.snapshot("after reset")
    assert 1 == len(attached)
