"""
The output file format: a msgpack header, the msgpack value, then raw buffers.

A stored output is a stream of msgpack objects, so any msgpack reader can open it::

    {header}            format, slot, fingerprint, created_at, encoding, checksum, size,
                        buffers, hsum (a digest of the header itself), mac (with a secret)
    value               the value; large NumPy buffers replaced by references
    nil* bin32 ...      each large buffer: nil padding so its bytes start 64-byte aligned, then
                        a bin object holding the raw bytes (read back without copying)

``checksum`` is the BLAKE3 hash of everything after the header and doubles as the value's
digest when the value is passed to another step. With a secret, ``mac`` is an
HMAC-SHA256 of the header (which holds the checksum), so the whole file is authenticated
before anything in it is decoded.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import blake3
import msgpack

from . import _codec_arrays  # noqa: F401 - adds NumPy and pandas values to the codec
from ._checksum import PREFIX, checksum
from ._codec_types import Decoder, Encoder, StandInDecoder, Undecodable, Unstorable, find_path, qualified_name
from .exceptions import SerializationError, StateFormatError

FORMAT = 1
_ALIGN = 64
_BIN32 = 5  # bytes of a bin32 object's prefix
_MAC_PREFIX = "hmac-sha256:"
_HEAD_GUESS = 4096
_HEAD_MAX = 64 * 1024 * 1024  # no real header comes near this; a damaged length field might

Buffer = bytes | bytearray | memoryview


class DamagedFileError(Exception):
    """A stored file is unreadable, truncated, tampered with or refused; carries the reason."""


def utcnow() -> str:
    """The current UTC time as ISO 8601 with a ``Z`` suffix (millisecond precision)."""
    seconds, ns = divmod(time.time_ns(), 1_000_000_000)
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(seconds))}.{ns // 1_000_000:03d}Z"


class Encoded(NamedTuple):
    """A value packed and ready to be framed: the body and its out-of-band buffers."""

    body: bytes
    buffers: list[memoryview]
    pickled: bool


def encode(value: object, *, allow_pickle: bool, what: str = "the output") -> Encoded:
    """
    Pack *value* for storage.

    Raises:
        SerializationError: *value* (or something inside it) cannot be stored; the message
            names *what* and where the offending object sits.
    """
    encoder = Encoder(allow_pickle=allow_pickle)
    try:
        body = encoder.pack(value)
    except Unstorable as exc:
        where = find_path(value, exc.obj)
        type_name = qualified_name(type(exc.obj))
        msg = f"cannot store {what}: {where} is a {type_name}, and {exc.reason}."
        raise SerializationError(msg, where=where, type_name=type_name) from None
    except ValueError as exc:
        reason = "it contains itself or is nested too deeply" if "recursion" in str(exc) else str(exc)
        msg = f"cannot store {what}: {reason}."
        raise SerializationError(msg) from None
    except (OverflowError, TypeError) as exc:
        msg = f"cannot store {what}: {type(exc).__name__}: {exc}."
        raise SerializationError(msg) from None
    return Encoded(body, encoder.buffers, encoder.pickled)


_NO_CHECKSUM, _NO_HSUM, _NO_MAC = PREFIX + "0" * 64, "0" * 32, _MAC_PREFIX + "0" * 64
_HSUM_VALUE = 2 + 32  # a packed 32-character str (str8)
_MAC_FIELD = 4 + 2 + len(_MAC_PREFIX) + 64  # the packed "mac" key and its value


def _header_sum(raw_header: Buffer, *, signed: bool) -> str:
    """
    A digest of the packed header up to the value of ``hsum`` (which comes last, before
    ``mac``), so a damaged header is caught like a damaged value, without re-packing it.
    """
    end = len(raw_header) - _HSUM_VALUE - (_MAC_FIELD if signed else 0)
    return blake3.blake3(memoryview(raw_header)[:end]).digest(16).hex()  # hexdigest()[:32], sooner


def _sign(header: Mapping[str, Any], secret: bytes) -> str:
    unsigned = {k: v for k, v in header.items() if k != "mac"}
    mac = hmac.new(secret, msgpack.packb(unsigned), hashlib.sha256).hexdigest()
    return _MAC_PREFIX + mac


class Framed(NamedTuple):
    """An output ready to be written: its header (packed: *head*) and value chunks."""

    header: dict[str, Any]
    head: bytes
    value_chunks: list[Buffer]

    @property
    def size(self) -> int:
        """Total size of the file in bytes."""
        return len(self.head) + int(self.header["size"])

    def chunks(self) -> list[Buffer]:
        """The whole file as a list of chunks, header first."""
        return [self.head, *self.value_chunks]


def _lay_out(header: dict[str, Any], body_len: int) -> None:
    """Set the buffers' padding and the value size in *header* (its placeholders keep its length)."""
    # Padding depends on the header's length, and "size" on the padding: iterate to a fixed
    # point (pads are < 64, always one msgpack byte, so this settles at once in practice).
    header["size"] = body_len + sum(_BIN32 + n for _, n in header["buffers"])  # padding aside
    while True:
        head_len = len(msgpack.packb(header))
        position = head_len + body_len
        for entry in header["buffers"]:
            entry[0] = -(position + _BIN32) % _ALIGN
            position += entry[0] + _BIN32 + entry[1]
        if header["size"] == position - head_len:
            return
        header["size"] = position - head_len


def frame(
    encoded: Encoded, meta: Mapping[str, Any], *, secret: bytes | None = None, dated: bool = True
) -> Framed:
    """Frame *encoded* as an output file with header *meta*, and ``created_at`` if *dated*."""
    header: dict[str, Any] = {"format": FORMAT, **meta}
    if dated:
        header["created_at"] = utcnow()
    # placeholders of the final lengths, set once the value's layout is known
    header["encoding"] = "msgpack+pickle" if encoded.pickled else "msgpack"
    header["checksum"] = _NO_CHECKSUM
    header["size"] = len(encoded.body)
    header["buffers"] = [[0, b.nbytes] for b in encoded.buffers]
    header["hsum"] = _NO_HSUM
    if secret is not None:
        header["mac"] = _NO_MAC
    try:
        return _frame(encoded, header, secret)
    except UnicodeEncodeError:  # a str holding lone surrogates (a key made of os.listdir() names)
        return _frame(encoded, _valid_text(header), secret)


def _frame(encoded: Encoded, header: dict[str, Any], secret: bytes | None) -> Framed:
    chunks: list[Buffer] = [encoded.body]
    if encoded.buffers:
        _lay_out(header, len(encoded.body))
        chunks = _value_chunks(encoded, [pad for pad, _ in header["buffers"]])
    header["checksum"] = checksum(chunks)
    packed: bytes = msgpack.packb(header)
    header["hsum"] = _header_sum(packed, signed=secret is not None)
    if secret is not None:
        header["mac"] = _sign(header, secret)
        packed = msgpack.packb(header)
    else:  # hsum's value is the last thing packed: put it in place instead of packing again
        packed = packed[: -len(_NO_HSUM)] + header["hsum"].encode()
    return Framed(header, packed, chunks)


def _valid_text(value: Any) -> Any:
    """
    *value* with every str that is not valid Unicode turned into its bytes, losslessly: the
    header must stay readable by any msgpack reader, and strict UTF-8 cannot hold a surrogate.
    """
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return value.encode("utf-8", "surrogatepass")
        return value
    if type(value) is dict:
        return {_valid_text(k): _valid_text(v) for k, v in value.items()}
    if type(value) in {list, tuple}:
        return type(value)(_valid_text(v) for v in value)
    return value


def _value_chunks(encoded: Encoded, pads: Sequence[int]) -> list[Buffer]:
    """The value part of a file: the body, then each buffer after its padding and bin32 prefix."""
    chunks: list[Buffer] = [encoded.body]
    for pad, buf in zip(pads, encoded.buffers, strict=True):
        chunks += [b"\xc0" * pad + struct.pack(">BI", 0xC6, buf.nbytes), buf]
    return chunks


def value_checksum(encoded: Encoded, pads: Sequence[int]) -> str:
    """
    The checksum a file would record for *encoded* laid out with these buffer *pads*: equal
    to a stored file's ``checksum`` exactly when the value encodes to the same bytes.
    """
    return checksum(_value_chunks(encoded, pads))


def parse_header(data: Buffer) -> tuple[dict[str, Any], int]:
    """
    Read the header at the start of *data* (the whole file, or at least its head).

    Raises:
        DamagedFileError: it is not a resumable output file.
        StateFormatError: it was written by a newer version.
    """
    view = memoryview(data)
    # read_size: its first buffer; the default (1 MiB) is a fresh allocation at every header read
    unpacker = msgpack.Unpacker(
        raw=False, strict_map_key=False, max_buffer_size=_HEAD_MAX, read_size=_HEAD_GUESS
    )
    # Feed the head only: the value may be large, and the Unpacker would copy it all.
    fed = min(len(view), _HEAD_GUESS)
    unpacker.feed(view[:fed])
    while True:
        try:
            header = unpacker.unpack()
            break
        except msgpack.OutOfData:
            if fed >= len(view) or fed >= _HEAD_MAX:
                msg = "truncated header"
                raise DamagedFileError(msg) from None
            more = min(len(view), fed * 4, _HEAD_MAX)
            unpacker.feed(view[fed:more])
            fed = more
        except Exception as exc:  # noqa: BLE001 - any msgpack error means "not our file"
            msg = f"unreadable header ({type(exc).__name__})"
            raise DamagedFileError(msg) from None
    if not _valid_header(header):
        msg = "not a resumable output file (bad header)"
        raise DamagedFileError(msg)
    head_len: int = unpacker.tell()
    # The header digest comes before anything in the header is believed, even its format.
    hsum = header.get("hsum")
    expected = _header_sum(view[:head_len], signed="mac" in header)
    if not isinstance(hsum, str) or not hmac.compare_digest(hsum, expected):
        msg = "header checksum mismatch (the file was damaged after it was written)"
        raise DamagedFileError(msg)
    if header["format"] > FORMAT:
        raise StateFormatError(str(header.get("slot", "?")), header["format"], FORMAT)
    return header, head_len


_HEADER_TYPES = (("format", int), ("slot", str), ("checksum", str), ("size", int), ("buffers", list))


def _valid_header(header: object) -> bool:
    if not isinstance(header, dict):
        return False
    for key, tp in _HEADER_TYPES:
        if type(header.get(key)) is not tp:
            return False
    return all(
        type(e) is list and len(e) == 2 and type(e[0]) is int and type(e[1]) is int and min(e) >= 0
        for e in header["buffers"]
    )


def verify(
    data: Buffer,
    header: Mapping[str, Any],
    head_len: int,
    secret: bytes | None,
) -> None:
    """
    Check that *data* (already through :func:`parse_header`) is complete, authentic (with a
    secret) and matches its checksum.

    Raises:
        DamagedFileError: it is not.
    """
    if secret is not None:
        mac = header.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _sign(header, secret)):
            msg = "authentication failed (written without the secret, or tampered with)"
            raise DamagedFileError(msg)
    size = len(data) - head_len
    if size != header["size"]:
        msg = f"{'truncated' if size < header['size'] else 'trailing bytes'}: "
        msg += f"{size} value bytes instead of {header['size']}"
        raise DamagedFileError(msg)
    if not hmac.compare_digest(checksum([memoryview(data)[head_len:]]), header["checksum"]):
        msg = "checksum mismatch (the file was damaged after it was written)"
        raise DamagedFileError(msg)


class Verified(NamedTuple):
    """
    A whole output file (or record, or chunk) whose header was parsed and whose bytes were
    checked (size, HMAC with a secret, checksum): the only thing that can be decoded.
    """

    data: Buffer
    header: dict[str, Any]
    head_len: int

    @property
    def size(self) -> int:
        """The file's bytes: header and value."""
        return self.head_len + int(self.header["size"])

    def decode(self, *, allow_pickle: bool, stand_ins: bool = False) -> Any:
        """
        Turn the file back into its value. With *stand_ins* (for display), classes that are
        not imported and refused pickles become placeholder dicts instead of errors.

        Raises:
            DamagedFileError: the value is malformed, refers to a class that is not imported,
                or holds a pickle while pickles are not allowed.
        """
        data, header, head_len = self.data, self.header, self.head_len
        if not allow_pickle and not stand_ins and header.get("encoding") != "msgpack":
            msg = "it holds a pickled value and pickles are not allowed (allow_pickle=False)"
            raise DamagedFileError(msg)
        position = head_len + header["size"]
        spans: list[tuple[int, int]] = []
        for pad, size in reversed(header["buffers"]):
            position -= size
            spans.append((position, size))
            position -= pad + _BIN32
        spans.reverse()
        pickled = header.get("encoding") == "msgpack+pickle"
        kind = StandInDecoder if stand_ins else Decoder
        decoder = kind(data, spans, allow_pickle=allow_pickle, pickled=pickled)
        try:
            return decoder.unpack(memoryview(data)[head_len:position])
        except Undecodable as exc:
            raise DamagedFileError(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - a checksummed file that will not decode is damaged
            msg = f"the value does not decode ({type(exc).__name__}: {exc})"
            raise DamagedFileError(msg) from None

    def check_decodes(self) -> None:
        """
        Check that the value decodes safely, pickles unread and classes not imported here
        standing in, so that only damage fails (``resumable verify``).

        Raises:
            DamagedFileError: the value is damaged or hostile.
        """
        self.decode(allow_pickle=False, stand_ins=True)


def read_verified(data: Buffer, secret: bytes | None) -> Verified:
    """
    Parse the header of a whole file and check its bytes: the one way to a decodable value.

    Raises:
        DamagedFileError: it is not a resumable file, or it is incomplete, forged or damaged.
        StateFormatError: it was written by a newer version.
    """
    header, head_len = parse_header(data)
    verify(data, header, head_len, secret)
    return Verified(data, header, head_len)


def _read_path(path: str | os.PathLike[str]) -> bytearray:
    """The whole file at *path* in a writable buffer (arrays decoded from it are writable)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # a FIFO must not block
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            msg = "it is not a plain file (a FIFO, a device or a directory)"
            raise DamagedFileError(msg)
        buf = bytearray(os.fstat(fd).st_size)
        del buf[f.readinto(buf) or 0 :]
    return buf


def value_digest(header: Mapping[str, Any]) -> str:
    """The digest another step's fingerprint uses for this stored value."""
    checksum: str = header["checksum"]
    return checksum.partition(":")[2]


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """Normalise a secret given as str or bytes; fall back to ``$RESUMABLE_SECRET``."""
    if secret is None:
        secret = os.environ.get("RESUMABLE_SECRET") or None
    if isinstance(secret, str):
        return secret.encode()
    return secret


def load(
    path: str | os.PathLike[str],
    *,
    allow_pickle: bool = True,
    secret: str | bytes | None = None,
) -> Any:
    """
    Return the value stored in a step output file such as ``state/parse.msgpack``.

    The checksum is verified first; with *secret* (default ``$RESUMABLE_SECRET``) the file
    must also be authenticated. Modules named in the file are never imported, so classes
    of attrs, dataclass, pydantic or Enum values must be imported before loading.

    Raises:
        SerializationError: the file is damaged, tampered with, or cannot be decoded here.
        StateFormatError: the file was written by a newer version of resumable.
        FileNotFoundError: there is no such file.
    """
    try:
        checked = read_verified(_read_path(path), secret_bytes(secret))
        return checked.decode(allow_pickle=allow_pickle)
    except DamagedFileError as exc:
        msg = f"cannot load {os.fspath(path)}: {exc}"
        raise SerializationError(msg) from None
