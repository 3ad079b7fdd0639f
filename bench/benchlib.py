"""
What the benchmark scripts share: the result rows, the alternating measurement, the
environment line, the Markdown table and the driver of a script's ``main``.

The scripts run as ``python bench/<script>.py``, so this module is imported as ``benchlib``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgpack

ROOT = Path(__file__).resolve().parent.parent

# A ~1 KB output (650 bytes of msgpack would be too small: this one packs to ~1,030 bytes).
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


# --- measuring ------------------------------------------------------------------------------


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


def interleave(
    blocks: dict[str, Callable[[], float]],
    rounds: int,
    *,
    first: int = 0,
    out: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """
    Run each block once per round, alternating their order; return their results.

    Rounds are numbered from *first*: an even round runs the blocks in the order given, an odd
    one in reverse. Results are appended to *out* (and *out* returned) when it is given, so that
    one round at a time can be measured into the same lists.
    """
    if out is None:
        out = {}
    for name in blocks:
        out.setdefault(name, [])
    names = list(blocks)
    for r in range(first, first + rounds):
        gc.collect()
        for name in names if r % 2 == 0 else reversed(names):
            out[name].append(blocks[name]())
    return out


def ratios(a: list[float], b: list[float]) -> float:
    """Median of the per-round ratios a/b."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f} µs"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


GROUP_WINDOW = 0.1  # as resumable's local store: a rename's directory fsync is shared this long
_unsynced_since: dict[str, float] = {}


def fsync_dir_shared(path: str) -> None:
    """The directory fsync of a durable store as resumable makes it: shared with the next 0.1 s."""
    now = time.monotonic()
    if now - _unsynced_since.setdefault(path, now) >= GROUP_WINDOW:
        fsync_dir(path)
        del _unsynced_since[path]


def quiet() -> None:
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("resumable").setLevel(logging.WARNING)


# --- the report -----------------------------------------------------------------------------


def filesystem(base: Path) -> str:
    """The file system *base* is on, and its mount point, from /proc/mounts ("?" if unknown)."""
    fs = "?"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
        best = ""
        real = os.path.realpath(base)
        for line in mounts:
            parts = line.split()
            if len(parts) > 2 and real.startswith(parts[1]) and len(parts[1]) >= len(best):
                best, fs = parts[1], f"{parts[2]} on {parts[1]}"
    except OSError:
        pass
    return fs


def commit() -> str:
    """The checkout's short commit, marked when the package has uncommitted changes ("?" if unknown)."""
    described = "?"
    try:
        described = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--", "resumable"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
        ).stdout.strip()
        if changed:
            described += " + uncommitted changes"
    except (OSError, subprocess.CalledProcessError):
        pass
    return described


def environment(where: tuple[str, str], versions: dict[str, str]) -> dict[str, str]:
    """
    The environment line of the report: the machine, *where* the state goes (a label and a
    value), resumable's version and commit, then the *versions* of the libraries measured with.
    """
    import resumable

    label, value = where
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": str(os.cpu_count()),
        label: value,
        "resumable": f"{resumable.__version__} ({commit()})",
        **versions,
    }


def local_environment(base: Path) -> dict[str, str]:
    """The environment of the benchmarks keeping their state in the local directory *base*."""
    return environment(("filesystem", filesystem(base)), {"msgpack": ".".join(map(str, msgpack.version))})


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


# --- driving a script -----------------------------------------------------------------------


def run_timed(bench: Callable[[], list[Row]], name: str | None = None) -> list[Row]:
    """Run one benchmark; print a PASS/FAIL/info line per row and the time taken to stderr."""
    t0 = time.perf_counter()
    rows = bench()
    for row in rows:
        print(f"{row.result:4}  {row.name}: {row.library} vs {row.baseline}", file=sys.stderr)
    label = f"{name}: " if name else ""
    print(f"      ({label}{time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return rows


def report(rows: list[Row], env: dict[str, str], json_path: str | None) -> int:
    """Print the table, write it to *json_path* if given; return 1 if a target was missed, else 0."""
    print(render(rows, env))
    if json_path:
        Path(json_path).write_text(
            json.dumps(
                {"environment": env, "rows": [asdict(r) | {"result": r.result} for r in rows]}, indent=2
            )
            + "\n"
        )
    return 0 if all(r.passed is not False for r in rows) else 1


def drive(
    argv: list[str] | None,
    *,
    description: str | None,
    benches: dict[str, Callable[[Path, bool], list[Row]]],
    child: Callable[[str, str], None],
    prefix: str,
) -> int:
    """
    The ``main`` of a script of local benchmarks: parse ``--quick``, ``--only``, ``--dir`` and
    ``--json`` (and the hidden ``--child MODE STATE``, handed to *child*), run the selected
    *benches* (each called with the temporary directory and whether ``--quick`` was given) in
    their order, in a temporary directory named with *prefix*, and report them.
    """
    names = tuple(benches)
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    parser.add_argument("--only", default=",".join(names), help=f"comma-separated subset of {names}")
    parser.add_argument("--dir", default=None, help="where temporary state goes (default: $TMPDIR)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    quiet()
    warnings.simplefilter("error")  # a warning from the library would mean a wrong setup
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = set(only) - set(names)
    if unknown:
        parser.error(f"unknown benchmarks {sorted(unknown)}; choose from {names}")
    base = Path(tempfile.mkdtemp(prefix=prefix, dir=args.dir))
    rows: list[Row] = []
    try:
        env = local_environment(base)
        for name, bench in benches.items():
            if name in only:
                rows += run_timed(functools.partial(bench, base, args.quick), name)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return report(rows, env, args.json)
