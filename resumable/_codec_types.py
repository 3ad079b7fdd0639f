"""
How Python values map to msgpack: native types as they are, the rest as ext types.

Decoding never imports a module named in the data and calls nothing but the constructors
of the kinds of value it knows: a class named in the data must be exactly the class of
that name and of the recorded kind, every payload must have the shape its encoder writes,
and anything else is refused as damage (:class:`Refused`), even when decoding for display.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import inspect
import io
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


class Refused(Undecodable):
    """
    The data names something the decoder must not construct, or has a shape no encoder
    writes: damage or tampering, never shown as a stand-in.
    """


def qualified_name(tp: type) -> str:
    """``module.QualName`` of a type, for messages."""
    module = tp.__module__
    return tp.__qualname__ if module == "builtins" else f"{module}.{tp.__qualname__}"


def _tz_key(tz: dt.tzinfo | None) -> str | None:
    """The IANA key of a ZoneInfo, so it survives the round trip; None otherwise."""
    key = getattr(tz, "key", None)
    return key if isinstance(key, str) else None


class Encoder:
    """Packs one value; collects out-of-band buffers and notes whether it pickled."""

    def __init__(self, *, allow_pickle: bool) -> None:
        self.allow_pickle = allow_pickle
        self.buffers: list[memoryview] = []
        self.pickled = False
        # One packer per level of nesting (an ext payload is packed while its container is):
        # made once per value, not once per tuple or datetime in it.
        self._packers: list[msgpack.Packer] = []
        self._depth = 0

    def pack(self, obj: object) -> bytes:
        # Strict UTF-8 first (with an error handler, msgpack encodes every str through a new
        # bytes object); a lone surrogate (a name from os.listdir) packs the value again.
        buffers, pickled, depth = len(self.buffers), self.pickled, self._depth
        if depth == len(self._packers):
            self._packers.append(msgpack.Packer(default=self.default, strict_types=True, use_bin_type=True))
        self._depth = depth + 1
        try:
            packed: bytes = self._packers[depth].pack(obj)
        except UnicodeEncodeError:
            del self.buffers[buffers:]
            self.pickled = pickled
            packer = msgpack.Packer(
                default=self.default, strict_types=True, use_bin_type=True, unicode_errors="surrogatepass"
            )
            packed = packer.pack(obj)
        finally:
            self._depth = depth
            if not depth:  # the value is packed: the packers (which hold self.default) and
                self._packers.clear()  # their buffers go now, not at the next garbage collection
        return packed

    def ext(self, code: int, payload: object) -> msgpack.ExtType:
        return msgpack.ExtType(code, self.pack(payload))

    def default(self, obj: object) -> object:
        tp = type(obj)
        handler = _ENCODERS.get(tp)
        if handler is not None:
            return handler(self, obj)
        kind = "enum" if isinstance(obj, enum.Enum) else object_kind(tp)
        if kind is not None:
            if not _importable(tp):
                why = "its class cannot be found by name when loading (it is defined inside a function)"
                return self.pickle_fallback(obj, why)
            if kind == "enum":
                return self.ext(ENUM, [tp.__module__, tp.__qualname__, obj.value])  # type: ignore[attr-defined]
            # pydantic's own pickle state (taken without pickling), or the fields
            state = obj.__getstate__() if kind == "pydantic" else dict(object_fields(obj) or ())
            return self.ext(OBJECT, [kind, tp.__module__, tp.__qualname__, state])
        encoded = encode_array(self, obj)
        if encoded is not None:
            return encoded
        return self.pickle_fallback(obj, "it has no msgpack encoding")

    def pickle_fallback(self, obj: object, why: str) -> msgpack.ExtType:
        _refuse_resource(obj)
        if not self.allow_pickle:
            msg = f"{why} and allow_pickle=False forbids the cloudpickle fallback"
            raise Unstorable(obj, msg)
        try:
            data = _pickle_checked(obj)
        except Unstorable:
            raise
        except Exception as exc:  # noqa: BLE001 - any pickling failure means "unstorable"
            msg = f"{why} and it cannot be pickled either ({type(exc).__name__}: {exc})"
            raise Unstorable(obj, msg) from None
        self.pickled = True
        return msgpack.ExtType(PICKLE, data)


def _pickle_checked(obj: object) -> bytes:
    """cloudpickle *obj*, refusing any OS resource inside it (it would come back as something else)."""
    import cloudpickle  # noqa: PLC0415 - heavy, needed only for the fallback

    class Checked(cloudpickle.Pickler):  # type: ignore[misc]
        def reducer_override(self, obj: object) -> Any:
            _refuse_resource(obj)
            return super().reducer_override(obj)

    out = io.BytesIO()
    Checked(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


# Kinds of OS resources (module, class names, what they are): an output holding one cannot
# be stored, and pickling would silently turn a file into a StringIO or fail obscurely.
# Looked up in sys.modules only: if the module is not imported, no such object exists.
_RESOURCES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("io", ("IOBase",), "an open file"),
    ("tempfile", ("_TemporaryFileWrapper", "SpooledTemporaryFile"), "an open file"),
    ("socket", ("socket",), "a socket"),
    ("_thread", ("LockType", "RLock"), "a lock"),
    ("threading", ("Thread", "Condition", "Semaphore", "Event", "Barrier"), "a thread or a lock"),
    ("multiprocessing.synchronize", ("SemLock", "Condition", "Event", "Barrier"), "a lock"),
    ("multiprocessing.process", ("BaseProcess",), "a process"),
    ("multiprocessing.connection", ("Connection",), "a pipe"),
    ("sqlite3", ("Connection", "Cursor", "Blob"), "a database connection"),
    ("asyncio", ("Future", "AbstractEventLoop", "Handle", "BaseTransport"), "an asyncio object"),
    ("asyncio", ("StreamReader", "StreamWriter", "AbstractServer"), "an asyncio object"),
    ("asyncio", ("Lock", "Event", "Semaphore", "Condition", "Queue", "Barrier"), "an asyncio lock or queue"),
    ("concurrent.futures", ("Executor", "Future"), "an executor or a future"),
    ("mmap", ("mmap",), "a memory map"),
    ("subprocess", ("Popen",), "a subprocess"),
    ("selectors", ("BaseSelector",), "a selector"),
)


def _os_resource(obj: object) -> str | None:
    """What kind of OS resource *obj* is (an open file, a socket, a lock ...), or None."""
    tp = type(obj)
    for module, names, what in _RESOURCES:
        mod = sys.modules.get(module)
        if mod is None:
            continue
        classes = tuple(c for c in (getattr(mod, n, None) for n in names) if isinstance(c, type))
        if classes and issubclass(tp, classes):
            if module == "io" and issubclass(tp, (mod.StringIO, mod.BytesIO)):
                return None  # in memory: stored like any other object
            return what
    # e.g. a connection of a database driver: it owns a file descriptor
    if callable(getattr(tp, "fileno", None)) and callable(getattr(tp, "close", None)):
        return "an object holding an OS handle (it has fileno() and close())"
    return None


def _refuse_resource(obj: object) -> None:
    """Raise Unstorable if *obj* is an OS resource or a generator: it cannot be stored."""
    if inspect.isgenerator(obj) or inspect.isasyncgen(obj) or inspect.iscoroutine(obj):
        raise Unstorable(obj, "generators and iterators cannot be stored: return a list instead")
    what = _os_resource(obj)
    if what is not None:
        msg = (
            f"it is {what}, which lives only in the process that opened it and cannot be "
            "stored: return the data it gives access to (a file's contents or path, query results ...)"
        )
        raise Unstorable(obj, msg)


def _importable(tp: type) -> bool:
    """True if the class can be found again by module and qualified name (not a local class)."""
    obj: Any = sys.modules.get(tp.__module__)
    for part in tp.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is tp


def object_kind(tp: type) -> str | None:
    """The kind of class *tp* is ("attrs", "dataclass" or "pydantic"), or None."""
    if attrs.has(tp):
        return "attrs"
    if dataclasses.is_dataclass(tp):
        return "dataclass"
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and issubclass(tp, pydantic.BaseModel):
        return "pydantic"
    return None


def object_fields(obj: Any) -> list[tuple[str, Any]] | None:
    """The fields of an attrs, dataclass or pydantic instance, or None."""
    kind = object_kind(type(obj))
    if kind == "attrs":
        return [(a.name, getattr(obj, a.name)) for a in attrs.fields(type(obj))]
    if kind == "dataclass":
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return list(obj) if kind == "pydantic" else None


def _encode_when(code: int) -> Callable[[Encoder, Any], object]:
    def encode(enc: Encoder, obj: Any) -> object:
        tz = obj.tzinfo
        if not (tz is None or type(tz) is dt.timezone or _tz_key(tz) is not None):
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
        pickled: bool = False,
    ) -> None:
        self.data = data
        self.buffers = buffers
        self.allow_pickle = allow_pickle
        self.pickled = pickled  # the header says the value holds pickles

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
        if not self.pickled:  # the encoder always declares its pickles: this one was slipped in
            _damage("it holds a pickle its header does not declare")
        if not self.allow_pickle:
            _refuse("it holds a pickled value and pickles are not allowed (allow_pickle=False)")
        return pickle.loads(payload)  # noqa: S301 - allowed by the caller, checksummed/authenticated


class StandInDecoder(Decoder):
    """
    Decodes what it can for display: values of classes that are not imported (or no longer
    exist) become dicts naming their class, and pickles (unless allowed) a placeholder.
    """

    def ext_hook(self, code: int, payload: bytes) -> Any:
        if code in {OBJECT, ENUM}:
            fields = self.unpack(payload)  # once: its items are decoded with it
            try:
                return (_enum_from if code == ENUM else _object_from)(fields)
            except Refused:
                raise
            except Undecodable:  # its fields have the right shape: they were checked first
                if code == ENUM:
                    return {"__enum__": f"{fields[0]}.{fields[1]}", "value": fields[2]}
                return {"__class__": f"{fields[1]}.{fields[2]}", **fields[3]}
        if code == PICKLE and self.pickled and not self.allow_pickle:
            return {"__pickled__": f"{len(payload)} bytes, not loaded (pickles are not allowed)"}
        return super().ext_hook(code, payload)


def _refuse(reason: str) -> NoReturn:
    raise Undecodable(reason)


def _damage(reason: str) -> NoReturn:
    raise Refused(reason)


FieldType = type | tuple[type, ...]


def _fields(dec: Decoder, payload: bytes, types: tuple[FieldType, ...]) -> list[Any]:
    """The payload's list of fields, refused unless it has exactly these types."""
    return _checked(dec.unpack(payload), types)


def _checked(fields: Any, types: tuple[FieldType, ...]) -> list[Any]:
    """*fields* (decoded) if it is a list of values of exactly these types; damage otherwise."""
    if type(fields) is not list or len(fields) != len(types):
        _damage(f"malformed value: expected {len(types)} fields, got a {type(fields).__name__}")
    for value, tp in zip(fields, types, strict=True):
        # bool is an int to isinstance, but no encoder writes one where an int belongs
        if not isinstance(value, tp) or (tp is int and type(value) is bool):
            _damage(f"malformed value: a {type(value).__name__} where {tp} belongs")
    return fields


def _attribute(obj: object, name: str) -> object:
    """``obj.name`` read from the object's own namespace: no ``__getattr__``, no descriptor runs."""
    try:
        namespace = vars(obj)
    except TypeError:
        return None
    return namespace.get(name)


def _find_class(module: str, qualname: str, kind: str, is_kind: Callable[[type], bool]) -> Any:
    """
    The class ``module.qualname`` among modules already imported (never import one):
    Undecodable if it is not there, Refused if the name leads to anything but a class of *kind*.
    """
    mod = sys.modules.get(module)
    if mod is None:
        _refuse(f"the stored value is a {module}.{qualname} ({kind}) but module {module!r} is not imported")
    obj: object = mod
    for part in qualname.split("."):
        obj = _attribute(obj, part)
    if obj is None:
        _refuse(f"the stored value is a {module}.{qualname} ({kind}) but it no longer exists")
    # The name must be the class's own: not a class reached through another module's
    # attribute (``mymodule.subprocess.Popen``), nor a function or any other object.
    if not (
        isinstance(obj, type) and obj.__module__ == module and obj.__qualname__ == qualname and is_kind(obj)
    ):
        _damage(f"the stored value names {module}.{qualname}, which is not a {kind} class")
    return obj


def _decode_path(dec: Decoder, payload: bytes) -> pathlib.PurePath:
    kind, text = _fields(dec, payload, (str, str))
    cls = _PATH_CLASSES.get(kind)
    if cls is None:
        _damage(f"unknown kind of path {kind!r}")
    path: pathlib.PurePath = cls(text)
    return path


def _enum_from(fields: Any) -> Any:
    module, qualname, value = _checked(fields, (str, str, object))
    cls = _find_class(module, qualname, "Enum", lambda c: issubclass(c, enum.Enum))
    try:
        return cls(value)
    except ValueError:
        _refuse(f"{module}.{qualname} has no member with value {value!r} any more")


_OBJECT_KINDS = frozenset({"attrs", "dataclass", "pydantic"})


def _object_from(fields: Any) -> Any:
    kind, module, qualname, state = _checked(fields, (str, str, str, dict))
    if kind not in _OBJECT_KINDS:
        _damage(f"unknown kind of object {kind!r}")
    cls = _find_class(module, qualname, kind, lambda c: object_kind(c) == kind)
    if not all(type(name) is str for name in state):
        _damage(f"malformed state of a {module}.{qualname}: a field name that is not a str")
    obj = cls.__new__(cls)
    if kind == "pydantic":
        obj.__setstate__(state)
        return obj
    fields = attrs.fields(cls) if kind == "attrs" else dataclasses.fields(cls)
    if {f.name for f in fields} != set(state):
        _refuse(f"the fields of {module}.{qualname} changed since the value was stored")
    for name, value in state.items():
        # Restore the stored state as pickle would: no __init__, converters or validators.
        object.__setattr__(obj, name, value)
    return obj


def _decode_when(dec: Decoder, payload: bytes, parse: Callable[[str], Any]) -> Any:
    iso, key, fold = _fields(dec, payload, (str, (str, type(None)), int))
    value = parse(iso)
    if key is not None:
        import zoneinfo  # noqa: PLC0415 - slow to import; only zone-aware values need it

        value = value.replace(tzinfo=zoneinfo.ZoneInfo(key))
    return value.replace(fold=fold)


def _not_an_array(_enc: Encoder, _obj: object) -> object:
    return None


# NumPy and pandas values: _codec_arrays (imported by _codec) sets this and adds its decoders.
encode_array: Callable[[Encoder, Any], object] = _not_an_array


def _sequence(make: Callable[[list[Any]], Any]) -> Callable[[Decoder, bytes], Any]:
    """A decoder for a tuple, set or frozenset: its payload must be a list."""

    def decode(dec: Decoder, payload: bytes) -> Any:
        items = dec.unpack(payload)
        if type(items) is not list:
            _damage(f"malformed value: a {type(items).__name__} where a list belongs")
        return make(items)

    return decode


def _decode_bigint(_dec: Decoder, payload: bytes) -> int:
    if not payload.lstrip(b"-").isdigit():
        _damage("malformed integer")
    return int(payload)


def _decode_uuid(_dec: Decoder, payload: bytes) -> uuid.UUID:
    if len(payload) != 16:
        _damage("malformed UUID")
    return uuid.UUID(bytes=payload)


_DECODERS: dict[int, Callable[[Decoder, bytes], Any]] = {
    TUPLE: _sequence(tuple),
    SET: _sequence(set),
    FROZENSET: _sequence(frozenset),
    BIGINT: _decode_bigint,
    DATETIME: lambda dec, p: _decode_when(dec, p, dt.datetime.fromisoformat),
    DATE: lambda _dec, p: dt.date.fromisoformat(p.decode()),
    TIME: lambda dec, p: _decode_when(dec, p, dt.time.fromisoformat),
    TIMEDELTA: lambda dec, p: dt.timedelta(*_fields(dec, p, (int, int, int))),
    DECIMAL: lambda _dec, p: decimal.Decimal(p.decode()),
    UUID: _decode_uuid,
    PATH: _decode_path,
    COMPLEX: lambda _dec, p: complex(*struct.unpack("<dd", p)),
    ENUM: lambda dec, p: _enum_from(dec.unpack(p)),
    OBJECT: lambda dec, p: _object_from(dec.unpack(p)),
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
    fields = object_fields(obj)
    if fields is not None:
        return [(v, f"{path}.{k}") for k, v in fields]
    state = getattr(obj, "__dict__", None)  # a plain object, pickled with its attributes
    if isinstance(state, dict) and not isinstance(obj, type):
        return [(v, f"{path}.{k}") for k, v in state.items()]
    return []
