"""
Per-step overhead of resumable on S3, against raw requests for the same bytes.

Run from the repository root (needs the ``test`` extra: s3fs and moto)::

    python bench/bench_remote.py                 # starts a moto server on a free local port
    python bench/bench_remote.py --quick         # fewer rounds, for a smoke test
    python bench/bench_remote.py --endpoint http://127.0.0.1:9000 --bucket bench   # MinIO ...

Both sides use the same s3fs client and the same server. The library side is a keyed
``@step`` storing a ~1 KB output in a new slot, then, in a new run, skipping it (the first
skip of a slot in a run: the object is read and verified). The baseline is one PUT
(``pipe_file``) and one GET (``cat_file`` as a single request) of the very bytes the
library stored. Library and baseline blocks alternate within every round (the order flips
each round) and a ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections import Counter
from typing import Any

from benchlib import SMALL, Row, environment, interleave, ms, quiet, ratios, report, run_timed

from resumable import Pipeline, step


def small_output(i: int) -> dict[str, Any]:  # noqa: ARG001 - the argument picks the slot
    return SMALL


remote_step = step(name="remote_step", key="{i}")(small_output)


# --- the server -----------------------------------------------------------------------------


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1):  # noqa: S310 - our local server
                return proc, endpoint
        except (urllib.error.URLError, OSError):
            time.sleep(0.05)
    proc.kill()
    msg = f"moto did not start on {endpoint}"
    raise RuntimeError(msg)


# --- measuring ------------------------------------------------------------------------------


def count_requests(fs: Any) -> Counter[str]:
    """Count the S3 calls made through *fs*, by operation, until ``del fs._call_s3``."""
    counts: Counter[str] = Counter()
    real = fs._call_s3  # noqa: SLF001 - the one place every s3fs request goes through

    async def counting(method: str, *args: Any, **kwargs: Any) -> Any:
        counts[method] += 1
        return await real(method, *args, **kwargs)

    fs._call_s3 = counting  # noqa: SLF001 - removed again with `del fs._call_s3`
    return counts


def bench_steps(bucket: str, rounds: int, n: int) -> list[Row]:
    res: dict[str, list[float]] = {}
    opens: list[float] = []
    requests: Counter[str] = Counter()
    for r in range(rounds):
        url = f"s3://{bucket}/bench-{uuid.uuid4().hex}"
        pipe = Pipeline("bench", store=url)
        t0 = time.perf_counter()
        with pipe:
            opens.append(time.perf_counter() - t0)
            remote_step(-1)  # the run's first step: lists the store once, computes the code digest
            store: Any = pipe.store
            fs = store.fs
            data = fs.cat_file(store._path("remote_step/-1.msgpack"))  # noqa: SLF001
            raw = store._path("raw")  # noqa: SLF001

            def library_store(offset: int = 0) -> float:
                t = time.perf_counter()
                for i in range(offset, offset + n):
                    remote_step(i)
                return (time.perf_counter() - t) / n

            def raw_put(fs: Any = fs, raw: str = raw, data: bytes = data) -> float:
                t = time.perf_counter()
                for i in range(n):
                    fs.pipe_file(f"{raw}/{i}.msgpack", data)
                return (time.perf_counter() - t) / n

            interleave({"store": library_store, "put": raw_put}, 1, first=r, out=res)
            if r == 0:  # requests per stored step, background writes included
                counts = count_requests(fs)
                library_store(10_000)
                time.sleep(0.5)  # let the background writer catch up
                del fs._call_s3  # noqa: SLF001
                requests = counts
        with Pipeline("bench", store=url) as again:
            fs = again.store.fs  # type: ignore[attr-defined]

            def library_skip() -> float:
                t = time.perf_counter()
                for i in range(n):
                    remote_step(i)
                return (time.perf_counter() - t) / n

            def raw_get(fs: Any = fs, raw: str = raw) -> float:
                t = time.perf_counter()
                for i in range(n):
                    fs.cat_file(f"{raw}/{i}.msgpack", max_concurrency=1)  # one GET, no HEAD first
                return (time.perf_counter() - t) / n

            interleave({"skip": library_skip, "get": raw_get}, 1, first=r, out=res)
    per_step = [s + k for s, k in zip(res["store"], res["skip"], strict=True)]
    raw_step = [p + g for p, g in zip(res["put"], res["get"], strict=True)]
    med = {k: statistics.median(v) for k, v in res.items()}
    details = med | {"per_round": res, "run_open_s": statistics.median(opens)}
    ratio = ratios(per_step, raw_step)
    per = {k: round(v / n, 2) for k, v in requests.items()}
    return [
        Row(
            "per step: store ~1 KB output, then skip it in a new run, vs raw PUT + GET of the same bytes",
            ms(statistics.median(per_step)),
            ms(statistics.median(raw_step)),
            ratio,
            "library / raw",
            "≤ 1.5",
            ratio <= 1.5,
            details,
        ),
        Row(
            "store ~1 KB output (one slot per call) vs raw PUT",
            ms(med["store"]),
            ms(med["put"]),
            ratios(res["store"], res["put"]),
            "library / raw",
            "",
            None,
            details | {"requests_per_store": per},
        ),
        Row(
            "skip, first in a new run (read and verify) vs raw GET",
            ms(med["skip"]),
            ms(med["get"]),
            ratios(res["skip"], res["get"]),
            "library / raw",
            "",
            None,
            details,
        ),
        Row(
            "open a run: take the lease, load manifest and log, write the manifest (per run, not per step)",
            ms(statistics.median(opens)),
            "—",
            None,
            "",
            "",
            None,
            {"run_open_s": opens},
        ),
        Row(
            f"S3 requests per stored step (over {n} steps, background writes included)",
            ", ".join(f"{k} {v}" for k, v in sorted(per.items())),
            "put_object 1.0",
            None,
            "",
            "",
            None,
            {"requests": dict(requests)},
        ),
    ]


# --- the report -----------------------------------------------------------------------------


def remote_environment(endpoint: str, server: str) -> dict[str, str]:
    import fsspec
    import s3fs

    return environment(
        ("server", f"{server} at {endpoint}"), {"fsspec": fsspec.__version__, "s3fs": s3fs.__version__}
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test)")
    parser.add_argument("--endpoint", default=None, help="an S3-compatible server (default: start moto)")
    parser.add_argument("--bucket", default="resumable-bench", help="bucket to use (created if missing)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 9, 3 with --quick)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args(argv)
    quiet()
    warnings.simplefilter("error")  # a warning from the library would mean a wrong setup
    proc = None
    if args.endpoint is None:
        proc, endpoint, server = *start_moto(), "moto server"
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    else:
        endpoint, server = args.endpoint, "S3-compatible server"
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    try:
        import s3fs

        fs = s3fs.S3FileSystem()
        if not fs.exists(args.bucket):
            fs.mkdir(args.bucket)
        rounds = args.rounds or (3 if args.quick else 9)
        rows = run_timed(lambda: bench_steps(args.bucket, rounds, 20 if args.quick else 40))
        env = remote_environment(endpoint, server)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    return report(rows, env, args.json)


if __name__ == "__main__":
    sys.exit(main())
