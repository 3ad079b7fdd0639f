"""
Argument digests: equal arguments give equal digests in every process.

A value is fed into SHA-256 as a tagged, length-prefixed byte string. Dicts and sets
are order-free (their encoded items are sorted), floats are hashed by their bits, and
NumPy arrays by dtype, shape and the BLAKE3 hash of their raw bytes. A value's digest
depends on what it holds, never on where it came from: a step's output passed back
gives the digest its content gives. Only an earlier step's output that has no digest of
its own (an object stored by pickle) is known by the checksum of its stored output, as
long as it still encodes to the stored bytes (see :class:`_Provenance`). Anything else
without a stable meaning raises :class:`FingerprintError` rather than being hashed by
identity or by pickled bytes.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import hashlib
import pathlib
import struct
import sys
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import attrs

from ._codec_types import qualified_name
from ._files import file_digests
from .exceptions import FingerprintError, SerializationError

_PACK_LEN = struct.Struct("<Q").pack
_PACK_FLOAT = struct.Struct("<d").pack
_PACK_COMPLEX = struct.Struct("<dd").pack
_PATH_TAGS: dict[type, bytes] = {pathlib.PurePosixPath: b"pp", pathlib.PureWindowsPath: b"pw"}


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
    without loading or rehashing it: the digest of its content, stored with it (or, for a
    value that has none, the checksum of the stored value).
    """

    __slots__ = ("_load", "_loaded", "_value", "digest", "plain_digest", "slot")

    def __init__(
        self, slot: str, digest: str, load: Callable[[], Any], plain_digest: str | None = None
    ) -> None:
        self.slot = slot
        self.digest = digest
        # the digest of the value's content, stored with it (None if it has none)
        self.plain_digest = plain_digest
        self._load = load
        self._loaded = False
        self._value: Any = None

    def __repr__(self) -> str:
        return f"<stored output of {self.slot!r}>"

    @property
    def arg_digest(self) -> str:
        """What this output contributes to the fingerprint of a step it is passed to."""
        if self.plain_digest is not None:
            return self.plain_digest
        return hashlib.sha256(b"@" + self.digest.encode()).hexdigest()

    def get(self) -> Any:
        """Load (once) and return the value."""
        if not self._loaded:
            self._value = self._load()
            self._loaded = True
        return self._value


_NO_WEAKREF: set[type] = {dict, list, tuple}  # types known to refuse weak references


class _Entry(NamedTuple):
    checksum: str  # the stored file's checksum of the value bytes
    pads: tuple[int, ...]  # its buffers' padding, to lay a re-encoding out the same way
    ref: weakref.ref[Any] | None  # a weak reference where the type allows one (identity is then exact)
    tp: type
    # what it encodes to in this process, where that may differ from the stored bytes (a
    # pickle of a class defined in a script names that class by a per-process id)
    baseline: str


class _Provenance:
    """
    Remembers which live objects were returned by steps (or loaded from their outputs) that
    have no digest of their own, and the checksum of the stored value each one was.

    Nothing is held alive: objects are known by ``id`` (and a weak reference where their type
    allows one). A stored checksum is only ever used after the object has been encoded again
    and found to give the very bytes that were stored, so an object changed in place (at any
    depth) or a new object at a reused address is fingerprinted by what it holds now.
    """

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def remember(
        self, obj: object, checksum: str, pads: tuple[int, ...] = (), *, loaded_pickle: bool = False
    ) -> None:
        """
        Remember that *obj* is the value stored with *checksum*. A value just decoded from
        bytes holding a pickle (*loaded_pickle*) is encoded once more now: pickles are not
        byte-stable across processes, and later checks compare with what it encodes to here.
        """
        ref: weakref.ref[Any] | None = None  # lists, dicts, tuples: known by id, checked by content
        if type(obj) not in _NO_WEAKREF:
            try:
                ref = weakref.ref(obj)
            except TypeError:
                _NO_WEAKREF.add(type(obj))
        baseline = None
        if loaded_pickle:
            try:
                baseline = self._encoding_checksum(obj, pads, like=checksum)
            except _Unhashable:
                return  # it cannot be encoded again: it is fingerprinted as it is when passed on
        entry = _Entry(checksum, pads, ref, type(obj), baseline or checksum)
        key = id(obj)
        entries = self._entries
        with self._lock:
            entries.pop(key, None)  # (re)inserted last: the oldest entries go first
            entries[key] = entry
            if len(entries) > self.MAX_ENTRIES:
                entries.popitem(last=False)  # O(1), where a dict's first key is a scan

    def entry(self, obj: object) -> _Entry | None:
        """What is remembered of *obj* if it (or an object at its address) is a step output."""
        entry = self._entries.get(id(obj))
        if entry is None or type(obj) is not entry.tp:
            return None
        if entry.ref is not None and entry.ref() is not obj:
            return None
        return entry

    def check(self, obj: object, entry: _Entry) -> tuple[bool, str]:
        """
        ``(True, stored digest)`` if *obj* still encodes to the stored bytes, else ``(False,
        digest of what it encodes to now)``.

        Raises:
            _Unhashable: it cannot be encoded any more.
        """
        actual = self._encoding_checksum(obj, entry.pads, like=entry.baseline)
        if actual == entry.baseline:
            return True, entry.checksum.partition(":")[2]
        return False, actual.partition(":")[2]

    @staticmethod
    def _encoding_checksum(obj: object, pads: tuple[int, ...], like: str | None = None) -> str:
        from ._codec import encode, value_checksum  # noqa: PLC0415 - the codec imports NumPy lazily

        try:
            encoded = encode(obj, allow_pickle=True)
        except SerializationError as exc:
            raise _Unhashable("value", obj, f"it cannot be encoded ({exc})") from None
        return value_checksum(encoded, pads, like)

    def lookup(self, obj: object) -> str | None:
        """The stored digest of *obj* if it is a step output that is unchanged, else None."""
        entry = self.entry(obj)
        if entry is None:
            return None
        try:
            unchanged, digest = self.check(obj, entry)
        except _Unhashable:
            return None
        return digest if unchanged else None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __bool__(self) -> bool:
        return bool(self._entries)


provenance = _Provenance()


class _Feeder:
    """Turns a value into the canonical byte string that is hashed."""

    __slots__ = ("active", "outputs", "paths")

    def __init__(self, *, outputs: bool = False) -> None:
        self.active: set[int] = set()
        self.paths = False  # True once a Path was fed: the digest then depends on its files
        # a second pass, for a value that has no digest of its own: step outputs that cannot
        # be fingerprinted are known by their stored checksum (see _Provenance)
        self.outputs = outputs

    def feed(self, out: bytearray, obj: Any, where: str) -> None:
        tp = type(obj)
        simple = _SIMPLE.get(tp)
        if simple is not None:
            out += simple(obj)
            return
        if isinstance(obj, pathlib.Path):  # a file by its contents, a directory by its files
            self.paths = True
            contents = file_digests.digest(obj)
            out += (
                _PATH_TAGS[pathlib.PurePosixPath] + _text(str(obj)) if contents is None else b"F" + contents
            )
            return
        if tp is StoredOutput:
            out += b"&" + bytes.fromhex(obj.arg_digest)
            return
        if self.outputs:
            entry = provenance.entry(obj)
            if entry is not None and not is_fingerprintable(obj):
                # as stored: the stored checksum; changed in place since: that of its encoding now
                unchanged, digest = provenance.check(obj, entry)
                out += (b"@" if unchanged else b"#") + digest.encode()
                return
        self._content(out, obj, where)

    def _content(self, out: bytearray, obj: Any, where: str) -> None:  # noqa: C901
        """Feed what *obj* holds (its type is not a simple one)."""
        tp = type(obj)
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

    def _special(self, out: bytearray, obj: Any, where: str) -> None:  # noqa: PLR0911 - one return per kind
        np = sys.modules.get("numpy")
        if np is not None and isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                out += b"a" + _text(str(obj.shape))
                self.feed(out, obj.tolist(), where)
                return
            import blake3  # noqa: PLC0415 - loaded with the first array, as NumPy is

            data = np.ascontiguousarray(obj)
            # BLAKE3, threaded for large arrays: an array passed on is hashed at every call
            flat = memoryview(data.reshape(-1).view("uint8"))
            body = blake3.blake3(flat, max_threads=blake3.blake3.AUTO).digest()
            descr = str(np.lib.format.dtype_to_descr(obj.dtype))  # structured dtypes in full
            out += b"A" + _text(descr) + _text(str(obj.shape)) + body
            return
        if np is not None and isinstance(obj, np.generic):
            out += b"n" + _text(obj.dtype.str) + obj.tobytes()
            return
        if np is not None and (
            isinstance(obj, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.generic))
        ):
            try:  # np.float32 and np.dtype("f4") alike (they compare equal)
                descr = str(np.lib.format.dtype_to_descr(np.dtype(obj)))
            except (TypeError, ValueError) as exc:  # an abstract type (np.floating)
                raise _Unhashable(where, obj, str(exc)) from None
            out += b"y" + _text(descr)
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


def content_digest(value: object) -> str | None:
    """
    The digest of *value* as an argument (:func:`digest_value`), kept with a stored output:
    None if it has none, or if it holds a ``Path`` (whose files may change after it is stored).
    """
    out = bytearray()
    feeder = _Feeder()
    try:
        feeder.feed(out, value, "value")
    except (_Unhashable, RecursionError):
        return None
    return None if feeder.paths else hashlib.sha256(out).hexdigest()


def is_fingerprintable(value: object) -> bool:
    """True if :func:`digest_value` accepts *value*."""
    try:
        digest_value(value)
    except (_Unhashable, RecursionError):
        return False
    return True


def argument_digest(step: str, name: str, value: object, feeder: _Feeder | None = None) -> bytes:
    """
    The digest of one argument (32 bytes): the SHA-256 of its canonical bytes, which for a
    stored output is what :attr:`StoredOutput.arg_digest` says without loading it.

    Raises:
        FingerprintError: the argument has no stable digest.
    """
    if type(value) is StoredOutput:
        return bytes.fromhex(value.arg_digest)
    item = bytearray()
    try:
        try:
            (feeder or _Feeder()).feed(item, value, name)
        except _Unhashable:
            if not provenance:
                raise
            item.clear()  # a step output that has no digest of its own may be in it
            _Feeder(outputs=True).feed(item, value, name)
    except _Unhashable as exc:
        tp = qualified_name(type(exc.obj))
        raise FingerprintError(step, name, exc.where, tp, exc.detail) from None
    except RecursionError:
        raise FingerprintError(step, name, name, qualified_name(type(value)), "nested too deeply") from None
    return hashlib.sha256(item).digest()


def digest_arguments(step: str, arguments: Mapping[str, Any], ignore: frozenset[str]) -> str:
    """
    Digest of a step's bound arguments, minus those in *ignore*.

    Raises:
        FingerprintError: an argument has no stable digest.
    """
    return digest_parameters(step, arguments, ignore)[0]


def digest_parameters(
    step: str, arguments: Mapping[str, Any], ignore: frozenset[str]
) -> tuple[str, dict[str, str]]:
    """
    Digest of a step's bound arguments, minus those in *ignore*, and a short digest of each
    (to tell which parameters changed).

    Raises:
        FingerprintError: an argument has no stable digest.
    """
    out = bytearray()
    feeder = _Feeder()
    params: dict[str, str] = {}
    for name, value in arguments.items():
        if name in ignore:
            continue
        digest = argument_digest(step, name, value, feeder)
        params[name] = digest[:8].hex()
        out += _text(name)
        out += digest
    return hashlib.sha256(out).hexdigest()[:32], params
