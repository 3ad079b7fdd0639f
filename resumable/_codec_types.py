"""
How Python values map to msgpack: native types as they are, the rest as ext types.

NumPy buffers of :data:`OOB_MIN` bytes or more are not copied into the msgpack body:
the body holds a reference and the file carries the raw buffer after it (see _codec).
Decoding never imports a module named in the data: classes (attrs, dataclass,
pydantic, Enum) are looked up in ``sys.modules`` only, and pickles are refused unless
allowed.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import pathlib
import pickle
import struct
import sys
import uuid
from collections.abc import Callable
from typing import Any, NoReturn

import attrs
import msgpack

# Ext type codes: part of the file format, never renumber.
TUPLE, SET, FROZENSET, BIGINT, DATETIME, DATE, TIME, TIMEDELTA = range(1, 9)
# 13 was reserved for bytearray, which msgpack stores natively as bin (read back as bytes).
DECIMAL, UUID, PATH, COMPLEX, _RESERVED, ENUM, OBJECT = range(9, 16)
NDARRAY, NDARRAY_REF, NPSCALAR = 16, 17, 18
DATAFRAME, SERIES, PD_INDEX, PD_TIMESTAMP, PD_TIMEDELTA, PD_MISSING = range(19, 25)
PICKLE = 99

OOB_MIN = 64 * 1024  # buffers at least this large are written out of band, uncopied
_MAX_BIN = 2**32 - 1  # largest msgpack bin object
_PATH_KINDS: dict[type, str] = {
    pathlib.PosixPath: "posix",
    pathlib.WindowsPath: "windows",
    pathlib.PurePosixPath: "pure-posix",
    pathlib.PureWindowsPath: "pure-windows",
}
_PATH_CLASSES = {v: k for k, v in _PATH_KINDS.items()}


class Unstorable(Exception):  # noqa: N818 - internal signal, never escapes the codec
    """Raised by the encoder for an object it cannot store; carries the object."""

    def __init__(self, obj: object, reason: str) -> None:
        self.obj = obj
        self.reason = reason
        super().__init__(reason)


class Undecodable(Exception):  # noqa: N818 - internal signal, never escapes the codec
    """Raised by the decoder for data it refuses or cannot turn back into a value."""


def qualified_name(tp: type) -> str:
    """``module.QualName`` of a type, for messages."""
    module = tp.__module__
    return tp.__qualname__ if module == "builtins" else f"{module}.{tp.__qualname__}"


def _tz_key(tz: dt.tzinfo | None) -> str | None:
    """The IANA key of a ZoneInfo, so it survives the round trip; None otherwise."""
    key = getattr(tz, "key", None)
    return key if isinstance(key, str) else None


def _portable_tz(tz: dt.tzinfo | None) -> bool:
    return tz is None or type(tz) is dt.timezone or _tz_key(tz) is not None


class Encoder:
    """Packs one value; collects out-of-band buffers and notes whether it pickled."""

    def __init__(self, *, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.buffers: list[memoryview] = []
        self.pickled = False

    def pack(self, obj: object) -> bytes:
        packer = msgpack.Packer(
            default=self.default, strict_types=True, use_bin_type=True, unicode_errors="surrogatepass"
        )
        packed: bytes = packer.pack(obj)
        return packed

    def ext(self, code: int, payload: object) -> msgpack.ExtType:
        return msgpack.ExtType(code, self.pack(payload))

    def default(self, obj: object) -> object:  # noqa: PLR0911 - one dispatch
        tp = type(obj)
        handler = _ENCODERS.get(tp)
        if handler is not None:
            return handler(self, obj)
        kind = "enum" if isinstance(obj, enum.Enum) else _object_kind(obj)
        if kind is not None:
            if not _importable(tp):
                why = "its class cannot be found by name when loading (it is defined inside a function)"
                return self.pickle_fallback(obj, why)
            if kind == "enum":
                return self.ext(ENUM, [tp.__module__, tp.__qualname__, obj.value])  # type: ignore[attr-defined]
            return self.ext(OBJECT, [kind, tp.__module__, tp.__qualname__, _object_state(kind, obj)])
        np = sys.modules.get("numpy")
        if np is not None:
            if tp is np.ndarray and not obj.dtype.hasobject:  # type: ignore[attr-defined]
                return _codec_arrays().encode_ndarray(self, obj)
            if isinstance(obj, np.generic) and not isinstance(obj, np.object_):
                return self.ext(NPSCALAR, [_codec_arrays().descr(obj.dtype), obj.tobytes()])
        pd = sys.modules.get("pandas")
        if pd is not None:
            encoded = _codec_arrays().encode_pandas(self, pd, obj)
            if encoded is not None:
                return encoded
        return self.pickle_fallback(obj, "it has no msgpack encoding")

    def pickle_fallback(self, obj: object, why: str) -> msgpack.ExtType:
        if _is_generator_like(obj):
            msg = "generators and iterators cannot be stored: return a list instead"
            raise Unstorable(obj, msg)
        if not self.allow_pickle:
            msg = f"{why} and allow_pickle=False forbids the cloudpickle fallback"
            raise Unstorable(obj, msg)
        import cloudpickle  # noqa: PLC0415 - heavy, needed only for the fallback

        try:
            data = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - any pickling failure means "unstorable"
            msg = f"{why} and it cannot be pickled either ({type(exc).__name__}: {exc})"
            raise Unstorable(obj, msg) from None
        self.pickled = True
        return msgpack.ExtType(PICKLE, data)


def _importable(tp: type) -> bool:
    """True if the class can be found again by module and qualified name (not a local class)."""
    obj: Any = sys.modules.get(tp.__module__)
    for part in tp.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is tp


def _is_generator_like(obj: object) -> bool:
    import inspect  # noqa: PLC0415 - only on the slow path

    return inspect.isgenerator(obj) or inspect.isasyncgen(obj) or inspect.iscoroutine(obj)


def _object_kind(obj: object) -> str | None:
    tp = type(obj)
    if attrs.has(tp):
        return "attrs"
    if dataclasses.is_dataclass(tp):
        return "dataclass"
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(obj, pydantic.BaseModel):
        return "pydantic"
    return None


def _object_state(kind: str, obj: Any) -> dict[str, Any]:
    if kind == "attrs":
        return {a.name: getattr(obj, a.name) for a in attrs.fields(type(obj))}
    if kind == "dataclass":
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    # pydantic's own pickle state, taken without pickling
    state: dict[str, Any] = obj.__getstate__()
    return state


def _encode_when(code: int) -> Callable[[Encoder, Any], object]:
    def encode(enc: Encoder, obj: Any) -> object:
        if not _portable_tz(obj.tzinfo):
            return enc.pickle_fallback(obj, "its tzinfo is not a ZoneInfo or a fixed offset")
        return enc.ext(code, [obj.isoformat(), _tz_key(obj.tzinfo), obj.fold])

    return encode


def _encode_set(code: int) -> Callable[[Encoder, Any], object]:
    def encode(enc: Encoder, obj: Any) -> object:
        # Sort the packed elements: the file (and its checksum) must not depend on hash order.
        items = sorted(enc.pack(item) for item in obj)
        count = len(items)
        head = bytes([0x90 | count]) if count < 16 else struct.pack(">BI", 0xDD, count)
        return msgpack.ExtType(code, head + b"".join(items))

    return encode


_ENCODERS: dict[type, Callable[[Encoder, Any], object]] = {
    tuple: lambda enc, o: enc.ext(TUPLE, list(o)),
    set: _encode_set(SET),
    frozenset: _encode_set(FROZENSET),
    int: lambda _enc, o: msgpack.ExtType(BIGINT, str(o).encode()),
    dt.datetime: _encode_when(DATETIME),
    dt.date: lambda _enc, o: msgpack.ExtType(DATE, o.isoformat().encode()),
    dt.time: _encode_when(TIME),
    dt.timedelta: lambda enc, o: enc.ext(TIMEDELTA, [o.days, o.seconds, o.microseconds]),
    decimal.Decimal: lambda _enc, o: msgpack.ExtType(DECIMAL, str(o).encode()),
    uuid.UUID: lambda _enc, o: msgpack.ExtType(UUID, o.bytes),
    complex: lambda _enc, o: msgpack.ExtType(COMPLEX, struct.pack("<dd", o.real, o.imag)),
    **dict.fromkeys(_PATH_KINDS, lambda enc, o: enc.ext(PATH, [_PATH_KINDS[type(o)], str(o)])),
}


class Decoder:
    """Unpacks one value; *data* holds the whole file so out-of-band buffers can be viewed."""

    def __init__(
        self,
        data: bytes | bytearray | memoryview,
        buffers: list[tuple[int, int]],
        *,
        allow_pickle: bool,
    ) -> None:
        self.data = data
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self.readonly = memoryview(data).readonly

    def unpack(self, body: bytes | memoryview) -> Any:
        return msgpack.unpackb(
            body,
            ext_hook=self.ext_hook,
            raw=False,
            strict_map_key=False,
            timestamp=0,
            unicode_errors="surrogatepass",
        )

    def ext_hook(self, code: int, payload: bytes) -> Any:
        decode = _DECODERS.get(code)
        if decode is None:
            _refuse(f"unknown ext type {code}: written by a newer version of resumable?")
        return decode(self, payload)

    def _pickle(self, payload: bytes) -> Any:
        if not self.allow_pickle:
            _refuse("it holds a pickled value and pickles are not allowed (allow_pickle=False)")
        return pickle.loads(payload)  # noqa: S301 - allowed by the caller, checksummed/authenticated


class StandInDecoder(Decoder):
    """
    Decodes what it can for display: values of classes that are not imported become dicts
    naming their class, and pickles (unless allowed) a placeholder. Nothing is imported.
    """

    def ext_hook(self, code: int, payload: bytes) -> Any:
        if code == OBJECT:
            _, module, qualname, state = self.unpack(payload)
            try:
                return _decode_object(self, payload)
            except Undecodable:
                fields = state if isinstance(state, dict) else {"state": state}
                return {"__class__": f"{module}.{qualname}", **fields}
        if code == ENUM:
            module, qualname, value = self.unpack(payload)
            try:
                return _decode_enum(self, payload)
            except Undecodable:
                return {"__enum__": f"{module}.{qualname}", "value": value}
        if code == PICKLE and not self.allow_pickle:
            return {"__pickled__": f"{len(payload)} bytes, not loaded (pickles are not allowed)"}
        return super().ext_hook(code, payload)


def _refuse(reason: str) -> NoReturn:
    raise Undecodable(reason)


def _find_class(module: str, qualname: str, kind: str) -> Any:
    """Look a class up among modules already imported; never import one."""
    mod = sys.modules.get(module)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if mod is None or not isinstance(obj, type):
        where = f"module {module!r} is not imported" if mod is None else "it no longer exists"
        _refuse(f"the stored value is a {module}.{qualname} ({kind}) but {where}")
    return obj


def _decode_path(kind: str, text: str) -> pathlib.PurePath:
    path: pathlib.PurePath = _PATH_CLASSES[kind](text)
    return path


def _decode_enum(dec: Decoder, payload: bytes) -> Any:
    module, qualname, value = dec.unpack(payload)
    cls = _find_class(module, qualname, "Enum")
    try:
        return cls(value)
    except ValueError:
        _refuse(f"{module}.{qualname} has no member with value {value!r} any more")


def _decode_object(dec: Decoder, payload: bytes) -> Any:
    kind, module, qualname, state = dec.unpack(payload)
    cls = _find_class(module, qualname, kind)
    if _object_kind_of_class(cls) != kind:
        _refuse(f"{module}.{qualname} is no longer a {kind} class")
    obj = cls.__new__(cls)
    if kind == "pydantic":
        obj.__setstate__(state)
        return obj
    expected = {a.name for a in attrs.fields(cls)} if kind == "attrs" else None
    if expected is None:
        expected = {f.name for f in dataclasses.fields(cls)}
    if expected != set(state):
        _refuse(f"the fields of {module}.{qualname} changed since the value was stored")
    for name, value in state.items():
        # Restore the stored state as pickle would: no __init__, converters or validators.
        object.__setattr__(obj, name, value)
    return obj


def _object_kind_of_class(cls: type) -> str | None:
    if attrs.has(cls):
        return "attrs"
    if dataclasses.is_dataclass(cls):
        return "dataclass"
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(cls, pydantic.BaseModel):
        return "pydantic"
    return None


def _decode_when(dec: Decoder, payload: bytes, parse: Callable[[str], Any]) -> Any:
    iso, key, fold = dec.unpack(payload)
    value = parse(iso)
    if key is not None:
        import zoneinfo  # noqa: PLC0415 - only for zone-aware values

        value = value.replace(tzinfo=zoneinfo.ZoneInfo(key))
    return value.replace(fold=fold)


def _codec_arrays() -> Any:
    from . import _codec_arrays as module  # noqa: PLC0415 - only once a NumPy or pandas value is met

    return module


def _arrays(name: str) -> Callable[[Decoder, bytes], Any]:
    """A decoder from _codec_arrays, imported when first used."""

    def decode(dec: Decoder, payload: bytes) -> Any:
        function: Callable[[Decoder, bytes], Any] = getattr(_codec_arrays(), name)
        return function(dec, payload)

    return decode


_DECODERS: dict[int, Callable[[Decoder, bytes], Any]] = {
    TUPLE: lambda dec, p: tuple(dec.unpack(p)),
    SET: lambda dec, p: set(dec.unpack(p)),
    FROZENSET: lambda dec, p: frozenset(dec.unpack(p)),
    BIGINT: lambda _dec, p: int(p.decode()),
    DATETIME: lambda dec, p: _decode_when(dec, p, dt.datetime.fromisoformat),
    DATE: lambda _dec, p: dt.date.fromisoformat(p.decode()),
    TIME: lambda dec, p: _decode_when(dec, p, dt.time.fromisoformat),
    TIMEDELTA: lambda dec, p: dt.timedelta(*dec.unpack(p)),
    DECIMAL: lambda _dec, p: decimal.Decimal(p.decode()),
    UUID: lambda _dec, p: uuid.UUID(bytes=p),
    PATH: lambda dec, p: _decode_path(*dec.unpack(p)),
    COMPLEX: lambda _dec, p: complex(*struct.unpack("<dd", p)),
    ENUM: _decode_enum,
    OBJECT: _decode_object,
    NDARRAY: _arrays("decode_ndarray"),
    NDARRAY_REF: _arrays("decode_ndarray_ref"),
    NPSCALAR: _arrays("decode_npscalar"),
    DATAFRAME: _arrays("decode_dataframe"),
    SERIES: _arrays("decode_series"),
    PD_INDEX: _arrays("decode_index"),
    PD_TIMESTAMP: _arrays("decode_timestamp"),
    PD_TIMEDELTA: _arrays("decode_timedelta"),
    PD_MISSING: _arrays("decode_missing"),
    PICKLE: Decoder._pickle,  # noqa: SLF001
}


def find_path(root: object, target: object, name: str = "output") -> str:
    """Where *target* sits inside *root*, e.g. ``output['rows'][3].conn`` (best effort)."""
    seen: set[int] = set()
    stack: list[tuple[object, str]] = [(root, name)]
    while stack:
        obj, path = stack.pop()
        if obj is target:
            return path
        if id(obj) in seen or len(seen) > 100_000:
            continue
        seen.add(id(obj))
        stack.extend(_children(obj, path))
    return name


def _children(obj: object, path: str) -> list[tuple[object, str]]:
    if isinstance(obj, dict):
        pairs = list(obj.items())
        return [(v, f"{path}[{k!r}]") for k, v in pairs] + [(k, f"{path} key {k!r}") for k, _ in pairs]
    if isinstance(obj, (list, tuple)):
        return [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(v, f"{path} element") for v in obj]
    kind = _object_kind(obj)
    if kind in {"attrs", "dataclass"}:
        return [(v, f"{path}.{k}") for k, v in _object_state(kind, obj).items()]
    if kind == "pydantic":
        return [(v, f"{path}.{k}") for k, v in dict(obj).items()]  # type: ignore[call-overload]
    return []
