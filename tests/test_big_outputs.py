"""
Large outputs (8 MiB or more), read the fast way: into an uninitialised buffer, each 4 MiB
piece of the tree checksum read and hashed by one thread of the pool. Nothing of such a
file is returned unless all of it checks out, and what is returned is a private, writable
copy of the stored array.
"""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import resumable
from resumable import Pipeline, ResumableWarning, SerializationError, StateDirectoryError, _checksum, _codec
from resumable._stores._local import LocalStore

PIECE = 4 * 1024 * 1024
# 18.4 MB of float64: four whole pieces of the tree checksum and part of a fifth
EXPECTED = np.arange(2_300_000, dtype=np.float64) * 1.5


class Big:
    """A step ``big`` returning a fresh copy of EXPECTED; every :meth:`run` is a new run."""

    def __init__(self, state_dir: Path, **options: Any) -> None:
        self.state_dir = state_dir
        self.options = {"durable": False, **options}
        self.calls = 0
        self.reason: str | None = None

    @property
    def path(self) -> Path:
        return self.state_dir / "big.msgpack"

    def run(self, **options: Any) -> np.ndarray:
        with Pipeline("test", state_dir=self.state_dir, **{**self.options, **options}) as pipe:

            @pipe.step(name="big", version="1")  # identity: no digest of EXPECTED
            def big() -> np.ndarray:
                self.calls += 1
                return EXPECTED.copy()

            result = big()
            self.reason = pipe.status().steps["big"].reason
        return result


@pytest.fixture
def big(state_dir: Path) -> tuple[Big, bytes, int]:
    """A stored large output: the producer, the good file's bytes and its header's length."""
    producer = Big(state_dir)
    producer.run()
    good = producer.path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(good[:65536])
    header = unpacker.unpack()
    assert header["checksum"].startswith("blake3-tree:")
    return producer, good, unpacker.tell()


def same(expected: np.ndarray, actual: Any) -> bool:
    """Same type, dtype, shape and bytes (so a flipped bit anywhere counts)."""
    return (
        type(actual) is np.ndarray
        and (expected.dtype, expected.shape) == (actual.dtype, actual.shape)
        and expected.tobytes() == actual.tobytes()
    )


def flipped(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :]


def test_skip_returns_the_stored_array(big):
    """A skip in a new run returns the stored array: equal bytes, dtype and shape, without running."""
    producer, _, _ = big
    result = producer.run()
    assert (1, True) == (producer.calls, same(EXPECTED, result))
    assert same(EXPECTED, resumable.load(producer.path))


def test_returned_array_is_a_private_writable_copy(big):
    """
    The array returned by a skip is writable; changing it leaves the file alone, changing the
    file in place afterwards does not show through, and two skips share no memory.
    """
    producer, good, _ = big
    first, second = producer.run(), producer.run()
    assert (True, True) == (first.flags.writeable, first.flags.c_contiguous)
    first[:] = -1.0
    assert good == producer.path.read_bytes()
    with producer.path.open("r+b") as f:  # in place: same inode, new bytes at the end
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    assert (False, True) == (np.shares_memory(first, second), same(EXPECTED, second))


POSITIONS = {
    "header": lambda head_len, size: 10,
    "header's last byte": lambda head_len, size: head_len - 1,
    "first value byte": lambda head_len, size: head_len,
    "first piece's last byte": lambda head_len, size: head_len + PIECE - 1,
    "second piece's first byte": lambda head_len, size: head_len + PIECE,
    "middle": lambda head_len, size: size // 2,
    "last byte": lambda head_len, size: size - 1,
}


@pytest.mark.parametrize("where", list(POSITIONS))
def test_a_flipped_byte_anywhere_is_never_returned(big, where):
    """A flipped bit anywhere in a large file: load() refuses it; a run warns and recomputes."""
    producer, good, head_len = big
    offset = POSITIONS[where](head_len, len(good))
    producer.path.write_bytes(flipped(good, offset))
    with pytest.raises(SerializationError):
        resumable.load(producer.path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = producer.run()
    assert ("corrupt", 2, [ResumableWarning], True) == (
        producer.reason,
        producer.calls,
        [w.category for w in caught],
        same(EXPECTED, result),
    )
    assert good[head_len:] == producer.path.read_bytes()[head_len:]  # rewritten whole


CUTS = {
    "in the header": lambda head_len, size: 10,
    "after the header": lambda head_len, size: head_len,
    "at a piece boundary": lambda head_len, size: head_len + PIECE,
    "in the middle": lambda head_len, size: size // 2,
    "the last byte": lambda head_len, size: size - 1,
}


@pytest.mark.parametrize("where", list(CUTS))
def test_a_truncated_file_is_never_returned(big, where):
    """A large file cut short anywhere: load() refuses it; a run warns and recomputes."""
    producer, good, head_len = big
    producer.path.write_bytes(good[: CUTS[where](head_len, len(good))])
    with pytest.raises(SerializationError):
        resumable.load(producer.path)
    with pytest.warns(ResumableWarning, match="recomputed"):
        result = producer.run()
    assert ("corrupt", 2, True) == (producer.reason, producer.calls, same(EXPECTED, result))


def test_trailing_bytes_are_never_returned(big):
    """A byte appended to a large file makes it invalid."""
    producer, good, _ = big
    producer.path.write_bytes(good + b"\xc0")
    with pytest.raises(SerializationError, match="trailing"):
        resumable.load(producer.path)


@pytest.mark.parametrize("cut", [1, PIECE, PIECE + 12345])
def test_a_file_cut_short_while_it_is_read_is_judged_by_what_was_read(big, cut):
    """
    A file shorter than it was when opened (cut meanwhile) is refused as truncated, and is
    verified like any other if what was read is whole.
    """
    producer, good, _ = big
    producer.path.write_bytes(good[:-cut])
    outcomes = []
    for claimed in (len(good), len(good) - cut + 1):
        with producer.path.open("rb") as f:
            reading = _codec.read_output_fd(f.fileno(), claimed)
        try:
            outcomes.append(same(EXPECTED, reading.verified(None).decode(allow_pickle=False)))
        except _codec.DamagedFileError as exc:
            outcomes.append(str(exc).split(":")[0])
    producer.path.write_bytes(good)
    with producer.path.open("rb") as f:
        reading = _codec.read_output_fd(f.fileno(), len(good) + cut)
    outcomes.append(same(EXPECTED, reading.verified(None).decode(allow_pickle=False)))
    assert ["truncated", "truncated", True] == outcomes


def test_a_small_file_cut_short_while_it_is_read_is_judged_by_what_was_read(tmp_path):
    """The same for a small file, read in one call: whole it verifies, cut short it is truncated."""
    framed = _codec.frame(_codec.encode([1, 2, 3], allow_pickle=False), {"slot": "x"})
    path = tmp_path / "x.msgpack"
    good = b"".join(bytes(c) for c in framed.chunks())
    outcomes = []
    for data in (good, good[:-1]):
        path.write_bytes(data)
        with path.open("rb") as f:
            reading = _codec.read_output_fd(f.fileno(), len(good) + 100)
        try:
            outcomes.append(reading.verified(None).decode(allow_pickle=False))
        except _codec.DamagedFileError as exc:
            outcomes.append(str(exc).split(":")[0])
    assert [[1, 2, 3], "truncated"] == outcomes


def test_a_large_file_from_another_secret_is_refused(state_dir):
    """With a secret, a large file is authenticated too: another secret's file is recomputed."""
    producer = Big(state_dir, secret="one")
    producer.run()
    assert (1, True) == (producer.calls, same(EXPECTED, producer.run()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = producer.run(secret="two")
    assert [m for m in map(str, (w.message for w in caught)) if "authentication failed" in m]
    assert ("corrupt", 2, True) == (producer.reason, producer.calls, same(EXPECTED, result))


def test_a_large_file_with_a_plain_checksum_still_reads(state_dir, monkeypatch):
    """A large value checksummed with plain SHA-256 (as before tree checksums) reads and is verified."""
    producer = Big(state_dir)
    with monkeypatch.context() as patch:
        patch.setattr(_checksum, "TREE_MIN", 1 << 40)
        patch.setattr(_codec, "TREE_MIN", 1 << 40)
        producer.run()
    good = producer.path.read_bytes()
    assert b"sha256:" in good[:4096]
    assert b"-tree:" not in good[:4096]
    assert (1, True) == (producer.calls, same(EXPECTED, producer.run()))
    producer.path.write_bytes(flipped(good, len(good) - 1))
    with pytest.warns(ResumableWarning, match="checksum mismatch"):
        result = producer.run()
    assert ("corrupt", 2, True) == (producer.reason, producer.calls, same(EXPECTED, result))


def test_a_header_longer_than_the_first_read_is_read_whole(tmp_path):
    """A header over 64 KiB (read first for the header alone) still parses, verifies and decodes."""
    framed = _codec.frame(_codec.encode(EXPECTED, allow_pickle=False), {"slot": "x", "note": "n" * 100_000})
    path = tmp_path / "x.msgpack"
    path.write_bytes(b"".join(bytes(c) for c in framed.chunks()))
    assert framed.head_len > 64 * 1024
    assert same(EXPECTED, resumable.load(path))
    path.write_bytes(flipped(path.read_bytes(), framed.head_len + 5))
    with pytest.raises(SerializationError, match="checksum mismatch"):
        resumable.load(path)


def test_a_symbolic_link_is_not_followed(big, tmp_path):
    """A large output file replaced by a link to a valid copy elsewhere is refused, not read."""
    producer, good, _ = big
    elsewhere = tmp_path / "elsewhere.msgpack"
    elsewhere.write_bytes(good)
    producer.path.unlink()
    producer.path.symlink_to(elsewhere)
    with pytest.raises(StateDirectoryError) as info:
        LocalStore(producer.state_dir).read_with("big.msgpack", lambda fd, size: size)
    assert errno.ELOOP == info.value.errno
    with pytest.raises(StateDirectoryError, match="symbolic link"):
        producer.run()
    assert (1, good) == (producer.calls, elsewhere.read_bytes())


def test_a_large_value_without_arrays_does_not_import_numpy(tmp_path):
    """Loading a large file that holds no array reads it without importing NumPy."""
    payload = hashlib.sha256(b"seed").digest() * 300_000  # 9.6 MB of bytes, in the msgpack body
    framed = _codec.frame(_codec.encode(payload, allow_pickle=False), {"slot": "x"})
    path = tmp_path / "x.msgpack"
    path.write_bytes(b"".join(bytes(c) for c in framed.chunks()))
    assert framed.header["checksum"].startswith("blake3-tree:")
    code = (
        "import hashlib, sys, resumable\n"
        f"value = resumable.load({str(path)!r})\n"
        "print(hashlib.sha256(value).hexdigest(), 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{hashlib.sha256(payload).hexdigest()} False" == out.strip()


@given(
    data=st.binary(max_size=700),
    start=st.integers(0, 700),
    filled=st.integers(0, 700),
    cut=st.integers(0, 800),
)
def test_reading_while_hashing_gives_the_tree_checksum(data, start, filled, cut):
    """
    Filling a buffer piece by piece on the pool gives the bytes read and the tree checksum
    a writer records; a file that ends early reports where it ended.
    """
    start = min(start, len(data))
    filled = min(max(filled, start), len(data))
    available = data[:cut]

    def read_at(part: memoryview, offset: int) -> int:
        got = available[offset : offset + len(part)]
        part[: len(got)] = got
        return len(got)

    buffer = bytearray(len(data))
    buffer[:filled] = data[:filled]
    with pytest.MonkeyPatch.context() as patch:  # small pieces and steps, to cross many boundaries
        patch.setattr(_checksum, "_TREE_PIECE", 64)
        patch.setattr(_checksum, "_READ_STEP", 24)
        tree = _checksum.TREE_PREFIX
        checksum, reached = _checksum.fill_and_checksum(read_at, memoryview(buffer), start, filled, tree)
        expected = _checksum.start_checksum([data[start:]], _checksum.TREE_MIN)()
        old = _checksum.SHA256_TREE_PREFIX  # files written before: the same, with SHA-256
        old_checksum, _ = _checksum.fill_and_checksum(
            read_at, memoryview(bytearray(buffer)), start, filled, old
        )
        old_expected = _checksum.start_checksum([data[start:]], _checksum.TREE_MIN, old)()
    assert min(len(data), max(cut, filled)) == reached
    if reached == len(data):
        assert (expected, data) == (checksum, bytes(buffer))
        assert old_expected == old_checksum


def test_a_large_file_with_a_sha256_tree_still_reads(state_dir, monkeypatch):
    """Large values written before BLAKE3 trees (SHA-256 trees) read, are verified, and pass on unchanged."""
    producer = Big(state_dir)
    write_tree = _codec.start_checksum

    def sha256_tree(chunks: Any, size: int, tree: str = _checksum.TREE_PREFIX) -> Any:
        return write_tree(chunks, size, _checksum.SHA256_TREE_PREFIX)

    with monkeypatch.context() as patch:
        patch.setattr(_codec, "TREE_PREFIX", _checksum.SHA256_TREE_PREFIX)
        patch.setattr(_codec, "start_checksum", sha256_tree)
        producer.run()
    good = producer.path.read_bytes()
    assert b"sha256-tree:" in good[:4096]
    assert (1, True) == (producer.calls, same(EXPECTED, producer.run()))
    assert same(EXPECTED, resumable.load(producer.path))
    producer.path.write_bytes(flipped(good, len(good) // 2))
    with pytest.warns(ResumableWarning, match="checksum mismatch"):
        producer.run()
    assert 2 == producer.calls
