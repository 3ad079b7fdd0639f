"""
The resume contract as a user meets it: a script edited between runs, killed with SIGKILL,
run again. Each test writes a script, runs it in a fresh interpreter, edits it, runs it
again, and checks what ran and what came out against what an uninterrupted run gives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

TIMEOUT = 60


class Script:
    """A user's script in its own directory (state in ./state), run in a fresh process each time."""

    def __init__(self, root: Path, source: str) -> None:
        self.root = root
        self.path = root / "script.py"
        self.edit(source)

    def edit(self, source: str) -> None:
        self.path.write_text(textwrap.dedent(source))

    def replace(self, old: str, new: str) -> None:
        text = self.path.read_text()
        assert old in text
        self.path.write_text(text.replace(old, new))

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, str(self.path), *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            env={**os.environ, "RESUMABLE_PROGRESS": "0"},
            check=False,
        )
        if ok:
            assert 0 == done.returncode, done.stderr
        return done

    def start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, str(self.path)],
            cwd=self.root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RESUMABLE_PROGRESS": "0"},
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "resumable", *args],
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )

    def lines(self, name: str) -> list[str]:
        path = self.root / name
        return path.read_text().splitlines() if path.exists() else []


def kill_when(proc: subprocess.Popen[str], ready: object) -> None:
    """SIGKILL *proc* as soon as ``ready()`` is true."""
    deadline = time.monotonic() + TIMEOUT
    while not ready():  # type: ignore[operator]
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()


# never stale ---------------------------------------------------------------------------


def test_an_output_changed_in_place_reruns_the_step_it_is_passed_to(tmp_path: Path):
    """d = load(); d["cfg"]["threshold"] = N; use(d): a new N is a new result, at any size and depth."""
    script = Script(
        tmp_path,
        """
        from resumable import step

        @step
        def load() -> dict:
            return {"cfg": {"threshold": 1000}, "rows": list(range(2000))}  # well over 4 KiB

        @step
        def use(d: dict) -> int:
            return sum(r for r in d["rows"] if r < d["cfg"]["threshold"])

        d = load()
        d["cfg"]["threshold"] = 1000
        print(use(d))
        """,
    )
    assert str(sum(range(1000))) == script.run().stdout.strip()
    script.replace('d["cfg"]["threshold"] = 1000', 'd["cfg"]["threshold"] = 1500')
    assert str(sum(range(1500))) == script.run().stdout.strip()
    assert str(sum(range(1500))) == script.run().stdout.strip()  # and then skipped, still right


def test_a_path_argument_is_fingerprinted_by_the_file_contents(tmp_path: Path):
    """count_lines(Path("input.txt")) follows the file; the same bytes with a new mtime do not rerun it."""
    script = Script(
        tmp_path,
        """
        from pathlib import Path
        from resumable import step

        @step
        def count_lines(path: Path) -> int:
            with open("calls.txt", "a") as f:
                f.write("ran\\n")
            return len(path.read_text().splitlines())

        print(count_lines(Path("input.txt")))
        """,
    )
    data = tmp_path / "input.txt"
    data.write_text("a\nb\n")
    assert "2" == script.run().stdout.strip()
    data.write_text("a\nb\nc\n")
    assert "3" == script.run().stdout.strip()
    os.utime(data, (time.time() + 10, time.time() + 10))  # touched, not changed
    assert "3" == script.run().stdout.strip()
    assert 2 == len(script.lines("calls.txt"))


def test_editing_a_dict_constant_reruns_the_steps_that_read_it(tmp_path: Path):
    """A module-level dict (examples/agent_loop.py's WEATHER) is part of the code of the steps reading it."""
    script = Script(
        tmp_path,
        """
        from resumable import step

        WEATHER = {"paris": "rain", "rome": "sun"}

        @step
        def forecast(city: str) -> str:
            return WEATHER[city]

        print(forecast("paris"))
        """,
    )
    assert "rain" == script.run().stdout.strip()
    script.replace('"paris": "rain"', '"paris": "snow"')
    assert "snow" == script.run().stdout.strip()
    out = script.cli("why", "forecast").stdout
    assert "value WEATHER: {'paris': 'rain', 'rome': 'sun'} -> {'paris': 'snow', 'rome': 'sun'}" in out


def test_a_global_reassigned_during_the_run_is_read_at_each_call(tmp_path: Path):
    """for LANG in ["en", "fr"]: greet("Ann") gives two greetings, in the first run and the next."""
    script = Script(
        tmp_path,
        """
        from resumable import step

        LANG = "en"

        @step(key="{name}-{lang}")
        def greet(name: str, lang: str = "") -> str:
            return {"en": "Hello", "fr": "Bonjour"}[LANG] + " " + name

        @step
        def hello(name: str) -> str:
            return {"en": "Hello", "fr": "Bonjour"}[LANG] + " " + name

        for LANG in ["en", "fr"]:
            print(greet("Ann", LANG), "/", hello("Ann"))
        """,
    )
    # (hello has one slot: its second call replaces the first, with a warning to add key=)
    expected = "Hello Ann / Hello Ann\nBonjour Ann / Bonjour Ann"
    assert expected == script.run().stdout.strip()
    assert expected == script.run().stdout.strip()


def test_helpers_behind_lru_cache_and_dispatch_tables_are_part_of_the_code(tmp_path: Path):
    """Editing a same-module helper reached through @lru_cache or a dispatch dict reruns the step."""
    script = Script(
        tmp_path,
        """
        import functools
        from resumable import step

        @functools.lru_cache
        def rate(kind: str) -> float:
            return 0.1

        def csv_size(n: int) -> int:
            return n * 10

        HANDLERS = {"csv": csv_size}

        @step
        def cost(kind: str, n: int) -> float:
            return HANDLERS[kind](n) * rate(kind)

        print(cost("csv", 5))
        """,
    )
    assert "5.0" == script.run().stdout.strip()
    script.replace("return 0.1", "return 0.2")
    assert "10.0" == script.run().stdout.strip()
    script.replace("return n * 10", "return n * 100")
    assert "100.0" == script.run().stdout.strip()


def test_a_small_output_of_any_type_can_be_passed_to_the_next_step(tmp_path: Path):
    """A plain class returned by a step (not fingerprintable on its own) is passed on; the rerun skips both."""
    script = Script(
        tmp_path,
        """
        from resumable import step

        class Config:
            def __init__(self, depth: int) -> None:
                self.depth = depth

        @step
        def configure() -> Config:
            return Config(3)

        @step
        def build(config: Config) -> int:
            with open("calls.txt", "a") as f:
                f.write("build\\n")
            return config.depth * 2

        print(build(configure()))
        """,
    )
    assert "6" == script.run().stdout.strip()
    assert "6" == script.run().stdout.strip()
    assert ["build"] == script.lines("calls.txt")


# never redo what already happened ----------------------------------------------------------

BATCH = """
import sys, time
from resumable import checkpointed_map, step

def enrich_row(x: int) -> int:
    with open("calls.txt", "a") as f:
        f.write(f"{x}\\n")
    time.sleep(0.002)
    return x * 2

@step
def enrich() -> list[int]:
    return checkpointed_map(enrich_row, range(300), every=10)

print(sum(enrich()))
"""


def test_a_batch_killed_then_fixed_keeps_its_committed_rows(tmp_path: Path):
    """kill -9 mid-batch, edit the row function, rerun: committed rows are not computed again."""
    script = Script(tmp_path, BATCH)
    proc = script.start()
    kill_when(proc, lambda: len(script.lines("calls.txt")) >= 100)
    before = [int(x) for x in script.lines("calls.txt")]
    script.replace("return x * 2", "return 2 * x  # edited")
    done = script.run()
    assert str(sum(range(300)) * 2) == done.stdout.strip()  # what an uninterrupted run gives
    assert "that earlier code of the step computed" in done.stderr
    assert "resumable reset enrich" in done.stderr
    again = [int(x) for x in script.lines("calls.txt")][len(before) :]
    committed = sorted(set(range(300)) - set(again))
    assert len(committed) >= 90  # at most the rows since the last commit are redone
    assert committed == list(range(len(committed)))  # chunks commit in order
    assert set(again) == set(range(len(committed), 300))


def test_a_batch_whose_step_arguments_changed_does_not_mix_rows(tmp_path: Path):
    """Rows computed with factor=2 are not reused for factor=3, even after a kill."""
    script = Script(
        tmp_path,
        """
        import sys, time
        from resumable import checkpointed_map, step

        def slow(x: int) -> int:
            time.sleep(0.002)
            with open("calls.txt", "a") as f:
                f.write(f"{x}\\n")
            return x

        @step
        def scaled(factor: int) -> list[int]:
            return [r * factor for r in checkpointed_map(slow, range(200), every=10)]

        print(sum(scaled(int(sys.argv[1]) if len(sys.argv) > 1 else 2)))
        """,
    )
    proc = script.start()
    kill_when(proc, lambda: len(script.lines("calls.txt")) >= 60)
    done = script.run("3")
    assert str(sum(range(200)) * 3) == done.stdout.strip()
    assert "arguments changed (factor)" in done.stderr


def test_a_changed_non_idempotent_step_is_not_run_again_without_confirmation(tmp_path: Path):
    """pay() reads PRICE: editing it raises StepChangedError; following its hint runs it exactly once more."""
    script = Script(
        tmp_path,
        """
        from resumable import step

        PRICE = 100

        @step(idempotent=False)
        def pay(customer: str) -> str:
            with open("charges.txt", "a") as f:
                f.write(f"{customer} {PRICE}\\n")
            return f"charged {PRICE}"

        print(pay("ann"))
        """,
    )
    assert "charged 100" == script.run().stdout.strip()
    script.replace("PRICE = 100", "PRICE = 120")
    refused = script.run(ok=False)
    assert 1 == refused.returncode
    assert "StepChangedError" in refused.stderr
    assert "its code changed (const PRICE)" in refused.stderr
    assert "resumable reset pay" in refused.stderr
    assert ["ann 100"] == script.lines("charges.txt")
    assert 0 == script.cli("reset", "pay").returncode  # the hint, followed
    assert "charged 120" == script.run().stdout.strip()
    assert "charged 120" == script.run().stdout.strip()
    assert ["ann 100", "ann 120"] == script.lines("charges.txt")


def test_loop_state_comes_out_right_after_kills(tmp_path: Path):
    """A counter kept in checkpointed(state=) equals an uninterrupted run's after two SIGKILLs."""
    script = Script(
        tmp_path,
        """
        import time
        from resumable import checkpointed

        loop = checkpointed(range(200), every=10, name="send", state={"sent": 0, "even": 0})
        for x in loop:
            time.sleep(0.002)
            with open("sent.txt", "a") as f:
                f.write(f"{x}\\n")
            loop.state["sent"] += 1
            loop.state["even"] += x % 2 == 0
        print(loop.state["sent"], loop.state["even"])
        """,
    )
    for at in (50, 120):
        proc = script.start()
        kill_when(proc, lambda at=at: len(script.lines("sent.txt")) >= at)
    assert "200 100" == script.run().stdout.strip()
    sent = [int(x) for x in script.lines("sent.txt")]
    assert set(range(200)) == set(sent)
    assert len(sent) - 200 <= 2 * 10  # at most the rows since the last commit, per kill


@pytest.mark.parametrize("mode", ["unchanged", "edited"])
def test_a_batch_outside_a_step_keeps_its_rows_too(tmp_path: Path, mode: str):
    """A named batch keeps its rows whether or not the script changed (as it did before)."""
    script = Script(
        tmp_path,
        """
        import time
        from resumable import checkpointed_map

        def row(x: int) -> int:
            time.sleep(0.002)
            with open("calls.txt", "a") as f:
                f.write(f"{x}\\n")
            return x + 1

        print(sum(checkpointed_map(row, range(200), every=10, name="rows")))
        """,
    )
    proc = script.start()
    kill_when(proc, lambda: len(script.lines("calls.txt")) >= 60)
    first = len(script.lines("calls.txt"))
    if mode == "edited":
        script.replace("return x + 1", "return 1 + x")
    assert str(sum(range(1, 201))) == script.run().stdout.strip()
    assert len(script.lines("calls.txt")) - first <= 200 - 50


def _alive(pid: int) -> bool:
    """True if *pid* runs (a zombie, dead but not reaped by its new parent, does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in {"Z", "X"}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_process_pool_workers_exit_when_their_run_is_killed(tmp_path: Path):
    """kill -9 of a run mid-batch on a process pool: its workers exit by themselves; the rerun finishes."""
    script = Script(
        tmp_path,
        """
        import multiprocessing, os, time
        from concurrent.futures import ProcessPoolExecutor
        from resumable import checkpointed_map, step

        def slow(x: int) -> int:
            with open(f"worker-{os.getpid()}", "a") as f:
                f.write(f"{x}\\n")
            time.sleep(0.05)
            return x

        @step
        def rows() -> int:
            with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
                return sum(checkpointed_map(slow, range(120), every=5, executor=pool))

        if __name__ == "__main__":
            print(rows())
        """,
    )
    proc = script.start()
    kill_when(proc, lambda: len(list(tmp_path.glob("worker-*"))) >= 2)
    workers = [int(p.name.split("-")[1]) for p in tmp_path.glob("worker-*")]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [] == [pid for pid in workers if _alive(pid)]
    assert str(sum(range(120))) == script.run().stdout.strip()
