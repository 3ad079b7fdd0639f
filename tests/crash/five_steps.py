"""
Five steps in script mode, two of them keyed, each taking a few milliseconds.

Usage: ``python five_steps.py STATE_DIR SIDE_FILE [--small]`` (see crashkit.py for the
side file, the result line and the environment variables it reads). Kill it anywhere and
run it again: it prints the same ``RESULT`` line as an uninterrupted run.
"""

from __future__ import annotations

import hashlib

import crashkit

from resumable import step

SMALL = crashkit.setup()
ITEMS = 6 if SMALL else 40
CHUNK = 2


@step
def load(n: int) -> list[int]:
    crashkit.work("load", 0.02)
    return [(i * 7919) % 1000 for i in range(n)]


@step(key="{i}")
def fetch(i: int, seed: int) -> dict[str, object]:
    crashkit.work(f"fetch/{i}", 0.004)
    digest = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()
    return {"i": i, "seed": seed, "digest": digest[:12]}


@step
def transform(records: list[dict[str, object]]) -> list[int]:
    crashkit.work("transform", 0.03)
    return [int(str(r["digest"]), 16) % 10007 for r in records]


@step(key="{c}")
def score(c: int, values: list[int]) -> int:
    crashkit.work(f"score/{c}", 0.008)
    return sum(v * (c + 1) for v in values) % 1_000_003


@step
def summarize(scores: list[int]) -> dict[str, object]:
    crashkit.work("summarize", 0.02)
    return {"n": len(scores), "total": sum(scores), "scores": scores}


seeds = load(ITEMS)
records = [fetch(i, seed) for i, seed in enumerate(seeds)]
values = transform(records)
scores = [score(c, values[c * CHUNK : (c + 1) * CHUNK]) for c in range(len(values) // CHUNK)]
crashkit.result(summarize(scores))
