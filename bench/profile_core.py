"""
Where the time goes on the paths bench_core.py measures: cProfile listings and phase costs.

Run from the repository root::

    python bench/profile_core.py            # skip, store, big and import
    python bench/profile_core.py skip store # a subset
    python bench/profile_core.py --what-if  # also time stores into a 1,000-slot pipeline
                                            # with a cheaper manifest flush (patched here only)

The phase tables call the library's internal functions one at a time, in an open run, so
their sum is the CPU cost of a call; the gap to the measured call time is glue code and
contention with the background manifest writer. ``--what-if`` patches ``Journal.flush`` in
this process only (the manifest is snapshotted under the journal lock and encoded outside
it, without ``attrs.asdict`` and without ``indent``), to show what a cheaper flush would
gain (see docs/performance.md); nothing under resumable/ changes.
"""

# ruff: noqa: SLF001 - this script measures the library's internals on purpose

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_core as bc

from resumable import Pipeline, _journal, _run
from resumable._codec import decode, encode, frame, parse_header, utcnow, value_digest, verify
from resumable._fingerprint import provenance
from resumable._slots import MANIFEST, slot_file


def per_call(fn: Callable[[], object], n: int, repeat: int = 7) -> float:
    """Median seconds per call of *fn* over *repeat* loops of *n* calls."""
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def top_functions(fn: Callable[[], object], limit: int = 15) -> str:
    """cProfile *fn*; the functions with the most own time, with their share of the total."""
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    out = io.StringIO()
    out.write(
        f"  cProfile, main thread, {total * 1e3:.0f} ms in total (own time, share, calls, cumulative):\n"
    )
    for (file, line, name), (_cc, nc, tt, ct, _callers) in rows[:limit]:
        where = name if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({name})"
        out.write(f"    {tt * 1e3:8.1f} ms {tt / total:6.1%} {nc:7d}  cum {ct * 1e3:8.1f} ms  {where}\n")
    return out.getvalue()


def open_run(pipe: Pipeline) -> Any:
    run = pipe._run
    if run is None:
        msg = "the pipeline has no open run"
        raise RuntimeError(msg)
    return run


def phase_table(title: str, phases: dict[str, float], measured: float) -> str:
    total = sum(phases.values())
    out = [f"  {title}: phases (µs per call, share of their sum)"]
    out += [f"    {v * 1e6:8.1f} µs {v / total:6.1%}  {k}" for k, v in phases.items()]
    out.append(f"    {total * 1e6:8.1f} µs          sum of phases")
    out.append(f"    {measured * 1e6:8.1f} µs          measured call (glue + writer contention: "
               f"{(measured - total) * 1e6:.1f} µs)")  # fmt: skip
    return "\n".join(out)


def cheap_flush() -> None:
    """What-if: snapshot the manifest under the lock, encode it outside, without attrs.asdict or indent."""
    import attrs

    from resumable._manifest import Manifest

    names = [a.name for a in attrs.fields(Manifest)]

    def plain(obj: Any) -> Any:
        if attrs.has(type(obj)):
            return {a.name: getattr(obj, a.name) for a in attrs.fields(type(obj))}
        return obj

    def flush(self: Any, *, durable: bool) -> None:
        with self._flush_lock:
            with self.lock:
                self._write_pending(durable=durable)
                m = self.manifest
                data = {n: getattr(m, n) for n in names}
                data["completed_steps"] = list(m.completed_steps)
                data["steps"] = {k: plain(v) for k, v in m.steps.items()}
                data["batches"] = {k: plain(v) for k, v in m.batches.items()}
                data["code"] = {k: dict(v) for k, v in m.code.items()}
                data["error"] = plain(m.error)
            text = json.dumps(_journal._signed(data, self.secret), ensure_ascii=False) + "\n"
            self.store.write(MANIFEST, [text.encode()], durable=durable)

    _journal.Journal.flush = flush  # type: ignore[method-assign]


# --- the paths ------------------------------------------------------------------------------


def profile_skip(base: Path) -> None:
    print("== skip: a completed step with a small argument, ~1 KB output ==")
    pipe = Pipeline("bench", state_dir=base / "skip")
    with pipe:
        bc.skip_small(42)
        measured = per_call(lambda: bc.skip_small(42), 2000)
        print(top_functions(lambda: [bc.skip_small(42) for _ in range(5000)]))
        spec = bc.skip_small.__resumable_step__
        run = open_run(pipe)
        plan = spec.plan((42,), {})
        key = slot_file(plan.slot)
        data = run.store.read(key)
        header, head_len = parse_header(data)
        value = decode(data, header, head_len, allow_pickle=True)
        digest = value_digest(header)
        fields = {"slot": plan.slot, "fingerprint": plan.fingerprint, "bytes": 1000, "created_at": "x"}
        # The library changes under these names; follow whichever version is installed.
        _run_remember = getattr(_run, "_remember", None)
        record_skip = getattr(run.journal, "record_skip", None)

        def remember() -> None:
            if _run_remember is not None:
                _run_remember(value, header)
            else:
                provenance.remember(value, digest)

        def note_skip() -> None:
            if record_skip is not None:
                record_skip(plan.slot, plan.fingerprint, 1000, "x")
            else:
                run.journal.record("step_skipped", lazy=True, **fields)

        phases = {
            "wrapper: RESUMABLE_DISABLE check, current pipeline, open_run": lambda: (
                os.environ.get("RESUMABLE_DISABLE", ""),
                spec.pipeline_for_call().open_run(spec),
            ),
            "plan: bind, digest_arguments, fingerprint sha256, slot_id": lambda: spec.plan((42,), {}),
            "store.read: the whole file into a bytearray": lambda: run.store.read(key),
            "parse_header: Unpacker, _valid_header": lambda: parse_header(data),
            "verify: header digest, body sha256": lambda: verify(data, header, head_len, None),
            "decode: Decoder + unpackb": lambda: decode(data, header, head_len, allow_pickle=True),
            "provenance (remember the output's digest)": remember,
            "journal: note the skip": note_skip,
        }
        costs = {k: per_call(f, 2000) for k, f in phases.items()}

        def json_line() -> bytes:
            return (
                _journal._dumps(_journal._signed({"t": "x", "event": "e", **fields}, None)) + "\n"
            ).encode()

        sub = {
            "  of which utcnow()": per_call(utcnow, 5000),
            "  of which the JSON line (_signed, _dumps, encode)": per_call(json_line, 5000),
        }
        print(phase_table("skip", costs, measured))
        print("\n".join(f"    {v * 1e6:8.1f} µs          {k}" for k, v in sub.items()))
        bare_path = str(base / "skip" / key)

        def bare() -> None:
            os.path.exists(bare_path)
            with open(bare_path, "rb") as f:
                raw = f.read()
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(raw)
            unpacker.unpack()
            unpacker.unpack()

        print(f"    {per_call(bare, 2000) * 1e6:8.1f} µs          bare exists + read + unpack (baseline)\n")


def profile_store(base: Path) -> None:
    print("== store: a ~1 KB output, durably, new slot per call ==")
    pipe = Pipeline("bench", state_dir=base / "store")
    counter = itertools.count()
    with pipe:
        bc.store_small(-1)
        measured = per_call(lambda: bc.store_small(next(counter)), 40)
        print(top_functions(lambda: [bc.store_small(next(counter)) for _ in range(200)]))
        spec = bc.store_small.__resumable_step__
        run = open_run(pipe)
        plan = spec.plan((10**9,), {})
        encoded = encode(bc.SMALL, allow_pickle=True)
        meta = {"slot": plan.slot, "step": spec.name, "key": plan.key, "fingerprint": plan.fingerprint}
        chunks, _ = frame(encoded, meta)
        bare_dir = base / "store-bare"
        bare_dir.mkdir()
        fake = itertools.count(10**6)
        phases = {
            "plan: bind, key, digest_arguments, fingerprint": lambda: spec.plan((10**9,), {}),
            "lookup (miss): open fails, manifest check": lambda: run.lookup(spec, plan),
            "journal.record('step_started')": lambda: run.journal.record(
                "step_started", slot=f"fake/{next(fake)}", step="x", reason="new", fingerprint="f", attempt=1
            ),
            "encode (msgpack Packer)": lambda: encode(bc.SMALL, allow_pickle=True),
            "frame: header packb x3, header sum, sha256": lambda: frame(encoded, meta),
            "store.write: tmp, write, fsync, rename, dir fsync": lambda: run.store.write(
                f"store_small/w{next(fake)}.msgpack", chunks, durable=True
            ),
            "journal.record('step_completed')": lambda: run.journal.record(
                "step_completed",
                slot=f"fake/{next(fake)}",
                fingerprint="f",
                bytes=1,
                duration_s=0.1,
                attempts=1,
            ),
        }
        costs = {k: per_call(f, 40 if "write" in k else 500) for k, f in phases.items()}
        print(phase_table("store", costs, measured))
        bare = per_call(lambda: bc.bare_store(str(bare_dir), next(fake), bc.SMALL), 40)
        print(f"    {bare * 1e6:8.1f} µs          bare packb + tmp + fsync + rename + dir fsync (baseline)\n")


def timed_writes(write: Callable[[Path], None], directory: Path, reps: int = 7) -> float:
    """Median seconds of ``write(path)`` to a fresh file; the file is deleted between reps, untimed."""
    samples = []
    for i in range(reps):
        path = directory / f"w{i}.bin"
        t0 = time.perf_counter()
        write(path)
        samples.append(time.perf_counter() - t0)
        path.unlink()
    return statistics.median(samples)


def profile_big(base: Path) -> None:
    import hashlib

    import numpy as np

    print("== 100 MB float64 output: where a durable write goes ==")
    arr = np.random.default_rng(1).random(bc.BIG_FLOATS)
    raw = memoryview(arr).cast("B")  # type: ignore[arg-type]
    pipe = Pipeline("bench", state_dir=base / "big")
    with pipe:
        run = open_run(pipe)
        encoded = encode(arr, allow_pickle=True)
        chunks, _ = frame(encoded, {"slot": "big", "fingerprint": "f"})

        def library_write(path: Path) -> None:
            run.store.write(path.name, chunks, durable=True)

        def raw_write(path: Path) -> None:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.write(fd, raw)
            os.fsync(fd)
            os.close(fd)

        phases = {
            "encode (array by reference, no copy)": per_call(lambda: encode(arr, allow_pickle=True), 5, 3),
            "frame: sha256 of 100 MB": per_call(
                lambda: frame(encoded, {"slot": "big", "fingerprint": "f"}), 3, 5
            ),
            "store.write: write 100 MB, fsync, rename, dir fsync": timed_writes(library_write, base / "big"),
        }
        total = sum(phases.values())
        for k, v in phases.items():
            print(f"    {v * 1e3:8.1f} ms {v / total:6.1%}  {k}")
        lines = {
            "raw write + fsync (baseline)": timed_writes(raw_write, base),
            "hashlib.sha256 alone": per_call(lambda: hashlib.sha256(raw).digest(), 1, 5),
            "hashlib.blake2b alone": per_call(lambda: hashlib.blake2b(raw).digest(), 1, 3),
            "prototype: sha256 overlapped with write + fdatasync": timed_writes(
                lambda path: overlapped_write(path, raw), base
            ),
        }
        for k, v in lines.items():
            print(f"    {v * 1e3:8.1f} ms          {k}")
        print()


def overlapped_write(path: Path, raw: memoryview, head_len: int = 512, chunk: int = 8 << 20) -> None:
    """
    A prototype of a durable write that hashes while it writes: a thread writes the value
    after room left for the header and fdatasyncs it, while the caller computes the
    SHA-256; then the header (which holds the digest) goes to offset 0, and the file is
    fsynced, renamed into place and its directory fsynced. Still atomic: the rename comes last.
    """
    import hashlib
    import threading

    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:

        def write_value() -> None:
            offset = head_len
            for start in range(0, len(raw), chunk):
                offset += os.pwrite(fd, raw[start : start + chunk], offset)
            os.fdatasync(fd)

        writer = threading.Thread(target=write_value)
        writer.start()
        digest = hashlib.sha256()
        for start in range(0, len(raw), chunk):
            digest.update(raw[start : start + chunk])
        writer.join()
        os.pwrite(fd, digest.hexdigest().encode().ljust(head_len), 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    bc.fsync_dir(str(path.parent))


def profile_import(base: Path) -> None:
    print("== import resumable: self time per module (python -X importtime, median of 9) ==")
    samples: dict[str, list[int]] = {}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(base / "pycache")
    for i in range(10):
        err = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import resumable"],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        ).stderr
        if i == 0:
            continue  # warms the bytecode cache
        for line in err.splitlines():
            parts = line.removeprefix("import time:").split("|")
            if len(parts) == 3 and parts[0].strip().isdigit():
                samples.setdefault(parts[2].strip(), []).append(int(parts[0]))
    med = {k: statistics.median(v) for k, v in samples.items()}
    total = sum(med.values())
    own = sum(v for k, v in med.items() if k.startswith("resumable"))
    print(
        f"  total {total / 1e3:.1f} ms, of which resumable's own modules {own / 1e3:.1f} ms ({own / total:.0%})"
    )
    for name, v in sorted(med.items(), key=lambda kv: -kv[1])[:20]:
        print(f"    {v / 1e3:6.2f} ms {v / total:6.1%}  {name}")
    print()


PATHS: dict[str, Callable[[Path], None]] = {
    "skip": profile_skip,
    "store": profile_store,
    "big": profile_big,
    "import": profile_import,
}


def what_if(base: Path, slots: int = 1000) -> None:
    print(f"== what-if: storing into a pipeline holding {slots:,} slots, manifest flush as is / cheaper ==")
    for label in ("as is", "cheap flush"):
        if label == "cheap flush":
            cheap_flush()
        lib, bare, flush = _store_many(base / f"whatif-{label.replace(' ', '-')}", slots)
        ratio = statistics.median(a / b for a, b in zip(lib, bare, strict=True))
        print(
            f"    {label:12} store {statistics.median(lib) * 1e6:7.1f} µs, bare {statistics.median(bare) * 1e6:7.1f} µs,"
            f" ratio {ratio:.2f}; one manifest flush {flush * 1e3:.1f} ms"
        )
    print()


def _store_many(where: Path, slots: int) -> tuple[list[float], list[float], float]:
    with Pipeline("bench", state_dir=where / "state", durable=False):
        for i in range(slots):
            bc.store_small(-1 - i)
    counter = itertools.count()
    bare_dir = where / "bare"
    bare_dir.mkdir()
    lib, bare = [], []
    with Pipeline("bench", state_dir=where / "state") as pipe:
        bc.store_small(0)
        journal = open_run(pipe).journal
        for _ in range(5):  # blocks long enough to span a few manifest flushes (one per 0.2 s)
            lib.append(per_call(lambda: bc.store_small(next(counter)), 100, 1))
            bare.append(per_call(lambda: bc.bare_store(str(bare_dir), next(counter), bc.SMALL), 100, 1))
        flush = per_call(lambda: journal.flush(durable=False), 5, 3)
    return lib, bare, flush


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("paths", nargs="*", help=f"which of {', '.join(PATHS)} (default: all)")
    parser.add_argument(
        "--what-if",
        action="store_true",
        help="also time stores in a 1,000-slot pipeline with a cheaper flush",
    )
    args = parser.parse_args(argv)
    unknown = sorted(set(args.paths) - set(PATHS))
    if unknown:
        parser.error(f"unknown paths {unknown}; choose from {', '.join(PATHS)}")
    bc.quiet()
    with tempfile.TemporaryDirectory(prefix="resumable-profile-") as tmp:
        base = Path(tmp)
        for name in args.paths or PATHS:
            PATHS[name](base)
        if args.what_if:
            what_if(base)
    return 0


if __name__ == "__main__":
    sys.exit(main())
