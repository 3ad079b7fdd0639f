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
import gc
import json
import logging
import os
import platform
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
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from resumable import Pipeline, step

ROOT = Path(__file__).resolve().parent.parent

SMALL = {
    "id": 12345,
    "title": "a small record, as an API call or an LLM call would return it",
    "score": 0.875,
    "ok": True,
    "tags": [f"tag-{i:02d}" for i in range(20)],
    "values": list(range(100)),
    "nested": {"a": [1.5, 2.5, 3.5], "b": {"c": "d" * 200, "e": None}},
    "text": "lorem ipsum dolor sit amet " * 10,
}


def small_output(i: int) -> dict[str, Any]:  # noqa: ARG001 - the argument picks the slot
    return SMALL


remote_step = step(name="remote_step", key="{i}")(small_output)


@dataclass
class Row:
    name: str
    library: str
    baseline: str
    ratio: float | None
    ratio_label: str
    target: str
    passed: bool | None
    details: dict[str, Any]

    @property
    def result(self) -> str:
        if self.passed is None:
            return "info"
        return "PASS" if self.passed else "FAIL"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


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


def interleave(blocks: dict[str, Callable[[], float]], r: int, out: dict[str, list[float]]) -> None:
    names = list(blocks)
    gc.collect()
    for name in names if r % 2 == 0 else reversed(names):
        out.setdefault(name, []).append(blocks[name]())


def ratios(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


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

            interleave({"store": library_store, "put": raw_put}, r, res)
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

            interleave({"skip": library_skip, "get": raw_get}, r, res)
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


def environment(endpoint: str, server: str) -> dict[str, str]:
    import fsspec
    import s3fs

    import resumable

    commit = "?"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
        if subprocess.run(
            ["git", "status", "--porcelain", "--", "resumable"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.strip():
            commit += " + uncommitted changes"
    except (OSError, subprocess.CalledProcessError):
        pass
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        "server": f"{server} at {endpoint}",
        "resumable": f"{resumable.__version__} ({commit})",
        "fsspec": fsspec.__version__,
        "s3fs": s3fs.__version__,
    }


def render(rows: list[Row], env: dict[str, str]) -> str:
    lines = [
        "",
        "| benchmark | library | baseline | ratio | target | result |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        ratio = "—" if row.ratio is None else f"{row.ratio:.2f} ({row.ratio_label})"
        lines.append(
            f"| {row.name} | {row.library} | {row.baseline} | {ratio} | {row.target} | {row.result} |"
        )
    lines.append("")
    lines.append("; ".join(f"{k}: {v}" for k, v in env.items()))
    return "\n".join(lines)


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
    logging.basicConfig(level=logging.WARNING)
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
        t0 = time.perf_counter()
        rows = bench_steps(args.bucket, rounds, 20 if args.quick else 40)
        for row in rows:
            print(f"{row.result:4}  {row.name}: {row.library} vs {row.baseline}", file=sys.stderr)
        print(f"      ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        env = environment(endpoint, server)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    print(render(rows, env))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"environment": env, "rows": [asdict(r) | {"result": r.result} for r in rows]}, indent=2
            )
            + "\n"
        )
    return 0 if all(r.passed is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
