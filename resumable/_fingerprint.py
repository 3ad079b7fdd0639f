"""
Argument digests: equal arguments give equal digests in every process.

A value is fed into SHA-256 as a tagged, length-prefixed byte string. Dicts and sets
are order-free (their encoded items are sorted), floats are hashed by their bits, and
NumPy arrays by dtype, shape and raw bytes. Objects returned by an earlier step are
not rehashed: the provenance registry maps them to the checksum of the stored output.
Anything without a stable meaning raises :class:`FingerprintError` rather than being
hashed by identity or by pickled bytes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import functools
import hashlib
import pathlib
import struct
import sys
import threading
import uuid
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from ._codec_types import qualified_name
from .exceptions import FingerprintError, ResumableWarning

_PACK_LEN = struct.Struct("<Q").pack
_PACK_FLOAT = struct.Struct("<d").pack
_PACK_COMPLEX = struct.Struct("<dd").pack
_PATH_TAGS: dict[type, bytes] = {
    pathlib.PosixPath: b"pp",
    pathlib.PurePosixPath: b"pp",
    pathlib.WindowsPath: b"pw",
    pathlib.PureWindowsPath: b"pw",
}


class _Unhashable(Exception):  # noqa: N818 - internal signal turned into FingerprintError
    def __init__(self, where: str, obj: object, detail: str = "") -> None:
        self.where = where
        self.obj = obj
        self.detail = detail
        super().__init__(where)


class StoredOutput:
    """
    A skipped step's output that has not been loaded (the pipeline runner's lazy value).

    A step taking it as an argument gets the same fingerprint as with the loaded value,
    without loading or rehashing it: small outputs carry their value's digest (taken when
    they were stored), larger ones are known by their stored checksum, exactly as when a
    step is called with the output another step returned.
    """

    __slots__ = ("_load", "_loaded", "_value", "digest", "slot", "value_digest")

    def __init__(
        self, slot: str, digest: str, load: Callable[[], Any], value_digest: str | None = None
    ) -> None:
        self.slot = slot
        self.digest = digest
        self.value_digest = value_digest
        self._load = load
        self._loaded = False
        self._value: Any = None

    def __repr__(self) -> str:
        return f"<stored output of {self.slot!r}>"

    @property
    def arg_digest(self) -> str:
        """What this output contributes to the fingerprint of a step it is passed to."""
        if self.value_digest is not None:
            return self.value_digest
        return hashlib.sha256(b"@" + self.digest.encode()).hexdigest()

    def get(self) -> Any:
        """Load (once) and return the value."""
        if not self._loaded:
            self._value = self._load()
            self._loaded = True
        return self._value


class _Provenance:
    """Maps live objects returned by steps to the digest of their stored output."""

    _MAX_STRONG = 256  # outputs that cannot be weakly referenced are held, at most this many

    def __init__(self) -> None:
        # id -> (the object or a weak reference to it, digest, probe, weak?)
        self._entries: dict[int, tuple[Any, str, object, bool]] = {}
        self._strong: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self.changed = 0  # outputs found changed in place, for a warning

    def remember(self, obj: object, digest: str) -> None:
        tp = type(obj)
        if tp in _SCALARS or tp is tuple or tp is frozenset:
            return  # small immutable values may be shared singletons: always hash them
        if (tp is str or tp is bytes) and len(obj) < _MIN_REMEMBERED:  # type: ignore[arg-type]
            return
        key = id(obj)
        probe = _probe(obj)
        with self._lock:
            try:
                ref = weakref.ref(obj, functools.partial(self._forget, key))
            except TypeError:  # lists and dicts cannot be weakly referenced: hold them
                self._entries[key] = (obj, digest, probe, False)
                self._strong[key] = None
                self._strong.move_to_end(key)
                while len(self._strong) > self._MAX_STRONG:
                    old, _ = self._strong.popitem(last=False)
                    self._entries.pop(old, None)
            else:
                self._entries[key] = (ref, digest, probe, True)
                self._strong.pop(key, None)

    def _forget(self, key: int, ref: object) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] is ref:
                del self._entries[key]

    def lookup(self, obj: object) -> str | None:
        """The stored digest of *obj*, or None if it is unknown or was changed in place."""
        entry = self._entries.get(id(obj))
        if entry is None:
            return None
        held, digest, probe, weak = entry
        if (held() if weak else held) is not obj:
            return None
        if probe is not None and _probe(obj) != probe:
            self._entries.pop(id(obj), None)
            self.changed += 1
            return None
        return digest

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._strong.clear()


def _ids(items: Iterable[object]) -> int:
    return hash(tuple(map(id, items)))


def _probe(obj: object) -> object:
    """
    A cheap summary that changes when *obj* is changed in place: which objects a container
    holds (not what they hold), or for arrays their buffer, shape and a sample of their bytes.
    """
    if isinstance(obj, (list, set)):
        return _ids(obj)
    if isinstance(obj, dict):
        return (_ids(obj), _ids(obj.values()))
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.itemsize == 0:
            return None
        flat = obj.reshape(-1)
        sample = hashlib.sha256()
        for part in (flat[:: max(1, flat.size // 256)], flat[:512], flat[-512:]):
            sample.update(memoryview(np.ascontiguousarray(part).view("uint8")))
        return (obj.shape, obj.dtype.str, obj.__array_interface__["data"][0], sample.digest())
    fields = _fields_of(obj)
    if fields is not None:
        return _ids(value for _, value in fields)
    return None


provenance = _Provenance()
# str/bytes outputs shorter than this are rehashed (cheap); short ones may be interned or shared
_MIN_REMEMBERED = 4096
_SCALARS: frozenset[type] = frozenset({type(None), bool, int, float, complex})


class _Feeder:
    """Turns a value into the canonical byte string that is hashed."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active: set[int] = set()

    def feed(self, out: bytearray, obj: Any, where: str) -> None:  # noqa: C901, PLR0912
        tp = type(obj)
        simple = _SIMPLE.get(tp)
        if simple is not None:
            out += simple(obj)
            return
        if tp is StoredOutput:
            out += b"&" + bytes.fromhex(obj.arg_digest)
            return
        origin = provenance.lookup(obj)
        if origin is not None:
            out += b"@" + origin.encode()
            return
        if tp is list or tp is tuple:
            out += (b"l" if tp is list else b"t") + _PACK_LEN(len(obj))
            self._enter(obj, where)
            for i, item in enumerate(obj):
                self.feed(out, item, f"{where}[{i}]")
            self.active.discard(id(obj))
        elif tp is dict:
            self._enter(obj, where)
            items = []
            for k, v in obj.items():
                item = bytearray()
                self.feed(item, k, f"{where} key {k!r}")
                self.feed(item, v, f"{where}[{k!r}]")
                items.append(bytes(item))
            self.active.discard(id(obj))
            self._sorted(out, b"d", items)
        elif tp is set or tp is frozenset:
            items = []
            for v in obj:
                item = bytearray()
                self.feed(item, v, f"{where} element {v!r}")
                items.append(bytes(item))
            self._sorted(out, b"S", items)
        elif isinstance(obj, enum.Enum):
            out += b"E" + _text(qualified_name(tp))
            self.feed(out, obj.value, f"{where}.value")
        elif getattr(tp, "__resumable_fingerprint__", None) is not None and not isinstance(obj, type):
            try:
                stable = obj.__resumable_fingerprint__()
            except Exception as exc:
                raise _Unhashable(where, obj, f"its __resumable_fingerprint__() raised {exc!r}") from exc
            out += b"R" + _text(qualified_name(tp))
            self.feed(out, stable, f"{where}.__resumable_fingerprint__()")
        else:
            fields = _fields_of(obj)
            if fields is None:
                self._special(out, obj, where)
                return
            out += b"O" + _text(qualified_name(tp))
            self._enter(obj, where)
            for name, value in fields:
                out += _text(name)
                self.feed(out, value, f"{where}.{name}")
            self.active.discard(id(obj))

    def _enter(self, obj: object, where: str) -> None:
        if id(obj) in self.active:
            raise _Unhashable(where, obj, "it contains itself")
        self.active.add(id(obj))

    @staticmethod
    def _sorted(out: bytearray, tag: bytes, items: list[bytes]) -> None:
        items.sort()
        out += tag + _PACK_LEN(len(items))
        for item in items:
            out += _PACK_LEN(len(item)) + item

    def _special(self, out: bytearray, obj: Any, where: str) -> None:
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                out += b"a" + _text(str(obj.shape))
                self.feed(out, obj.tolist(), where)
                return
            data = np.ascontiguousarray(obj)
            body = hashlib.sha256(memoryview(data.reshape(-1).view("uint8"))).digest()
            descr = str(np.lib.format.dtype_to_descr(obj.dtype))  # structured dtypes in full
            out += b"A" + _text(descr) + _text(str(obj.shape)) + body
            return
        if np is not None and isinstance(obj, np.generic):
            out += b"n" + _text(obj.dtype.str) + obj.tobytes()
            return
        pd = sys.modules.get("pandas")
        if pd is not None and isinstance(obj, (pd.DataFrame, pd.Series, pd.Index)):
            self._pandas(out, pd, obj, where)
            return
        if pd is not None and isinstance(obj, (pd.Timestamp, pd.Timedelta)):
            # nanoseconds and the zone, which the datetime/timedelta digests would drop
            out += b"t" + _text(type(obj).__name__) + _text(str(obj.value))
            out += _text(str(getattr(obj, "tz", None)))
            return
        if isinstance(obj, (str, bytes, int, float, dt.date, dt.time, dt.timedelta, pathlib.PurePath)):
            # subclasses of supported scalars (e.g. a str subclass): hash as the base type
            base = next(b for b in type(obj).__mro__ if b in _SIMPLE)
            out += b"~" + _SIMPLE[base](obj)
            return
        raise _Unhashable(where, obj)

    def _pandas(self, out: bytearray, pd: Any, obj: Any, where: str) -> None:
        try:
            hashed = pd.util.hash_pandas_object(obj, index=True).to_numpy()
        except TypeError as exc:
            raise _Unhashable(where, obj, str(exc)) from None
        out += b"P" + _text(type(obj).__name__) + hashlib.sha256(hashed.tobytes()).digest()
        frame = isinstance(obj, pd.DataFrame)
        index = obj if isinstance(obj, pd.Index) else obj.index
        labels = {
            "columns": list(obj.columns) if frame else None,
            "column_names": list(obj.columns.names) if frame else None,
            "index_names": list(index.names),
            "name": None if frame else obj.name,
            "dtypes": [_dtype_label(pd, d) for d in (obj.dtypes if frame else [obj.dtype])],
        }
        self.feed(out, labels, where)


def _dtype_label(pd: Any, dtype: Any) -> object:
    if isinstance(dtype, pd.CategoricalDtype):  # the categories and their order are part of it
        return ["category", list(dtype.categories), bool(dtype.ordered)]
    return str(dtype)


def _fields_of(obj: object) -> Iterable[tuple[str, Any]] | None:
    tp = type(obj)
    if attrs.has(tp):
        return [(a.name, getattr(obj, a.name)) for a in attrs.fields(tp)]
    if dataclasses.is_dataclass(tp):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]  # type: ignore[arg-type]
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(obj, pydantic.BaseModel):
        return list(obj)
    return None


def _text(s: str) -> bytes:
    b = s.encode("utf-8", "surrogatepass")
    return _PACK_LEN(len(b)) + b


def _tz(value: dt.datetime | dt.time) -> bytes:
    key = getattr(value.tzinfo, "key", None)
    return _text(key if isinstance(key, str) else "")


_SIMPLE: dict[type, Callable[[Any], bytes]] = {
    type(None): lambda _o: b"N",
    bool: lambda o: b"T" if o else b"F",
    int: lambda o: b"i" + _text(str(o)),
    float: lambda o: b"f" + _PACK_FLOAT(o),
    complex: lambda o: b"c" + _PACK_COMPLEX(o.real, o.imag),
    str: lambda o: b"s" + _text(o),
    bytes: lambda o: b"b" + _PACK_LEN(len(o)) + o,
    bytearray: lambda o: b"b" + _PACK_LEN(len(o)) + bytes(o),
    memoryview: lambda o: b"b" + _PACK_LEN(o.nbytes) + o.tobytes(),
    dt.datetime: lambda o: b"D" + _text(o.isoformat()) + _tz(o) + bytes([o.fold]),
    dt.date: lambda o: b"a" + _text(o.isoformat()),
    dt.time: lambda o: b"h" + _text(o.isoformat()) + _tz(o) + bytes([o.fold]),
    dt.timedelta: lambda o: b"e" + _text(f"{o.days},{o.seconds},{o.microseconds}"),
    decimal.Decimal: lambda o: b"m" + _text(str(o)),
    uuid.UUID: lambda o: b"u" + o.bytes,
    **dict.fromkeys(_PATH_TAGS, lambda o: _PATH_TAGS[type(o)] + _text(str(o))),
}


def digest_value(value: object) -> str:
    """Digest of one value (raises ``_Unhashable`` for unsupported values)."""
    out = bytearray()
    _Feeder().feed(out, value, "value")
    return hashlib.sha256(out).hexdigest()


def is_fingerprintable(value: object) -> bool:
    """True if :func:`digest_value` accepts *value*."""
    try:
        digest_value(value)
    except (_Unhashable, RecursionError):
        return False
    return True


def digest_arguments(step: str, arguments: Mapping[str, Any], ignore: frozenset[str]) -> str:
    """
    Digest of a step's bound arguments, minus those in *ignore*.

    Raises:
        FingerprintError: an argument has no stable digest.
    """
    out = bytearray()
    feeder = _Feeder()
    changed = provenance.changed
    for name, value in arguments.items():
        if name in ignore:
            continue
        out += _text(name)
        if type(value) is StoredOutput:
            out += bytes.fromhex(value.arg_digest)
            continue
        # Each argument adds the digest of its value (digest_value), which is what a stored
        # small output records, so the runner can fingerprint it without loading it.
        item = bytearray()
        try:
            feeder.feed(item, value, name)
        except _Unhashable as exc:
            tp = qualified_name(type(exc.obj))
            raise FingerprintError(step, name, exc.where, tp, exc.detail) from None
        except RecursionError:
            raise FingerprintError(
                step, name, name, qualified_name(type(value)), "nested too deeply"
            ) from None
        out += hashlib.sha256(item).digest()
    if provenance.changed != changed:
        warnings.warn(
            ResumableWarning(
                f"step {step!r}: an argument is the output of an earlier step that was changed in "
                "place after it was returned, so it is fingerprinted by its content. Copy outputs "
                "before changing them, or make the change inside a step."
            ),
            stacklevel=4,
        )
    return hashlib.sha256(out).hexdigest()[:32]
