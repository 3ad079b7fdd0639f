"""
Argument digests (_fingerprint): equal arguments give equal digests in every process,
different ones different digests; unsupported arguments are a clear FingerprintError;
outputs of earlier steps are fingerprinted by their stored checksum (provenance).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as dt
import enum
import gc
import io
import math
import os
import runpy
import socket
import subprocess
import sys
import threading
import uuid
import weakref
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path, PosixPath, PurePosixPath
from typing import Any
from zoneinfo import ZoneInfo

import attrs
import blake3
import msgpack
import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import (
    Color,
    Coord,
    Fingerprinted,
    Frozen,
    Item,
    Outer,
    Perm,
    Point,
    User,
    arguments,
    fingerprintable,
    hashable_scalars,
    numpy_arrays,
)

from resumable import FingerprintError, Pipeline, _codec, _fingerprint
from resumable._fingerprint import (
    StoredOutput,
    digest_parameters,
    digest_value,
    is_fingerprintable,
    provenance,
)

TESTS = Path(__file__).resolve().parent


def digest_arguments(step: str, arguments: dict[str, Any], ignore: frozenset[str]) -> str:
    """The digest of a step's arguments (minus *ignore*)."""
    return digest_parameters(step, arguments, ignore)[0]


def digest(value: object, name: str = "x") -> str:
    """The argument digest of a one-parameter step called with *value*."""
    return digest_arguments("step", {name: value}, frozenset())


def stored_digest(value: object) -> str | None:
    """The stored digest *value* is known by as a step output with no digest of its own, if any."""
    found = provenance.check(value)
    return found[1] if found is not None and found[0] else None


def _fields(value: Any) -> tuple[Any, ...]:
    tp = type(value)
    fields = attrs.fields(tp) if attrs.has(tp) else dataclasses.fields(tp)
    return (tp.__qualname__, tuple((f.name, canonical(getattr(value, f.name))) for f in fields))


_CANONICAL: list[tuple[Callable[[Any], bool], Callable[[Any], Any]]] = [
    (lambda v: type(v) in {set, frozenset}, lambda v: ("set", frozenset(canonical(x) for x in v))),
    (
        lambda v: type(v) is dict,
        lambda v: ("dict", frozenset((canonical(k), canonical(x)) for k, x in v.items())),
    ),
    (lambda v: type(v) in {list, tuple}, lambda v: (type(v).__name__, tuple(canonical(x) for x in v))),
    (lambda v: type(v) is float, lambda v: ("float", v.hex())),
    (lambda v: type(v) is complex, lambda v: ("complex", v.real.hex(), v.imag.hex())),
    (
        lambda v: type(v) in {dt.datetime, dt.time},
        lambda v: (type(v).__name__, v.isoformat(), getattr(v.tzinfo, "key", None), v.fold),
    ),
    (
        lambda v: type(v) in {Decimal, PurePosixPath, PosixPath},
        lambda v: ("text", type(v) is Decimal, str(v)),
    ),
    (lambda v: isinstance(v, np.generic), lambda v: ("numpy", v.dtype.str, v.tobytes())),
    (lambda v: isinstance(v, enum.Enum), lambda v: ("enum", type(v).__qualname__, canonical(v.value))),
    (lambda v: type(v) is Fingerprinted, lambda v: ("fingerprint", canonical(v.key))),
    (lambda v: attrs.has(type(v)) or dataclasses.is_dataclass(type(v)), _fields),
]


def canonical(value: Any) -> Any:
    """What makes two arguments the same: type, exact bits, contents (order-free for dicts and sets)."""
    make = next((make for test, make in _CANONICAL if test(value)), lambda v: (type(v).__name__, v))
    return make(value)


#: fingerprintable values without NumPy arrays, whose digest collisions are tested apart
plain_values = st.recursive(
    st.one_of(hashable_scalars, st.builds(Fingerprinted, hashable_scalars)),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(st.text() | st.integers(), children, max_size=3),
        st.frozensets(hashable_scalars, max_size=3),
        st.builds(Point, st.integers(), st.floats(allow_nan=False)),
        st.builds(Item, st.text(), st.none(), st.dictionaries(st.text(), children, max_size=2)),
    ),
    max_leaves=8,
)


# --------------------------------------------------------------------------------------
# equal arguments, equal digests; different arguments, different digests


@given(value=fingerprintable)
def test_equal_arguments_give_equal_digests(value):
    """Property: a deep copy of any fingerprintable value has the same digest."""
    assert digest(value) == digest(copy.deepcopy(value))


@given(args=arguments)
def test_digest_is_a_short_hex_string(args):
    """Property: digest_arguments returns 32 lowercase hex characters, the same on every call."""
    first = digest_arguments("step", args, frozenset())
    assert 32 == len(first)
    assert set(first) <= set("0123456789abcdef")
    assert first == digest_arguments("step", args, frozenset())


@given(data=st.dictionaries(st.text() | st.integers(), fingerprintable, max_size=6))
def test_dict_insertion_order_is_irrelevant(data):
    """Property: a dict with the same items in another order has the same digest."""
    assert digest(data) == digest(dict(reversed(data.items())))


@given(items=st.lists(hashable_scalars, max_size=8, unique=True), seed=st.randoms(use_true_random=False))
def test_set_order_is_irrelevant(items, seed):
    """Property: sets and frozensets built in any order have the same digest."""
    shuffled = list(items)
    seed.shuffle(shuffled)
    assert digest(set(items)) == digest(set(shuffled))
    assert digest(frozenset(items)) == digest(frozenset(reversed(shuffled)))


@given(a=plain_values, b=plain_values)
def test_digests_are_equal_exactly_when_values_are(a, b):
    """Property: two values get the same digest if and only if they are the same (type, bits, contents)."""
    assert (canonical(a) == canonical(b)) == (digest(a) == digest(b))


@given(value=plain_values)
def test_wrapping_a_value_changes_its_digest(value):
    """Property: a value, a list of it, a tuple of it and a dict holding it all differ."""
    digests = {digest(value), digest([value]), digest((value,)), digest({"k": value})}
    assert 4 == len(digests)


@pytest.mark.parametrize(
    "value",
    [
        [],
        (),
        [1, "a", b"b", 2.5, None, True],
        (3, 4),
        list(range(5000)),
        [2**70, 1],
        ["\udcff"],
        [-(2**63), 2**64 - 1],
    ],
)
def test_plain_sequences_digest_as_any_value(value):
    """Lists and tuples of plain scalars: digest_value is the walk's digest, and wrapping them changes it."""
    feeder = _fingerprint._Feeder()
    feeder.feed(value)
    assert digest_value(value) == feeder.digest().hex()
    assert digest_value([value]) != digest_value(value)


def test_parameter_names_and_step_order_matter():
    """The same value under another parameter name, or arguments swapped, give other digests."""
    assert digest(1, "x") != digest(1, "y")
    swapped = digest_arguments("s", {"a": 1, "b": 2}, frozenset()) != digest_arguments(
        "s", {"a": 2, "b": 1}, frozenset()
    )
    assert swapped


STABLE_PROGRAM = """
import datetime as dt, sys
if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])  # the tests directory, for strategies
from decimal import Decimal
from pathlib import PurePosixPath
from zoneinfo import ZoneInfo
import numpy as np
from strategies import Color, Point, Item
from resumable._fingerprint import digest_parameters

def value():
    return {
        "tags": {f"tag{i}" for i in range(40)},
        "frozen": frozenset({"a", "b", ("c", "d")}),
        "meta": {f"k{i}": {"v": i, "s": {str(i), "x"}} for i in range(20)},
        "objects": [Point(1, 2.5), Item("i", None, {"z": {"q"}}), Color.BLUE],
        "misc": (Decimal("1.10"), PurePosixPath("a/b"), dt.datetime(2024, 3, 1, tzinfo=ZoneInfo("Asia/Tokyo")), 2**100),
        "array": np.arange(12, dtype=np.int32).reshape(3, 4).T,
    }

DIGEST = digest_parameters("stable", {"config": value(), "n": 3}, frozenset())[0]
if __name__ == "__main__":
    print(DIGEST)
"""


def test_digest_is_stable_across_processes_and_hash_seeds(tmp_path):
    """The digest of str sets and dicts is the same under PYTHONHASHSEED=1, =2 and in this process."""
    program = tmp_path / "stable.py"
    program.write_text(STABLE_PROGRAM)
    digests = {"here": runpy.run_path(str(program), run_name="stable")["DIGEST"]}
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, str(program), str(TESTS)], env=env, capture_output=True, text=True, check=True
        )
        digests[seed] = done.stdout.strip()
    assert {digests["here"]} == set(digests.values())


# --------------------------------------------------------------------------------------
# every supported type


def _ambiguous(fold: int) -> dt.datetime:
    return dt.datetime(2024, 10, 27, 2, 30, fold=fold, tzinfo=ZoneInfo("Europe/Paris"))


class Label(str):
    """A str subclass: hashed as a str, distinct from a plain str."""

    __slots__ = ()


SUPPORTED = {
    "none vs false": (lambda: None, lambda: False),
    "bool vs int": (lambda: True, lambda: 1),
    "int": (lambda: 1, lambda: 2),
    "big int": (lambda: 2**100, lambda: 2**100 + 1),
    "float": (lambda: 0.1, lambda: math.nextafter(0.1, 1)),
    "negative zero": (lambda: 0.0, lambda: -0.0),
    "int vs float": (lambda: 1, lambda: 1.0),
    "complex": (lambda: 1 + 2j, lambda: 1 - 2j),
    "str": (lambda: "abc", lambda: "abd"),
    "str vs bytes": (lambda: "abc", lambda: b"abc"),
    "bytes": (lambda: b"\x00", lambda: b"\x00\x00"),
    "bytearray": (lambda: bytearray(b"ab"), lambda: bytearray(b"ba")),
    "list vs tuple": (lambda: [1, 2], lambda: (1, 2)),
    "list order": (lambda: [1, 2], lambda: [2, 1]),
    "nested list boundaries": (lambda: [[1], [2, 3]], lambda: [[1, 2], [3]]),
    "dict": (lambda: {"a": 1}, lambda: {"a": 2}),
    "dict key vs value": (lambda: {"a": "b"}, lambda: {"b": "a"}),
    "set": (lambda: {1, 2}, lambda: {1, 3}),
    "frozenset": (lambda: frozenset({"a"}), lambda: frozenset({"a", "b"})),
    "datetime naive": (lambda: dt.datetime(2024, 1, 1), lambda: dt.datetime(2024, 1, 1, 0, 0, 0, 1)),
    "datetime utc vs naive": (
        lambda: dt.datetime(2024, 1, 1, tzinfo=dt.UTC),
        lambda: dt.datetime(2024, 1, 1),
    ),
    "datetime zoneinfo vs fixed offset": (
        lambda: dt.datetime(2024, 1, 1, tzinfo=ZoneInfo("Europe/Paris")),
        lambda: dt.datetime(2024, 1, 1, tzinfo=dt.timezone(dt.timedelta(hours=1))),
    ),
    "datetime fold": (lambda: _ambiguous(0), lambda: _ambiguous(1)),
    "date": (lambda: dt.date(2024, 1, 1), lambda: dt.date(2024, 1, 2)),
    "time": (lambda: dt.time(1, 2, 3), lambda: dt.time(1, 2, 4)),
    "time tz": (lambda: dt.time(1, tzinfo=dt.UTC), lambda: dt.time(1)),
    "timedelta": (lambda: dt.timedelta(days=1), lambda: dt.timedelta(hours=24, microseconds=1)),
    "decimal": (lambda: Decimal("1.5"), lambda: Decimal("1.6")),
    "uuid": (lambda: uuid.UUID(int=1), lambda: uuid.UUID(int=2)),
    "pure posix path": (lambda: PurePosixPath("a/b"), lambda: PurePosixPath("a/c")),
    "posix path": (lambda: PosixPath("/tmp/a"), lambda: PosixPath("/tmp/b")),
    "path vs str": (lambda: PurePosixPath("a"), lambda: "a"),
    "enum": (lambda: Color.RED, lambda: Color.GREEN),
    "enum vs its value": (lambda: Color.RED, lambda: "red"),
    "int flag": (lambda: Perm.R | Perm.W, lambda: Perm.R),
    "attrs": (lambda: Item("a", Point(1, 2.0)), lambda: Item("a", Point(1, 2.5))),
    "attrs private field": (lambda: Coord(1.0, 2.0), lambda: Coord(1.0, 3.0)),
    "dataclass": (lambda: Point(1, 2.0), lambda: Point(2, 2.0)),
    "frozen dataclass": (lambda: Frozen("a", ("b",)), lambda: Frozen("a", ("c",))),
    "dataclass vs other dataclass": (lambda: Outer.Inner(1), lambda: Point(1, 0.0)),
    "pydantic": (lambda: User(name="a", tags=["x"]), lambda: User(name="a", tags=["y"])),
    "numpy values": (lambda: np.arange(5), lambda: np.arange(1, 6)),
    "numpy dtype": (lambda: np.arange(5, dtype=np.int32), lambda: np.arange(5, dtype=np.int64)),
    "numpy shape": (lambda: np.zeros((2, 3)), lambda: np.zeros((3, 2))),
    "numpy byte order": (lambda: np.arange(3, dtype="<i4"), lambda: np.arange(3, dtype=">i4")),
    "numpy strings": (lambda: np.array(["a", "b"]), lambda: np.array(["a", "c"])),
    "numpy object array": (
        lambda: np.array([1, "a"], dtype=object),
        lambda: np.array([1, "b"], dtype=object),
    ),
    "numpy scalar": (lambda: np.float32(1.0), lambda: np.float64(1.0)),
    "numpy scalar vs python": (lambda: np.int64(3), lambda: 3),
    "fingerprint method": (lambda: Fingerprinted("k", noise=1), lambda: Fingerprinted("j", noise=1)),
    "str subclass": (lambda: Label("a"), lambda: "a"),
    "pandas frame values": (lambda: pd.DataFrame({"a": [1, 2]}), lambda: pd.DataFrame({"a": [1, 3]})),
    "pandas frame columns": (lambda: pd.DataFrame({"a": [1, 2]}), lambda: pd.DataFrame({"b": [1, 2]})),
    "pandas frame dtypes": (lambda: pd.DataFrame({"a": [1, 2]}), lambda: pd.DataFrame({"a": [1.0, 2.0]})),
    "pandas frame index": (
        lambda: pd.DataFrame({"a": [1]}, index=[0]),
        lambda: pd.DataFrame({"a": [1]}, index=[5]),
    ),
    "pandas series name": (lambda: pd.Series([1], name="a"), lambda: pd.Series([1], name="b")),
    "pandas series vs index": (lambda: pd.Series([1, 2]), lambda: pd.Index([1, 2])),
    "pandas timestamp": (
        lambda: pd.Timestamp("2024-01-01"),
        lambda: pd.Timestamp("2024-01-01 00:00:00.000000001"),
    ),
}


@pytest.mark.parametrize(("make", "make_other"), list(SUPPORTED.values()), ids=list(SUPPORTED))
def test_supported_type_has_a_stable_distinct_digest(make, make_other):
    """Each supported type: two equal values share a digest; a different value gets another."""
    assert is_fingerprintable(make())
    assert digest(make()) == digest(make())
    assert digest(make()) != digest(make_other())


def test_fingerprint_method_decides_the_digest():
    """Objects with __resumable_fingerprint__ are hashed by what it returns, nothing else."""
    assert digest(Fingerprinted("k", noise=1)) == digest(Fingerprinted("k", noise=object()))
    assert digest(Fingerprinted({"a", "b"})) == digest(Fingerprinted({"b", "a"}))


def test_array_layout_does_not_matter():
    """C, Fortran and strided arrays with the same dtype, shape and values share a digest."""
    base = np.arange(12.0).reshape(3, 4)
    views = [np.asfortranarray(base), np.repeat(base, 2, axis=1)[:, ::2], base.T.copy().T]
    assert [False, False, False] == [v.flags.c_contiguous for v in views]
    assert [digest(base)] * 3 == [digest(v) for v in views]


@given(arr=numpy_arrays())
def test_numpy_array_digest_follows_its_bytes(arr):
    """Property: an array's digest equals its copy's and changes when one byte changes."""
    assert digest(arr) == digest(arr.copy())
    if arr.nbytes:
        changed = np.ascontiguousarray(arr).copy()
        changed.view(np.uint8).reshape(-1)[0] ^= 1
        assert digest(arr) != digest(changed)


def test_every_supported_type_through_a_step(state_dir):
    """A step taking all supported types at once is skipped on rerun and reruns when one changes."""

    def config(last: int) -> dict[str, Any]:
        return {
            "scalars": [None, True, 2**70, 1.5, 1j, "s", b"b", Decimal("1.0"), uuid.UUID(int=3)],
            "when": [
                dt.datetime(2024, 1, 1, tzinfo=ZoneInfo("UTC")),
                dt.date(2024, 1, 1),
                dt.time(1),
                dt.timedelta(1),
            ],
            "containers": ({"k": {1, 2}}, frozenset({"f"})),
            "objects": [
                Point(1, 2.0),
                Item("i"),
                Coord(1.0),
                Color.RED,
                PurePosixPath("p"),
                Fingerprinted("fp"),
            ],
            "numpy": [np.arange(last), np.float32(2)],
            "pandas": pd.DataFrame({"a": [1, last]}),
        }

    calls = []

    def run(last: int) -> str:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:

            @pipe.step(name="consume")
            def consume(cfg: dict[str, Any]) -> int:
                calls.append(1)
                return len(cfg)

            consume(config(last))
            return pipe.status().steps["consume"].reason

    assert ["new", "new", "inputs changed"] == [run(3), run(3), run(4)]
    assert 2 == len(calls)


def test_argument_binding_does_not_change_the_digest(pipe):
    """Positional, keyword, reordered keywords and applied defaults bind to the same fingerprint."""
    calls = []
    with pipe:

        @pipe.step(name="bound", key="k")
        def bound(a: int, b: int = 2, **extra: Any) -> int:
            calls.append(1)
            return a + b

        bound(1)
        bound(1, 2)
        bound(a=1, b=2)
        bound(b=2, a=1)
        bound(1, c=3, d=4)
        bound(1, d=4, c=3)
    assert 2 == len(calls)


# --------------------------------------------------------------------------------------
# unsupported arguments


def _generator():
    yield 1


UNSUPPORTED = {
    "lock": threading.Lock,
    "arbitrary object": object,
    "lambda": lambda: lambda x: x,
    "function": lambda: _generator,
    "generator": _generator,
    "file": io.StringIO,
    "pandas NA": lambda: pd.NA,
}


@pytest.mark.parametrize("make", list(UNSUPPORTED.values()), ids=list(UNSUPPORTED))
def test_unsupported_argument_raises_fingerprint_error(pipe, state_dir, make):
    """An unsupported argument: FingerprintError naming step and parameter, suggesting ignore=; nothing runs."""
    calls = []
    with pipe:

        @pipe.step(name="use")
        def use(n: int, client: object) -> int:
            calls.append(1)
            return n

        with pytest.raises(FingerprintError) as info:
            use(1, make())
    assert ("use", "client", "client") == (info.value.step, info.value.param, info.value.where)
    assert "step 'use'" in str(info.value)
    assert "ignore=('client',)" in str(info.value)
    assert [] == calls
    assert not (state_dir / "use.msgpack").exists()


def test_socket_argument_raises_fingerprint_error(pipe):
    """A socket argument is refused with a FingerprintError naming its type."""
    with pipe:

        @pipe.step(name="send")
        def send(conn: object) -> None:
            return None

        with socket.socket() as sock, pytest.raises(FingerprintError) as info:
            send(sock)
    assert ("send", "conn", "socket.socket") == (info.value.step, info.value.param, info.value.type_name)


def test_nested_unsupported_value_is_located():
    """The message points at the offending element inside containers and objects."""
    lock = threading.Lock()
    cases = {
        "x['a'][1]": {"a": [1, lock]},
        "x[0].extra['k']": [Item("i", None, {"k": lock})],
        "x.x": Point(lock, 1.0),
    }
    found = {}
    for where, value in cases.items():
        with pytest.raises(FingerprintError) as info:
            digest(value)
        found[where] = info.value.where
    assert {w: w for w in cases} == found


@pytest.mark.parametrize("kind", ["list", "dict", "dataclass"])
def test_self_containing_argument_raises(kind):
    """A value containing itself is a FingerprintError saying so, not a RecursionError."""
    if kind == "list":
        value: Any = [1]
        value.append(value)
    elif kind == "dict":
        value = {"a": 1}
        value["self"] = value
    else:
        value = Point(1, 2.0)
        value.x = [value]  # type: ignore[assignment]
    with pytest.raises(FingerprintError, match="contains itself") as info:
        digest(value)
    assert "step" == info.value.step
    assert not is_fingerprintable(value)


def test_shared_references_are_not_cycles():
    """The same list twice inside a value is fine and hashed like two equal lists."""
    shared = [1, 2]
    assert digest([shared, shared]) == digest([[1, 2], [1, 2]])


def test_too_deeply_nested_argument_raises():
    """A value nested thousands deep is a FingerprintError, not a crash."""
    value: list[Any] = []
    for _ in range(5000):
        value = [value]
    with pytest.raises(FingerprintError, match="nested too deeply"):
        digest(value)


def test_pandas_with_unhashable_cells_raises():
    """A DataFrame holding lists cannot be hashed by pandas: FingerprintError with the reason."""
    frame = pd.DataFrame({"a": [[1], [2]]})
    with pytest.raises(FingerprintError, match="unhashable"):
        digest(frame)


def test_class_with_fingerprint_method_as_argument():
    """Passing a class (not an instance) that defines __resumable_fingerprint__ is a FingerprintError."""
    with pytest.raises(FingerprintError) as info:
        digest(Fingerprinted)
    assert "x" == info.value.param


# --------------------------------------------------------------------------------------
# digest collisions between different values


def test_zero_d_array_differs_from_one_element_array():
    """np.array(5) and np.array([5]) are different arguments with different digests."""
    assert digest(np.array(5)) != digest(np.array([5]))


def test_structured_arrays_with_different_fields_differ():
    """Structured arrays with other field names or types get other digests, even with equal bytes."""
    ints = np.zeros(2, dtype=[("a", "<i8"), ("b", "<i8")])
    floats = np.zeros(2, dtype=[("x", "<f8"), ("y", "<f8")])
    assert digest(ints) != digest(floats)


def test_dataframe_column_label_types_matter():
    """DataFrames whose columns are 1 and "1" are different arguments."""
    assert digest(pd.DataFrame({1: [1]})) != digest(pd.DataFrame({"1": [1]}))


def test_dataframe_index_name_matters():
    """A DataFrame with a named index differs from the same data with an unnamed one."""
    frame = pd.DataFrame({"a": [1, 2]})
    assert digest(frame) != digest(frame.rename_axis("key"))


def test_categorical_categories_matter():
    """Categorical Series with other categories (value_counts differs) get other digests."""
    small = pd.Series(pd.Categorical(["a"], categories=["a"]))
    large = pd.Series(pd.Categorical(["a"], categories=["a", "b"]))
    assert digest(small) != digest(large)


def test_pandas_timedelta_nanoseconds_matter():
    """pd.Timedelta values differing by nanoseconds get different digests."""
    assert digest(pd.Timedelta(1, unit="ns")) != digest(pd.Timedelta(2, unit="ns"))


# --------------------------------------------------------------------------------------
# ignore=


def test_ignored_parameter_is_left_out(state_dir):
    """ignore= drops a parameter: unsupported values are accepted and changes do not rerun the step."""
    calls = []

    def run(n: int, client: object) -> str:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:

            @pipe.step(name="fetch", ignore=("client",))
            def fetch(n: int, client: object) -> int:
                calls.append(n)
                return n * 2

            fetch(n, client)
            return pipe.status().steps["fetch"].reason

    assert ["new", "new", "inputs changed"] == [run(1, threading.Lock()), run(1, object()), run(2, object())]
    assert [1, 2] == calls


def test_ignore_in_digest_arguments():
    """An ignored parameter contributes nothing: same digest as without it."""
    with_client = digest_arguments("s", {"n": 1, "client": threading.Lock()}, frozenset({"client"}))
    assert digest_arguments("s", {"n": 1}, frozenset()) == with_client


def test_ignore_accepts_a_single_name(pipe):
    """ignore="client" (a str) means that one parameter, not its characters."""
    with pipe:

        @pipe.step(name="fetch_one", ignore="client")
        def fetch_one(n: int, client: object) -> int:
            return n

        assert 5 == fetch_one(5, threading.Lock())
    assert frozenset({"client"}) == fetch_one.__resumable_step__.ignore


# --------------------------------------------------------------------------------------
# step outputs: by their content; those with no digest of their own by their stored checksum


def _expected_args(name: str, checksum: str) -> str:
    """The argument digest of one parameter holding a step output known by its checksum."""
    value = blake3.blake3(b"\xc1@" + msgpack.packb(checksum)).digest()
    assert value.hex() == _fingerprint.stored_argument_digest(checksum)
    return blake3.blake3(msgpack.packb(name) + value).hexdigest()[:32]


def test_a_step_output_counts_as_its_content(state_dir):
    """
    An array returned by a step and passed to another counts as what it holds: the stored
    file carries the digest of its content, which is what an equal array gives.
    """
    runs = []

    def run() -> list[str]:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:

            @pipe.step(name="make")
            def make() -> np.ndarray:
                runs.append("make")
                return np.arange(1_000_000, dtype=np.float64)

            @pipe.step(name="total")
            def total(arr: np.ndarray) -> float:
                runs.append("total")
                return float(arr.sum())

            assert 499999500000.0 == total(make())
            assert 499999500000.0 == total(np.arange(1_000_000, dtype=np.float64))  # the same call
            return [pipe.status().steps[s].reason for s in ("make", "total")]

    assert ["new", "new"] == run()
    assert ["new", "new"] == run()  # both skipped: reasons are those of the last execution
    assert ["make", "total"] == runs
    make_header, _ = _codec.parse_header((state_dir / "make.msgpack").read_bytes())
    assert digest_value(np.arange(1_000_000, dtype=np.float64)) == make_header["pdigest"]
    header, _ = _codec.parse_header((state_dir / "total.msgpack").read_bytes())
    assert (
        digest_arguments("total", {"arr": np.arange(1_000_000, dtype=np.float64)}, frozenset())
        == header["args"]
    )


def test_copy_of_a_step_output_gives_its_digest(pipe):
    """A copy of a step's output holds what the output holds: the same digest."""
    with pipe:

        @pipe.step(name="make")
        def make() -> np.ndarray:
            return np.arange(100_000, dtype=np.int64)

        arr = make()
        assert digest(arr.copy()) == digest(arr)
        assert stored_digest(arr) is None  # it has a digest of its own: nothing to remember


def test_mutated_step_output_is_not_taken_for_the_stored_one(state_dir):
    """An output changed in place before it is passed on is fingerprinted by its new contents."""
    seen = []

    def run(first: float) -> float:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:

            @pipe.step(name="make")
            def make() -> np.ndarray:
                return np.zeros(1000)

            @pipe.step(name="total")
            def total(arr: np.ndarray) -> float:
                seen.append(float(arr[0]))
                return float(arr.sum())

            arr = make()
            arr[0] = first
            return total(arr)

    assert [1.0, 2.0, 2.0] == [run(1.0), run(2.0), run(2.0)]
    assert [1.0, 2.0] == seen  # the third run found the output for 2.0


def test_change_deep_inside_a_step_output_is_seen(state_dir):
    """A change at any depth of a (large) dict output reruns the step it is passed to."""
    seen = []

    def run(threshold: int) -> int:
        with Pipeline("test", state_dir=state_dir, durable=False) as pipe:

            @pipe.step(name="load")
            def load() -> dict:
                return {"cfg": {"threshold": 1000}, "rows": list(range(2000))}

            @pipe.step(name="use")
            def use(d: dict) -> int:
                seen.append(d["cfg"]["threshold"])
                return sum(1 for r in d["rows"] if r > d["cfg"]["threshold"])

            d = load()
            d["cfg"]["threshold"] = threshold
            return use(d)

    assert [999, 499, 499] == [run(1000), run(1500), run(1500)]
    assert [1000, 1500] == seen


def test_stored_output_digest_is_used_without_loading():
    """A StoredOutput (the runner's lazy value) is fingerprinted by its digest; it is never loaded."""
    loads = []
    lazy = StoredOutput("make", "abc123", lambda: loads.append(1))
    assert _expected_args("x", "abc123") == digest(lazy)
    assert [] == loads


class Plain:
    """A class with no fingerprint of its own (stored by pickle)."""

    def __init__(self, value: int) -> None:
        self.value = value


def _checksum(value: object) -> str:
    return _codec.value_checksum(_codec.encode(value, allow_pickle=True), ())


def test_provenance_holds_no_output_alive(pipe):
    """Outputs are known by id and weak reference: the registry keeps none of them alive."""
    with pipe:

        @pipe.step(name="make", key="{i}")
        def make(i: int) -> Plain:
            return Plain(i)

        outputs = [make(i) for i in range(5)]
    assert 5 == len({stored_digest(o) for o in outputs})
    refs = [weakref.ref(o) for o in outputs]
    del outputs
    gc.collect()
    assert [None] * 5 == [r() for r in refs]
    assert all(e.ref is not None and e.ref() is None for e in provenance._entries.values())


def test_provenance_of_lists_sees_an_append(pipe):
    """A list output with no digest of its own, appended to after the step, is known by what it holds now."""
    with pipe:

        @pipe.step(name="rows")
        def rows() -> list[Plain]:
            return [Plain(i) for i in range(3)]

        out = rows()
        stored = stored_digest(out)
        assert stored is not None
        assert _expected_args("x", stored) == digest(out)
        out.append(Plain(4))
        assert stored_digest(out) is None
        assert _expected_args("x", stored) != digest(out)
        out.pop()
        assert _expected_args("x", stored) == digest(out)  # back to the stored bytes


def test_small_plain_outputs_are_hashed_by_content(pipe):
    """A short str, a number or a short tuple of them is hashed by content: equal values match."""
    with pipe:

        @pipe.step(name="small")
        def small() -> tuple[int, str]:
            return (1, "a")

        out = small()
    assert stored_digest(out) is None
    assert digest((1, "a")) == digest(out)


def test_provenance_is_bounded():
    """The registry holds at most MAX_ENTRIES entries, oldest dropped first."""
    values = [Plain(i) for i in range(provenance.MAX_ENTRIES + 10)]
    for value in values:
        provenance.remember(value, _checksum(value))
    assert provenance.MAX_ENTRIES == len(provenance._entries)
    assert stored_digest(values[0]) is None
    assert _checksum(values[-1]).partition(":")[2] == stored_digest(values[-1])


def test_only_outputs_without_a_digest_of_their_own_are_remembered(pipe):
    """An output that can be fingerprinted counts as its content: provenance keeps only the others."""
    with pipe:

        @pipe.step(name="rows")
        def rows() -> list[dict[str, int]]:
            return [{"a": i} for i in range(3000)]

        @pipe.step(name="plain")
        def plain() -> Plain:
            return Plain(1)

        out, other = rows(), plain()
    assert stored_digest(out) is None
    assert stored_digest(other) is not None
    assert digest([{"a": i} for i in range(3000)]) == digest(out)


def test_a_reused_address_is_checked_by_content():
    """An object at the address of a dead output is not taken for it unless it encodes the same."""
    first = [Plain(1)]
    provenance.remember(first, _checksum(first))
    key = id(first)
    del first
    other = [Plain(9)]
    entry = provenance._entries.pop(key)
    provenance._entries[id(other)] = entry  # as if `other` had been allocated at that address
    assert stored_digest(other) is None
    assert _expected_args("x", entry.checksum.partition(":")[2]) != digest(other)


def test_changed_output_without_a_digest_of_its_own_is_known_by_its_encoding(pipe):
    """An output of a plain class changed in place is fingerprinted by its encoding, never refused."""
    with pipe:

        @pipe.step(name="make")
        def make() -> Plain:
            return Plain(1)

        out = make()
        stored = digest(out)
        out.value = 2
        changed = digest(out)
        out.value = 1
        assert [False, True] == [stored == changed, stored == digest(out)]
