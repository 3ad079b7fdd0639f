"""
Hostile and damaged state: stored data that names classes and functions it must not
reach, outputs that are OS resources, and a state directory that links or traverses out
of itself, fills up, or is shared with forked workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import errno
import inspect
import io
import logging
import mmap
import os
import pickle
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

import resumable
from resumable import (
    Pipeline,
    ResumableWarning,
    SerializationError,
    StateDirectoryError,
    StateLockedError,
    UsageError,
    _codec,
    _codec_types,
)
from resumable._codec_types import (
    _RESERVED,
    BIGINT,
    COMPLEX,
    DATAFRAME,
    DATE,
    DATETIME,
    DECIMAL,
    ENUM,
    FROZENSET,
    NDARRAY,
    NDARRAY_REF,
    NPSCALAR,
    OBJECT,
    PATH,
    PD_INDEX,
    PD_MISSING,
    PD_TIMEDELTA,
    PD_TIMESTAMP,
    PICKLE,
    SERIES,
    SET,
    TIME,
    TIMEDELTA,
    TUPLE,
    UUID,
)
from resumable._stores._local import LocalStore

SENTINELS = "hostile_sentinels"


class _Recorder(type):
    """A metaclass whose classes record every attempt to call them."""

    calls: list[str] = []

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        _Recorder.calls.append(f"call {cls.__qualname__}")
        return super().__call__(*args, **kwargs)


class Plain(metaclass=_Recorder):
    """A plain class: not an Enum, attrs, dataclass or pydantic class."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        _Recorder.calls.append("Plain.__new__")
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _Recorder.calls.append("Plain.__init__")


class Hidden(enum.Enum):
    """A real Enum, defined in another module than the one the hostile data names."""

    ONE = 1


def _run(*args: object, **kwargs: object) -> None:
    _Recorder.calls.append("run")


def _module_getattr(name: str) -> object:
    if not name.startswith("__"):  # tools (pytest's tracebacks) look for __file__ and such
        _Recorder.calls.append(f"__getattr__ {name}")
    raise AttributeError(name)


@pytest.fixture
def sentinels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """
    A module of sentinels in sys.modules, and the real hostile targets patched to record
    calls; returns the list of calls (which must stay empty).
    """
    _Recorder.calls = []
    module = types.ModuleType(SENTINELS)
    inner = types.ModuleType(f"{SENTINELS}_inner")
    Plain.__module__ = SENTINELS
    Hidden.__module__ = inner.__name__
    module.Plain, module.run, module.inner, module.__getattr__ = Plain, _run, inner, _module_getattr
    inner.Hidden = Hidden
    monkeypatch.setitem(sys.modules, SENTINELS, module)
    monkeypatch.setitem(sys.modules, inner.__name__, inner)

    def record(name: str) -> Any:
        def recorded(*args: object, **kwargs: object) -> None:
            _Recorder.calls.append(name)
            raise RuntimeError(name)

        return recorded

    for cls in (subprocess.Popen, logging.FileHandler, ctypes.CDLL):
        monkeypatch.setattr(cls, "__init__", record(f"{cls.__qualname__}.__init__"))
    return _Recorder.calls


# (module, qualified name) of things a stored value must never reach
TARGETS = [
    ("subprocess", "Popen"),
    ("logging", "FileHandler"),
    ("ctypes", "CDLL"),
    ("os", "system"),
    ("builtins", "eval"),
    ("builtins", "object"),
    ("builtins", "type"),
    (SENTINELS, "Plain"),
    (SENTINELS, "run"),
    (SENTINELS, "inner.Hidden"),  # a real Enum, reached through another module's attribute
    ("resumable._codec_types", "sys.modules"),
]
NAME = "subprocess.Popen"
RANGE = ["range", 0, 1, 1, None]


def _hostile_payloads() -> dict[int, list[object]]:
    """For every ext type code, payloads (objects to pack, or raw bytes) no encoder writes."""
    named = [NAME, {"__class__": NAME}]
    return {
        TUPLE: named,
        SET: named,
        FROZENSET: named,
        BIGINT: [NAME.encode(), b"__import__('os')"],
        DATETIME: [["2020-01-01T00:00:00", NAME, 0], [NAME, None, 0], named[1]],
        DATE: [NAME.encode()],
        TIME: [["12:00:00", "../../etc/passwd", 0], named[1]],
        TIMEDELTA: [["subprocess", "Popen", 1], NAME],
        DECIMAL: [NAME.encode()],
        UUID: [b"os.system", b""],
        PATH: [[NAME, "/tmp"], ["posix", ["subprocess", "Popen"]], NAME],
        COMPLEX: [b"os.system"],
        _RESERVED: [NAME, [NAME]],
        ENUM: [[m, q, 1] for m, q in TARGETS] + [NAME],
        OBJECT: [[k, m, q, {}] for m, q in TARGETS for k in ("attrs", "dataclass", "pydantic")]
        + [["pickle", "subprocess", "Popen", {}], ["dataclass", "subprocess", "Popen", {"args": "ls"}], NAME],
        NDARRAY: [["|O", [1], "C", bytes(8)], [[["f", "|O"]], [1], "C", bytes(8)], [NAME, [1], "C", b""]],
        NDARRAY_REF: [["|O", [1], "C", [0]], ["<f8", [1], "C", [0]], NAME],
        NPSCALAR: [["|O", bytes(8)], [NAME, b""]],
        DATAFRAME: [
            [RANGE, RANGE, [["ext", NAME, [1]]]],
            [RANGE, RANGE, [["ext", "object", [1]]]],
            [RANGE, RANGE, [["pickle", NAME]]],
            [["index", ["ext", "O", [1]], None, None], RANGE, []],
        ],
        SERIES: [[None, RANGE, ["ext", NAME, [1]]], [None, [NAME, 0, 1, 1, None], ["obj", [1]]]],
        PD_INDEX: [["index", ["ext", NAME, [1]], None, None], [NAME], ["multi", NAME, [], []]],
        PD_TIMESTAMP: [[NAME, None, "ns"], named[1]],
        PD_TIMEDELTA: [[NAME, "ns"], named[1]],
        PD_MISSING: [NAME.encode(), b""],
        PICKLE: [pickle.dumps(types.SimpleNamespace()), b"csubprocess\nPopen\n(S'id'\ntR."],
    }


def _ext_codes() -> set[int]:
    """Every ext type code the codec defines (the module's upper-case int constants below 100)."""
    return {
        value
        for name, value in vars(_codec_types).items()
        if name.lstrip("_").isupper() and type(value) is int and 0 < value < 100 and name != "OOB_MIN"
    } | {PICKLE}


_FRAMING = {"format", "created_at", "encoding", "checksum", "size", "buffers", "hsum", "mac"}


def _hostile_file(code: int, payload: object, slot: str = "hostile", replaces: Path | None = None) -> bytes:
    """
    A well-formed output file (valid header and checksum) whose value holds the hostile ext;
    with *replaces*, its header says what that file's says (slot, fingerprint ...).
    """
    raw = payload if isinstance(payload, bytes) else msgpack.packb(payload, use_bin_type=True)
    body = msgpack.packb({"rows": [1, msgpack.ExtType(code, raw)]}, use_bin_type=True)
    meta: dict[str, Any] = {"slot": slot}
    if replaces is not None:
        header, _ = _codec.parse_header(replaces.read_bytes())
        meta = {k: v for k, v in header.items() if k not in _FRAMING}
    framed = _codec.frame(_codec.Encoded(body, [], pickled=False), meta)
    return b"".join(bytes(c) for c in framed.chunks())


def _decode_both_ways(data: bytes) -> list[str]:
    """Decode as a run and as ``show``; return the damage reasons (one each, or a failure)."""
    header, head_len = _codec.parse_header(data)
    _codec.verify(data, header, head_len, None)
    reasons = []
    for allow_pickle, stand_ins in ((False, False), (True, True), (False, True)):
        with pytest.raises(_codec.DamagedFileError) as info:
            _codec.Verified(data, header, head_len).decode(
                allow_pickle=allow_pickle and stand_ins, stand_ins=stand_ins
            )
        reasons.append(str(info.value))
    with pytest.raises(_codec.DamagedFileError):
        _codec.Verified(data, header, head_len).check_decodes()
    return reasons


def test_the_corpus_covers_every_ext_type() -> None:
    """The hostile corpus has payloads for every ext type code the codec defines."""
    assert _ext_codes() == set(_hostile_payloads())
    assert 25 == len(_ext_codes())


@pytest.mark.parametrize("code", sorted(_hostile_payloads()))
def test_hostile_values_are_damage_and_call_nothing(code: int, sentinels: list[str]) -> None:
    """For every ext type, a value naming wrong targets or of the wrong shape is damage; nothing is called."""
    payloads = _hostile_payloads()[code]
    damaged = 0
    for payload in payloads:
        reasons = _decode_both_ways(_hostile_file(code, payload))
        damaged += len(reasons) == 3
    assert (len(payloads), []) == (damaged, sentinels)


def test_refusals_name_the_target(sentinels: list[str]) -> None:
    """A class of the wrong kind is refused with its name, even for display (no stand-in)."""
    messages = {}
    for code, payload in {
        "enum": ["subprocess", "Popen", 1],
        "object": ["dataclass", "logging", "FileHandler", {}],
        "function": ["os", "system", "id"],
    }.items():
        data = _hostile_file(ENUM if code != "object" else OBJECT, payload)
        messages[code] = _decode_both_ways(data)[1]
    assert {
        "enum": "the stored value names subprocess.Popen, which is not a Enum class",
        "object": "the stored value names logging.FileHandler, which is not a dataclass class",
        "function": "the stored value names os.system, which is not a Enum class",
    } == messages
    assert [] == sentinels


def test_classes_not_imported_still_stand_in_for_display() -> None:
    """A class whose module is not imported is shown as a stand-in (and is damage only for a run)."""
    data = _hostile_file(OBJECT, ["dataclass", "not_imported_anywhere", "Thing", {"a": 1}])
    header, head_len = _codec.parse_header(data)
    shown = _codec.Verified(data, header, head_len).decode(allow_pickle=False, stand_ins=True)
    _codec.Verified(data, header, head_len).check_decodes()
    with pytest.raises(_codec.DamagedFileError, match="module 'not_imported_anywhere' is not imported"):
        _codec.Verified(data, header, head_len).decode(allow_pickle=False)
    assert {"rows": [1, {"__class__": "not_imported_anywhere.Thing", "a": 1}]} == shown


def test_lookups_run_no_module_getattr(sentinels: list[str]) -> None:
    """A missing class is looked up without running the module's ``__getattr__`` (lazy imports)."""
    data = _hostile_file(ENUM, [SENTINELS, "Missing", 1])
    header, head_len = _codec.parse_header(data)
    with pytest.raises(_codec.DamagedFileError, match="no longer exists"):
        _codec.Verified(data, header, head_len).decode(allow_pickle=False)
    shown = _codec.Verified(data, header, head_len).decode(allow_pickle=False, stand_ins=True)
    assert ({"rows": [1, {"__enum__": f"{SENTINELS}.Missing", "value": 1}]}, []) == (shown, sentinels)


def test_real_enums_and_pickles_still_decode(sentinels: list[str]) -> None:
    """The checks refuse only what no encoder writes: a real Enum decodes; an allowed pickle loads."""
    data = _hostile_file(ENUM, [f"{SENTINELS}_inner", "Hidden", 1])
    header, head_len = _codec.parse_header(data)
    value = _codec.Verified(data, header, head_len).decode(allow_pickle=False)
    encoded = _codec.encode(types.SimpleNamespace(a=1), allow_pickle=True)
    framed = b"".join(bytes(c) for c in _codec.frame(encoded, {"slot": "p"}).chunks())
    header, head_len = _codec.parse_header(framed)
    _codec.Verified(framed, header, head_len).check_decodes()
    loaded = _codec.Verified(framed, header, head_len).decode(allow_pickle=True)
    assert ({"rows": [1, Hidden.ONE]}, 1, []) == (value, loaded.a, sentinels)


def _step_pipeline(state_dir: Path, calls: list[int]) -> tuple[Pipeline, Any]:
    """A pipeline with a step ``produce`` that has run once; returns it and the step."""
    pipe = Pipeline("hostile", state_dir=state_dir)

    @pipe.step
    def produce() -> dict[str, int]:
        calls.append(1)
        return {"n": len(calls)}

    with pipe:
        produce()
    return pipe, produce


def test_a_hostile_output_file_is_recomputed(state_dir: Path, sentinels: list[str], tmp_path: Path) -> None:
    """A step output replaced by a hostile file is recomputed with a ResumableWarning; nothing is called."""
    calls: list[int] = []
    pipe, produce = _step_pipeline(state_dir, calls)
    victim = tmp_path / "victim.log"
    output = state_dir / "produce.msgpack"
    output.write_bytes(_hostile_file(ENUM, ["logging", "FileHandler", str(victim)], replaces=output))
    with pytest.warns(ResumableWarning, match="produce"), pipe:
        value = produce()
    assert ({"n": 2}, "corrupt", False, []) == (
        value,
        pipe.status().steps["produce"].reason,
        victim.exists(),
        sentinels,
    )


def test_show_refuses_a_hostile_file(state_dir: Path, tmp_path: Path) -> None:
    """``resumable show`` (a real process) reports a hostile output as damaged and constructs nothing."""
    _step_pipeline(state_dir, [])
    victim = tmp_path / "victim.log"
    for payload in (["logging", "FileHandler", str(victim)], ["dataclass", "logging", "FileHandler", {}]):
        code = ENUM if len(payload) == 3 else OBJECT
        output = state_dir / "produce.msgpack"
        output.write_bytes(_hostile_file(code, payload, replaces=output))
        result = subprocess.run(
            [sys.executable, "-m", "resumable", "--state-dir", str(state_dir), "show", "produce"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert (1, "", False) == (result.returncode, result.stdout, victim.exists())
        assert "produce.msgpack is damaged" in result.stderr
        assert "logging.FileHandler, which is not a" in result.stderr


def test_verify_reports_a_hostile_file(state_dir: Path, tmp_path: Path) -> None:
    """``resumable verify`` (a real process) exits 1 naming a well-checksummed but hostile output."""
    _step_pipeline(state_dir, [])
    victim = tmp_path / "victim.log"
    output = state_dir / "produce.msgpack"
    output.write_bytes(_hostile_file(ENUM, ["builtins", "object", 1], replaces=output))
    result = subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", str(state_dir), "verify"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (1, False) == (result.returncode, victim.exists())
    assert f"DAMAGED {output}: " in result.stdout
    assert "builtins.object, which is not a" in result.stdout


def test_load_refuses_a_hostile_file(tmp_path: Path, sentinels: list[str]) -> None:
    """``resumable.load`` raises SerializationError for a hostile file, with or without pickles."""
    path = tmp_path / "hostile.msgpack"
    path.write_bytes(_hostile_file(OBJECT, ["attrs", SENTINELS, "Plain", {}]))
    messages = []
    for allow_pickle in (False, True):
        with pytest.raises(SerializationError) as info:
            resumable.load(path, allow_pickle=allow_pickle)
        messages.append(str(info.value).split(": ", 1)[1])
    expected = f"the stored value names {SENTINELS}.Plain, which is not a attrs class"
    assert ([expected, expected], []) == (messages, sentinels)


# outputs that are OS resources ----------------------------------------------------------


def _resources(tmp_path: Path) -> dict[str, Callable[[], object]]:
    """Makers of OS resources (and the objects holding them), by the type path expected."""
    text = tmp_path / "data.txt"
    text.write_text("rows")

    async def coroutine() -> None:
        return None

    def generator() -> Iterator[int]:
        yield 1

    holder = types.SimpleNamespace
    return {
        "_io.TextIOWrapper": lambda: open(text),
        "_io.BufferedReader": lambda: open(text, "rb"),
        "_io.BufferedWriter": lambda: open(tmp_path / "out.bin", "wb"),
        "_io.BufferedRandom": lambda: open(text, "r+b"),
        "_io.FileIO": lambda: open(text, "rb", buffering=0),
        "socket.socket": lambda: socket.socket(),
        "_thread.lock": threading.Lock,
        "_thread.RLock": threading.RLock,
        "threading.Thread": lambda: threading.Thread(target=print),
        "threading.Event": threading.Event,
        "sqlite3.Connection": lambda: sqlite3.connect(":memory:"),
        "generator": generator,
        "coroutine": coroutine,
        "asyncio.locks.Lock": asyncio.Lock,
        "mmap.mmap": lambda: mmap.mmap(-1, 16),
        "subprocess.Popen": lambda: subprocess.Popen([sys.executable, "-c", "pass"]),
        "select.epoll": select.epoll,
        # inside a plain object that would be pickled whole: found by the pickler
        "_io.TextIOWrapper in an object": lambda: holder(handle=open(text)),
    }


def _close(value: object) -> None:
    value = getattr(value, "handle", value)
    if isinstance(value, subprocess.Popen):
        value.wait()
    if inspect.iscoroutine(value):
        value.close()
    close = getattr(value, "close", None)
    if callable(close):
        close()


def test_os_resources_are_refused(state_dir: Path, tmp_path: Path) -> None:
    """A step returning an OS resource fails with SerializationError naming the step and the type path."""
    pipe = Pipeline("resources", state_dir=state_dir)
    made: list[object] = []
    found = {}
    with pipe:
        for expected, make in _resources(tmp_path).items():

            def produce(make: Callable[[], object] = make) -> object:
                made.append(make())
                return {"kept": made[-1]}

            step = pipe.step(name=f"r{len(found)}", ignore=("make",))(produce)
            with pytest.raises(SerializationError) as info:
                step()
            error = info.value
            found[expected] = (error.step, error.where, error.type_name, "cannot be stored" in str(error))
    for value in made:
        _close(value)
    expected_found = {}
    for i, name in enumerate(found):
        type_name = name.removesuffix(" in an object")
        where = "output['kept'].handle" if name.endswith("object") else "output['kept']"
        expected_found[name] = (f"r{i}", where, type_name, True)
    assert expected_found == found
    assert [] == sorted(p.name for p in state_dir.glob("r*.msgpack"))


def test_a_resource_never_replaces_a_stored_output(state_dir: Path, tmp_path: Path) -> None:
    """A rerun whose output is a file opened for reading fails; the stored output stays as it was."""
    text = tmp_path / "data.txt"
    text.write_text("rows")
    pipe = Pipeline("resources", state_dir=state_dir)
    outputs: list[object] = ["first"]

    @pipe.step(version="1")
    def produce(n: int) -> object:
        return outputs[-1]

    with pipe:
        produce(1)
    before = (state_dir / "produce.msgpack").read_bytes()
    with open(text) as handle:
        outputs.append(handle)
        with pipe, pytest.raises(SerializationError, match=r"step 'produce'.*_io\.TextIOWrapper.*open file"):
            produce(2)
    assert (before, "first") == (
        (state_dir / "produce.msgpack").read_bytes(),
        resumable.load(state_dir / "produce.msgpack"),
    )


def test_in_memory_files_are_still_stored(state_dir: Path) -> None:
    """StringIO and BytesIO hold no OS resource: they are stored (pickled) and come back equal."""
    pipe = Pipeline("resources", state_dir=state_dir)

    @pipe.step
    def produce() -> object:
        return [io.StringIO("text"), io.BytesIO(b"bytes")]

    with pipe:
        produce()
    text, data = resumable.load(state_dir / "produce.msgpack")
    assert ("text", b"bytes") == (text.getvalue(), data.getvalue())


# keys with surrogates -------------------------------------------------------------------

SURROGATE_PROGRAM = """
import os, sys
from resumable import Pipeline

pipe = Pipeline("names", state_dir=sys.argv[1])
calls = []

@pipe.step(key="{name}")
def size(name):
    calls.append(name)
    return {"name": name, "bytes": os.fsencode(name)}

with pipe:
    names = sorted(os.listdir(sys.argv[2]))
    values = [size(n) for n in names] + [size(n) for n in names]
    run = pipe.status().steps
print(len(calls), [v["bytes"] == os.fsencode(n) for v, n in zip(values, names * 2)].count(True))
print(sorted(run))
"""


def test_keys_with_surrogates_are_stored_and_skipped(tmp_path: Path) -> None:
    """A key from os.listdir() of a Latin-1 file name is stored, then skipped in the same and a fresh process."""
    folder = tmp_path / "files"
    folder.mkdir()
    for raw in (b"caf\xe9", "café".encode(), b"caf%ED%B3%A9"):  # undecodable, its UTF-8 twin, its escape
        (folder / os.fsdecode(raw)).write_text("x")
    program = tmp_path / "names.py"
    program.write_text(SURROGATE_PROGRAM)
    state = tmp_path / "state"
    runs = [
        subprocess.run(
            [sys.executable, str(program), str(state), str(folder)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONUTF8": "0", "LC_ALL": "C.UTF-8"},
        ).stdout.splitlines()
        for _ in range(2)
    ]
    slots = "['size/caf%25%45%44%25%423%25%419', 'size/caf%C3%A9', 'size/caf%ED%B3%A9']"
    assert [["3 6", slots], ["0 6", slots]] == runs
    undecodable = os.fsdecode(b"caf\xe9")
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "resumable",
            "--state-dir",
            os.fsencode(state),
            "show",
            "size",
            "--key",
            b"caf\xe9",
        ],
        capture_output=True,
        check=True,
    ).stdout
    stored = resumable.load(state / "size" / "caf%ED%B3%A9.msgpack")
    assert ({"name": undecodable, "bytes": b"caf\xe9"}, True) == (stored, b"caf\\xe9" in shown)


# symbolic links, hard links and traversal -----------------------------------------------


def _precious(tmp_path: Path) -> Path:
    precious = tmp_path / "precious.txt"
    precious.write_text("precious\n")
    return precious


def _run_once(state_dir: Path) -> None:
    pipe = Pipeline("links", state_dir=state_dir)

    @pipe.step
    def produce() -> int:
        return 1

    with pipe:
        produce()


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
@pytest.mark.parametrize("target", [".resumable/lock", "events.jsonl"])
def test_linked_lock_and_log_are_refused(tmp_path: Path, link: str, target: str) -> None:
    """A lock file or event log that links to a file elsewhere is refused, naming it; the target is untouched."""
    state_dir = tmp_path / "state"
    _run_once(state_dir)
    precious = _precious(tmp_path)
    planted = state_dir / target
    planted.unlink()
    if link == "symlink":
        planted.symlink_to(precious)
    else:
        os.link(precious, planted)
    with contextlib.ExitStack() as stack:
        if (link, target) == ("hardlink", "events.jsonl"):  # read (harmless), not appended to
            stack.enter_context(pytest.warns(ResumableWarning, match="skipped 1 line"))
        info = stack.enter_context(pytest.raises(StateDirectoryError))
        _run_once(state_dir)
    what = "a symbolic link" if link == "symlink" else "a hard link to another file"
    assert (f"{planted} is {what}", "precious\n") == (
        str(info.value).split(": ", 1)[1].split(",")[0].split(" which")[0],
        precious.read_text(),
    )


def test_store_never_follows_links_out(tmp_path: Path) -> None:
    """Reads, writes, deletes and listings do not go through a symbolic link out of the state directory."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "1.msgpack").write_bytes(b"outside")
    store = LocalStore(tmp_path / "state")
    store.write("a.msgpack", [b"ours"], durable=False)
    (tmp_path / "state" / "fetch").symlink_to(outside)
    (tmp_path / "state" / "b.msgpack").symlink_to(outside / "1.msgpack")
    refused = []
    for action in (
        lambda: store.delete("fetch/1.msgpack", durable=True),
        lambda: store.write("fetch/2.msgpack", [b"x"], durable=True),
        lambda: store.append("fetch/log", b"x", durable=True),
        lambda: store.copy("a.msgpack", "fetch/3.msgpack", durable=True),
        lambda: store.read("b.msgpack"),
        lambda: store.read("b.msgpack", 0),
    ):
        with pytest.raises(StateDirectoryError) as info:
            action()
        refused.append(info.value.errno)
    assert [errno.ELOOP] * 6 == refused
    assert (["1.msgpack"], b"outside") == (os.listdir(outside), (outside / "1.msgpack").read_bytes())
    assert (["a.msgpack", "b.msgpack", "fetch"], []) == (sorted(store.list()), store.list("fetch/"))
    store.delete("b.msgpack", durable=True)  # the link itself goes, not what it points to
    assert (b"outside", False) == (
        (outside / "1.msgpack").read_bytes(),
        (tmp_path / "state" / "b.msgpack").exists(),
    )


@pytest.mark.parametrize(
    "key", ["../precious.msgpack", "/etc/passwd", "a/../../x", "./a", "a//b", "a/./b", "a\x00"]
)
def test_store_refuses_keys_that_leave_it(tmp_path: Path, key: str) -> None:
    """Keys with '..', '.' or empty components, absolute keys and NUL bytes are refused by the store."""
    store = LocalStore(tmp_path / "state")
    precious = _precious(tmp_path)
    errors = []
    for action in (
        lambda: store.read(key),
        lambda: store.write(key, [b"x"], durable=False),
        lambda: store.delete(key, durable=False),
        lambda: store.append(key, b"x", durable=False),
    ):
        with pytest.raises(UsageError, match="is not a key inside the store") as info:
            action()
        errors.append(isinstance(info.value, ValueError))
    assert ([True] * 4, "precious\n") == (errors, precious.read_text())


# a full disk -----------------------------------------------------------------------------


def test_appends_go_on_after_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An append whose write() calls write a few bytes each is completed, not cut short."""
    store = LocalStore(tmp_path)
    real_write = os.write
    calls: list[int] = []

    def short(fd: int, data: bytes) -> int:
        calls.append(fd)
        return real_write(fd, bytes(data[:3]))

    monkeypatch.setattr(os, "write", short)
    store.append("events.jsonl", b'{"event": "one"}\n', durable=True)
    store.append("events.jsonl", b'{"event": "two"}\n', durable=False)
    monkeypatch.undo()
    assert (12, b'{"event": "one"}\n{"event": "two"}\n') == (
        len(calls),
        (tmp_path / "events.jsonl").read_bytes(),
    )


@pytest.mark.parametrize("failure", ["ENOSPC", "no progress"])
def test_full_disk_errors_name_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Disk full in an append, a write or a header-last write: the OSError names the file written."""
    store = LocalStore(tmp_path)
    store.append("events.jsonl", b"old\n", durable=True)
    store.write("a.msgpack", [b"old"], durable=True)
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if failure == "ENOSPC":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, b"") if len(data) else 0

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: full(fd, data))
    errors = []
    for key, action in (
        ("events.jsonl", lambda: store.append("events.jsonl", b"new line\n", durable=True)),
        ("a.msgpack", lambda: store.write("a.msgpack", [b"new"], durable=True)),
    ):
        with pytest.raises(OSError, match="No space left on device") as info:
            action()
        errors.append((info.value.errno, info.value.filename))
    monkeypatch.undo()
    assert [(errno.ENOSPC, str(tmp_path / key)) for key in ("events.jsonl", "a.msgpack")] == errors
    assert (b"old", ["a.msgpack", "events.jsonl"]) == (
        (tmp_path / "a.msgpack").read_bytes(),
        sorted(set(os.listdir(tmp_path)) - {".resumable"}),  # no temporary file left
    )


def test_a_step_whose_output_cannot_be_written_reports_the_output(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while a step's output is written: the error names the output file; the old output stays."""
    pipe = Pipeline("full", state_dir=state_dir)
    outputs = iter(["first", "second"])

    @pipe.step(version="1")
    def produce(n: int) -> str:
        return next(outputs)

    with pipe:
        produce(1)
    real_write = os.write
    written: dict[int, str] = {}
    real_open = os.open

    def tracking_open(path: str, flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        fd = real_open(path, flags, mode, **kwargs)
        written[fd] = os.fspath(path)
        return fd

    def full(fd: int, data: bytes) -> int:
        if ".produce.msgpack." in written.get(fd, ""):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "write", full)
    with pipe, pytest.raises(OSError, match="No space left on device") as info:
        produce(2)
    monkeypatch.undo()
    assert (str(state_dir / "produce.msgpack"), "first", "failed") == (
        info.value.filename,
        resumable.load(state_dir / "produce.msgpack"),
        pipe.status().steps["produce"].status,
    )


# the run lock and forked workers ------------------------------------------------------

FORKING_HOLDER = """
import os, sys, time
from resumable._stores._local import LocalStore

lock = LocalStore(sys.argv[1]).lock({"pid": os.getpid()})
if sys.argv[2] == "pool":
    import concurrent.futures, multiprocessing
    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"))
    child = pool.submit(os.getpid).result()
    pool.submit(time.sleep, 120)
    print(child, flush=True)
elif os.fork() == 0:  # the child says it runs (its copy of the lock is closed by then)
    print(os.getpid(), flush=True)
    time.sleep(120)
    os._exit(0)
time.sleep(120)
"""


@pytest.mark.parametrize("how", ["fork", "pool"])
def test_forked_workers_do_not_keep_the_lock(tmp_path: Path, how: str) -> None:
    """After SIGKILL of a lock holder, its forked children (still alive) do not block the next run."""
    program = tmp_path / "holder.py"
    program.write_text(FORKING_HOLDER)
    state = tmp_path / "state"
    parent = subprocess.Popen(
        [sys.executable, str(program), str(state), how], stdout=subprocess.PIPE, text=True
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        with pytest.raises(StateLockedError):
            LocalStore(state).lock({"pid": os.getpid()})  # the parent holds it while it lives
        parent.kill()
        parent.wait()
        os.kill(child, 0)  # the child is still alive
        lock = LocalStore(state).lock({"pid": os.getpid()})
        lock.release()
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if child:
            os.kill(child, signal.SIGKILL)
    assert -signal.SIGKILL == parent.returncode


def test_a_forked_child_releasing_does_not_unlock_the_parent(tmp_path: Path) -> None:
    """release() in a forked child is a no-op: the parent still holds the lock afterwards."""
    held = LocalStore(tmp_path).lock({"pid": os.getpid()})
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child exits at once
        held.release()
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    try:
        with pytest.raises(StateLockedError):
            LocalStore(tmp_path).lock({"pid": 0})
    finally:
        held.release()
    assert 0 == status
