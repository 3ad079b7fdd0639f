"""
A million rows, committed every 1,000: kill it, run it again, it resumes at the last commit.

Try::

    python examples/batch_rows.py --kill-at 700000   # dies (SIGKILL) at row 700,000
    python examples/batch_rows.py                    # resumes at row 700,000 and finishes
    python examples/batch_rows.py                    # everything is stored: returns at once

On a terminal a progress bar shows the rows done, the rate, the time left and how many
rows were resumed. The checksum printed at the end is the same as an uninterrupted run's.
Start over with ``resumable reset enrich`` (or delete ./state).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import signal

from resumable import checkpointed_map, step

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--rows", type=int, default=1_000_000, help="how many rows (default 1,000,000)")
parser.add_argument("--kill-at", type=int, default=None, help="SIGKILL this process at this row")
args = parser.parse_args()
processed = [0]  # rows this process worked on


def score(row: int) -> str:
    """The work done per row: here a hash; in real life an API call, a model, a parser ..."""
    if row == args.kill_at:
        print(f"killing the process at row {row:,}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    processed[0] += 1
    return hashlib.blake2b(row.to_bytes(8, "little"), digest_size=4).hexdigest()


@step
def enrich(n: int) -> list[str]:
    # Inside a step the batch belongs to the step: its chunks are removed once the step's
    # output is stored.
    return checkpointed_map(score, range(n), every=1000)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = enrich(args.rows)
    checksum = hashlib.sha256("".join(result).encode()).hexdigest()[:16]
    print(f"rows: {len(result):,}; processed in this run: {processed[0]:,}; checksum: {checksum}")
