"""
An LLM-style batch: many async calls in flight, every finished chunk committed at once.

Try::

    python examples/async_llm_batch.py       # press Ctrl-C (or kill it) half-way
    python examples/async_llm_batch.py       # resumes: committed prompts are not asked again
    cat state/manifest.json                  # while it runs: "batches" shows rows done, failures

The fake API answers in 20 to 80 ms and refuses about one call in fifty with a rate-limit
error. With ``on_error="record"`` a refused prompt becomes a ``RowFailure`` (its index,
the error's type and message) in the result, the batch goes on, and the failures are
counted in the manifest. ``--kill-after N`` kills the process (SIGKILL) after N answers.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import signal

from resumable import RowFailure, checkpointed_map, step

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--prompts", type=int, default=2000, help="how many prompts (default 2,000)")
parser.add_argument("--kill-after", type=int, default=None, help="SIGKILL this process after N answers")
args = parser.parse_args()
answered = [0]  # answers received by this process


class RateLimitedError(Exception):
    """What a busy API answers."""


def _hash(prompt: str) -> int:
    return int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:4], "little")


async def ask_model(prompt: str) -> str:
    """A stand-in for an LLM client: network latency, and an occasional rate-limit error."""
    h = _hash(prompt)
    await asyncio.sleep(0.02 + (h % 61) / 1000)
    if h % 50 == 0:
        msg = "429 Too Many Requests: rate limit reached, retry later"
        raise RateLimitedError(msg)
    answered[0] += 1
    if answered[0] == args.kill_after:
        print(f"killing the process after {answered[0]} answers", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return f"summary #{h % 9973} of {prompt!r}"


@step
async def summarize(prompts: list[str]) -> list[str | RowFailure]:
    # 32 calls in flight; each finished chunk of 100 prompts is committed as it completes.
    return await checkpointed_map(ask_model, prompts, every=100, concurrency=32, on_error="record")


async def main() -> None:
    prompts = [f"Summarize customer review #{i}" for i in range(args.prompts)]
    answers = await summarize(prompts)
    failures = [a for a in answers if isinstance(a, RowFailure)]
    checksum = hashlib.sha256(repr(answers).encode()).hexdigest()[:16]
    print(f"answers: {len(answers) - len(failures):,}; failed: {len(failures):,}; checksum: {checksum}")
    print(f"API calls answered in this run: {answered[0]:,}")
    for failure in failures[:3]:
        print(f"  row {failure.index}: {failure.type}: {failure.message}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    asyncio.run(main())
