"""
Argument digests: equal arguments give equal digests in every process.

A value is turned into a canonical byte stream hashed with BLAKE3: plain scalars as msgpack
writes them, dicts and sets in a canonical order, NumPy arrays by dtype, shape and bytes.
A step output passed on counts as its content; only an output that has no digest of its
own (a pickled object) is known by its stored checksum, while it still encodes to the
stored bytes (:class:`_Provenance`). Anything else raises :class:`FingerprintError`
rather than being hashed by identity or by pickled bytes.
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import logging
import math
import pathlib
import struct
import sys
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from operator import itemgetter
from typing import Any, NamedTuple

import blake3
import msgpack

from ._checksum import hasher
from ._codec import encode, value_checksum
from ._codec_types import _tz_key, object_fields, qualified_name
from ._files import file_digests
from .exceptions import FingerprintError, SerializationError

log = logging.getLogger("resumable")


class _Unhashable(Exception):  # noqa: N818 - internal signal turned into FingerprintError
    def __init__(self, obj: object, detail: str = "") -> None:
        self.obj = obj
        self.detail = detail
        # where in the value it is, innermost first: an int for an item, ".name", "['key']"
        self.path: list[str | int] = []
        super().__init__(detail)


class StoredOutput:
    """A skipped step's output not loaded yet: as an argument it counts as the loaded value would."""

    __slots__ = ("_load", "_loaded", "_value", "digest", "plain_digest", "slot")

    def __init__(
        self, slot: str, digest: str, load: Callable[[], Any], plain_digest: str | None = None
    ) -> None:
        self.slot, self.digest, self.plain_digest = slot, digest, plain_digest
        self._load = load
        self._loaded = False
        self._value: Any = None

    def __repr__(self) -> str:
        return f"<stored output of {self.slot!r}>"

    @property
    def arg_digest(self) -> str:
        return self.plain_digest or stored_argument_digest(self.digest)

    def get(self) -> Any:
        if not self._loaded:
            self._value = self._load()
            self._loaded = True
        return self._value


class Outputs(Mapping[str, Any]):
    """Outputs by step name or key, in order; a :class:`StoredOutput` is loaded when first used."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self._data = data

    def __getitem__(self, key: str) -> Any:
        value = self._data[key]
        return value.get() if isinstance(value, StoredOutput) else value

    def __contains__(self, key: object) -> bool:
        return key in self._data  # (without loading the value, as Mapping's would)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        return f"<outputs {list(self._data)}>"


class _Entry(NamedTuple):
    checksum: str  # the stored file's checksum of the value bytes
    pads: tuple[int, ...]  # its buffers' padding, to lay a re-encoding out the same way
    ref: weakref.ref[Any] | None  # where the type allows one
    tp: type
    baseline: str  # what it encodes to in this process (a pickle may differ from the stored bytes)


class _Provenance:
    """
    The step outputs (returned or loaded) that have no digest of their own, each with the
    checksum of its stored value. Nothing is held alive, and a stored checksum is used only
    after the object was encoded again to the very bytes stored: an object changed in place
    or a new one at a reused address is fingerprinted by what it holds now.
    """

    MAX_ENTRIES = 4096

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest first
        self._lock = threading.Lock()

    def remember(
        self, obj: object, checksum: str, pads: tuple[int, ...] = (), *, loaded_pickle: bool = False
    ) -> None:
        """Remember that *obj* is the value stored with *checksum* (a loaded pickle by its encoding now)."""
        try:
            ref: weakref.ref[Any] | None = weakref.ref(obj)
        except TypeError:
            ref = None
        try:
            baseline = _encoding_checksum(obj, pads) if loaded_pickle else checksum
        except _Unhashable:
            return
        with self._lock:
            self._entries.pop(id(obj), None)  # (re)inserted last: the oldest entries go first
            self._entries[id(obj)] = _Entry(checksum, pads, ref, type(obj), baseline)
            if len(self._entries) > self.MAX_ENTRIES:
                self._entries.popitem(last=False)

    def check(self, obj: object) -> tuple[bool, str] | None:
        """
        None if *obj* is not a remembered output with no digest of its own, else (True, the
        stored digest) while it encodes to the stored bytes, (False, its encoding's) after.
        """
        entry = self._entries.get(id(obj))
        if entry is None or type(obj) is not entry.tp or (entry.ref is not None and entry.ref() is not obj):
            return None
        if is_fingerprintable(obj):
            return None
        actual = _encoding_checksum(obj, entry.pads)
        if actual == entry.baseline:
            return True, entry.checksum.partition(":")[2]
        return False, actual.partition(":")[2]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def _encoding_checksum(obj: object, pads: tuple[int, ...]) -> str:
    try:
        encoded = encode(obj, allow_pickle=True)
    except SerializationError as exc:
        raise _Unhashable(obj, f"it cannot be encoded ({exc})") from None
    return value_checksum(encoded, pads)


provenance = _Provenance()


# --------------------------------------------------------------------------------------
# the canonical stream
#
# Plain scalars (exact None, bool, int of up to 64 bits, float, str, bytes) are written as
# msgpack writes them, so that a list of them is one call of msgpack's C packer. Everything
# else starts with 0xC1, the one byte msgpack never writes, and a tag. Every encoding ends
# where its own header says, so the concatenation of encodings can be read back one way only.

_LEAVES: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})
_NATURAL: frozenset[type] = frozenset({str, int, bytes})  # totally ordered: keys sorted as they are

# the item types of a list of dicts, and of rows
_ONLY_DICTS: frozenset[type] = frozenset({dict})
_ONLY_ROWS: tuple[frozenset[type], ...] = (frozenset({tuple}), frozenset({list}))
_LIST, _TUPLE = b"\xc1l", b"\xc1t"
_SEQ_TAGS: dict[type, bytes] = {list: _LIST, tuple: _TUPLE}
_ROWS = b"\xc1r"  # a list or tuple of lists (or of tuples) of plain scalars
_RECORDS = b"\xc1k"  # a list or tuple of dicts: the columns of each part
_DICT, _SET = b"\xc1d", b"\xc1S"
_BIG_INT = b"\xc1I"
_SURROGATES = b"\xc1z"  # a str holding lone surrogates
_UNPACKABLE = (OverflowError, UnicodeEncodeError)  # a plain scalar needing _Feeder._leaf
_STORED = b"\xc1@"  # a step output passed on unchanged: its stored checksum
_CHANGED = b"\xc1#"  # a step output changed in place that has no digest of its own: its encoding
_LAZY = b"\xc1&"  # a StoredOutput

_CHUNK = 8192  # items packed per call of msgpack
_PART = 8192  # dicts taken as one table: part of the format
_LARGE = 1 << 20  # bytes buffered before they are hashed
_DIRECT = 1 << 16  # bytes hashed where they are rather than copied to the buffer

SLOW_AFTER = 1.0
"""Seconds after which a fingerprint still going is announced (one INFO line)."""
_clock = time.monotonic


def _pack_surrogates(obj: Any) -> bytes:
    return msgpack.packb(obj, unicode_errors="surrogatepass")  # type: ignore[no-any-return]


def stored_argument_digest(digest: str) -> str:
    """The argument digest (hex) of a step output passed on unchanged, stored with *digest*."""
    return blake3.blake3(_STORED + msgpack.packb(digest)).hexdigest()


class _Feeder:
    """
    Turns values into the canonical byte stream and hashes it. Containers are looked at a
    level at a time, so that lists of plain scalars, rows and records (dicts with the same
    keys, column by column) are written by msgpack's C packer; the way a value takes
    depends only on what it holds.
    """

    def __init__(self, describe: Callable[[], str] | None = None, *, outputs: bool = False) -> None:
        """*describe* says what is fingerprinted, if it ever takes long."""
        self.active: set[int] = set()  # ids of the containers being walked, to refuse cycles
        self.outputs = outputs  # second pass: step outputs with no digest are known by their checksum
        self.paths = False  # True once a Path was fed: the digest then depends on its files
        self.out = bytearray()
        self._hasher = blake3.blake3()
        packer = msgpack.Packer(use_bin_type=True, buf_size=1024)
        self._pack: Callable[[Any], bytes] = packer.pack
        self._header: Callable[[int], bytes] = packer.pack_array_header
        self.capturing = 0  # > 0 while encodings are made to be sorted: nothing is hashed
        self._describe = describe
        self._deadline = _clock() + SLOW_AFTER if describe is not None else math.inf

    def _text(self, obj: Any) -> bytes:
        """Names, tags and the text of other scalars (a path's text may hold lone surrogates)."""
        try:
            return self._pack(obj)
        except UnicodeEncodeError:
            return _pack_surrogates(obj)

    def _leaf(self, obj: Any) -> bytes:
        """A plain scalar msgpack cannot write as it is: an int beyond 64 bits, a str with lone surrogates."""
        try:
            return self._pack(obj)
        except OverflowError:
            return _BIG_INT + self._pack(str(obj))
        except UnicodeEncodeError:
            return _SURROGATES + _pack_surrogates(obj)

    def digest(self) -> bytes:
        """The BLAKE3 digest (32 bytes) of the stream."""
        self._hasher.update(self.out)
        if self._describe is not None:
            self._tick()  # a value hashed without a look at the clock is announced now
        return bytes(self._hasher.digest())

    def _write(self, data: bytes | memoryview) -> None:
        """Append *data* to the stream: the buffer is hashed once it is large, a large piece where it is."""
        if self.capturing or len(data) < _DIRECT:
            self.out += data
            if self.capturing or len(self.out) < _LARGE:
                return
            self._hasher.update(self.out)
        else:  # hashed where it is, not copied
            self._hasher.update(self.out)
            self._hasher.update(data)
        self.out.clear()  # the same buffer: callers hold it
        self._tick()

    def _tick(self) -> None:
        """Announce (once) a fingerprint that has been going on for over SLOW_AFTER seconds."""
        if _clock() > self._deadline and self._describe is not None:
            self._deadline = math.inf
            log.info(
                "%s takes over %s s to fingerprint; arguments and the values a step reads are "
                "fingerprinted at every call, skips included",
                self._describe(),
                f"{SLOW_AFTER:g}",
            )

    # values -----------------------------------------------------------------------------

    def feed(self, obj: Any) -> None:
        tp = type(obj)
        if tp in _LEAVES:
            packed = self._leaf(obj)
            if len(packed) < _DIRECT:
                self.out += packed  # most leaves: a call fewer
            else:
                self._write(packed)
        elif self.outputs and self._output(obj):
            return
        elif tp is dict:
            self._dict(obj)
        elif tp is list or tp is tuple:
            self._sequence(obj, _SEQ_TAGS[tp])
        else:
            self._other(obj, tp)

    def _other(self, obj: Any, tp: type) -> None:
        scalar = _OTHER_SCALARS.get(tp)
        if scalar is not None:
            self.out += scalar(obj, self._text)
        elif isinstance(obj, pathlib.Path):  # a file by its contents, a directory by its files
            self.paths = True
            contents = file_digests.digest(obj)
            if contents is None:  # nothing there: by its name
                self.out += _PURE_POSIX + self._text(str(obj))
            else:
                self.out += _FILE + self._text(contents)
        elif tp is StoredOutput:
            self.out += _LAZY + bytes.fromhex(obj.arg_digest)
        elif tp is set or tp is frozenset:
            self.out += _SET
            self._sorted(list(obj), " element ")
        else:
            self._content(obj, tp)

    def _content(self, obj: Any, tp: type) -> None:
        """An Enum, an object with __resumable_fingerprint__, an attrs/dataclass/pydantic instance ..."""
        if isinstance(obj, enum.Enum):
            self.out += _ENUM + self._text(qualified_name(tp))
            self._inside(obj.value, ".value")
        elif getattr(tp, "__resumable_fingerprint__", None) is not None and not isinstance(obj, type):
            try:
                stable = obj.__resumable_fingerprint__()
            except Exception as exc:
                raise _Unhashable(obj, f"its __resumable_fingerprint__() raised {exc!r}") from exc
            self.out += _METHOD + self._text(qualified_name(tp))
            self._inside(stable, ".__resumable_fingerprint__()")
        else:
            fields = object_fields(obj)
            if fields is None:
                self._special(obj)
                return
            self._enter(obj)
            self.out += _OBJECT + self._text(qualified_name(tp)) + self._header(len(fields))
            for name, value in fields:
                self.out += self._text(name)
                self._inside(value, f".{name}")
            self.active.discard(id(obj))

    def _output(self, obj: object) -> bool:
        """A step output with no digest of its own: its stored checksum (or its encoding's, if changed)."""
        found = provenance.check(obj)
        if found is None:
            return False
        unchanged, digest = found
        self.out += (_STORED if unchanged else _CHANGED) + self._text(digest)
        return True

    def _inside(self, obj: object, where: str) -> None:
        try:
            self.feed(obj)
        except _Unhashable as exc:
            exc.path.append(where)
            raise

    def _enter(self, obj: object) -> None:
        if id(obj) in self.active:
            raise _Unhashable(obj, "it contains itself")
        self.active.add(id(obj))

    # containers -------------------------------------------------------------------------

    def _sequence(self, obj: list[Any] | tuple[Any, ...], tag: bytes) -> None:
        types = set(map(type, obj))
        if types <= _LEAVES:
            self.out += tag
            self._scalars(obj)
            return
        if types == _ONLY_DICTS:
            self._records(obj, tag)
            return
        rows = types in _ONLY_ROWS
        if rows and set(map(type, chain.from_iterable(obj))) <= _LEAVES:
            self.out += _ROWS + tag + _SEQ_TAGS[types.pop()]
            self._scalars(obj)
            self._tick()
            return
        self._enter(obj)
        self.out += tag
        self._items(obj)
        self.active.discard(id(obj))

    def _items(self, items: list[Any] | tuple[Any, ...]) -> None:
        self.out += self._header(len(items))
        self._parts(items, 0, self.feed)

    def _listed(self, items: list[Any], where: str, names: list[Any]) -> None:
        """Keys, values or elements; the i-th is called ``where.format(names[i])`` in messages."""
        try:
            self._sequence(items, _LIST)
        except _Unhashable as exc:
            if exc.path and type(exc.path[-1]) is int:
                exc.path[-1] = where.format(names[exc.path[-1]])
            raise

    def _scalars(self, items: list[Any] | tuple[Any, ...]) -> None:
        """Plain scalars (or rows of them): an array header, then as msgpack writes them, in chunks."""
        if len(items) <= _CHUNK:
            try:  # most lists: the header and the items in one piece
                packed = self._pack(items)
            except _UNPACKABLE:
                pass  # item by item, below
            else:
                self._write(packed)
                return
        self.out += self._header(len(items))
        for start in range(0, len(items), _CHUNK):
            chunk = items[start : start + _CHUNK]
            try:
                self._write(memoryview(self._pack(chunk))[len(self._header(len(chunk))) :])
            except _UNPACKABLE:
                for item in chunk:
                    if type(item) in _LEAVES:
                        self._write(self._leaf(item))
                    else:
                        self._items(item)
            if start:
                self._tick()

    def _records(self, rows: list[dict[Any, Any]] | tuple[dict[Any, Any], ...], tag: bytes) -> None:
        """
        Dicts, in parts of _PART: a part whose dicts have the same keys is a table (its keys
        in canonical order, then one column per key, fed as any list), others dict by dict.
        """
        self._enter(rows)
        self.out += _RECORDS + tag + self._header(len(rows))
        for start in range(0, len(rows), _PART):
            part = rows[start : start + _PART]
            table = self._table(part)
            if table is None:
                self.out += b"g"
                self._parts(part, start, self._dict)
                continue
            keys, columns = table
            self.out += b"k"
            self._sequence(keys, _LIST)
            for key, column in zip(keys, columns, strict=True):
                try:
                    self._sequence(column, _LIST)
                except _Unhashable as exc:
                    if exc.path and type(exc.path[-1]) is int:  # row i of the part: rows[start + i][key]
                        exc.path[-1:] = [f"[{key!r}]", start + exc.path[-1]]
                    raise
            self._tick()
        self.active.discard(id(rows))

    @staticmethod
    def _parts(part: list[Any] | tuple[Any, ...], start: int, feed: Callable[[Any], None]) -> None:
        for i, row in enumerate(part):
            try:
                feed(row)
            except _Unhashable as exc:
                exc.path.append(start + i)
                raise

    def _table(
        self, part: list[dict[Any, Any]] | tuple[dict[Any, Any], ...]
    ) -> tuple[list[Any], list[list[Any]]] | None:
        """The keys (in canonical order) and columns of dicts that all have the same plain keys, or None."""
        if len(set(map(len, part))) != 1:
            return None
        keys = list(part[0])
        if not set(map(type, keys)) <= _LEAVES:
            return None
        keys = self._ordered(keys, " key ")
        try:
            return keys, [list(map(itemgetter(key), part)) for key in keys]
        except KeyError:
            return None

    def _dict(self, obj: dict[Any, Any]) -> None:
        """A dict: its keys in canonical order, then its values in that order (two lists)."""
        self._enter(obj)
        self.out += _DICT
        keys = self._sorted(list(obj), " key ")
        self._listed(list(map(obj.__getitem__, keys)), "[{!r}]", keys)
        self.active.discard(id(obj))

    def _sorted(self, items: list[Any], label: str) -> list[Any]:
        """Write dict keys or set elements as a list in their canonical order; return them in that order."""
        types = set(map(type, items))
        if len(types) == 1 and types <= _NATURAL:  # plain scalars, sorted as they are
            items.sort()
            self.out += _LIST
            self._scalars(items)
            return items
        items = self._ordered(items, label)
        self._listed(items, label + "{!r}", items)
        return items

    def _ordered(self, items: list[Any], label: str) -> list[Any]:
        """
        Dict keys or set elements in their canonical order: the natural order when they are
        all str, all int or all bytes, else the order of their encodings.
        """
        if len(items) < 2:
            return items
        types = set(map(type, items))
        if len(types) == 1 and types <= _NATURAL:
            return sorted(items)
        encoded = []
        self.capturing += 1
        try:
            for item in items:
                mark = len(self.out)
                try:
                    self.feed(item)
                except _Unhashable as exc:
                    exc.path.append(f"{label}{item!r}")
                    raise
                encoded.append(bytes(self.out[mark:]))
                del self.out[mark:]
        finally:
            self.capturing -= 1
        order = sorted(range(len(items)), key=encoded.__getitem__)
        return [items[i] for i in order]

    # other values -----------------------------------------------------------------------

    def _special(self, obj: Any) -> None:
        np = sys.modules.get("numpy")
        if np is not None and self._numpy(np, obj):
            return
        pd = sys.modules.get("pandas")
        if pd is not None and isinstance(obj, (pd.DataFrame, pd.Series, pd.Index)):
            self._pandas(pd, obj)
            return
        if pd is not None and isinstance(obj, (pd.Timestamp, pd.Timedelta)):
            # nanoseconds and the zone, which the datetime/timedelta digests would drop
            tz = str(getattr(obj, "tz", None))
            self.out += _PANDAS_TIME + self._text([type(obj).__name__, str(obj.value), tz])
            return
        if isinstance(obj, (str, bytes, int, float)):  # subclasses of plain scalars: as their base
            self.out += _SUBCLASS + self._leaf(obj)
            return
        if isinstance(obj, (dt.date, dt.time, dt.timedelta, pathlib.PurePath)):
            base = next(b for b in type(obj).__mro__ if b in _OTHER_SCALARS)
            self.out += _SUBCLASS + _OTHER_SCALARS[base](obj, self._text)
            return
        raise _Unhashable(obj)

    def _numpy(self, np: Any, obj: Any) -> bool:
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                self.out += _OBJECT_ARRAY + self._text(list(obj.shape))
                self.feed(obj.tolist())
                return True
            data = np.ascontiguousarray(obj)
            descr = str(np.lib.format.dtype_to_descr(obj.dtype))  # structured dtypes in full
            # its own BLAKE3 (on several threads when large), then in the stream
            body = hasher(memoryview(data.reshape(-1).view("uint8")))
            self.out += _ARRAY + self._text([descr, list(obj.shape)]) + body.digest()
            self._tick()
            return True
        if isinstance(obj, np.generic):
            self.out += _NUMPY_SCALAR + self._text([obj.dtype.str, obj.tobytes()])
            return True
        if isinstance(obj, np.dtype) or (isinstance(obj, type) and issubclass(obj, np.generic)):
            try:  # np.float32 and np.dtype("f4") alike (they compare equal)
                descr = str(np.lib.format.dtype_to_descr(np.dtype(obj)))
            except (TypeError, ValueError) as exc:  # an abstract type (np.floating)
                raise _Unhashable(obj, str(exc)) from None
            self.out += _DTYPE + self._text(descr)
            return True
        return False

    def _pandas(self, pd: Any, obj: Any) -> None:
        try:
            hashed = pd.util.hash_pandas_object(obj, index=True).to_numpy()
        except TypeError as exc:
            raise _Unhashable(obj, str(exc)) from None
        self.out += _PANDAS + self._text([type(obj).__name__, hashed.nbytes])
        self._write(memoryview(hashed.tobytes()))
        frame = isinstance(obj, pd.DataFrame)
        index = obj if isinstance(obj, pd.Index) else obj.index
        labels = {
            "columns": list(obj.columns) if frame else None,
            "column_names": list(obj.columns.names) if frame else None,
            "index_names": list(index.names),
            "name": None if frame else obj.name,
            "dtypes": [_dtype_label(pd, d) for d in (obj.dtypes if frame else [obj.dtype])],
        }
        self.feed(labels)


def _dtype_label(pd: Any, dtype: Any) -> object:
    if isinstance(dtype, pd.CategoricalDtype):  # the categories and their order are part of it
        return ["category", list(dtype.categories), bool(dtype.ordered)]
    return str(dtype)


_ENUM, _METHOD, _OBJECT, _SUBCLASS = b"\xc1E", b"\xc1R", b"\xc1O", b"\xc1~"
_ARRAY, _OBJECT_ARRAY, _NUMPY_SCALAR = b"\xc1A", b"\xc1a", b"\xc1n"
_DTYPE = b"\xc1y"
_PANDAS, _PANDAS_TIME = b"\xc1P", b"\xc1T"
_PURE_POSIX, _PURE_WINDOWS, _FILE = b"\xc1p", b"\xc1w", b"\xc1F"
_PACK_COMPLEX = struct.Struct("<dd").pack


Pack = Callable[[Any], bytes]

# Scalars other than the plain ones, by exact type: their encodings.
_OTHER_SCALARS: dict[type, Callable[[Any, Pack], bytes]] = {
    complex: lambda o, _p: b"\xc1c" + _PACK_COMPLEX(o.real, o.imag),
    bytearray: lambda o, p: b"\xc1b" + p(bytes(o)),
    memoryview: lambda o, p: b"\xc1b" + p(o.tobytes()),
    dt.datetime: lambda o, p: b"\xc1D" + p([o.isoformat(), _tz_key(o.tzinfo) or "", o.fold]),
    dt.date: lambda o, p: b"\xc1j" + p(o.isoformat()),
    dt.time: lambda o, p: b"\xc1h" + p([o.isoformat(), _tz_key(o.tzinfo) or "", o.fold]),
    dt.timedelta: lambda o, p: b"\xc1e" + p([o.days, o.seconds, o.microseconds]),
    decimal.Decimal: lambda o, p: b"\xc1m" + p(str(o)),
    uuid.UUID: lambda o, _p: b"\xc1u" + o.bytes,
    pathlib.PurePosixPath: lambda o, p: _PURE_POSIX + p(str(o)),
    pathlib.PureWindowsPath: lambda o, p: _PURE_WINDOWS + p(str(o)),
}


def _size(value: object) -> str:
    """How big *value* is, for a message: its type and length (or bytes)."""
    name = qualified_name(type(value))
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return f"{name} of {nbytes:,} bytes"
    try:
        n = len(value)  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - only for a message
        return name
    return f"{name} of {n:,} items"


def digest_value(value: object, *, describe: str | None = None) -> str:
    """Digest of one value (hex); *describe* names it if it takes long (e.g. "step 'a': global 'ROWS'")."""
    feeder = _Feeder(None if describe is None else lambda: f"{describe} ({_size(value)})")
    feeder.feed(value)
    return feeder.digest().hex()


def content_digest(value: object) -> str | None:
    """:func:`digest_value`, kept with a stored output; None if it has none or holds a ``Path``."""
    feeder = _Feeder()
    try:
        feeder.feed(value)
    except (_Unhashable, RecursionError):
        return None
    return None if feeder.paths else feeder.digest().hex()


def is_fingerprintable(value: object) -> bool:
    """True if :func:`digest_value` accepts *value*."""
    try:
        digest_value(value)
    except (_Unhashable, RecursionError):
        return False
    return True


def argument_digest(step: str, name: str, value: object) -> bytes:
    """The digest of one argument (32 bytes); FingerprintError if it has no stable digest."""
    if type(value) is StoredOutput:
        return bytes.fromhex(value.arg_digest)

    def describe() -> str:
        return f"step {step!r}: argument {name!r} ({_size(value)})"

    feeder = _Feeder(describe)
    try:
        try:
            feeder.feed(value)
        except _Unhashable:  # it may hold outputs with no digest of their own: by their stored checksum
            feeder = _Feeder(describe, outputs=True)
            feeder.feed(value)
    except _Unhashable as exc:
        tp = qualified_name(type(exc.obj))
        where = name + "".join(f"[{p}]" if type(p) is int else str(p) for p in reversed(exc.path))
        raise FingerprintError(step, name, where, tp, exc.detail) from None
    except RecursionError:
        raise FingerprintError(step, name, name, qualified_name(type(value)), "nested too deeply") from None
    return feeder.digest()


def digest_parameters(
    step: str, arguments: Mapping[str, Any], ignore: frozenset[str]
) -> tuple[str, dict[str, str]]:
    """
    Digest of a step's bound arguments, minus those in *ignore*, and a short digest of each
    (to tell which parameters changed); FingerprintError if one has no stable digest.
    """
    out = bytearray()
    params: dict[str, str] = {}
    for name, value in arguments.items():
        if name in ignore:
            continue
        digest = argument_digest(step, name, value)
        params[name] = digest[:8].hex()
        out += msgpack.packb(name) + digest
    return blake3.blake3(out).hexdigest()[:32], params
