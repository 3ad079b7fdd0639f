"""
Quickstart: a three-step script that survives a crash.

fetch -> clean -> summarize, each decorated with ``@step``. Try it:

    python examples/quickstart.py --crash   # fetch and clean complete, summarize raises
    python examples/quickstart.py           # fetch and clean are skipped; summarize runs
    cat state/manifest.json                 # the progress manifest, plain JSON
    resumable status                        # the same, as a table
    python examples/quickstart.py --fresh   # forget its stored outputs and start over

State goes to ``$RESUMABLE_STATE_DIR`` if set, else ``./state`` in the current directory.
Once every step has completed, runs (``--crash`` included) only replay stored outputs;
pass ``--fresh`` to see the crash again.
"""

import argparse
import logging
import sys
import time

from resumable import Pipeline, step


@step
def fetch(source: str) -> list[str]:
    """Pretend to download some reviews."""
    time.sleep(0.5)  # the slow part a rerun should never repeat
    return [f"  {source} review {i}: {'GREAT' if i % 3 else 'meh'} product  " for i in range(1, 10)]


@step
def clean(reviews: list[str]) -> list[str]:
    """Normalise whitespace and case."""
    time.sleep(0.3)
    return [" ".join(review.split()).lower() for review in reviews]


# `crash` is left out of the fingerprint: it changes how this run behaves, not what the
# step computes, so a run without --crash can still reuse what a crashed run stored.
@step(ignore=["crash"])
def summarize(reviews: list[str], crash: bool = False) -> dict[str, int]:
    """Count the verdicts."""
    time.sleep(0.2)
    if crash:
        msg = "simulated crash in summarize (run again without --crash to resume)"
        raise RuntimeError(msg)
    great = sum("great" in review for review in reviews)
    return {"reviews": len(reviews), "great": great, "meh": len(reviews) - great}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--crash", action="store_true", help="raise in the third step")
    parser.add_argument("--fresh", action="store_true", help="forget the stored outputs of these steps first")
    args = parser.parse_args()

    # One INFO line per step run or skip; on stdout so it interleaves with the prints.
    logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
    logging.getLogger("resumable").setLevel(logging.INFO)

    if args.fresh:
        # A Pipeline with no arguments points at the same state as the module-level
        # `step` ($RESUMABLE_STATE_DIR or ./state). Name this script's steps, so that other
        # scripts sharing ./state (the other examples) keep their outputs.
        forgotten = Pipeline().reset("fetch", "clean", "summarize", downstream=False)
        print(f"--fresh: forgot {len(forgotten)} stored output(s)")

    print("1/3 fetch")
    reviews = fetch("shop.example")
    print("2/3 clean")
    cleaned = clean(reviews)
    print("3/3 summarize")
    summary = summarize(cleaned, crash=args.crash)
    print(f"done: {summary}")
    if args.crash:
        # A completed step is never run again, so there was nothing left to crash.
        print("(summarize was already stored, so nothing crashed: add --fresh to start over)")


if __name__ == "__main__":
    main()
