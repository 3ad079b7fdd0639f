"""
Big arguments and big values a step reads (_fingerprint's canonical stream, _codehash's
value digests): lists of rows and records take msgpack's C packer a level at a time, yet a
value's digest depends only on what it holds; a slow fingerprint is announced; what
`resumable why` keeps of a value is bounded.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import types
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import Item, hashable_scalars

from resumable import FingerprintError, Pipeline, _codehash, _codeshape, _fingerprint
from resumable._fingerprint import digest_parameters, digest_value


def digest(value: object) -> str:
    return digest_parameters("step", {"x": value}, frozenset())[0]


def shuffled_dict(items: list[tuple[Any, Any]], rng: random.Random) -> dict[Any, Any]:
    order = list(items)
    rng.shuffle(order)
    return dict(order)


scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),  # beyond 64 bits too
    st.floats(),  # nan, inf and -0.0 too
    st.text(),
    st.binary(),
)
keys = st.lists(st.text(max_size=3) | st.integers(), min_size=1, max_size=4, unique_by=lambda k: (type(k), k))
# a value a record may hold: plain scalars, and sometimes a container
cell = (
    scalar
    | st.lists(scalar, max_size=3)
    | st.tuples(scalar, scalar)
    | st.dictionaries(st.text(max_size=2), scalar)
)


@st.composite
def records(draw: st.DrawFn) -> list[dict[Any, Any]]:
    """Dicts with the same keys (inserted in any order), the shape of a table."""
    names = draw(keys)
    rows = draw(st.lists(st.tuples(*[cell] * len(names)), max_size=6))
    rng = draw(st.randoms(use_true_random=False))
    return [shuffled_dict(list(zip(names, row, strict=True)), rng) for row in rows]


@st.composite
def rows(draw: st.DrawFn) -> list[Any]:
    """Lists of tuples (or of lists) of plain scalars."""
    kind = draw(st.sampled_from([tuple, list]))
    return [kind(r) for r in draw(st.lists(st.lists(scalar, max_size=4), max_size=6))]


@given(data=records(), seed=st.randoms(use_true_random=False))
def test_records_ignore_key_order(data, seed):
    """Property: a list of dicts with their keys inserted in another order has the same digest."""
    reordered = [shuffled_dict(list(row.items()), seed) for row in data]
    assert digest(data) == digest(reordered)


@given(data=records() | rows(), other=records() | rows())
def test_tables_differ_exactly_when_their_contents_do(data, other):
    """Property: two tables get one digest if and only if they hold the same rows, same types, same bits."""

    def canonical(value: Any) -> Any:
        if type(value) is dict:
            return ("dict", frozenset((canonical(k), canonical(v)) for k, v in value.items()))
        if type(value) in {list, tuple}:
            return (type(value).__name__, tuple(canonical(v) for v in value))
        if type(value) is float:
            return ("float", "nan" if math.isnan(value) else value.hex())  # NaN bits: compared below
        return (type(value).__name__, value)

    same = canonical(data) == canonical(other)
    if same and repr(data) != repr(other):  # NaN payloads and -0.0 are told apart by their bits
        return
    assert same == (digest(data) == digest(other))


@given(data=records() | rows() | st.lists(scalar, max_size=40) | st.dictionaries(st.text(max_size=3), cell))
def test_chunks_and_buffers_do_not_change_the_digest(data):
    """Property: packing 2 items at a time and hashing every byte as it comes gives the same digest."""
    expected = digest_value(data)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fingerprint, "_CHUNK", 2)
        mp.setattr(_fingerprint, "_LARGE", 1)
        assert expected == digest_value(data)


def test_big_ints_in_a_long_list_are_told_apart():
    """A long list of plain scalars with an int beyond 64 bits in one chunk: each big int counts."""
    base = list(range(200_000))
    first, second = [*base, 2**70], [*base, 2**71]
    assert digest(first) != digest(second)
    assert digest(first) == digest([*range(200_000), 2**70])
    rows_a = [(i, 2**80 if i == 150_000 else i) for i in range(200_000)]
    rows_b = [(i, 2**81 if i == 150_000 else i) for i in range(200_000)]
    assert digest(rows_a) != digest(rows_b)


def test_a_million_records_in_any_key_order():
    """1,000,000 dicts inserted in another key order, and a change in one of them."""
    table = [{"id": i, "name": f"n{i}", "score": i * 0.5} for i in range(1_000_000)]
    first = digest(table)
    reordered = [{"score": i * 0.5, "name": f"n{i}", "id": i} for i in range(1_000_000)]
    assert first == digest(reordered)
    reordered[777_777]["score"] = -0.0 if reordered[777_777]["score"] == 0.0 else 0.0
    assert first != digest(reordered)


def test_shapes_are_told_apart():
    """Rows of tuples, rows of lists, records and dicts of them: each its own digest."""
    values = [
        [(1, "a"), (2, "b")],
        [[1, "a"], [2, "b"]],
        ([1, "a"], [2, "b"]),
        ((1, "a"), (2, "b")),
        [{0: 1, 1: "a"}, {0: 2, 1: "b"}],
        [{"0": 1, "1": "a"}, {"0": 2, "1": "b"}],
        [1, "a", 2, "b"],
        [(1, "a"), [2, "b"]],
        [{0: 1, 1: "a"}, {0: 2}],
        {0: [1, 2], 1: ["a", "b"]},
        [{0: 1.0, 1: "a"}, {0: 2, 1: "b"}],
        [(True, "a"), (2, "b")],
    ]
    assert len(values) == len({digest(v) for v in values})


def test_mixed_keys_have_one_order():
    """Dict keys of several types (and sets of them) are ordered by their encoding: insertion order is irrelevant."""
    items = [(1, "a"), ("1", "b"), (b"1", "c"), (1.5, "d"), (None, "e"), ((1, 2), "f"), (False, "g")]
    rng = random.Random(7)  # noqa: S311 - a shuffle, not a secret
    digests = {digest(shuffled_dict(items, rng)) for _ in range(20)}
    assert 1 == len(digests)
    elements = [k for k, _ in items]
    assert 1 == len({digest(set(rng.sample(elements, len(elements)))) for _ in range(20)})


def test_errors_inside_tables_are_located():
    """An unsupported value in a record, a row or a dict of records is named by its place."""
    lock = threading.Lock()
    cases = {
        "x[1]['b']": [{"a": 1, "b": 2}, {"a": 1, "b": lock}],
        "x['t'][0]['k'][2]": {"t": [{"k": [1, 2, lock]}]},
        "x[0][1]": [(1, lock), (2, 3)],
        "x key <unlocked _thread.lock object": {lock: 1},
    }
    found = {}
    for where, value in cases.items():
        with pytest.raises(FingerprintError) as info:
            digest(value)
        found[where] = info.value.where[: len(where)]
    assert {w: w for w in cases} == found


def test_a_record_containing_its_list():
    """A list of dicts whose dict holds the list itself: "contains itself", not a RecursionError."""
    table: list[dict[str, Any]] = [{"a": 1}]
    table[0]["a"] = table
    with pytest.raises(FingerprintError, match="contains itself"):
        digest(table)


def test_numpy_types_as_arguments():
    """np.dtype("f4") and np.float32 fingerprint alike (they compare equal), apart from other dtypes."""
    values = [np.dtype("f4"), np.dtype("f8"), np.int64, np.dtype([("a", "<i4")])]
    assert len(values) == len({digest(v) for v in values})
    assert digest(np.dtype("f4")) == digest(np.float32)


# --------------------------------------------------------------------------------------
# a slow fingerprint is announced


@pytest.fixture
def slow(monkeypatch):
    """A clock that moves 0.6 s every time it is read: a fingerprint that looks at it twice looks slow."""
    now = [0.0]

    def clock() -> float:
        now[0] += 0.6
        return now[0]

    monkeypatch.setattr(_fingerprint, "_clock", clock)


def _announcements(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "resumable" and "to fingerprint" in r.message]


def test_slow_argument_is_announced_once(pipe, caplog, slow):
    """An argument whose fingerprint takes over a second: one INFO line naming step, parameter and size."""
    caplog.set_level(logging.INFO, logger="resumable")
    table = [{"id": i, "name": f"n{i}"} for i in range(5000)]
    with pipe:

        @pipe.step(name="enrich")
        def enrich(rows: list[dict[str, Any]], n: int) -> int:
            return len(rows) + n

        enrich(table, 1)
    [line] = _announcements(caplog)
    assert line.startswith(
        "step 'enrich': argument 'rows' (list of 5,000 items) takes over 1 s to fingerprint"
    )


def test_slow_value_read_by_a_step_is_announced(pipe, caplog, slow):
    """A module-level value a step reads that takes long to fingerprint: one INFO line naming it."""
    caplog.set_level(logging.INFO, logger="resumable")
    namespace: dict[str, Any] = {"TABLE": [(i, str(i)) for i in range(3000)]}
    exec("def count(n):\n    return len(TABLE) + n\n", namespace)  # noqa: S102 - a function reading a global
    with pipe:
        count = pipe.step(name="count", version="1")(namespace["count"])
        count(1)
    lines = _announcements(caplog)
    assert ["step 'count': value 'TABLE' read by its code (list of 3,000 items)"] == [
        line.partition(" takes over")[0] for line in lines
    ]


def test_fast_fingerprints_say_nothing(pipe, caplog):
    """With the real clock, small arguments are never announced."""
    caplog.set_level(logging.INFO, logger="resumable")
    with pipe:

        @pipe.step(name="small")
        def small(rows: list[int]) -> int:
            return len(rows)

        small([1, 2, 3])
    assert [] == _announcements(caplog)


def test_a_huge_single_value_is_announced_after_the_fact(caplog, monkeypatch):
    """A value hashed without a pause (one long bytes) is announced when its digest is done."""
    caplog.set_level(logging.INFO, logger="resumable")
    times = iter([0.0, 5.0])
    monkeypatch.setattr(_fingerprint, "_clock", lambda: next(times))
    digest_value(b"x" * 100, describe="step 's': argument 'blob'")
    assert ["step 's': argument 'blob' (bytes of 100 items)"] == [
        line.partition(" takes over")[0] for line in _announcements(caplog)
    ]


# --------------------------------------------------------------------------------------
# values a step reads


def test_value_digest_is_the_argument_fingerprint():
    """A value a step reads is digested exactly as an argument is (no cache, no other encoding)."""
    table = [{"k": i, "v": [i, str(i)]} for i in range(100)]
    assert "f" + digest_value(table)[:15] == _codehash.value_digest(table)
    table[50]["v"][1] = "changed"
    assert "f" + digest_value(table)[:15] == _codehash.value_digest(table)


def test_no_value_cache_by_identity():
    """The digest of a value read again follows its content, also for objects at a reused address."""
    seen = set()
    for i in range(200):
        value = (i, "x")  # a new tuple at an address a dead one may have had
        seen.add(_codehash.value_digest(value))
    assert 200 == len(seen)
    assert not hasattr(_codehash, "_immutable_digests")
    assert not hasattr(_codehash, "_packed_digests")


class _Counted:
    """An item that counts how often it is looked at."""

    looked = 0

    def __getattr__(self, name: str) -> Any:
        type(self).looked += 1
        raise AttributeError(name)

    def __repr__(self) -> str:
        type(self).looked += 1
        return "<counted>"


def test_a_large_global_is_not_searched_for_functions():
    """A module-level list of 20,000 items is data: the code shape does not look at its items."""
    namespace: dict[str, Any] = {"ITEMS": [_Counted() for _ in range(20_000)], "__name__": "m"}
    exec("def use():\n    return len(ITEMS)\n", namespace)  # noqa: S102 - a function reading a global
    fn = namespace["use"]
    assert isinstance(fn, types.FunctionType)
    _Counted.looked = 0
    shape = _codeshape.code_shape(fn, lambda _value: None)
    assert ["const ITEMS"] == [label for label, _ in shape.reads]
    assert 0 == _Counted.looked


def test_why_keeps_a_short_repr_of_a_large_value():
    """The repr kept for `why` shows a few items, calls repr on a few only and sorts nothing."""
    compared = []

    class Key(str):
        __slots__ = ()

        def __lt__(self, other: object) -> bool:
            compared.append(1)
            return str.__lt__(self, other)  # type: ignore[operator]

        __hash__ = str.__hash__

    _Counted.looked = 0
    values = {
        "list": [_Counted() for _ in range(100_000)],
        "dict": {Key(f"k{i}"): i for i in range(100_000)},
        "set": {f"s{i}" for i in range(100_000)},
        "nested": [{"a": [list(range(1000))] * 1000}] * 1000,
    }
    texts = {name: _codehash.short_repr(v) for name, v in values.items()}
    assert all(len(t) <= 200 for t in texts.values()), texts
    assert _Counted.looked <= 10
    assert [] == compared
    assert texts["list"].startswith("[<counted>, <counted>")
    assert texts["dict"].startswith("{'k0': 0, 'k1': 1")


def test_why_repr_of_a_dataclass_holding_a_large_list():
    """An attrs or dataclass instance is shown field by field, each bounded."""
    item = Item("big", None, {"rows": list(range(1_000_000))})
    text = _codehash.short_repr(item)
    assert text.startswith("Item(name='big', point=None, extra={'rows': [0, 1, 2")
    assert len(text) <= 200


def test_globals_of_a_step_are_fingerprinted_at_every_call(state_dir):
    """A global list of records changed in place between calls reruns the step; unchanged, it skips."""
    namespace: dict[str, Any] = {"TABLE": [{"id": i, "v": i} for i in range(1000)], "__name__": "m"}
    exec("def total():\n    return sum(r['v'] for r in TABLE)\n", namespace)  # noqa: S102
    reasons = []
    with Pipeline("t", state_dir=state_dir, durable=False) as pipe:
        total = pipe.step(name="total")(namespace["total"])
        results = [total()]
        namespace["TABLE"][500]["v"] = 10_000
        results.append(total())
        reasons.append(pipe.status().steps["total"].reason)
        results.append(total())
    assert [499_500, 509_000, 509_000] == results
    assert ["code changed"] == reasons


@given(value=st.lists(hashable_scalars, max_size=5))
def test_value_digest_matches_digest_value(value):
    """Property: for plain values, the digest of a value read equals its argument digest (prefixed)."""
    assert "f" + digest_value(value)[:15] == _codehash.value_digest(value)


def test_lone_surrogates_are_fingerprinted_alike_everywhere():
    """A str holding a lone surrogate (a file name from os.fsdecode) has one digest alone, in lists, rows and tables."""
    odd = "name-\udcff"
    assert digest(odd) == digest("name-\udcff")
    assert digest(odd) != digest("name-\udcfe")
    assert digest(odd) != digest("name-")
    assert digest([odd, 1]) == digest(["name-\udcff", 1])
    assert digest([(odd, 1)] * 3) != digest([("name-", 1)] * 3)
    assert digest([{"a": odd}] * 3) == digest([{"a": "name-\udcff"}] * 3)
    assert digest({odd: 1}) != digest({"name-": 1})
    expected = digest([*range(5), odd])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_fingerprint, "_CHUNK", 2)
        assert expected == digest([0, 1, 2, 3, 4, "name-\udcff"])


def test_a_forked_child_hashes_large_values_after_its_parent_did(tmp_path):
    """
    The blake3 package's threads are made once per process: a child forked after the parent
    hashed on them must not wait for threads it does not have (fingerprints and checksums).
    """
    import os
    import signal
    import time

    from resumable._checksum import checksum

    big = np.arange(12 << 20, dtype=np.uint8)  # above the threaded size
    digest_value(big)
    checksum([big.data])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        signal.alarm(60)
        ok = digest_value(big) == digest_value(big.copy()) and checksum([big.data]).startswith("blake3:")
        os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung hashing a large value")
    assert os.waitstatus_to_exitcode(done[1]) == 0
