"""Every command shown in docs/cli.md, run on a real state: its output has the documented shape."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest

from tests.conftest import ROOT

DOC = ROOT / "docs" / "cli.md"
DEMO = "/tmp/demo"  # the directory the samples were made in

# What changes from one run to the next, replaced by a placeholder (order matters).
_VOLATILE = [
    (re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+Z"), "TIME"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "HEX"),
    (re.compile(r"\b\d+(\.\d+)?[smhd] ago\b"), "AGO"),
    (re.compile(r"\b\d+(\.\d+)?(ms|s|min)\b"), "DURATION"),
    (re.compile(r"\b\d+(\.\d+)? (B|KB|MB|GB)\b"), "SIZE"),
    (re.compile(r"on host \S+"), "on host HOST"),
    (re.compile(r"\bpid \d+"), "pid PID"),
    (re.compile(r" +"), " "),  # table columns are as wide as their widest cell
]


def shape(text: str) -> list[str]:
    """The lines of *text* with times, digests, sizes, hosts and column widths masked."""
    lines = []
    for line in text.strip("\n").splitlines():
        for pattern, placeholder in _VOLATILE:
            line = pattern.sub(placeholder, line)
        lines.append(line.rstrip())
    return lines


def samples() -> Iterator[tuple[str, str]]:
    """(command, its documented output) for every `$ resumable ...` line in docs/cli.md."""
    blocks = re.findall(r"```text\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    for block in blocks:
        command: str | None = None
        output: list[str] = []
        for line in block.splitlines():
            if line.startswith("$ "):
                if command is not None:
                    yield command, "\n".join(output)
                command, output = (line[2:] if line.startswith("$ resumable ") else None), []
            elif command is not None:
                output.append(line)
        if command is not None:
            yield command, "\n".join(output)


SAMPLES = list(samples())
# the documented pipeline: the first Python block (fenced `{.python notest}`: it needs an argument)
PIPELINE = re.findall(r"```(?:python|{.python[^}]*})\n(.*?)```", DOC.read_text(), flags=re.DOTALL)[0]

HOLD = """
import sys, time
from resumable import Pipeline
with Pipeline(state_dir=sys.argv[1]):
    print("holding", flush=True)
    time.sleep(60)
"""


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The state docs/cli.md's pipeline leaves after the two documented runs."""
    root = tmp_path_factory.mktemp("demo")
    (root / "pipeline.py").write_text(PIPELINE)
    for text in ("What is a checkpoint?", "What is fsync?"):
        subprocess.run([sys.executable, "pipeline.py", text], cwd=root, check=True, capture_output=True)
    return root / "state"


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


def _prepare(cwd: Path, command: str, documented: str) -> None:
    """Set up what the sample shows happened before it: an export, damage."""
    state = cwd / "state"
    if "code changed" in documented:  # the sample after an edit of `answer`
        (cwd / "pipeline.py").write_text(PIPELINE.replace("prompt.upper()", "prompt.lower()"))
        run = [sys.executable, "pipeline.py", "What is fsync?"]
        subprocess.run(run, cwd=cwd, check=True, capture_output=True)
    if "DAMAGED" in documented:
        _flip_last_byte(state / "answer.msgpack")
    if " import " in f" {command} ":
        subprocess.run(
            [sys.executable, "-m", "resumable", "export", "-o", "agent.state"],
            cwd=cwd,
            check=True,
            capture_output=True,
        )
        exported = msgpack.unpackb((cwd / "agent.state").read_bytes())
        broken = bytearray(exported["files"]["answer.msgpack"])
        broken[-1] ^= 1
        exported["files"]["answer.msgpack"] = bytes(broken)
        (cwd / "broken.state").write_bytes(msgpack.packb(exported))


def test_docs_show_commands():
    """docs/cli.md shows every command of the command line at least once."""
    shown = {
        command.split()[1] if not command.split()[1].startswith("-") else command.split()[3]
        for command, _ in SAMPLES
    }
    assert {
        "status",
        "show",
        "why",
        "reset",
        "history",
        "rollback",
        "export",
        "import",
        "verify",
        "clean",
    } == shown


@pytest.mark.parametrize(("command", "documented"), SAMPLES, ids=[c for c, _ in SAMPLES])
def test_documented_output(demo: Path, tmp_path: Path, command: str, documented: str):
    """The command, run on the documented pipeline's state, prints what docs/cli.md shows."""
    cwd = tmp_path / "demo"
    shutil.copytree(demo, cwd / "state")
    _prepare(cwd, command, documented)
    argv = [sys.executable, "-m", "resumable", *command.split()[1:]]
    holder = None
    if "is in use by a run" in documented:
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, "state"], cwd=cwd, stdout=subprocess.PIPE, text=True
        )
        assert "holding" == holder.stdout.readline().strip()
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
            holder.stdout.close()
    printed = (done.stdout + done.stderr).replace(str(cwd), DEMO)
    assert shape(documented) == shape(printed)
