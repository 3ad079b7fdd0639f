"""
Large outputs (tens of MB): nothing of such a file is returned unless all of it checks out,
and what is returned is a private, writable copy of the stored array.
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

import resumable
from resumable import Pipeline, ResumableWarning, SerializationError, StateDirectoryError, _codec
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
    assert header["checksum"].startswith("blake3:")
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


def test_a_header_longer_than_the_first_read_is_read_whole(tmp_path):
    """A header over 64 KiB (read first for the header alone) still parses, verifies and decodes."""
    framed = _codec.frame(_codec.encode(EXPECTED, allow_pickle=False), {"slot": "x", "note": "n" * 100_000})
    path = tmp_path / "x.msgpack"
    path.write_bytes(b"".join(bytes(c) for c in framed.chunks()))
    assert len(framed.head) > 64 * 1024
    assert same(EXPECTED, resumable.load(path))
    path.write_bytes(flipped(path.read_bytes(), len(framed.head) + 5))
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
        LocalStore(producer.state_dir).read("big.msgpack")
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
    assert framed.header["checksum"].startswith("blake3:")
    code = (
        "import hashlib, sys, resumable\n"
        f"value = resumable.load({str(path)!r})\n"
        "print(hashlib.sha256(value).hexdigest(), 'numpy' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"{hashlib.sha256(payload).hexdigest()} False" == out.strip()
