"""
The codec (_codec, _codec_types): round trips through real steps and files, the file
format, the pickle fallback, refusing to import, integrity and authentication.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import enum
import gc
import hashlib
import hmac
import logging
import math
import os
import pickle
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import types
import uuid
import warnings
import weakref
from decimal import Decimal
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any
from unittest import mock
from zoneinfo import ZoneInfo

import attrs
import blake3
import msgpack
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    Color,
    Coord,
    Frozen,
    Item,
    Loose,
    Opaque,
    Outer,
    Perm,
    Point,
    User,
    numpy_arrays,
    storable,
)

import resumable
from resumable import Pipeline, ResumableWarning, SerializationError, _codec, _codec_arrays, _codec_types

STEP = "produce"
KEY_ONE, KEY_TWO, ENV_KEY = "alpha", "beta", "from-env"
HEADER_KEYS = {
    "format",
    "slot",
    "fingerprint",
    "created_at",
    "encoding",
    "checksum",
    "size",
    "buffers",
    "hsum",
}


class Producer:
    """A step named ``produce`` returning ``self.value``; every :meth:`run` is a new run."""

    def __init__(self, state_dir: Path, value: object = None, **options: Any) -> None:
        self.state_dir = state_dir
        self.value = value
        self.options = options
        self.calls = 0
        self.reason: str | None = None

    @property
    def path(self) -> Path:
        return self.state_dir / f"{STEP}.msgpack"

    def run(self, pipeline: Pipeline | None = None, *, token: object = 0, **options: Any) -> Any:
        """
        Open a run (in *pipeline* or a new Pipeline on the same state dir) and call the step;
        a different *token* changes the step's arguments, so it runs again.
        """
        if pipeline is None:
            pipeline = Pipeline("test", state_dir=self.state_dir, **{**self.options, **options})
        producer = self
        with pipeline:

            @pipeline.step(name=STEP)
            def produce(token: object) -> Any:
                producer.calls += 1
                return producer.value

            result = produce(token)
            self.reason = pipeline.status().steps[STEP].reason
        return result


def round_trip(
    state_dir: Path, value: object, pipeline: Pipeline | None = None, **options: Any
) -> tuple[Any, Any]:
    """Store *value* with a step, rerun it in a new Pipeline (a skip); return (rerun value, load value)."""
    producer = Producer(state_dir, value, **options)
    first = producer.run(pipeline)
    assert first is value
    second = producer.run()
    assert 1 == producer.calls
    loaded = resumable.load(producer.path, allow_pickle=options.get("allow_pickle", True))
    return second, loaded


def read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header of a stored file read with a plain msgpack Unpacker, and its length."""
    with path.open("rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False)
        header = unpacker.unpack()
        return header, unpacker.tell()


def assert_same(expected: Any, actual: Any, where: str = "value") -> None:
    """Equal value and same type, recursively (NumPy arrays by dtype, shape, layout and bytes)."""
    assert type(expected) is type(actual), f"{where}: {type(expected)} != {type(actual)}"
    if isinstance(expected, np.ndarray):
        assert_same_array(expected, actual, where)
    elif isinstance(expected, (list, tuple)):
        assert len(expected) == len(actual), where
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same(e, a, f"{where}[{i}]")
    elif isinstance(expected, dict):
        assert list(expected) == list(actual), where
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}[{key!r}]")
    elif attrs.has(type(expected)) or dataclasses.is_dataclass(expected):
        names = [
            f.name
            for f in (attrs.fields if attrs.has(type(expected)) else dataclasses.fields)(type(expected))
        ]
        for name in names:
            assert_same(getattr(expected, name), getattr(actual, name), f"{where}.{name}")
    else:
        assert_same_scalar(expected, actual, where)


def assert_same_array(expected: np.ndarray, actual: np.ndarray, where: str) -> None:
    """Same dtype, shape, bytes and memory order; the decoded array is writable."""
    assert expected.dtype == actual.dtype, where
    assert expected.shape == actual.shape, where
    assert expected.tobytes() == actual.tobytes(), where
    if expected.flags.c_contiguous:
        assert actual.flags.c_contiguous, where
    elif expected.flags.f_contiguous:
        assert (False, True) == (actual.flags.c_contiguous, actual.flags.f_contiguous), where
    assert actual.flags.writeable, where


def assert_same_scalar(expected: Any, actual: Any, where: str) -> None:
    """Scalars: exact float bits, Decimal digits, datetime zone and fold."""
    if isinstance(expected, float):
        assert expected.hex() == actual.hex(), where
    elif isinstance(expected, (Decimal, complex)):
        assert repr(expected) == repr(actual), where
    elif isinstance(expected, (dt.datetime, dt.time)):
        assert (expected, expected.tzinfo, expected.fold) == (actual, actual.tzinfo, actual.fold), where
        assert expected.isoformat() == actual.isoformat(), where
    elif isinstance(expected, np.generic):
        assert (expected.dtype, expected.tobytes()) == (actual.dtype, actual.tobytes()), where
    elif isinstance(expected, enum.Enum):
        assert expected is actual, where
    else:
        assert expected == actual, where


def flipped(data: bytes, offset: int, mask: int) -> bytes:
    """*data* with the byte at *offset* XORed with *mask*."""
    damaged = bytearray(data)
    damaged[offset] ^= mask
    return bytes(damaged)


# --------------------------------------------------------------------------------------
# round trips of every supported type, through a real step and file

TYPED_VALUES: dict[str, Any] = {
    "none": None,
    "true": True,
    "false": False,
    "zero": 0,
    "int": -7,
    "uint64 max": 2**64 - 1,
    "int64 min": -(2**63),
    "big int": 2**100 + 1,
    "negative big int": -(2**64) - 5,
    "float": 1.5,
    "negative zero": -0.0,
    "infinity": -math.inf,
    "tiny float": 5e-324,
    "complex": 1 - 2.5j,
    "str": "héllo ✓ \x00",
    "empty str": "",
    "bytes": b"\x00\xff" * 3,
    "list": [1, "a", None, [2.5]],
    "tuple": (1, (2, (3,)), []),
    "empty tuple": (),
    "dict str keys": {"b": 1, "a": {"c": [1, 2]}},
    "dict int keys": {1: "a", -5: "b", 2**70: "big"},
    "dict tuple keys": {(1, "a"): 1, (): 2, ((1, 2), "x"): 3},
    "dict frozenset key": {frozenset({1, 2}): "x"},
    "set": {1, "a", (2, 3), b"z"},
    "empty set": set(),
    "frozenset": frozenset({b"x", 1.5, None}),
    "large set": set(range(100)),
    "set of frozensets": {frozenset({1}), frozenset()},
    "datetime naive": dt.datetime(2024, 2, 29, 12, 30, 1, 5),
    "datetime utc": dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
    "datetime fixed offset": dt.datetime(
        2024, 1, 1, 8, tzinfo=dt.timezone(dt.timedelta(hours=-3, minutes=-30))
    ),
    "datetime zoneinfo": dt.datetime(2024, 7, 1, 9, tzinfo=ZoneInfo("Europe/Paris")),
    "datetime fold": dt.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=ZoneInfo("Europe/Paris")),
    "datetime min": dt.datetime.min,
    "date": dt.date(1, 1, 1),
    "time": dt.time(23, 59, 59, 999999),
    "time utc": dt.time(1, 2, tzinfo=dt.UTC),
    "time zoneinfo": dt.time(1, 2, fold=1, tzinfo=ZoneInfo("America/New_York")),
    "timedelta": dt.timedelta(days=-3, microseconds=7),
    "decimal": Decimal("-1.2300"),
    "decimal exponent": Decimal("1E+300"),
    "decimal negative zero": Decimal("-0.00"),
    "decimal nan": Decimal("NaN"),
    "uuid": uuid.UUID("12345678-1234-5678-1234-567812345678"),
    "pure posix path": PurePosixPath("a/b.txt"),
    "posix path": PosixPath("/tmp/x y/z"),
    "enum str": Color.RED,
    "enum tuple value": Color.BLUE,
    "int flag": Perm.R | Perm.W,
    "dataclass": Point(1, 2.5),
    "frozen dataclass": Frozen("a", ("b", "c")),
    "attrs": Item("x", Point(1, 2.0), {"k": [1, (2,)]}),
    "frozen attrs private field": Coord(1.0, 2.0),
    "nested class": Outer.Inner(3),
    "numpy in a dict": {"a": np.arange(3), "b": [np.float32(1.5)]},
    "mixed": [Point(1, 0.5), {Color.GREEN: {dt.date(2020, 1, 1)}}, (Decimal(1), uuid.UUID(int=0))],
}


@pytest.mark.parametrize("value", list(TYPED_VALUES.values()), ids=list(TYPED_VALUES))
def test_supported_type_round_trips_through_a_step(pipe, state_dir, value):
    """Stored by a step, a supported value comes back equal and of the same type, without pickle."""
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert_same(value, second)
    assert_same(value, loaded)
    assert "msgpack" == read_header(state_dir / f"{STEP}.msgpack")[0]["encoding"]


@given(value=storable)
def test_any_storable_value_round_trips_through_a_step(tmp_path, value):
    """Property: every storable value survives store, skip-and-reload and load(), type included."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as directory:
        state = Path(directory)
        second, loaded = round_trip(state, value, durable=False)
        encoding = read_header(state / f"{STEP}.msgpack")[0]["encoding"]
    assert_same(value, second)
    assert_same(value, loaded)
    assert "msgpack" == encoding


def _codec_round_trip(value: object, **options: Any) -> tuple[Any, dict[str, Any]]:
    encoded = _codec.encode(value, allow_pickle=options.get("allow_pickle", True))
    chunks = _codec.frame(encoded, {"slot": "s"}, secret=options.get("secret")).chunks()
    data = bytearray(b"".join(bytes(c) for c in chunks))
    header, head_len = _codec.parse_header(data)
    _codec.verify(data, header, head_len, options.get("secret"))
    return _codec.Verified(data, header, head_len).decode(
        allow_pickle=options.get("allow_pickle", True)
    ), header


@given(value=storable)
def test_codec_round_trip_property(value):
    """Property: value == decode(encode(value)) in memory, with no pickle involved."""
    decoded, header = _codec_round_trip(value, allow_pickle=False)
    assert_same(value, decoded)
    assert "msgpack" == header["encoding"]


def test_dict_and_list_keep_their_order(pipe, state_dir):
    """Dict insertion order and list order survive the round trip."""
    value = {"z": 1, "a": 2, "m": [3, 1, 2]}
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert ["z", "a", "m"] == list(second)
    assert ["z", "a", "m"] == list(loaded)
    assert [3, 1, 2] == loaded["m"]


def test_bytearray_is_stored_as_bytes(pipe, state_dir):
    """A bytearray is stored natively as msgpack bin and comes back as equal bytes (documented)."""
    second, loaded = round_trip(state_dir, bytearray(b"abc"), pipeline=pipe)
    assert b"abc" == second
    assert bytes is type(loaded)


def test_str_with_lone_surrogate_round_trips(pipe, state_dir):
    """A str holding a lone surrogate (os.fsdecode of a non-UTF-8 file name) can be stored."""
    name = os.fsdecode(b"report-\xff.csv")
    assert "report-\udcff.csv" == name
    second, loaded = round_trip(state_dir, [name], pipeline=pipe)
    assert [name] == second
    assert [name] == loaded


class _SurrogatesAlways(_codec_types.Encoder):
    """The encoder as it was: every str through msgpack's error handler."""

    def pack(self, obj: object) -> bytes:
        packer = msgpack.Packer(
            default=self.default, strict_types=True, use_bin_type=True, unicode_errors="surrogatepass"
        )
        return bytes(packer.pack(obj))


@settings(max_examples=150, deadline=None)
@given(value=storable, name=st.text(max_size=5))
def test_packing_strict_utf8_first_gives_the_bytes_of_the_error_handler(value: Any, name: str) -> None:
    """A lone surrogate anywhere (after arrays, inside ext types) packs again from a clean state: same bytes, same buffers."""
    surrogate = f"{name}\udcff"
    big = np.arange(_codec_types.OOB_MIN)  # out of band: a buffer the first attempt has already taken
    for candidate in (value, [big, value, surrogate], {surrogate: value}, (big, (surrogate,))):
        fast, slow = _codec_types.Encoder(allow_pickle=True), _SurrogatesAlways(allow_pickle=True)
        assert (slow.pack(candidate), [bytes(b) for b in slow.buffers], slow.pickled) == (
            fast.pack(candidate),
            [bytes(b) for b in fast.buffers],
            fast.pickled,
        )


# --------------------------------------------------------------------------------------
# pandas and pydantic


def _pandas_values() -> dict[str, Any]:
    mi = pd.MultiIndex.from_product([["a", "b"], [1, 2]], names=["k", "n"])
    return {
        "numeric frame": pd.DataFrame({"i": [1, 2, 3], "f": [1.5, np.nan, -0.0], "b": [True, False, True]}),
        "object column": pd.DataFrame({"o": pd.Series([{"a": 1}, [1], None], dtype=object)}),
        "categorical": pd.DataFrame(
            {"c": pd.Categorical(["a", "b", "a"], categories=["b", "a", "unused"], ordered=True)}
        ),
        "tz-aware datetimes": pd.DataFrame({"t": pd.date_range("2020-03-28", periods=3, tz="Europe/Paris")}),
        "naive datetimes and timedeltas": pd.DataFrame(
            {"d": pd.date_range("2020", periods=2), "td": pd.to_timedelta([1, 2], unit="s")}
        ),
        "nullable Int64": pd.DataFrame({"n": pd.array([1, None, 3], dtype="Int64")}),
        "nullable boolean and Float64": pd.DataFrame(
            {"b": pd.array([True, None], dtype="boolean"), "f": pd.array([None, 2.5], dtype="Float64")}
        ),
        "string dtype": pd.DataFrame({"s": pd.array(["x", None, "z"], dtype="string")}),
        "default str dtype": pd.DataFrame({"s": ["x", "y"]}),
        "multiindex rows": pd.DataFrame({"v": range(4)}, index=mi),
        "multiindex columns": pd.DataFrame([[1, 2, 3, 4]], columns=mi),
        "range index with step": pd.DataFrame({"v": [1, 2]}, index=pd.RangeIndex(10, 14, 2, name="r")),
        "duplicate column names": pd.DataFrame([[1, 2]], columns=["a", "a"]),
        "empty frame": pd.DataFrame(),
        "large numeric column": pd.DataFrame({"x": np.arange(20_000.0)}),
        "named series": pd.Series([1.5, 2.5], index=["a", "b"], name="s"),
        "series with datetime index and freq": pd.Series(
            range(5), index=pd.date_range("2021-01-01", periods=5, freq="D", name="day")
        ),
        "series with hourly tz index": pd.Series(
            range(3), index=pd.date_range("2021-01-01", periods=3, freq="h", tz="UTC")
        ),
        "categorical series": pd.Series(pd.Categorical(["x", "y"]), name=("a", 1)),
    }


PANDAS_VALUES = _pandas_values()


def assert_pandas_same(expected: Any, actual: Any) -> None:
    """Exact pandas equality (dtypes, index, names, freq)."""
    assert type(expected) is type(actual)
    if isinstance(expected, pd.DataFrame):
        pd.testing.assert_frame_equal(expected, actual, check_exact=True, check_freq=True)
    else:
        pd.testing.assert_series_equal(expected, actual, check_exact=True, check_freq=True)
    assert getattr(expected.index, "freq", None) == getattr(actual.index, "freq", None)


@pytest.mark.parametrize("value", list(PANDAS_VALUES.values()), ids=list(PANDAS_VALUES))
def test_pandas_round_trips_through_a_step(pipe, state_dir, value):
    """DataFrames and Series come back equal (pandas.testing), dtypes and freq included, no pickle."""
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert_pandas_same(value, second)
    assert_pandas_same(value, loaded)
    assert "msgpack" == read_header(state_dir / f"{STEP}.msgpack")[0]["encoding"]


def test_pandas_index_and_scalars_round_trip(pipe, state_dir):
    """pandas Index, Timestamp, Timedelta, NaT and NA keep their type and value."""
    value = [
        pd.Index([3, 1, 2], name="x"),
        pd.Timestamp("2020-01-01 10:00:00.000000001", tz="Europe/Paris"),
        pd.Timedelta(123, unit="ns"),
        pd.NaT,
        pd.NA,
    ]
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    for result in (second, loaded):
        pd.testing.assert_index_equal(value[0], result[0], exact=True)
        assert (value[1], str(value[1].tz), value[1].unit) == (result[1], str(result[1].tz), result[1].unit)
        assert (value[2], pd.Timedelta) == (result[2], type(result[2]))
        assert result[3] is pd.NaT
        assert result[4] is pd.NA


def test_large_dataframe_column_is_out_of_band(pipe, state_dir):
    """A DataFrame's large numeric column is written as a raw buffer, not in the msgpack body."""
    frame = pd.DataFrame({"x": np.arange(20_000.0)})
    round_trip(state_dir, frame, pipeline=pipe)
    header, _ = read_header(state_dir / f"{STEP}.msgpack")
    assert [frame["x"].to_numpy().nbytes] == [size for _, size in header["buffers"]]


def test_pydantic_models_round_trip(pipe, state_dir):
    """pydantic v2 models (nested, extras, fields set) come back equal, without pickle."""
    value = {
        "user": User(name="ann", tags=["a"], friend=User(name="bob", age=3)),
        "loose": Loose(name="x", colour="red"),
    }
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    for result in (second, loaded):
        assert value == result
        assert User is type(result["user"].friend)
        assert {"name", "tags", "friend"} == result["user"].model_fields_set
        assert {"colour": "red"} == result["loose"].model_extra
    assert "msgpack" == read_header(state_dir / f"{STEP}.msgpack")[0]["encoding"]


# --------------------------------------------------------------------------------------
# NumPy


def _arrays() -> dict[str, np.ndarray]:
    grid = np.arange(24, dtype=np.int32).reshape(2, 3, 4)
    return {
        "0-d int": np.array(7),
        "0-d float32": np.array(1.5, dtype=np.float32),
        "empty": np.array([], dtype=np.float64),
        "empty 2-d fortran": np.asfortranarray(np.zeros((3, 0))),
        "bool": np.array([[True, False], [False, True]]),
        "big-endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "float16": np.linspace(0, 1, 7, dtype=np.float16),
        "complex64": np.array([1 + 2j, -3j], dtype=np.complex64),
        "unicode": np.array(["a", "bcd", ""]),
        "bytes": np.array([b"ab", b""], dtype="S3"),
        "datetime64": np.array(["2020-01-01", "NaT"], dtype="M8[ns]"),
        "timedelta64": np.array([1, -2], dtype="m8[us]"),
        "structured": np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "fortran 2-d": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        "fortran 3-d": np.asfortranarray(grid),
        "transposed": grid.T,
        "non-contiguous": grid[:, ::2, 1:],
        "negative strides": np.arange(10)[::-3],
        "reversed columns": np.arange(12).reshape(4, 3)[:, ::-1],
        "broadcast (zero strides)": np.broadcast_to(np.arange(3), (4, 3)),
        "nan payloads": np.array([np.nan, -np.nan, np.inf]),
    }


ARRAYS = _arrays()


@pytest.mark.parametrize("arr", list(ARRAYS.values()), ids=list(ARRAYS))
def test_numpy_array_round_trips_through_a_step(pipe, state_dir, arr):
    """dtype, shape, bytes and C/Fortran order survive; the result is a writable ndarray."""
    second, loaded = round_trip(state_dir, arr, pipeline=pipe)
    assert_same_array(arr, second, "second")
    assert_same_array(arr, loaded, "loaded")
    assert "msgpack" == read_header(state_dir / f"{STEP}.msgpack")[0]["encoding"]


@given(arr=numpy_arrays())
def test_numpy_array_codec_property(arr):
    """Property: any generated array (0-d, empty, Fortran, strided) round-trips byte-exact."""
    decoded, _ = _codec_round_trip(arr, allow_pickle=False)
    assert_same_array(arr, decoded, "decoded")


def test_empty_numpy_string_scalars_round_trip(pipe, state_dir):
    """np.str_("") and np.bytes_(b"") (itemsize 0) are stored and read back."""
    value = [np.str_(""), np.bytes_(b"")]
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert_same(value, second)
    assert_same(value, loaded)


def test_numpy_scalars_round_trip(pipe, state_dir):
    """NumPy scalars keep their exact type and bits (np.float64 is not turned into float)."""
    value = [
        np.float64(1.5),
        np.float32(-0.0),
        np.int8(-3),
        np.uint64(2**64 - 1),
        np.bool_(True),
        np.complex128(1j),
        np.str_("abc"),
        np.bytes_(b"xy"),
        np.datetime64("2020-01-01T10:00", "m"),
        np.timedelta64(5, "D"),
    ]
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert_same(value, second)
    assert_same(value, loaded)


READ_ARRAYS = """
import sys
import resumable
imported = "numpy" in sys.modules or "pandas" in sys.modules
value = resumable.load(sys.argv[1])
print(imported, value["big"].sum(), value["cell"], value["table"].shape)
"""


def test_arrays_are_read_and_stored_by_a_fresh_process(pipe, state_dir):
    """`import resumable` imports neither NumPy nor pandas; a fresh process reads and stores arrays."""
    value = {
        "big": np.arange(_codec_types.OOB_MIN, dtype=np.int64),  # out of band
        "cell": np.float32(2.5),
        "table": pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}),
    }
    with pipe:
        pipe.step(name="arrays")(lambda: value)()
    done = subprocess.run(
        [sys.executable, "-c", READ_ARRAYS, str(state_dir / "arrays.msgpack")],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = f"False {value['big'].sum()} 2.5 (2, 2)"
    assert expected == done.stdout.strip()
    stored = subprocess.run(
        [sys.executable, "-c", STORE_ARRAY, str(state_dir)], capture_output=True, text=True
    )
    assert "[0, 1, 2]" == stored.stdout.strip(), stored.stderr


STORE_ARRAY = """
import sys
import numpy as np
from resumable import Pipeline, step
@step
def made() -> np.ndarray:
    return np.arange(3)
with Pipeline("test", state_dir=sys.argv[1]):
    made()
print(made.__wrapped__().tolist())
"""


def test_decoded_array_is_writable_and_independent(pipe, state_dir):
    """Writing into a loaded array changes neither the file nor the next load."""
    arr = np.arange(100_000, dtype=np.int64)
    round_trip(state_dir, arr, pipeline=pipe)
    path = state_dir / f"{STEP}.msgpack"
    before = path.read_bytes()
    first = resumable.load(path)
    first[:] = -1
    assert before == path.read_bytes()
    assert 4950 == int(resumable.load(path)[:100].sum())


def _out_of_band_spans(path: Path) -> tuple[dict[str, Any], Any, list[tuple[int, bytes]]]:
    """Header, value and (offset, raw bytes) of each out-of-band buffer, read with msgpack only."""
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data))
    unpacker.feed(data)
    header = unpacker.unpack()
    value = unpacker.unpack()
    spans = []
    pads = 0
    while unpacker.tell() < len(data):
        start = unpacker.tell()
        obj = unpacker.unpack()
        if obj is None:
            pads += 1
            continue
        assert isinstance(obj, bytes)
        spans.append((start + 5, obj))
    assert pads == sum(pad for pad, _ in header["buffers"])
    return header, value, spans


LARGE_ARRAYS = {
    "float64 C": np.arange(100_000, dtype=np.float64),
    "exactly 64 KiB": np.ones(64 * 1024, dtype=np.int8),
    "fortran": np.asfortranarray(np.arange(300 * 300, dtype=np.float64).reshape(300, 300)),
    "non-contiguous": np.arange(400_000, dtype=np.int32)[::2],
    "bool 3-d": np.ones((50, 40, 40), dtype=bool),
}


@pytest.mark.parametrize("arr", list(LARGE_ARRAYS.values()), ids=list(LARGE_ARRAYS))
def test_large_array_is_stored_out_of_band_and_aligned(pipe, state_dir, arr):
    """Arrays >= 64 KiB: raw bytes after the value, listed in `buffers`, at a 64-byte aligned offset."""
    second, loaded = round_trip(state_dir, arr, pipeline=pipe)
    assert_same_array(arr, second, "second")
    assert_same_array(arr, loaded, "loaded")
    header, value, spans = _out_of_band_spans(state_dir / f"{STEP}.msgpack")
    assert 1 == len(header["buffers"])
    assert arr.nbytes == header["buffers"][0][1]
    assert 0 <= header["buffers"][0][0] < 64
    assert msgpack.ExtType is type(value)
    assert _codec_types.NDARRAY_REF == value.code
    [(offset, raw)] = spans
    assert 0 == offset % 64
    assert arr.tobytes(order="A") == raw
    assert arr.nbytes + offset == (state_dir / f"{STEP}.msgpack").stat().st_size


def test_array_just_under_64_kib_is_in_band(pipe, state_dir):
    """An array of 65,535 bytes stays inside the msgpack body: no buffers."""
    arr = np.ones(64 * 1024 - 1, dtype=np.uint8)
    second, _ = round_trip(state_dir, arr, pipeline=pipe)
    header, value, spans = _out_of_band_spans(state_dir / f"{STEP}.msgpack")
    assert [] == header["buffers"]
    assert [] == spans
    assert _codec_types.NDARRAY == value.code
    assert_same_array(arr, second, "second")


def test_several_large_arrays_each_get_an_aligned_buffer(pipe, state_dir):
    """Large arrays anywhere in a value (nested in tuples and objects) each get an aligned buffer."""
    b = np.arange(33_333, dtype=np.int32)[::-1]
    value = {"a": np.arange(20_000.0), "small": np.arange(3), "b": (Item("i", None, {"arr": b}),)}
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert_same(value, second)
    assert_same(value, loaded)
    header, _, spans = _out_of_band_spans(state_dir / f"{STEP}.msgpack")
    assert [160_000, 133_332] == [size for _, size in header["buffers"]]
    assert [0, 0] == [offset % 64 for offset, _ in spans]
    assert [value["a"].tobytes(), b.tobytes()] == [raw for _, raw in spans]


def test_array_larger_than_one_bin_is_split(pipe, state_dir, monkeypatch):
    """An array over the msgpack bin limit is split over several aligned bins and joined back."""
    monkeypatch.setattr(_codec_arrays, "_MAX_BIN", 100_000)
    arr = np.arange(40_000, dtype=np.float64)  # 320,000 bytes: 4 bins
    second, loaded = round_trip(state_dir, arr, pipeline=pipe)
    assert_same_array(arr, second, "second")
    assert_same_array(arr, loaded, "loaded")
    header, _, spans = _out_of_band_spans(state_dir / f"{STEP}.msgpack")
    assert [100_000, 100_000, 100_000, 20_000] == [size for _, size in header["buffers"]]
    assert [0, 0, 0, 0] == [offset % 64 for offset, _ in spans]
    assert arr.tobytes() == b"".join(raw for _, raw in spans)


# --------------------------------------------------------------------------------------
# the file format


def test_any_msgpack_reader_reads_header_then_value(pipe, state_dir):
    """A plain msgpack.Unpacker over the file yields the header map, then the value, then nothing."""
    value = {"rows": [1, 2, 3], "name": "x"}
    producer = Producer(state_dir, value)
    producer.run(pipe)
    with producer.path.open("rb") as f:
        objects = list(msgpack.Unpacker(f, raw=False))
    assert 2 == len(objects)
    header, stored = objects
    assert HEADER_KEYS <= set(header)
    assert value == stored


def test_header_fields(pipe, state_dir):
    """Header: format 1, slot, the manifest's fingerprint, UTC created_at, checksum, size, hsum."""
    producer = Producer(state_dir, [1, "two", 3.0])
    producer.run(pipe)
    data = producer.path.read_bytes()
    header, head_len = read_header(producer.path)
    fingerprint = pipe.status().steps[STEP].fingerprint
    assert (1, STEP, fingerprint) == (header["format"], header["slot"], header["fingerprint"])
    created = dt.datetime.fromisoformat(header["created_at"])
    assert header["created_at"].endswith("Z")
    assert dt.timedelta(0) == created.utcoffset()
    assert abs(dt.datetime.now(dt.UTC) - created) < dt.timedelta(minutes=5)
    assert "msgpack" == header["encoding"]
    assert "blake3:" + blake3.blake3(data[head_len:]).hexdigest() == header["checksum"]
    assert len(data) - head_len == header["size"]
    assert [] == header["buffers"]
    assert "hsum" == list(header)[-1]  # last, so it can cover the packed header bytes before it
    assert blake3.blake3(data[: head_len - 34]).hexdigest()[:32] == header["hsum"]
    assert "mac" not in header
    assert len(data) == pipe.status().steps[STEP].bytes


def test_output_file_is_private(pipe, state_dir):
    """The stored output is readable by its owner only (0600)."""
    producer = Producer(state_dir, "secret data")
    producer.run(pipe)
    assert 0o600 == stat.S_IMODE(producer.path.stat().st_mode)


ENCODINGS = {
    "plain": ({"a": [1, 2]}, "msgpack"),
    "numpy": (np.arange(3), "msgpack"),
    "opaque object": (Opaque(1), "msgpack+pickle"),
    "nested opaque": ({"a": [1, Opaque(2)]}, "msgpack+pickle"),
    "object array": (np.array([1, "a"], dtype=object), "msgpack+pickle"),
    "dict subclass": (collections.OrderedDict(a=1), "msgpack+pickle"),
    "period series": (pd.Series(pd.period_range("2020", periods=2, freq="M")), "msgpack+pickle"),
}


@pytest.mark.parametrize(("value", "encoding"), list(ENCODINGS.values()), ids=list(ENCODINGS))
def test_encoding_names_the_pickle_fallback_only_when_used(pipe, state_dir, value, encoding):
    """Header `encoding` is msgpack+pickle exactly when cloudpickle was needed."""
    producer = Producer(state_dir, value)
    producer.run(pipe)
    assert encoding == read_header(producer.path)[0]["encoding"]


def test_set_encoding_does_not_depend_on_hash_seed():
    """The stored bytes of sets and frozensets are identical across PYTHONHASHSEED values."""
    program = textwrap.dedent(
        """
        import hashlib
        from resumable._codec import encode
        value = {"s": {f"item{i}" for i in range(50)}, "f": frozenset({"x", "y", ("t", "u")}), "n": {1.5, "a", b"b"}}
        print(hashlib.sha256(encode(value, allow_pickle=False).body).hexdigest())
        """
    )
    outputs = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=True
        )
        outputs.add(done.stdout.strip())
    assert 1 == len(outputs)


def test_equal_sets_built_differently_encode_identically():
    """A set's encoding is independent of its insertion order."""
    items = [f"k{i}" for i in range(200)] + list(range(50))
    backward: set[object] = set()
    for item in reversed(items):
        backward.add(item)
    forward = _codec.encode(set(items), allow_pickle=False).body
    assert forward == _codec.encode(backward, allow_pickle=False).body
    assert forward != _codec.encode(frozenset(items), allow_pickle=False).body  # its own ext type


def test_large_output_logs_a_warning(pipe, state_dir, monkeypatch, caplog):
    """An output over the size limit is stored, with a warning naming the step and the size."""
    monkeypatch.setattr("resumable._session.LARGE_OUTPUT", 1000)
    with caplog.at_level(logging.WARNING, logger="resumable"):
        Producer(state_dir, b"x" * 5000).run(pipe)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 == len(messages)
    assert "'produce'" in messages[0]
    assert "KB" in messages[0]


# --------------------------------------------------------------------------------------
# pickle fallback and allow_pickle=False


def test_unknown_object_falls_back_to_pickle(pipe, state_dir):
    """With allow_pickle=True (default) an unknown object is pickled and comes back equal."""
    value = {"a": [1, Opaque({"x": 1})]}
    second, loaded = round_trip(state_dir, value, pipeline=pipe)
    assert value == second
    assert value == loaded
    assert "msgpack+pickle" == read_header(state_dir / f"{STEP}.msgpack")[0]["encoding"]


def test_no_pickle_output_raises_before_overwriting(state_dir):
    """allow_pickle=False: a pickle-only output raises SerializationError naming step and path; file untouched."""
    producer = Producer(state_dir, {"a": [1, 2]}, allow_pickle=False)
    producer.run()
    before = producer.path.read_bytes()
    producer.value = {"a": [1, Opaque(2)]}
    with pytest.raises(SerializationError) as info:
        producer.run(token=1)
    assert "produce" == info.value.step
    assert "output['a'][1]" == info.value.where
    assert "strategies.Opaque" == info.value.type_name
    assert "'produce'" in str(info.value)
    assert "output['a'][1]" in str(info.value)
    assert before == producer.path.read_bytes()
    assert 2 == producer.calls


def test_no_pickle_output_error_names_path_in_objects(state_dir):
    """The offending path goes through dict keys, tuples and attrs/dataclass fields."""
    cases = {
        "output['k'][0].extra['deep']": {"k": (Item("i", None, {"deep": Opaque(1)}),)},
        "output.x": Point(Opaque(1), 0.0),
        "output[2]": [1, 2, Opaque(3)],
    }
    found = {}
    for expected, value in cases.items():
        with pytest.raises(SerializationError) as info:
            _codec.encode(value, allow_pickle=False)
        found[expected] = info.value.where
    assert {k: k for k in cases} == found


@pytest.fixture
def stored_first(state_dir):
    """A producer whose first run stored a plain value."""
    producer = Producer(state_dir, [1, 2, 3])
    producer.run()
    return producer


def _generator():
    yield 1


UNSTORABLE = {
    "generator": lambda: {"rows": _generator()},
    "generator expression": lambda: [1, (x for x in range(3))],
    "lock": threading.Lock,
}


@pytest.mark.parametrize("make", list(UNSTORABLE.values()), ids=list(UNSTORABLE))
def test_unstorable_output_raises_even_with_pickles(stored_first, make):
    """Generators and unpicklable objects raise SerializationError with pickles allowed; file untouched."""
    before = stored_first.path.read_bytes()
    stored_first.value = make()
    with pytest.raises(SerializationError) as info:
        stored_first.run(token=1)
    assert "produce" == info.value.step
    assert info.value.where.startswith("output")
    assert before == stored_first.path.read_bytes()
    assert 2 == stored_first.calls


def test_socket_output_raises_even_with_pickles(stored_first):
    """A socket cannot be stored, pickles allowed or not; the message names its path and type."""
    before = stored_first.path.read_bytes()
    with socket.socket() as sock:
        stored_first.value = {"conn": sock}
        with pytest.raises(SerializationError) as info:
            stored_first.run(token=1)
    assert ("output['conn']", "socket.socket") == (info.value.where, info.value.type_name)
    assert before == stored_first.path.read_bytes()


def test_self_containing_output_raises(stored_first):
    """A list containing itself is a SerializationError naming the step, not a crash."""
    loop: list[Any] = [1]
    loop.append(loop)
    stored_first.value = loop
    with pytest.raises(SerializationError, match="produce"):
        stored_first.run(token=1)
    assert [1, 2, 3] == resumable.load(stored_first.path)


def test_pickled_file_is_refused_without_pickles(state_dir, monkeypatch):
    """allow_pickle=False never unpickles: load() raises, the step recomputes with a warning."""
    producer = Producer(state_dir, {"obj": Opaque(1)})
    producer.run()
    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(a))
    with pytest.raises(SerializationError, match="allow_pickle=False"):
        resumable.load(producer.path, allow_pickle=False)
    producer.value = {"obj": "plain"}
    with pytest.warns(ResumableWarning, match="pickle"):
        second = producer.run(allow_pickle=False)
    assert {"obj": "plain"} == second
    assert (2, "corrupt") == (producer.calls, producer.reason)
    assert [] == unpickled
    assert "msgpack" == read_header(producer.path)[0]["encoding"]


# --------------------------------------------------------------------------------------
# decoding never imports a module named in the data

MODULE_SOURCE = """
import dataclasses, enum
import attrs

@attrs.define
class Thing:
    n: int

class Shade(enum.Enum):
    DARK = 1

@dataclasses.dataclass
class Box:
    item: object

class Plain:
    def __init__(self, n):
        self.n = n
"""

WRITER = """
import sys
sys.path.insert(0, sys.argv[1])
import {module} as mod
from resumable import Pipeline

for name, value in [("thing", mod.Thing(1)), ("shade", mod.Shade.DARK), ("box", [mod.Box(2)]), ("plain", mod.Plain(3))]:
    with Pipeline("writer", state_dir=sys.argv[2]) as pipe:
        pipe.step(name=name)(lambda: value)()
"""


def test_decoding_never_imports_modules(tmp_path, monkeypatch):
    """Values of classes from a module not imported here are refused, and the module stays unimported."""
    module = f"unimported_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{module}.py").write_text(MODULE_SOURCE)
    state = tmp_path / "state"
    writer = WRITER.format(module=module)
    subprocess.run([sys.executable, "-c", writer, str(tmp_path), str(state)], check=True, capture_output=True)
    monkeypatch.syspath_prepend(str(tmp_path))  # importing it would succeed: it must not happen
    messages = {}
    for name in ("thing", "shade", "box"):
        with pytest.raises(SerializationError) as info:
            resumable.load(state / f"{name}.msgpack")
        messages[name] = str(info.value)
    assert module not in sys.modules
    assert all(f"module {module!r} is not imported" in m for m in messages.values()), messages
    assert "msgpack+pickle" == read_header(state / "plain.msgpack")[0]["encoding"]
    with pytest.raises(SerializationError, match="pickle"):
        resumable.load(state / "plain.msgpack", allow_pickle=False)
    assert module not in sys.modules
    try:
        plain = resumable.load(state / "plain.msgpack")  # a pickle, allowed: the one exception
        assert (module, 3) == (type(plain).__module__, plain.n)
    finally:
        sys.modules.pop(module, None)


def _evolving(monkeypatch: pytest.MonkeyPatch, **classes: type) -> types.ModuleType:
    """A module named ``evolving`` in sys.modules holding *classes* under their names."""
    module = types.ModuleType("evolving")
    for name, cls in classes.items():
        cls.__module__, cls.__qualname__ = "evolving", name
        setattr(module, name, cls)
    monkeypatch.setitem(sys.modules, "evolving", module)
    return module


def test_changed_classes_are_refused(monkeypatch, tmp_path):
    """A stored value whose class changed (fields, members, kind) or vanished is refused, not guessed."""
    record = dataclasses.make_dataclass("Record", ["a"])
    level = enum.Enum("Level", {"LOW": 1, "HIGH": 2})
    module = _evolving(monkeypatch, Record=record, Level=level)
    paths = {}
    for name, value in {"record": module.Record(1), "level": module.Level.HIGH}.items():
        chunks = _codec.frame(_codec.encode(value, allow_pickle=False), {"slot": name}).chunks()
        paths[name] = tmp_path / f"{name}.msgpack"
        paths[name].write_bytes(b"".join(bytes(c) for c in chunks))
    assert (1, module.Level.HIGH) == (resumable.load(paths["record"]).a, resumable.load(paths["level"]))
    changes = {
        "fields of evolving.Record changed": dataclasses.make_dataclass("Record", ["a", "b"]),
        "names evolving.Record, which is not a dataclass class": type("Record", (), {}),
    }
    found = []
    for expected, replacement in changes.items():
        _evolving(monkeypatch, Record=replacement, Level=level)
        with pytest.raises(SerializationError, match=expected):
            resumable.load(paths["record"])
        found.append(expected)
    _evolving(monkeypatch, Level=enum.Enum("Level", {"LOW": 1}))
    with pytest.raises(SerializationError, match="no member with value 2"):
        resumable.load(paths["level"])
    with pytest.raises(SerializationError, match="no longer exists"):
        resumable.load(paths["record"])
    assert 2 == len(found)


def test_local_classes_survive_a_rerun(state_dir):
    """Instances of classes defined in a function are stored so that a rerun can read them back."""

    @dataclasses.dataclass
    class Local:
        n: int

    class Mood(enum.Enum):
        HAPPY = 1

    value = {"local": Local(1), "mood": Mood.HAPPY}
    producer = Producer(state_dir, value)
    producer.run()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        second = producer.run()
    assert [] == [str(w.message) for w in caught]
    assert (1, value) == (producer.calls, second)


# --------------------------------------------------------------------------------------
# integrity: damaged, truncated, tampered files


@pytest.fixture
def small_file(state_dir):
    """A producer whose stored output is a small file (a few hundred bytes), and its bytes."""
    producer = Producer(state_dir, {"a": [1, 2.5, "x"], "t": (1, 2), "s": {3}}, durable=False)
    producer.run()
    return producer, producer.path.read_bytes()


@pytest.mark.parametrize("mask", [0x01, 0x02, 0x80, 0xFF])
def test_load_detects_every_flipped_byte(small_file, tmp_path, mask):
    """Flipping any single byte (header or value) makes load() raise SerializationError."""
    _, good = small_file
    path = tmp_path / "damaged.msgpack"
    missed: dict[str, list[int]] = {}  # what happened instead: offsets
    for offset in range(len(good)):
        path.write_bytes(flipped(good, offset, mask))
        try:
            resumable.load(path)
        except SerializationError:
            continue
        except Exception as exc:
            missed.setdefault(type(exc).__name__, []).append(offset)
        else:
            missed.setdefault("returned a value", []).append(offset)
    assert {} == missed


@pytest.mark.parametrize("mask", [0x02, 0xFF])
def test_step_recomputes_on_every_flipped_byte(small_file, mask):
    """Any single damaged byte: the step warns, recomputes (reason `corrupt`) and rewrites a good file."""
    producer, good = small_file
    wrong: dict[str, list[int]] = {}  # (reason, runs, warnings) instead of a warned recompute: offsets
    for offset in range(len(good)):
        producer.path.write_bytes(flipped(good, offset, mask))
        calls = producer.calls
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                result = producer.run()
            except Exception as exc:
                wrong.setdefault(type(exc).__name__, []).append(offset)
                continue
        outcome = (producer.reason, producer.calls - calls, [w.category for w in caught], result)
        if outcome != ("corrupt", 1, [ResumableWarning], producer.value):
            wrong.setdefault(repr(outcome[:3]), []).append(offset)
    assert {} == wrong
    assert_same(producer.value, resumable.load(producer.path))


def test_damage_in_padding_and_raw_buffer_is_detected(state_dir):
    """Bytes of the alignment padding and of an out-of-band buffer are covered by the checksum."""
    producer = Producer(state_dir, np.arange(20_000.0), durable=False)
    producer.run()
    good = producer.path.read_bytes()
    header, _ = read_header(producer.path)
    pad, size = header["buffers"][0]
    raw_start = len(good) - size
    offsets = [
        raw_start - 5 - pad,
        raw_start - 5,
        raw_start - 1,
        raw_start,
        raw_start + size // 2,
        len(good) - 1,
    ]
    refused = 0
    for offset in offsets:
        producer.path.write_bytes(flipped(good, offset, 0x10))
        with pytest.raises(SerializationError):
            resumable.load(producer.path)
        refused += 1
    producer.path.write_bytes(flipped(good, raw_start + 8, 0x10))
    with pytest.warns(ResumableWarning, match="checksum"):
        result = producer.run()
    assert (len(offsets), 2, "corrupt") == (refused, producer.calls, producer.reason)
    assert_same_array(producer.value, result, "result")


def test_load_detects_every_truncation(small_file, tmp_path):
    """A file cut at any length is refused by load()."""
    _, good = small_file
    path = tmp_path / "cut.msgpack"
    missed = []
    for length in range(len(good)):
        path.write_bytes(good[:length])
        try:
            resumable.load(path)
        except SerializationError:
            continue
        missed.append(length)
    assert [] == missed


def test_step_recomputes_truncated_file(small_file):
    """A truncated output is recomputed with a warning (reason `corrupt`) at several cut points."""
    producer, good = small_file
    head_len = read_header(producer.path)[1]
    cuts = [0, 1, head_len - 1, head_len, len(good) - 1]
    reasons = []
    for length in cuts:
        producer.path.write_bytes(good[:length])
        with pytest.warns(ResumableWarning, match="recomputed"):
            producer.run()
        reasons.append(producer.reason)
    assert ["corrupt"] * len(cuts) == reasons
    assert 1 + len(cuts) == producer.calls
    assert_same(producer.value, resumable.load(producer.path))


def test_trailing_bytes_are_detected(small_file):
    """Bytes appended after the value make the file invalid."""
    producer, good = small_file
    producer.path.write_bytes(good + b"\xc0")
    with pytest.raises(SerializationError, match="trailing"):
        resumable.load(producer.path)


def test_not_an_output_file_is_refused(tmp_path):
    """Random bytes, an empty file and a msgpack value without header are refused by load()."""
    path = tmp_path / "x.msgpack"
    refused = 0
    for data in (b"", b"\x00\x01garbage", msgpack.packb({"format": 1}), msgpack.packb([1, 2])):
        path.write_bytes(data)
        with pytest.raises(SerializationError, match=r"x\.msgpack"):
            resumable.load(path)
        refused += 1
    assert 4 == refused


# --------------------------------------------------------------------------------------
# authentication


def run_refused(producer: Producer, **options: Any) -> list[str]:
    """
    Run *producer* expecting its stored output to fail authentication; return the warnings.

    With another secret the journal's lines are not authentic either, which is warned about
    separately: only the output file's warning is required here.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        producer.run(**options)
    messages = [str(w.message) for w in caught if w.category is ResumableWarning]
    assert len(messages) == len(caught)
    assert [m for m in messages if f"{STEP}.msgpack" in m and "authentication failed" in m], messages
    return messages


def test_file_from_another_secret_is_refused(state_dir):
    """With secret=, a file written with another secret is refused and recomputed."""
    producer = Producer(state_dir, {"v": 1}, durable=False)
    producer.run(secret=KEY_ONE)
    assert "mac" in read_header(producer.path)[0]
    assert {"v": 1} == resumable.load(producer.path, secret=KEY_ONE)
    with pytest.raises(SerializationError, match="authentication failed"):
        resumable.load(producer.path, secret=KEY_TWO)
    run_refused(producer, secret=KEY_TWO)
    assert (2, "corrupt") == (producer.calls, producer.reason)
    assert {"v": 1} == resumable.load(producer.path, secret=KEY_TWO.encode())


def test_file_without_mac_is_refused_with_a_secret(state_dir):
    """A file written without a secret is refused (and recomputed) once a secret is set."""
    producer = Producer(state_dir, {"v": 1}, durable=False)
    producer.run()
    assert "mac" not in read_header(producer.path)[0]
    with pytest.raises(SerializationError, match="authentication failed"):
        resumable.load(producer.path, secret=KEY_ONE)
    run_refused(producer, secret=KEY_ONE)
    assert (2, "corrupt") == (producer.calls, producer.reason)
    assert "mac" in read_header(producer.path)[0]


def test_tampered_file_with_fixed_checksums_is_refused(state_dir):
    """A forged file, consistent in every checksum but signed without the key, is refused."""
    producer = Producer(state_dir, {"amount": 10}, secret=KEY_ONE)
    producer.run()
    header, _ = read_header(producer.path)
    meta = {k: header[k] for k in ("slot", "step", "key", "fingerprint", "identity", "code", "args")}
    encoded = _codec.encode({"amount": 10_000}, allow_pickle=False)
    chunks = _codec.frame(encoded, meta, secret=KEY_TWO.encode()).chunks()
    producer.path.write_bytes(b"".join(bytes(c) for c in chunks))
    with pytest.raises(SerializationError, match="authentication failed"):
        resumable.load(producer.path, secret=KEY_ONE)
    assert {"amount": 10_000} == resumable.load(producer.path, secret=KEY_TWO)  # otherwise consistent
    run_refused(producer)
    assert ({"amount": 10}, 2) == (resumable.load(producer.path, secret=KEY_ONE), producer.calls)


def test_pickled_file_with_wrong_secret_is_never_unpickled(state_dir, monkeypatch):
    """A pickled file failing authentication is refused before anything is unpickled."""
    producer = Producer(state_dir, Opaque(1), secret=KEY_ONE)
    producer.run()
    unpickled = []
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: unpickled.append(a))
    with pytest.raises(SerializationError):
        resumable.load(producer.path, secret=KEY_TWO)
    producer.value = Opaque(2)
    run_refused(producer, secret=KEY_TWO)
    assert [] == unpickled
    assert 2 == producer.calls


def test_secret_from_environment(state_dir, monkeypatch):
    """$RESUMABLE_SECRET is the HMAC key when no secret= is given, for writing and reading."""
    monkeypatch.setenv("RESUMABLE_SECRET", ENV_KEY)
    producer = Producer(state_dir, [1, 2])
    producer.run()
    header, _ = read_header(producer.path)
    unsigned = {k: v for k, v in header.items() if k != "mac"}
    expected = (
        "hmac-sha256:" + hmac.new(ENV_KEY.encode(), msgpack.packb(unsigned), hashlib.sha256).hexdigest()
    )
    assert expected == header["mac"]
    assert [1, 2] == resumable.load(producer.path)
    monkeypatch.setenv("RESUMABLE_SECRET", "other-key")
    with pytest.raises(SerializationError, match="authentication failed"):
        resumable.load(producer.path)
    assert [1, 2] == resumable.load(producer.path, secret=ENV_KEY)
    run_refused(producer)
    assert (2, "corrupt") == (producer.calls, producer.reason)


def test_large_values_are_checksummed_like_any_other(tmp_path):
    """A 16 MB value carries a BLAKE3 checksum, verified like any other (damage included)."""
    arr = np.arange(2_000_000, dtype=np.float64)  # 16 MB
    with Pipeline(state_dir=tmp_path / "state") as pipe:

        @pipe.step(name="huge")
        def huge() -> np.ndarray:
            return arr

        huge()
    path = tmp_path / "state" / "huge.msgpack"
    with path.open("rb") as f:
        header = next(iter(msgpack.Unpacker(f, raw=False, strict_map_key=False)))
    assert header["checksum"].startswith("blake3:")
    assert np.array_equal(arr, resumable.load(path))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(resumable.SerializationError, match="checksum mismatch"):
        resumable.load(path)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=4_102_444_800 * 10**9), min_size=1, max_size=6))
def test_timestamps_are_the_utc_time_to_the_millisecond(moments: list[int]) -> None:
    """utcnow, which formats each second once, gives what datetime gives, in any order of calls."""
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    for ns in moments + [ns + 999_999 for ns in moments]:
        with mock.patch.object(_codec.time, "time_ns", return_value=ns):
            got = _codec.utcnow()
        moment = epoch + dt.timedelta(microseconds=ns // 1000)
        assert moment.isoformat(timespec="milliseconds").replace("+00:00", "Z") == got


def test_an_encoder_is_freed_once_its_value_is_packed():
    """Its packers (and their buffers) go at once, not at the next garbage collection."""
    gc.disable()
    try:
        encoder = _codec_types.Encoder(allow_pickle=False)
        gone = weakref.ref(encoder)
        encoder.pack([1, (2, 3), {"a": dt.date(2024, 1, 1)}])  # ext payloads are packed one level down
        del encoder
        assert gone() is None
    finally:
        gc.enable()


def test_stand_ins_decode_nested_objects_once(tmp_path, monkeypatch):
    """Objects of a module not imported (the CLI's show and verify) are unpacked once each, however deep."""
    from resumable import _codec_types
    from resumable._codec import encode, frame, read_verified

    (tmp_path / "nested_nodes.py").write_text(
        "import dataclasses\n\n@dataclasses.dataclass\nclass Node:\n    v: int\n    child: object\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import nested_nodes  # type: ignore[import-not-found]

    node = None
    for i in range(12):
        node = nested_nodes.Node(i, node)
    data = bytearray(b"".join(frame(encode(node, allow_pickle=False), {"slot": "x"}).chunks()))
    monkeypatch.delitem(sys.modules, "nested_nodes")  # as in the CLI: the user's module is not imported
    unpacked = []
    real = _codec_types.Decoder.unpack

    def counting(self, body):
        unpacked.append(len(body))
        return real(self, body)

    monkeypatch.setattr(_codec_types.Decoder, "unpack", counting)
    read_verified(data, None).check_decodes()
    assert len(unpacked) <= 13 + 1  # the value, and each object's fields once (it was 2**12)
