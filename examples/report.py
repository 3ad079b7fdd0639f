"""
A run worth looking at: it crashes, resumes, and writes one HTML file that shows both runs.

    python examples/report.py --crash   # a batch of reviews is scored, then `publish` raises
    python examples/report.py           # everything stored is skipped; publish runs; report.html
    resumable report -o report.html     # the same report from the command line

Open report.html in any browser, offline: the timeline of each run, why each step ran or was
skipped, the batch's rows per second and the rows the rerun resumed, the time the skips saved
and the error of the crashed run with its traceback. State goes to ``$RESUMABLE_STATE_DIR``
if set, else ``./state``; start over with ``resumable reset --all``.
"""

import argparse
import time

from resumable import Pipeline, checkpointed_map

pipe = Pipeline("reviews")


@pipe.step
def download(n: int) -> list[str]:
    """Pretend to fetch *n* reviews."""
    time.sleep(0.3)
    return [f"review {i}: {'great' if i % 3 else 'meh'} product" for i in range(n)]


@pipe.step(key=lambda lang: lang)
def translate(lang: str) -> str:
    """One stored output per language (a keyed step)."""
    time.sleep(0.05)
    return f"translated into {lang}"


def score_one(review: str) -> int:
    if review.startswith("review 13:"):
        msg = "review 13 has no text"
        raise ValueError(msg)
    time.sleep(0.002)
    return 5 if "great" in review else 2


@pipe.step
def score(reviews: list[str]) -> list[object]:
    """Score each review, committing every 25 rows; a row that raises is recorded, not fatal."""
    return list(checkpointed_map(score_one, reviews, every=25, on_error="record"))


@pipe.step(ignore=["crash"])
def publish(scores: list[object], crash: bool = False) -> dict[str, float]:
    """The last step: here the first run crashes."""
    if crash:
        msg = "the publishing service is down (run again without --crash)"
        raise ConnectionError(msg)
    numbers = [s for s in scores if isinstance(s, int)]
    return {"reviews": len(scores), "mean": round(sum(numbers) / len(numbers), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--crash", action="store_true", help="make the last step raise")
    parser.add_argument("-o", "--output", default="report.html", help="where to write the report")
    args = parser.parse_args()
    try:
        with pipe:
            reviews = download(200)
            for lang in ("de", "fr", "ja"):
                translate(lang)
            print(publish(score(reviews), crash=args.crash))
    finally:
        # The report reads the state (no lock, nothing written there), crashed or not.
        print(f"report: {pipe.report(args.output)}")


if __name__ == "__main__":
    main()
