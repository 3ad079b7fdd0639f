"""
Resume from S3: the state lives in a bucket, so a run killed on one machine resumes on another.

A spot instance, a CI runner or a Kubernetes pod is killed; the job restarts elsewhere with
an empty disk and goes on where it stopped. Try it against a local S3-compatible server:

    pip install "resumable[remote]" "moto[server]"
    moto_server -p 5000 &                      # or MinIO, or a real bucket
    export AWS_ENDPOINT_URL=http://127.0.0.1:5000 AWS_DEFAULT_REGION=us-east-1
    export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
    python examples/s3_resume.py --crash       # pages 1-3 are fetched, page 4 fails
    cd "$(mktemp -d)" && python "$OLDPWD/examples/s3_resume.py"   # elsewhere: pages 1-3 skipped
    resumable --state-dir s3://resumable-example/s3-resume status

Kill it with ``kill -9`` instead of ``--crash``: the killed run's lease (the lock on the
state) expires after ``$RESUMABLE_LEASE_TTL`` seconds (30 by default); a run started before
then says which process holds it and when it expires, a run started after takes over.

Options: ``--store URL`` (default ``s3://resumable-example/s3-resume``; the bucket is
created if it does not exist), ``--fresh`` to forget every stored output first.
"""

import argparse
import logging
import sys
import time

from resumable import Pipeline

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--store", default="s3://resumable-example/s3-resume", help="where the state lives")
parser.add_argument("--crash", action="store_true", help="fail while fetching page 4")
parser.add_argument("--fresh", action="store_true", help="forget the stored outputs first")
parser.add_argument("--pages", type=int, default=6, help="how many pages to fetch")
args = parser.parse_args()

pipe = Pipeline("s3_resume", store=args.store)


@pipe.step(key="{page}", ignore=["crash"])
def fetch_page(page: int, crash: bool = False) -> list[dict[str, float]]:
    """Pretend to call a slow, paid API for one page of orders."""
    time.sleep(0.2)
    if crash and page == 4:
        msg = "simulated crash fetching page 4 (run again without --crash to resume)"
        raise RuntimeError(msg)
    return [{"page": page, "order": i, "amount": round(page * 10 + i * 1.25, 2)} for i in range(5)]


@pipe.step
def total(pages: list[list[dict[str, float]]]) -> float:
    """Add up the orders of every page."""
    return round(sum(order["amount"] for page in pages for order in page), 2)


def ensure_bucket(url: str) -> None:
    """Create the bucket of an s3:// URL on a local server if it does not exist yet."""
    import fsspec  # comes with resumable[remote]

    fs, path = fsspec.core.url_to_fs(url)
    bucket = path.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)


def main() -> None:
    logging.basicConfig(stream=sys.stdout, format="  [%(name)s] %(message)s")
    logging.getLogger("resumable").setLevel(logging.INFO)
    if args.store.startswith("s3://"):
        ensure_bucket(args.store)
    if args.fresh:
        print(f"--fresh: forgot {len(pipe.reset())} stored output(s)")
    with pipe:
        pages = []
        for page in range(1, args.pages + 1):
            print(f"page {page}/{args.pages}")
            pages.append(fetch_page(page, crash=args.crash))
        print(f"total: {total(pages)}")


if __name__ == "__main__":
    main()
