"""
Sessions (docs/sessions.md): what a service pays per request, and what thousands of sessions cost.

Rows, each against a baseline measured in the same run:

- request: open a session, skip 10 slots, store one ~1 KB output, close; with durable=False
  (target <= 2 ms) and durable (target <= 1.5x one durable store of the same output in an open
  run); the old workaround, a state directory per conversation, beside it;
- 10,000 one-turn sessions: ``pipe.sessions()`` and the summary ``resumable status`` prints
  (targets <= 100 ms and <= 50 ms), against reading every session's manifest; the disk per
  session (<= 16 KB, <= 5 files); tracemalloc after 1,000 and 10,000 requests (flat);
- fork of a session of 1,000 slots, 1 GB (<= 150 ms, 0 output bytes copied), against
  hard-linking its files by hand;
- a conversation of 200 turns replayed by every request: the request and the bytes it
  appends to the event log at turn 200 against turn 10.

    python bench/bench_sessions.py [--quick] [--only request,many,fork,turns] [--dir DIR] [--json FILE]
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import benchlib
from benchlib import SMALL, Row, ms

from resumable import Pipeline
from resumable._sessions import list_sessions
from resumable._sessions_cli import summary

MB = 1024 * 1024


def _chat(state: Path, *, durable: bool, session: str | None = None) -> tuple[Pipeline, Any]:
    pipe = Pipeline("chat", state_dir=state, durable=durable, session=session)

    @pipe.step(key="{i}")
    def turn(i: int, text: str) -> dict[str, Any]:
        return {**SMALL, "text": text, "i": i}

    return pipe, turn


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


# --- 1. the request --------------------------------------------------------------------------


def bench_request(base: Path, quick: bool) -> list[Row]:
    conversations, rounds = (20, 5) if quick else (50, 15)
    return [
        *_request_rows(base, False, conversations, rounds),
        *_request_rows(base, True, conversations, rounds),
    ]


def _request_rows(base: Path, durable: bool, conversations: int, rounds: int) -> list[Row]:
    state = base / f"request-{durable}"
    pipe, turn = _chat(state, durable=durable)
    dirs: dict[str, tuple[Pipeline, Any]] = {}
    next_key: dict[str, int] = {}
    for c in range(conversations):
        sid = f"c{c}"
        with pipe.session(sid):
            for i in range(10):
                turn(i, f"{sid} {i}")
        dirs[sid] = _chat(base / f"dirs-{durable}" / sid, durable=durable)
        with dirs[sid][0]:
            for i in range(10):
                dirs[sid][1](i, f"{sid} {i}")
        next_key[sid] = 10
    store_pipe, store_turn = _chat(base / f"store-{durable}", durable=durable)
    store_key = [0]

    def session_request() -> float:
        t = 0.0
        for c in range(conversations):
            sid = f"c{c}"
            k = next_key[sid]
            start = time.perf_counter()
            with pipe.session(sid):
                for i in range(k - 10, k):
                    turn(i, f"{sid} {i}")
                turn(k, f"{sid} {k}")
            t += time.perf_counter() - start
            next_key[sid] = k + 1
        return t / conversations

    def dir_request() -> float:
        t = 0.0
        for c in range(conversations):
            sid = f"c{c}"
            p, fn = dirs[sid]
            k = next_key[sid] - 1  # the same work: 10 skips and one new slot
            start = time.perf_counter()
            with p:
                for i in range(k - 10, k):
                    fn(i, f"{sid} {i}")
                fn(k + 10_000, f"{sid} {k}")
            t += time.perf_counter() - start
        return t / conversations

    def one_store() -> float:
        with store_pipe:
            t = 0.0
            for _ in range(conversations):
                store_key[0] += 1
                start = time.perf_counter()
                store_turn(store_key[0], "x")
                t += time.perf_counter() - start
        return t / conversations

    got = benchlib.interleave({"session": session_request, "dirs": dir_request, "store": one_store}, rounds)
    s, d, one = _median(got["session"]), _median(got["dirs"]), _median(got["store"])
    label = "durable" if durable else "durable=False"
    details = {"session_s": got["session"], "store_s": got["store"], "dirs_s": got["dirs"]}
    syncs = []
    if durable:  # where an fsync costs milliseconds (a disk, not this VM's cache) they are the request
        request_syncs = _fsyncs(session_request) // conversations
        store_syncs = _fsyncs(one_store) // conversations
        syncs = [
            Row(
                "fsyncs per request (durable): open a session, 10 skips, 1 store, close",
                str(request_syncs),
                f"one durable store in an open run: {store_syncs}",
                request_syncs / store_syncs,
                "x one store",
                "<= 1.5x",
                request_syncs <= 1.5 * store_syncs,
                {},
            )
        ]
    return [
        *syncs,
        Row(
            f"request ({label}): open a session, 10 skips, 1 store, close",
            ms(s),
            f"one {'durable ' if durable else ''}store in an open run: {ms(one)}",
            s / one,
            "x one store",
            "<= 1.5x" if durable else "<= 2 ms",
            s / one <= 1.5 if durable else s <= 0.002,
            details,
        ),
        Row(
            f"request ({label}), the old way: a state directory per conversation",
            ms(d),
            f"a session: {ms(s)}",
            d / s,
            "x a session",
            "(info)",
            None,
            {},
        ),
    ]


def _fsyncs(block: Callable[[], float]) -> int:
    """How many times *block* calls ``os.fsync``."""
    real, count = os.fsync, [0]

    def counting(fd: int) -> None:
        count[0] += 1
        real(fd)

    os.fsync = counting
    try:
        block()
    finally:
        os.fsync = real
    return count[0]


# --- 2. 10,000 sessions ----------------------------------------------------------------------


def _disk(path: Path) -> tuple[int, int]:
    blocks = files = 0
    for directory, _dirs, names in os.walk(path):
        for name in names:
            st = os.lstat(os.path.join(directory, name))
            blocks += st.st_blocks * 512
            files += 1
    return blocks, files


def bench_many(base: Path, quick: bool) -> list[Row]:
    n = 5_000 if quick else 10_000
    state = base / "many"
    pipe, turn = _chat(state, durable=False)
    tracemalloc.start()
    marks: dict[int, int] = {}
    # a step memoizes up to 4,096 calls, then starts over: at 6,000 and 10,000 it holds about as many
    first = n * 3 // 5
    started = time.perf_counter()
    for i in range(n):
        with pipe.session(f"user-{i:05d}", metadata={"plan": "free"}):
            turn(0, f"hello {i}")
        if i + 1 in {first, n}:
            gc.collect()
            marks[i + 1] = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    build_s = time.perf_counter() - started
    rows = []
    growth = marks[n] - marks[first]
    rows.append(
        Row(
            f"memory after {n:,} requests on {n:,} sessions (tracemalloc; the bounded caches are full by 4,096)",
            f"{marks[n] / MB:.2f} MB",
            f"after {first:,}: {marks[first] / MB:.2f} MB",
            marks[n] / marks[first],
            f"x after {first:,}",
            "flat: <= 1 MB more",
            growth <= MB,
            {"marks": marks, "build_s": build_s},
        )
    )
    sessions_dir = state / ".sessions"
    one = sessions_dir / "user-00000"
    size, files = _disk(one)
    rows.append(
        Row(
            "disk per one-turn session (blocks allocated)",
            f"{size / 1024:.1f} KB, {files} files",
            "—",
            None,
            "",
            "<= 16 KB, <= 5 files",
            size <= 16 * 1024 and files <= 5,
            {"files": sorted(str(p.relative_to(one)) for p in one.rglob("*") if p.is_file())},
        )
    )

    def listing() -> float:
        t = time.perf_counter()
        got = list_sessions(pipe._root_store)  # noqa: SLF001 - what pipe.sessions() does
        if len(got) != n:
            raise RuntimeError(f"listed {len(got)} sessions of {n}")
        return time.perf_counter() - t

    def status() -> float:
        t = time.perf_counter()
        got = summary(pipe._root_store)  # noqa: SLF001 - what `resumable status` prints
        if got is None or got["count"] != n:
            raise RuntimeError(f"the summary counts {got and got['count']} sessions of {n}")
        return time.perf_counter() - t

    def manifests() -> float:  # what listing would cost with no index: every session's manifest
        t = time.perf_counter()
        for entry in os.scandir(sessions_dir):
            if entry.is_dir():
                with open(os.path.join(entry.path, "manifest.json"), "rb") as f:
                    f.read()
        return time.perf_counter() - t

    got = benchlib.interleave({"list": listing, "status": status, "manifests": manifests}, 3 if quick else 7)
    lst, st, man = _median(got["list"]), _median(got["status"]), _median(got["manifests"])
    rows.append(
        Row(
            f"`pipe.sessions()` (`resumable sessions`) with {n:,} sessions",
            ms(lst),
            f"reading every session's manifest.json: {ms(man)}",
            lst / man,
            "x manifests",
            "<= 100 ms",
            lst <= 0.100,
            got,
        )
    )
    rows.append(
        Row(
            f"the summary `resumable status` prints, {n:,} sessions",
            ms(st),
            f"reading every session's manifest.json: {ms(man)}",
            st / man,
            "x manifests",
            "<= 50 ms",
            st <= 0.050,
            {},
        )
    )
    shutil.rmtree(state)
    return rows


# --- 3. fork ---------------------------------------------------------------------------------


def bench_fork(base: Path, quick: bool) -> list[Row]:
    slots, size = (200, 256 * 1024) if quick else (1_000, MB)
    state = base / "fork"
    pipe = Pipeline("fork", state_dir=state, durable=False)
    payload = os.urandom(size)

    @pipe.step(key="{i}")
    def part(i: int) -> bytes:
        return payload[:-8] + i.to_bytes(8, "big")

    with pipe.session("src"):
        for i in range(slots):
            part(i)
    src = state / ".sessions" / "src"
    total = sum(p.stat().st_size for p in src.rglob("*.msgpack"))
    reps = 3 if quick else 5
    fork_s, link_s, copied = [], [], []
    for r in range(reps):
        t = time.perf_counter()
        pipe.fork("src", f"dst{r}")
        fork_s.append(time.perf_counter() - t)
        dst = state / ".sessions" / f"dst{r}"
        copied.append(sum(p.stat().st_size for p in (dst / "part").iterdir() if p.stat().st_nlink == 1))
        by_hand = state / f"by-hand-{r}"
        t = time.perf_counter()
        for directory, _dirs, names in os.walk(src):
            target = by_hand / os.path.relpath(directory, src)
            target.mkdir(parents=True, exist_ok=True)
            for name in names:
                os.link(os.path.join(directory, name), target / name)
        link_s.append(time.perf_counter() - t)
    f, lk = _median(fork_s), _median(link_s)
    with pipe.session("dst0"):
        executed = [i for i in range(slots) if not part.is_cached(i)]
    shutil.rmtree(state)
    return [
        Row(
            f"fork of a session of {slots:,} slots, {total / 2**30:.2f} GB",
            f"{ms(f)}, {max(copied)} output bytes copied",
            f"hard-linking its files by hand: {ms(lk)}",
            f / lk,
            "x by hand",
            "<= 150 ms, 0 bytes copied",
            f <= 0.150 and max(copied) == 0 and not executed,
            {"fork_s": fork_s, "link_s": link_s, "copied": copied, "would_run": len(executed)},
        )
    ]


# --- 4. a long conversation ------------------------------------------------------------------


def bench_turns(base: Path, quick: bool) -> list[Row]:
    turns = 100 if quick else 200
    early = 10
    state = base / "turns"
    pipe, turn = _chat(state, durable=False)
    log = state / ".sessions" / "c" / "events.jsonl"
    times: dict[int, float] = {}
    appended: dict[int, int] = {}
    for n in range(1, turns + 1):
        before = log.stat().st_size if log.exists() else 0
        t = time.perf_counter()
        with pipe.session("c"):
            for i in range(1, n + 1):  # the whole conversation replayed: every turn but the last skips
                turn(i, f"message {i}")
        times[n] = time.perf_counter() - t
        appended[n] = log.stat().st_size - before
    size = log.stat().st_size

    def at(n: int) -> float:  # a few requests around turn n, against noise
        return _median([times[k] for k in range(max(1, n - 2), min(turns, n + 2) + 1)])

    t_early, t_late = at(early), at(turns)
    half = turns // 2  # past the 32 slots whose skips a run logs: what a request appends is flat
    rows = [
        Row(
            f"request replaying a conversation at turn {turns} (durable=False)",
            ms(t_late),
            f"at turn {early}: {ms(t_early)}",
            t_late / t_early,
            f"x turn {early}",
            f"linear: <= {turns // early}x",
            t_late / t_early <= turns / early,
            {"times": times},
        ),
        Row(
            f"event log appended by the request at turn {turns}",
            f"{appended[turns]:,} B (log {size / 1024:.0f} KB in all)",
            f"at turn {half}: {appended[half]:,} B (at turn {early}: {appended[early]:,} B)",
            appended[turns] / appended[half],
            f"x turn {half}",
            "<= 1.1x (the log grows linearly)",
            appended[turns] <= 1.1 * appended[half],
            {"appended": appended},
        ),
    ]
    shutil.rmtree(state)
    return rows


BENCHES: dict[str, Callable[[Path, bool], list[Row]]] = {
    "request": bench_request,
    "turns": bench_turns,
    "fork": bench_fork,
    "many": bench_many,
}


def main(argv: list[str] | None = None) -> int:
    return benchlib.drive(
        argv, description=__doc__, benches=BENCHES, child=lambda *_: None, prefix="resumable-sessions-"
    )


if __name__ == "__main__":
    sys.exit(main())
