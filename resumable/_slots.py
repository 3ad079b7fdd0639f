"""Step names, slot ids and the file names they map to."""

from __future__ import annotations

import re

import blake3

from .exceptions import StepDefinitionError, UsageError

OUTPUT_SUFFIX = ".msgpack"
# Internal files live under this directory, which no step name can collide with.
INTERNAL_DIR = ".resumable"
LOCK = f"{INTERNAL_DIR}/lock"
MANIFEST = "manifest.json"
EVENTS = "events.jsonl"
# Named sessions live under this directory, each in the default session's layout.
SESSIONS_DIR = ".sessions"
_MAX_SESSION_ID = 200

_MAX_NAME = 100
_FORBIDDEN_NAME = re.compile(r'[\x00-\x1f\x7f/\\<>:"|?*]')
RECORDS = ".records"  # a keyed step's records file: <step>.records
_RESERVED_SUFFIXES = (".msgpack", ".json", ".jsonl", ".tmp", RECORDS)
# Key characters kept as they are in file names; everything else is %XX-escaped.
# Upper case is escaped too, so keys differing only by case never share a file on a
# case-insensitive file system (macOS, Windows).
_KEY_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")
_MAX_KEY_FILE = 150
_PLAIN_KEY = re.compile(r"[a-z0-9_-][a-z0-9_.-]*")  # encoded as it is (see encode_key)


def check_name(name: object) -> str:
    """Return *name* if it can be a step name (and a file name); raise otherwise."""
    if not isinstance(name, str):
        msg = f"step name must be a str, got {type(name).__name__}: pass name='...' to @step"
        raise StepDefinitionError(msg)
    problem = None
    if not name or name.strip() != name:
        problem = "it is empty or has leading/trailing spaces"
    elif len(name) > _MAX_NAME:
        problem = f"it is longer than {_MAX_NAME} characters"
    elif _FORBIDDEN_NAME.search(name):
        problem = "it contains '/', '\\', '<', '>', ':', '\"', '|', '?', '*' or a control character"
    elif name.startswith((".", "-")):
        problem = "it starts with '.' or '-'"
    elif name.endswith("."):
        problem = "it ends with '.'"
    elif name.lower().endswith(_RESERVED_SUFFIXES):
        problem = "it ends with a suffix resumable uses for its own files"
    if problem:
        msg = (
            f"{name!r} cannot be used as a step name because {problem}; step names are file "
            "names in the state directory. Pass name='a_valid_name' to @step."
        )
        raise StepDefinitionError(msg, step=name)
    return name


def encode_key(key: str) -> str:
    """Encode a slot key into one safe, unique file name component (without suffix)."""
    if len(key) <= _MAX_KEY_FILE and _PLAIN_KEY.fullmatch(key):
        return key  # the usual key needs no escape: no loop over its characters
    out = []
    for i, ch in enumerate(key):
        if ch in _KEY_SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8", "surrogatepass"))
    encoded = "".join(out)
    if not encoded:
        return "%"  # the empty key; '%' alone never results from escaping
    if len(encoded) > _MAX_KEY_FILE:
        # File names are limited to 255 bytes; '~' is always escaped above, so a shortened
        # name can never equal the encoding of another key.
        digest = blake3.blake3(key.encode("utf-8", "surrogatepass")).hexdigest()[:24]
        encoded = f"{encoded[:100]}~{digest}"
    return encoded


def slot_id(step: str, key: str | None) -> str:
    """The slot id: ``step`` or ``step/<encoded key>``; also the file path minus suffix."""
    return step if key is None else f"{step}/{encode_key(key)}"


def slot_file(slot: str) -> str:
    """The store key (relative path) of a slot's output file."""
    return slot + OUTPUT_SUFFIX


def step_of(slot: str) -> str:
    """The step name a slot belongs to."""
    return slot.partition("/")[0]


BATCHES = f"{INTERNAL_DIR}/batches"
STEP_BATCHES = f"{BATCHES}/steps/"  # then a step slot's batches: batch_dir
OBJECTS = f"{INTERNAL_DIR}/objects"


def batch_dir(slot: str | None, name: str | None = None) -> str:
    """Where the row chunks of a batch live: per step slot, or per name outside steps."""
    if slot is not None:
        return f"{STEP_BATCHES}{slot}/"
    return f"{BATCHES}/named/{name}/"


def is_output_file(path: str) -> bool:
    """True for store keys that hold step outputs (not internal or temporary files)."""
    if not path.endswith(OUTPUT_SUFFIX) or path.startswith(INTERNAL_DIR + "/"):
        return False
    parts = path.split("/")
    return len(parts) <= 2 and not any(p.startswith(".") for p in parts)


def check_session_id(session: object) -> str:
    """Return *session* if it can be a session id (a non-empty str of up to 200 characters)."""
    if not isinstance(session, str) or not session or len(session) > _MAX_SESSION_ID:
        msg = f"a session id is a non-empty str of at most {_MAX_SESSION_ID} characters, got {session!r}"
        raise UsageError(msg)
    return session


def session_prefix(session: str) -> str:
    """Where a named session's files live in the store: ``.sessions/<id encoded as keys are>``."""
    return f"{SESSIONS_DIR}/{encode_key(check_session_id(session))}"


def decode_key(encoded: str) -> str | None:
    """The key :func:`encode_key` made *encoded* of (None for a shortened long key, or no key)."""
    if encoded == "%":
        return ""
    try:
        raw = re.sub(rb"%([0-9A-F]{2})", lambda m: bytes([int(m.group(1), 16)]), encoded.encode("ascii"))
        decoded = raw.decode("utf-8", "surrogatepass")
    except (UnicodeError, ValueError):
        return None
    return decoded if "~" not in encoded and encode_key(decoded) == encoded else None


def records_file(step: str) -> str:
    """The store key of the records of a keyed step's slots, beside its directory (see _manifest.Steps)."""
    return f"{step}{RECORDS}"
