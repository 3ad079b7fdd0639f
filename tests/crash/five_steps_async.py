"""
The async twin of five_steps.py: ``async def`` steps, keyed stages run with ``asyncio.gather``.

Usage: ``python five_steps_async.py STATE_DIR SIDE_FILE [--small]``. It prints the same
``RESULT`` line as five_steps.py, however often it is killed and run again.
"""

from __future__ import annotations

import asyncio
import hashlib

import crashkit

from resumable import step

SMALL = crashkit.setup()
ITEMS = 6 if SMALL else 40
CHUNK = 2


@step
async def load(n: int) -> list[int]:
    await crashkit.awork("load", 0.02)
    return [(i * 7919) % 1000 for i in range(n)]


@step(key="{i}")
async def fetch(i: int, seed: int) -> dict[str, object]:
    # staggered durations, so that a kill finds some slots done and others running
    await crashkit.awork(f"fetch/{i}", 0.004 + 0.004 * (i % 8))
    digest = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()
    return {"i": i, "seed": seed, "digest": digest[:12]}


@step
async def transform(records: list[dict[str, object]]) -> list[int]:
    await crashkit.awork("transform", 0.03)
    return [int(str(r["digest"]), 16) % 10007 for r in records]


@step(key="{c}")
async def score(c: int, values: list[int]) -> int:
    await crashkit.awork(f"score/{c}", 0.004 + 0.004 * (c % 6))
    return sum(v * (c + 1) for v in values) % 1_000_003


@step
async def summarize(scores: list[int]) -> dict[str, object]:
    await crashkit.awork("summarize", 0.02)
    return {"n": len(scores), "total": sum(scores), "scores": scores}


async def main() -> dict[str, object]:
    seeds = await load(ITEMS)
    records = await asyncio.gather(*(fetch(i, seed) for i, seed in enumerate(seeds)))
    values = await transform(list(records))
    chunks = [values[c * CHUNK : (c + 1) * CHUNK] for c in range(len(values) // CHUNK)]
    scores = await asyncio.gather(*(score(c, chunk) for c, chunk in enumerate(chunks)))
    return await summarize(list(scores))


crashkit.result(asyncio.run(main()))
