"""
The floor of a store: what SPEC §5 and §6 require per stored ~1 KB output, hand-written.

Each block stores 100 outputs into a fresh directory; blocks run interleaved, and the
table gives per-round ratios to the atomic replace of bench_peers.py (the issue's baseline):

- atomic: msgpack.packb, write a temp file (+ fsync), rename it (+ fsync the directory,
  shared with the stores of the next 0.1 s as the library's is);
- floor: the same plus what the library must do besides: look the output up (one failed
  open), append a ``step_started`` and a ``step_completed`` line to ``events.jsonl`` (held
  open, one write each), a header with the value's BLAKE3 checksum before the value;
- floor, log opened per event: the same, the log opened and closed for each line, as a
  library must that lets a process hold thousands of open sessions (SPEC §6) without a file
  descriptor each;
- library: ``@step`` storing the same output (durable or not, as the row says).

    python bench/bench_store_floor.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import msgpack
from benchlib import SMALL, fsync_dir_shared, interleave, ratios, us

from resumable import Pipeline, step

N = 100


def small_output_keyed(i: int, record: dict[str, Any] = SMALL) -> dict[str, Any]:  # noqa: ARG001 - i picks the slot
    return record


store_small = step(name="store_small", key="{i}", ignore=("record",))(small_output_keyed)


def write_file(path: str, chunks: list[bytes], *, fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.writev(fd, chunks)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic(directory: str, i: int, *, durable: bool) -> None:
    target = f"{directory}/{i}.msgpack"
    write_file(target + ".tmp", [msgpack.packb(SMALL)], fsync=durable)
    os.replace(target + ".tmp", target)
    if durable:
        fsync_dir_shared(directory)


@functools.cache
def log(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)


def append(path: str, event: dict[str, Any], *, held: bool) -> None:
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    if held:
        os.write(log(path), line)
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def floor(directory: str, i: int, *, durable: bool, held: bool = True) -> None:
    target = f"{directory}/{i}.msgpack"
    try:  # the lookup: is the output stored?
        os.close(os.open(target, os.O_RDONLY | os.O_CLOEXEC))
    except FileNotFoundError:
        pass
    slot = f"store_small/{i}"
    append(f"{directory}/events.jsonl", {"t": time.time(), "event": "step_started", "slot": slot}, held=held)
    body = msgpack.packb(SMALL)
    header = {"format": 1, "slot": slot, "created_at": time.time(), "size": len(body)}
    header["checksum"] = "blake3:" + blake3.blake3(body).hexdigest()
    write_file(target + ".tmp", [msgpack.packb(header), body], fsync=durable)
    os.replace(target + ".tmp", target)
    if durable:
        fsync_dir_shared(directory)
    append(
        f"{directory}/events.jsonl", {"t": time.time(), "event": "step_completed", "slot": slot}, held=held
    )


def block(store: Callable[[int], None], counter: Iterator[int]) -> Callable[[], float]:
    def run() -> float:
        start = next(counter) * N
        t0 = time.perf_counter()
        for i in range(start, start + N):
            store(i)
        return (time.perf_counter() - t0) / N

    return run


def measure(base: Path, rounds: int, *, durable: bool) -> dict[str, list[float]]:
    res: dict[str, list[float]] = {}
    for r in range(rounds):
        root = base / f"{durable}-{r}"
        dirs = {name: str(root / name) for name in ("atomic", "floor", "opened")}
        for d in dirs.values():
            os.makedirs(d)
        counter = itertools.count(1)
        blocks = {
            "atomic": block(functools.partial(atomic, dirs["atomic"], durable=durable), counter),
            "floor": block(functools.partial(floor, dirs["floor"], durable=durable), counter),
            "opened": block(functools.partial(floor, dirs["opened"], durable=durable, held=False), counter),
            "library": block(store_small, counter),
        }
        with Pipeline("bench", state_dir=root / "state", durable=durable):
            store_small(0)  # opens the slot directory, computes the code digest
            interleave(blocks, 2, first=r, out=res)
        shutil.rmtree(root)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    print(
        "| store of a ~1 KB output | atomic | floor | floor, log opened per event | library "
        "| floor / atomic | opened / atomic | library / atomic |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for durable in (False, True):
            res = measure(Path(tmp), args.rounds, durable=durable)
            med = {k: statistics.median(v) for k, v in res.items()}
            print(
                f"| durable={durable} | {us(med['atomic'])} | {us(med['floor'])} | {us(med['opened'])} "
                f"| {us(med['library'])} | {ratios(res['floor'], res['atomic']):.2f} "
                f"| {ratios(res['opened'], res['atomic']):.2f} | {ratios(res['library'], res['atomic']):.2f} |"
            )


if __name__ == "__main__":
    main()
