"""
A real full disk: the state directory on a small tmpfs (where this machine lets the tests
mount one; skipped otherwise). Errors name the file, nothing stored is lost, a non-idempotent
step never runs without its start on disk, and the run after space is freed completes.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    from resumable import Pipeline

    pipe = Pipeline("full", state_dir=sys.argv[1])

    @pipe.step(key="{i}")
    def blob(i: int) -> bytes:
        return bytes([i % 256]) * 60_000

    @pipe.step(idempotent=False)
    def pay() -> str:
        with open(sys.argv[2], "a") as f:
            f.write("charged\\n")
        return "paid"

    with pipe:
        for i in range(int(sys.argv[3])):
            blob(i)
        if sys.argv[4] == "pay":
            print(pay())
    """
)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs, mounted for the test (skips where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, check=False
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def _run(state: Path, charges: Path, blobs: int, *, pay: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(state), str(charges), str(blobs), "pay" if pay else "no"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _fill(directory: Path) -> Path:
    """Fill the file system to the last byte with one file."""
    filler = directory / "filler"
    try:
        with open(filler, "wb", buffering=0) as f:
            for size in (65536, 4096, 512, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
    except OSError as exc:  # not even room for the file's name
        if exc.errno != errno.ENOSPC:
            raise
    return filler


def test_a_full_disk_names_the_file_loses_nothing_and_never_pays_twice(small_disk: Path, tmp_path: Path):
    state = small_disk / "state"
    charges = tmp_path / "charges.txt"
    ballast = small_disk / "other-data"  # the user's other files on that disk
    ballast.write_bytes(b"\0" * 300_000)
    first = _run(state, charges, 3)
    assert 0 == first.returncode, first.stderr
    # Outputs until the disk is full: the error names the output it could not write.
    more = _run(state, charges, 40)
    assert 0 != more.returncode
    assert "No space left on device" in more.stderr
    assert f"{state}/blob/" in more.stderr
    stored = {p.name for p in (state / "blob").glob("*.msgpack")}
    assert {"0.msgpack", "1.msgpack", "2.msgpack"} <= stored
    # The disk is full to the last byte when the non-idempotent step comes.
    filler = _fill(small_disk)
    blocked = _run(state, charges, 3, pay=True)
    assert 0 != blocked.returncode
    assert "No space left on device" in blocked.stderr
    charged_while_full = charges.exists()  # only if its start reached the log first
    # With room again: everything stored is skipped, and pay never runs a second time.
    filler.unlink(missing_ok=True)
    ballast.unlink()
    paid = _run(state, charges, 3, pay=True)
    if charged_while_full:
        assert "StepInterruptedError" in paid.stderr  # it may have paid: the user decides
    else:
        assert (0, "paid\n") == (paid.returncode, paid.stdout), paid.stderr
        again = _run(state, charges, 3, pay=True)
        assert (0, "paid\n") == (again.returncode, again.stdout), again.stderr
    assert ["charged"] == charges.read_text().splitlines()
    verify = subprocess.run(
        [sys.executable, "-m", "resumable", "--state-dir", str(state), "verify"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert 0 == verify.returncode, verify.stdout
