"""
An ETL pipeline run by ``Pipeline.run``: download -> parse -> aggregate.

A step's parameter named like an earlier step receives that step's output; the other
parameters come from the inputs given to ``pipe.run(...)``. Try it:

    python examples/etl.py                  # runs all three steps
    python examples/etl.py                  # skips all three
    python examples/etl.py --by product     # only aggregate depends on --by: only it reruns
    python examples/etl.py --url https://example.org/sales-2025.csv   # everything reruns

The download is fake (deterministic CSV text made from the URL), so no network is needed.
State goes to ``$RESUMABLE_STATE_DIR`` if set, else ``./state``.
"""

import argparse
import csv
import io
import logging
import random
import sys
import time
from collections import defaultdict

from resumable import Pipeline

Row = dict[str, str | float]

# An explicit pipeline: pipe.run() knows its steps, in the order they are defined here.
pipe = Pipeline("etl")


@pipe.step
def download(url: str) -> str:
    """Fetch the CSV file (faked: the same URL always gives the same text)."""
    time.sleep(0.4)
    rng = random.Random(url)  # seeded by the URL, so a rerun would download the same bytes
    lines = ["day,region,product,amount"]
    for day in range(1, 31):
        for region in ("north", "south", "east", "west"):
            product = rng.choice(["apples", "pears", "plums"])
            lines.append(f"{day},{region},{product},{rng.uniform(5, 50):.2f}")
    return "\n".join(lines)


@pipe.step
def parse(download: str) -> list[Row]:
    """Turn the CSV text into typed rows (`download` is the output of the step above)."""
    time.sleep(0.2)
    return [
        {"region": r["region"], "product": r["product"], "amount": float(r["amount"])}
        for r in csv.DictReader(io.StringIO(download))
    ]


@pipe.step
def aggregate(parse: list[Row], by: str = "region") -> dict[str, float]:
    """Total amount per region (or per product)."""
    time.sleep(0.1)
    totals: defaultdict[str, float] = defaultdict(float)
    for row in parse:
        totals[str(row[by])] += float(row["amount"])
    return {group: round(total, 2) for group, total in sorted(totals.items())}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--url", default="https://example.org/sales-2024.csv")
    parser.add_argument("--by", choices=["region", "product"], default="region")
    args = parser.parse_args()

    # The INFO lines say why each step ran ("new", "inputs changed") or when it was stored.
    logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
    logging.getLogger("resumable").setLevel(logging.INFO)

    run = pipe.run(url=args.url, by=args.by)
    print(f"executed: {', '.join(run.executed) or '-'}")
    print(f"skipped:  {', '.join(run.skipped) or '-'}")
    # Outputs load on access: a skipped download is never read back from disk here.
    for group, total in run.outputs["aggregate"].items():
        print(f"{group:>8} {total:10.2f}")


if __name__ == "__main__":
    main()
