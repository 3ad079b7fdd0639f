"""
Hypothesis strategies for the values resumable stores and the arguments it fingerprints.

The classes below live at module level so that decoding finds them in ``sys.modules``
(decoding never imports a module itself).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import pathlib
from typing import Any

import attrs
import numpy as np
import pydantic
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

# --------------------------------------------------------------------------------------
# classes whose instances are stored and fingerprinted


class Color(enum.Enum):
    """An Enum with values of several types."""

    RED = "red"
    GREEN = 2
    BLUE = (3, 4)


class Perm(enum.IntFlag):
    """An IntFlag: combinations of members are values too."""

    R = 4
    W = 2
    X = 1


@dataclasses.dataclass
class Point:
    """A plain dataclass."""

    x: int
    y: float


@dataclasses.dataclass(frozen=True)
class Frozen:
    """A frozen dataclass holding a container."""

    name: str
    tags: tuple[str, ...] = ()


@attrs.define
class Item:
    """A slotted attrs class holding other storable values."""

    name: str
    point: Point | None = None
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Coord:
    """A frozen attrs class with a private field."""

    lat: float
    _lon: float = 0.0


class Outer:
    """A namespace: the dataclass inside is found through its dotted qualname."""

    @dataclasses.dataclass
    class Inner:
        """A dataclass nested in a class."""

        value: int


class User(pydantic.BaseModel):
    """A pydantic v2 model with a nested model."""

    name: str
    age: int = 0
    tags: list[str] = []  # pydantic copies mutable defaults
    friend: User | None = None


class Loose(pydantic.BaseModel, extra="allow"):
    """A pydantic model keeping unknown fields as extras."""

    name: str


class Opaque:
    """A plain class msgpack has no encoding for: stored only as a pickle."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return type(other) is Opaque and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return f"Opaque({self.value!r})"


class Fingerprinted:
    """An object whose digest is what ``__resumable_fingerprint__`` returns."""

    def __init__(self, key: object, noise: object = None) -> None:
        self.key = key
        self.noise = noise  # not part of the fingerprint

    def __resumable_fingerprint__(self) -> object:
        return self.key


# --------------------------------------------------------------------------------------
# scalars

BIG_INTS = st.one_of(
    st.integers(min_value=2**64, max_value=2**300),
    st.integers(min_value=-(2**300), max_value=-(2**63) - 1),
)
INTS = st.one_of(st.integers(), st.integers(min_value=-(2**64), max_value=2**64), BIG_INTS)
FLOATS = st.floats(allow_nan=False)
TIMEZONES = st.one_of(st.just(dt.UTC), st.timezones())

datetimes = st.one_of(
    st.datetimes(),
    st.datetimes(timezones=st.just(dt.UTC)),
    st.datetimes(timezones=st.timezones()),
)
times = st.one_of(st.times(), st.times(timezones=TIMEZONES))
decimals = st.decimals(allow_nan=False, allow_infinity=False)
path_parts = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1), max_size=4
)
paths = st.one_of(
    st.builds(lambda parts: pathlib.PurePosixPath(*parts), path_parts),
    # concrete paths are fingerprinted by what they name: these name nothing (tests/test_files.py
    # covers files and directories)
    st.builds(lambda parts: pathlib.PosixPath("/nonexistent-resumable-test", *parts), path_parts),
)

hashable_scalars = st.one_of(
    st.none(),
    st.booleans(),
    INTS,
    FLOATS,
    st.text(),
    st.binary(),
    decimals,
    st.uuids(),
    st.dates(),
    st.timedeltas(),
    datetimes,
    times,
    paths,
    st.sampled_from(Color),
    st.sampled_from(Perm),
)

# --------------------------------------------------------------------------------------
# NumPy

NUMPY_DTYPES = [
    "bool",
    "int8",
    "uint16",
    ">i4",
    "int64",
    "uint64",
    "float16",
    "float32",
    "<f8",
    ">f8",
    "complex128",
    "U3",
    "S4",
    "M8[ns]",
    "m8[s]",
    [("a", "<i4"), ("b", "<f8")],
]


def _layout(arr: np.ndarray, layout: str) -> np.ndarray:
    if layout == "F":
        return np.asfortranarray(arr)
    if layout == "strided" and arr.ndim:
        return arr[..., ::2]
    if layout == "reversed" and arr.ndim:
        return arr[::-1]
    return arr


@st.composite
def numpy_arrays(draw: st.DrawFn, max_side: int = 5) -> np.ndarray:
    """Arrays of several dtypes and shapes (0-d, empty, ...), C, Fortran or non-contiguous."""
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES)))
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=max_side))
    arr = draw(hnp.arrays(dtype, shape))
    return _layout(arr, draw(st.sampled_from(["C", "F", "strided", "reversed"])))


@st.composite
def numpy_scalars(draw: st.DrawFn) -> np.generic:
    """NumPy scalars (np.float32, np.int64, np.str_, np.datetime64 ...)."""
    dtype = np.dtype(draw(st.sampled_from(NUMPY_DTYPES[:-1])))
    value: np.generic = draw(hnp.arrays(dtype, ()))[()]
    # np.str_("") has itemsize 0 and does not decode: a known bug with its own test
    assume(value.dtype.itemsize > 0)
    return value


# --------------------------------------------------------------------------------------
# containers and objects


def _objects(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(Point, st.integers(), FLOATS),
        st.builds(Frozen, st.text(), st.lists(st.text(), max_size=3).map(tuple)),
        st.builds(
            Item,
            st.text(),
            st.none() | st.builds(Point, st.integers(), FLOATS),
            st.dictionaries(st.text(), children, max_size=3),
        ),
        st.builds(Coord, FLOATS, FLOATS),
        st.builds(Outer.Inner, st.integers()),
    )


dict_keys = st.one_of(st.text(), st.integers(), BIG_INTS, st.tuples(st.text(), st.integers()))


def _containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(dict_keys, children, max_size=4),
        st.sets(hashable_scalars, max_size=4),
        st.frozensets(hashable_scalars, max_size=4),
        _objects(children),
    )


leaves = st.one_of(
    hashable_scalars,
    st.builds(complex, FLOATS, FLOATS),
    numpy_arrays(),
    numpy_scalars(),
)

#: Values a step may return: everything with a native or own encoding (no pickle).
storable = st.recursive(leaves, _containers, max_leaves=12)

#: Values with a digest (what step arguments may be): the same, plus fingerprint objects.
fingerprintable = st.recursive(
    st.one_of(leaves, st.builds(Fingerprinted, hashable_scalars)),
    _containers,
    max_leaves=12,
)

parameter_names = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)

#: Bound step arguments: parameter name to value.
arguments = st.dictionaries(parameter_names, fingerprintable, max_size=4)


__all__ = [
    "BIG_INTS",
    "Color",
    "Coord",
    "Fingerprinted",
    "Frozen",
    "Item",
    "Loose",
    "Opaque",
    "Outer",
    "Perm",
    "Point",
    "User",
    "arguments",
    "datetimes",
    "decimals",
    "fingerprintable",
    "hashable_scalars",
    "numpy_arrays",
    "numpy_scalars",
    "paths",
    "storable",
    "times",
]
