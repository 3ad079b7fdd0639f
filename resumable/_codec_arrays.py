"""
NumPy and pandas values in the codec, imported only when such a value is met.

Arrays are stored as their raw buffer with dtype, shape and order (large buffers out of
band, read back as views of the file's buffer); pandas objects column by column. A dtype
that could hold Python objects, an extension dtype name that is not a pandas extension
dtype, or a payload of the wrong shape is refused as damage.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import msgpack

from . import _codec_types
from ._codec_types import (
    _MAX_BIN,
    DATAFRAME,
    NDARRAY,
    NDARRAY_REF,
    NPSCALAR,
    OOB_MIN,
    PD_INDEX,
    PD_MISSING,
    PD_TIMEDELTA,
    PD_TIMESTAMP,
    SERIES,
    Decoder,
    Encoder,
    _checked,
    _damage,
    _fields,
)

_ANY = object
_OPT_STR = (str, type(None))


def encode(enc: Encoder, obj: Any) -> msgpack.ExtType | None:
    """A NumPy or pandas value, or None if *obj* is not one."""
    np = sys.modules.get("numpy")
    if np is not None:
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            return encode_ndarray(enc, obj)
        if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
            return enc.ext(NPSCALAR, [descr(obj.dtype), obj.tobytes()])
    pd = sys.modules.get("pandas")
    return None if pd is None else encode_pandas(enc, pd, obj)


def _numpy() -> Any:
    import numpy as np  # noqa: PLC0415 - NumPy only when the data holds arrays

    return np


def _pandas() -> Any:
    import pandas as pd  # noqa: PLC0415 - pandas only when the data holds pandas values

    return pd


def descr(dtype: Any) -> object:
    return _numpy().lib.format.dtype_to_descr(dtype)


def encode_ndarray(enc: Encoder, arr: Any) -> msgpack.ExtType:
    """A NumPy array: inline if small, else its buffer out of band, uncopied."""
    if arr.flags.c_contiguous:
        order, flat = "C", arr
    elif arr.flags.f_contiguous:
        order, flat = "F", arr.T
    else:
        order, flat = "C", arr.copy(order="C")
    raw = memoryview(flat.reshape(-1).view("uint8"))
    shape = list(arr.shape)
    if raw.nbytes < OOB_MIN:
        return enc.ext(NDARRAY, [descr(arr.dtype), shape, order, raw.tobytes()])
    indices = []
    for start in range(0, raw.nbytes, _MAX_BIN):
        indices.append(len(enc.buffers))
        enc.buffers.append(raw[start : start + _MAX_BIN])
    return enc.ext(NDARRAY_REF, [descr(arr.dtype), shape, order, indices])


def encode_pandas(enc: Encoder, pd: Any, obj: Any) -> msgpack.ExtType | None:  # noqa: PLR0911 - one dispatch
    """A pandas value, or None if *obj* is not one."""
    if isinstance(obj, pd.DataFrame) and type(obj) is pd.DataFrame:
        columns = [_column_payload(pd, obj.iloc[:, i]) for i in range(obj.shape[1])]
        payload = [_index_payload(pd, obj.columns), _index_payload(pd, obj.index), columns]
        return enc.ext(DATAFRAME, payload)
    if type(obj) is pd.Series:
        payload = [obj.name, _index_payload(pd, obj.index), _column_payload(pd, obj)]
        return enc.ext(SERIES, payload)
    if isinstance(obj, pd.Index):
        return enc.ext(PD_INDEX, _index_payload(pd, obj))
    if type(obj) is pd.Timestamp:
        tz = None if obj.tz is None else str(obj.tz)
        return enc.ext(PD_TIMESTAMP, [obj.value, tz, obj.unit])
    if type(obj) is pd.Timedelta:
        return enc.ext(PD_TIMEDELTA, [obj.value, obj.unit])
    if obj is pd.NA or obj is pd.NaT:
        return msgpack.ExtType(PD_MISSING, b"NA" if obj is pd.NA else b"NaT")
    return None


def _column_payload(pd: Any, series: Any) -> list[Any]:
    dtype = series.dtype
    if isinstance(dtype, _numpy().dtype) and not dtype.hasobject:
        return ["np", series.to_numpy(copy=False)]
    if isinstance(dtype, _numpy().dtype):
        return ["obj", series.tolist()]
    if isinstance(dtype, pd.CategoricalDtype):
        cat = series.array
        return ["cat", cat.codes, _index_payload(pd, cat.categories), bool(cat.ordered)]
    if isinstance(dtype, pd.DatetimeTZDtype):
        naive = series.dt.tz_convert("UTC").dt.tz_localize(None)
        return ["tz", naive.to_numpy(), str(dtype.tz)]
    return ["ext", str(dtype), series.tolist()]


def _index_payload(pd: Any, index: Any) -> list[Any]:
    if type(index) is pd.RangeIndex:
        return ["range", index.start, index.stop, index.step, index.name]
    if isinstance(index, pd.MultiIndex):
        levels = [_index_payload(pd, level) for level in index.levels]
        return ["multi", levels, list(index.codes), list(index.names)]
    freq = getattr(index, "freqstr", None)
    return ["index", _column_payload(pd, pd.Series(index, copy=False)), index.name, freq]


_ARRAY = object()  # stands for np.ndarray, which is imported only when met
_COLUMN_FIELDS: dict[str, tuple[Any, ...]] = {
    "np": (str, _ARRAY),
    "obj": (str, list),
    "cat": (str, _ARRAY, list, bool),
    "tz": (str, _ARRAY, str),
    "ext": (str, str, list),
}


def _column_values(pd: Any, payload: list[Any]) -> Any:
    kind = payload[0] if type(payload) is list and payload else None
    if not isinstance(kind, str) or kind not in _COLUMN_FIELDS:
        _damage(f"unknown kind of pandas column {kind!r}")
    fields = tuple(_numpy().ndarray if t is _ARRAY else t for t in _COLUMN_FIELDS[kind])
    payload = _checked(payload, fields)
    if kind in {"np", "obj"}:
        return payload[1]
    if kind == "cat":
        categories = _index_from(pd, payload[2])
        return pd.Categorical.from_codes(payload[1], categories=categories, ordered=payload[3])
    if kind == "tz":
        return pd.DatetimeIndex(payload[1]).tz_localize("UTC").tz_convert(payload[2])
    return pd.array(payload[2], dtype=_extension_dtype(pd, payload[1]))


def _extension_dtype(pd: Any, name: str) -> Any:
    """The pandas extension dtype called *name*; anything else is damage."""
    try:
        dtype = pd.api.types.pandas_dtype(name)
    except (TypeError, ValueError):
        _damage(f"unknown pandas dtype {name!r}")
    if not isinstance(dtype, pd.api.extensions.ExtensionDtype):
        _damage(f"{name!r} is not a pandas extension dtype")
    return dtype


_INDEX_FIELDS: dict[str, tuple[Any, ...]] = {
    "range": (str, int, int, int, _ANY),
    "multi": (str, list, list, list),
    "index": (str, list, _ANY, _OPT_STR),
}


def _index_from(pd: Any, payload: list[Any]) -> Any:
    kind = payload[0] if type(payload) is list and payload else None
    if not isinstance(kind, str) or kind not in _INDEX_FIELDS:
        _damage(f"unknown kind of pandas index {kind!r}")
    payload = _checked(payload, _INDEX_FIELDS[kind])
    if kind == "range":
        return pd.RangeIndex(payload[1], payload[2], payload[3], name=payload[4])
    if kind == "multi":
        levels = [_index_from(pd, p) for p in payload[1]]
        return pd.MultiIndex(levels=levels, codes=payload[2], names=payload[3])
    index = pd.Index(_column_values(pd, payload[1]), name=payload[2])
    if payload[3] is not None:
        index.freq = payload[3]
    return index


def _dtype(descr: Any) -> Any:
    """The dtype a stored description names; one that can hold Python objects is damage."""
    if not isinstance(descr, (str, list)):
        _damage(f"malformed dtype {descr!r}")
    dtype = _numpy().lib.format.descr_to_dtype(descr)
    if dtype.hasobject:  # no encoder writes one: object arrays are not stored raw
        _damage(f"dtype {descr!r} holds Python objects")
    return dtype


def _shape(shape: list[Any], order: str) -> list[int]:
    if not all(type(n) is int and n >= 0 for n in shape) or order not in {"C", "F"}:
        _damage("malformed array shape or order")
    return shape


def decode_ndarray_ref(dec: Decoder, payload: bytes) -> Any:
    """An array whose buffer follows the value in the file: a view of the file's buffer."""
    np = _numpy()
    descr, shape, order, indices = _fields(dec, payload, (_ANY, list, str, list))
    dtype = _dtype(descr)
    count = math.prod(_shape(shape, order))
    if not indices or not all(type(i) is int and 0 <= i < len(dec.buffers) for i in indices):
        _damage("malformed array: a buffer index out of range")
    if len(indices) == 1:
        offset, _ = dec.buffers[indices[0]]
        flat = np.frombuffer(dec.data, dtype=dtype, count=count, offset=offset)
        if not flat.flags.writeable:  # a read-only buffer (bytes): the array must be writable
            flat = flat.copy()
    else:  # split over several bins (over 4 GiB): joining them needs one copy
        parts = [memoryview(dec.data)[o : o + n] for o, n in (dec.buffers[i] for i in indices)]
        flat = np.frombuffer(bytearray(b"".join(parts)), dtype=dtype, count=count)
    return _shaped(flat, shape, order)


def _shaped(flat: Any, shape: list[int], order: str) -> Any:
    if order == "F":
        return flat.reshape(shape[::-1]).T
    return flat.reshape(shape)


def decode_ndarray(dec: Decoder, payload: bytes) -> Any:
    descr, shape, order, raw = _fields(dec, payload, (_ANY, list, str, bytes))
    dtype = _dtype(descr)
    flat = _numpy().frombuffer(bytearray(raw), dtype=dtype, count=math.prod(_shape(shape, order)))
    return _shaped(flat, shape, order)


def decode_npscalar(dec: Decoder, payload: bytes) -> Any:
    descr, raw = _fields(dec, payload, (_ANY, bytes))
    dtype = _dtype(descr)
    if dtype.itemsize == 0:  # np.str_("") and np.bytes_(b""): nothing to read
        return dtype.type()
    return _numpy().frombuffer(raw, dtype=dtype)[0]


def decode_dataframe(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    columns_p, index_p, cols = _fields(dec, payload, (list, list, list))
    index = _index_from(pd, index_p)
    data = {i: _column_values(pd, c) for i, c in enumerate(cols)}
    frame = pd.DataFrame(data, index=index)
    frame.columns = _index_from(pd, columns_p)
    return frame


def decode_series(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    name, index_p, column = _fields(dec, payload, (_ANY, list, list))
    return pd.Series(_column_values(pd, column), index=_index_from(pd, index_p), name=name)


def decode_timestamp(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    value, tz, unit = _fields(dec, payload, (int, _OPT_STR, str))
    stamp = pd.Timestamp(value, unit="ns")
    stamp = stamp if tz is None else stamp.tz_localize("UTC").tz_convert(tz)
    return stamp.as_unit(unit)


def decode_timedelta(dec: Decoder, payload: bytes) -> Any:
    value, unit = _fields(dec, payload, (int, str))
    return _pandas().Timedelta(value, unit="ns").as_unit(unit)


def decode_missing(_dec: Decoder, payload: bytes) -> Any:
    if payload not in {b"NA", b"NaT"}:
        _damage("malformed pandas missing value")
    pd = _pandas()
    return pd.NA if payload == b"NA" else pd.NaT


_codec_types.encode_array = encode
_codec_types._DECODERS.update(  # noqa: SLF001 - this module completes _codec_types
    {
        NDARRAY: decode_ndarray,
        NDARRAY_REF: decode_ndarray_ref,
        NPSCALAR: decode_npscalar,
        DATAFRAME: decode_dataframe,
        SERIES: decode_series,
        PD_INDEX: lambda dec, payload: _index_from(_pandas(), dec.unpack(payload)),
        PD_TIMESTAMP: decode_timestamp,
        PD_TIMEDELTA: decode_timedelta,
        PD_MISSING: decode_missing,
    }
)
