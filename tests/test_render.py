"""How the command line shows values, times and sizes."""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import json
import pathlib
import uuid

import numpy as np
import pandas as pd

from resumable import _render


class Color(enum.Enum):
    RED = "red"


def test_human_size_and_duration():
    """Sizes and durations read like a person would write them."""
    assert ["", "999 B", "1.2 KB", "3.4 MB", "5.6 GB", "7000.0 GB"] == [
        _render.human_size(n) for n in (None, 999, 1_234, 3_400_000, 5_600_000_000, 7e12)
    ]
    assert ["", "12ms", "3.4s", "2.5min", "2.5h"] == [
        _render.duration(s) for s in (None, 0.012, 3.4, 150, 9000)
    ]


def test_ago():
    """Times show how long ago they were; unparsable ones are shown as they are."""
    now = dt.datetime(2026, 1, 2, 12, 0, tzinfo=dt.UTC)
    assert "30s ago" == _render.ago("2026-01-02T11:59:30Z", now)
    assert "5m ago" == _render.ago("2026-01-02T11:55:00Z", now)
    assert "2h ago" == _render.ago("2026-01-02T10:00:00Z", now)
    assert "1d ago" == _render.ago("2026-01-01T12:00:00Z", now)
    assert ("", "soon") == (_render.ago(None, now), _render.ago("soon", now))


def test_summarise_cuts_long_values():
    """Long containers, texts and bytes are cut, with a count of what was left out."""
    value = {
        "items": list(range(50)),
        "text": "x" * 5000,
        "blob": b"y" * 100,
        "keys": dict.fromkeys(range(30)),
    }
    out = _render.summarise(value)
    assert "… 30 more items" == out["items"][-1]
    assert out["text"].endswith("… (5,000 characters)")
    assert out["blob"].endswith("… (100 bytes)")
    assert "10 more keys" == out["keys"]["…"]
    assert (1, 2) == _render.summarise((1, 2))


def test_json_of_every_kind_of_value():
    """as_json turns what JSON cannot hold into readable JSON."""
    value = {
        "when": dt.date(2026, 1, 2),
        "amount": decimal.Decimal("1.50"),
        "id": uuid.UUID(int=1),
        "path": pathlib.PurePosixPath("/a/b"),
        "color": Color.RED,
        "scalar": np.float32(1.5),
        "array": np.arange(20).reshape(4, 5),
        "frame": pd.DataFrame({"a": [1, 2]}),
        "raw": b"\x00\x01",
        "set": {3},
        "object": type("Thing", (), {"__init__": lambda self: setattr(self, "n", 1)})(),
        "opaque": object,
    }
    data = json.loads(_render.as_json(value))
    assert "2026-01-02" == data["when"]
    assert "1.50" == data["amount"]
    assert "00000000-0000-0000-0000-000000000001" == data["id"]
    assert "/a/b" == data["path"]
    assert "red" == data["color"]
    assert 1.5 == data["scalar"]
    assert {"__ndarray__": "int64", "shape": [4, 5], "head": list(range(10))} == data["array"]
    assert [2, 1] == data["frame"]["__dataframe__"]
    assert [{"a": 1}, {"a": 2}] == data["frame"]["head"]
    assert {"__bytes__": "AAE=", "length": 2} == data["raw"]
    assert [3] == data["set"]
    assert {"__class__": "Thing", "n": 1} == data["object"]
    assert "<class 'object'>" == data["opaque"]


def test_pretty_is_compact():
    """pretty packs short items on one line."""
    assert "[0, 1, 2]" == _render.pretty([0, 1, 2])
