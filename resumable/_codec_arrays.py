"""
NumPy and pandas values in the codec (imported once such a value is met).

Arrays are stored as their raw buffer with dtype, shape and order; large buffers go out
of band (see :mod:`._codec`) and come back as views of the file's buffer, with no pickle
and no extra copy. pandas objects are stored column by column: NumPy columns as arrays,
object columns as lists, categoricals as codes and categories, zone-aware datetimes as
UTC with their zone, other extension dtypes as their values and dtype name.
"""

from __future__ import annotations

from typing import Any

import msgpack

from ._codec_types import (
    _MAX_BIN,
    DATAFRAME,
    NDARRAY,
    NDARRAY_REF,
    OOB_MIN,
    PD_INDEX,
    PD_MISSING,
    PD_TIMEDELTA,
    PD_TIMESTAMP,
    SERIES,
    Decoder,
    Encoder,
)


def descr(dtype: Any) -> object:
    import numpy as np  # noqa: PLC0415 - NumPy only when a NumPy value is seen

    return np.lib.format.dtype_to_descr(dtype)


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
    import numpy as np  # noqa: PLC0415 - pandas implies NumPy

    dtype = series.dtype
    if isinstance(dtype, np.dtype) and not dtype.hasobject:
        return ["np", series.to_numpy(copy=False)]
    if isinstance(dtype, np.dtype):
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


def _column_values(pd: Any, payload: list[Any]) -> Any:
    kind = payload[0]
    if kind in {"np", "obj"}:
        return payload[1]
    if kind == "cat":
        categories = _index_from(pd, payload[2])
        return pd.Categorical.from_codes(payload[1], categories=categories, ordered=payload[3])
    if kind == "tz":
        return pd.DatetimeIndex(payload[1]).tz_localize("UTC").tz_convert(payload[2])
    return pd.array(payload[2], dtype=payload[1])


def _index_from(pd: Any, payload: list[Any]) -> Any:
    kind = payload[0]
    if kind == "range":
        return pd.RangeIndex(payload[1], payload[2], payload[3], name=payload[4])
    if kind == "multi":
        levels = [_index_from(pd, p) for p in payload[1]]
        return pd.MultiIndex(levels=levels, codes=payload[2], names=payload[3])
    index = pd.Index(_column_values(pd, payload[1]), name=payload[2])
    if payload[3] is not None:
        index.freq = payload[3]
    return index


def decode_ndarray_ref(dec: Decoder, payload: bytes) -> Any:
    """An array whose buffer follows the value in the file: a view of the file's buffer."""
    import numpy as np  # noqa: PLC0415 - NumPy only when the data holds arrays

    descr, shape, order, indices = dec.unpack(payload)
    dtype = np.lib.format.descr_to_dtype(descr)
    count = _prod(shape)
    if len(indices) == 1:
        offset, _ = dec.buffers[indices[0]]
        flat = np.frombuffer(dec.data, dtype=dtype, count=count, offset=offset)
        if dec.readonly:
            flat = flat.copy()
    else:  # split over several bins (over 4 GiB): joining them needs one copy
        parts = [memoryview(dec.data)[o : o + n] for o, n in (dec.buffers[i] for i in indices)]
        flat = np.frombuffer(bytearray(b"".join(parts)), dtype=dtype, count=count)
    return _shaped(flat, shape, order)


def _prod(shape: list[int]) -> int:
    total = 1
    for n in shape:
        total *= n
    return total


def _shaped(flat: Any, shape: list[int], order: str) -> Any:
    if order == "F":
        return flat.reshape(shape[::-1]).T
    return flat.reshape(shape)


def decode_ndarray(dec: Decoder, payload: bytes) -> Any:
    import numpy as np  # noqa: PLC0415 - NumPy only when the data holds arrays

    descr, shape, order, raw = dec.unpack(payload)
    dtype = np.lib.format.descr_to_dtype(descr)
    flat = np.frombuffer(bytearray(raw), dtype=dtype, count=_prod(shape))
    return _shaped(flat, shape, order)


def decode_npscalar(dec: Decoder, payload: bytes) -> Any:
    import numpy as np  # noqa: PLC0415 - NumPy only when the data holds arrays

    descr, raw = dec.unpack(payload)
    dtype = np.lib.format.descr_to_dtype(descr)
    if dtype.itemsize == 0:  # np.str_("") and np.bytes_(b""): nothing to read
        return dtype.type()
    return np.frombuffer(raw, dtype=dtype)[0]


def _pandas() -> Any:
    import pandas as pd  # noqa: PLC0415 - pandas only when the data holds pandas values

    return pd


def decode_dataframe(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    columns_p, index_p, cols = dec.unpack(payload)
    index = _index_from(pd, index_p)
    data = {i: _column_values(pd, c) for i, c in enumerate(cols)}
    frame = pd.DataFrame(data, index=index)
    frame.columns = _index_from(pd, columns_p)
    return frame


def decode_series(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    name, index_p, column = dec.unpack(payload)
    return pd.Series(_column_values(pd, column), index=_index_from(pd, index_p), name=name)


def decode_timestamp(dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    value, tz, unit = dec.unpack(payload)
    stamp = pd.Timestamp(value, unit="ns")
    stamp = stamp if tz is None else stamp.tz_localize("UTC").tz_convert(tz)
    return stamp.as_unit(unit)


def decode_timedelta(dec: Decoder, payload: bytes) -> Any:
    value, unit = dec.unpack(payload)
    return _pandas().Timedelta(value, unit="ns").as_unit(unit)


def decode_missing(_dec: Decoder, payload: bytes) -> Any:
    pd = _pandas()
    return pd.NA if payload == b"NA" else pd.NaT


def decode_index(dec: Decoder, payload: bytes) -> Any:
    """A pandas Index."""
    return _index_from(_pandas(), dec.unpack(payload))
