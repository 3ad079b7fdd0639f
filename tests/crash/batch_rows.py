"""
A batch of rows, for the batch kill tests (test_batch_crash.py).

Usage: ``python batch_rows.py STATE_DIR SIDE_FILE MODE [ROWS] [EVERY]``. Every execution of
a row appends one line (the row's index) to SIDE_FILE, from whichever process runs it, so
the tests can count executions. The program prints ``RESULT <json>`` when it finishes.
MODE is one of:

- ``seq``: ``checkpointed_map`` inside a step, row after row;
- ``each``: a ``checkpointed`` side-effect loop outside a step (``name="send"``);
- ``pool``: ``checkpointed_map`` inside a step on a ``ProcessPoolExecutor(2)``;
- ``async``: an async ``checkpointed_map`` inside an async step, ``concurrency=8``;
- ``dask``: ``checkpointed_map`` inside a step on a dask.distributed local cluster's executor.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from resumable import checkpointed, checkpointed_map, step

SIDE = sys.argv[2]
MODE = sys.argv[3]
ROWS = int(sys.argv[4]) if len(sys.argv) > 4 else 300
EVERY = int(sys.argv[5]) if len(sys.argv) > 5 else 10
SECONDS = 0.002  # per row
CONCURRENCY = 8  # async calls in flight


def executed(row: int) -> None:
    """Count one execution of *row* (one O_APPEND write: never torn by a kill)."""
    fd = os.open(SIDE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, f"{row}\n".encode())
    finally:
        os.close(fd)


def work(row: int) -> dict[str, Any]:
    executed(row)
    time.sleep(SECONDS)
    return {"row": row, "digest": hashlib.sha256(str(row).encode()).hexdigest()[:8]}


async def awork(row: int) -> dict[str, Any]:
    executed(row)
    await asyncio.sleep(SECONDS * (1 + row % 5))
    return {"row": row, "digest": hashlib.sha256(str(row).encode()).hexdigest()[:8]}


@step
def enrich(n: int, every: int) -> list[dict[str, Any]]:
    rows = list(range(n))
    if MODE == "pool":
        with ProcessPoolExecutor(2) as pool:
            return checkpointed_map(work, rows, every=every, executor=pool)
    if MODE == "dask":
        from distributed import Client, LocalCluster

        with (
            LocalCluster(
                n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None
            ) as cluster,
            Client(cluster) as client,
        ):
            return checkpointed_map(work, rows, every=every, executor=client.get_executor())
    return checkpointed_map(work, rows, every=every)


@step
async def enrich_async(n: int, every: int) -> list[dict[str, Any]]:
    return await checkpointed_map(awork, range(n), every=every, concurrency=CONCURRENCY)


def main() -> None:
    os.environ["RESUMABLE_STATE_DIR"] = sys.argv[1]
    if MODE == "each":
        for row in checkpointed(range(ROWS), every=EVERY, name="send"):
            executed(row)
            time.sleep(SECONDS)
        result: Any = "sent"
    elif MODE == "async":
        result = asyncio.run(enrich_async(ROWS, EVERY))
    else:
        result = enrich(ROWS, EVERY)
    text = json.dumps(result, sort_keys=True)
    print(f"RESULT {json.dumps([len(text), hashlib.sha256(text.encode()).hexdigest()])}", flush=True)


if __name__ == "__main__":
    main()
