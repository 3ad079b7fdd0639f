"""
`resumable report` in a real browser: a crashed (SIGKILL) and resumed run, a batch, a code
change compared with the run before it, a state full of hostile strings and a 100k-slot state.

The browser is Debian's Chromium driven by Playwright (`executable_path`, no download).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from resumable import Pipeline
from resumable._cli import main as cli
from resumable._journal import read_state
from resumable._report_data import collect
from resumable._stores import LocalStore

APT = "apt-get install -y --no-install-recommends chromium"

SCRIPT = """
import os, signal, sys, time
from resumable import Pipeline, checkpointed_map

pipe = Pipeline("shop", store=sys.argv[1])
MODE = os.environ.get("MODE", "")


def helper(x):
    return x * 2{change}


@pipe.step
def load(n: int) -> list[int]:
    time.sleep(0.05)
    return list(range(n))


@pipe.step(key=lambda i: f"item-{{i}}")
def fetch(i: int) -> int:
    time.sleep(0.005)
    return i * i


@pipe.step(retries=1)
def flaky(x: int) -> int:
    flag = os.path.join(os.path.dirname(sys.argv[1]), "flaky-once")
    if not os.path.exists(flag):
        open(flag, "w").close()
        raise ValueError("the first attempt fails")
    return x


def enrich_row(r: int) -> int:
    if MODE == "kill" and r == 230:
        os.kill(os.getpid(), signal.SIGKILL)
    if r % 97 == 0:
        raise ValueError(f"row {{r}} is bad")
    time.sleep(0.001)
    return r + 1


@pipe.step
def enrich(rows: list[int]) -> list:
    return list(checkpointed_map(enrich_row, rows, every=50, on_error="record"))


@pipe.step
def clean(rows: list) -> list:
    return [helper(r) for r in rows if isinstance(r, int)]


@pipe.step
def summary(xs: list[int]) -> int:
    if MODE == "fail":
        raise RuntimeError("summary failed: the total is wrong")
    return sum(xs)


with pipe:
    rows = load(400)
    squares = [fetch(i) for i in range(12)]
    flaky(3)
    print(summary(clean(enrich(rows))))
"""


# fixtures ----------------------------------------------------------------------------------


def _script(directory: Path, change: str = "") -> Path:
    path = directory / "shop.py"
    path.write_text(SCRIPT.format(change=change))
    return path


def _run(script: Path, state: Path, mode: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MODE": mode, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, str(script), str(state)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run 1 killed by SIGKILL in the batch, run 2 fails, run 3 completes, run 4 after a code change."""
    root = tmp_path_factory.mktemp("shop")
    state = root / "state"
    script = _script(root)
    killed = _run(script, state, "kill")
    assert -signal.SIGKILL == killed.returncode, killed.stderr
    failed = _run(script, state, "fail")
    assert 1 == failed.returncode
    assert "summary failed" in failed.stderr
    assert 0 == _run(script, state).returncode
    _script(root, change=" + 1")
    changed = _run(script, state)
    assert 0 == changed.returncode, changed.stderr
    return state


def _report(state: Path | str, out: Path, *args: str) -> Path:
    assert 0 == cli(["--state-dir", str(state), "report", "-o", str(out), *args])
    return out


@pytest.fixture(scope="module")
def shop_report(shop: Path) -> Path:
    return _report(shop, shop.parent / "report.html", "--compare", "3")


def _manifest(state: Path) -> dict[str, Any]:
    """The manifest's data, keyed steps' records included (they live in files of their own)."""
    return read_state(LocalStore(state)).to_dict()


def _events(state: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def browser():
    """Chromium from the system (Debian's package), driven by Playwright."""
    executable = (
        os.environ.get("RESUMABLE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        executable = None
    if executable is None:
        message = f"the report tests need Chromium and playwright: {APT}; pip install -e '.[test]'"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        yield instance
        instance.close()


class Page:
    """A page that records what a report must never do: fetch, log an error, open a dialog."""

    def __init__(self, browser: Any, path: Path, *, scripts: bool = True) -> None:
        self.context = browser.new_context(
            java_script_enabled=scripts, viewport={"width": 1200, "height": 900}
        )
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("request", lambda r: self.requests.append(r.url))
        self.page.on(
            "console", lambda m: self.errors.append(m.text) if m.type in {"error", "warning"} else None
        )
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))
        self.url = path.resolve().as_uri()
        self.page.goto(self.url)
        if scripts:
            self.page.wait_for_selector("html[data-ready]", timeout=10_000)

    def clean(self) -> None:
        assert [self.url] == self.requests
        assert [] == self.errors
        assert [] == self.dialogs

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def page(browser, shop_report):
    opened = Page(browser, shop_report)
    yield opened
    opened.close()


def _no_overlap(page: Any) -> int:
    """Assert no two visible labels of one SVG overlap; returns how many were checked."""
    boxes = page.evaluate(
        """() => Array.from(document.querySelectorAll('svg')).map(svg =>
            Array.from(svg.querySelectorAll('text')).map(t => {
                const r = t.getBoundingClientRect();
                return [r.left, r.top, r.right, r.bottom, t.textContent];
            }).filter(b => b[2] > b[0] && b[3] > b[1]))"""
    )
    checked = 0
    for texts in boxes:
        for i, a in enumerate(texts):
            for b in texts[i + 1 :]:
                overlap = min(a[2], b[2]) - max(a[0], b[0]) > 0.5 and min(a[3], b[3]) - max(a[1], b[1]) > 0.5
                assert not overlap, f"labels overlap: {a[4]!r} and {b[4]!r}"
            checked += 1
    return checked


# the crashed, failed, resumed and changed run ---------------------------------------------


def test_counts_on_the_page_are_the_manifests(page, shop):
    manifest = _manifest(shop)
    p = page.page
    assert str(len(manifest["completed_steps"])) == p.inner_text('[data-count="completed"] b')
    assert f"of {len(manifest['steps'])} slots completed" == p.inner_text('[data-count="completed"] span')
    assert manifest["status"] == p.inner_text("#status")
    events = _events(shop)
    starts = [i for i, e in enumerate(events) if e["event"] == "run_started"]
    assert 4 == len(starts) == manifest["runs"]
    last = events[starts[-1] :]
    ran = sum(1 for e in last if e["event"] == "step_completed")
    skipped = sum(1 for e in last if e["event"] == "step_skipped")
    row = p.locator('#runs-table tr[data-run="4"] td')
    assert [str(ran), str(skipped)] == [row.nth(5).inner_text(), row.nth(6).inner_text()]
    assert len(manifest["steps"]) == p.locator("#steps-table tbody tr").count()
    page.clean()


def test_the_killed_run_ends_within_an_interval(page, shop):
    p = page.page
    runs = p.locator("#runs-table tbody tr")
    assert "killed between" in runs.nth(0).inner_text()
    title = p.locator('.run-timeline[data-run="1"] rect.unknown title').last.text_content()
    assert "was killed" in title
    assert "the exact time is unknown" in title
    assert "failed" in runs.nth(1).inner_text()
    assert "resumed: skipped" in runs.nth(2).inner_text()
    page.clean()


def test_tooltips_and_the_reason_column_say_why(page):
    p = page.page
    flaky = p.locator('.run-timeline[data-run="1"] g.bar[data-slot="flaky"] title').first.text_content()
    assert "why it ran: new" in flaky
    assert "retried after ValueError: the first attempt fails" in flaky
    failed = p.locator('.run-timeline[data-run="2"] g.bar[data-slot="summary"] title').first.text_content()
    assert "failed: RuntimeError: summary failed: the total is wrong" in failed
    clean = p.locator('#steps-table tr[data-slot="clean"]')
    assert "code changed" in clean.locator("td.why").inner_text()
    clean.locator("td.why summary").click()
    assert "+    return x * 2 + 1" in clean.locator("pre.diff").inner_text()
    skipped = p.locator('#steps-table tr[data-slot="fetch/item-3"] td.why').inner_text()
    assert "its stored output matches its code and arguments (computed in run 1)" in skipped
    page.clean()


def test_sorting_and_filtering(page):
    p = page.page
    header = p.locator("#steps-table th", has_text="Duration")

    def durations() -> list[float]:
        cells = p.locator("#steps-table tbody tr td:nth-child(6)")
        return [float(c.get_attribute("data-v")) for c in cells.all()]

    header.click()
    assert sorted(durations()) == durations()
    header.click()
    assert sorted(durations(), reverse=True) == durations()
    p.fill("#steps-filter", "fetch/")
    visible = p.locator("#steps-table tbody tr:not([hidden])")
    assert 12 == visible.count()
    assert all("fetch/" in r.get_attribute("data-slot") for r in visible.all())
    assert "12 of" in p.inner_text("#steps-shown")
    p.fill("#steps-filter", "")
    p.select_option("#steps-outcome", "ran")
    assert {"ran"} == {r.get_attribute("data-outcome") for r in visible.all()}
    assert 0 < visible.count() < p.locator("#steps-table tbody tr").count()
    page.clean()


def test_the_comparison_highlights_the_first_divergence(page):
    p = page.page
    first = p.locator("#compare-table tr.first")
    assert 1 == first.count()
    assert "clean" == first.get_attribute("data-slot")
    assert "code changed" == first.get_attribute("data-verdict")
    text = p.inner_text("#first-divergence-text")
    assert "First divergence: clean: its code changed" in text
    same = p.locator('#compare-table tr[data-verdict="same"] td').first
    assert first.locator("td").first.evaluate("c => getComputedStyle(c).backgroundColor") != same.evaluate(
        "c => getComputedStyle(c).backgroundColor"
    )
    page.clean()


def test_batches_show_resumed_rows_rate_and_a_failure(page):
    p = page.page
    batch = p.locator("#batches .batch").first
    assert "enrich" == batch.get_attribute("data-batch")
    rows = batch.locator("tbody tr")
    text = rows.last.inner_text()
    assert "row 0: ValueError: row 0 is bad" in text or "row 97: ValueError" in text
    assert 0 < batch.locator("svg.rate circle").count()
    page.clean()


def test_labels_do_not_overlap_with_keyed_steps_expanded(page):
    p = page.page
    for summary in p.locator("details.keyed-step > summary").all():
        summary.click()
    assert 0 < p.locator("details.keyed-step[open] svg g.bar").count()
    assert 10 < _no_overlap(p)
    page.clean()


def test_without_scripts_the_tables_are_there(browser, shop_report, shop):
    opened = Page(browser, shop_report, scripts=False)
    try:
        p = opened.page
        assert len(_manifest(shop)["steps"]) == p.locator("#steps-table tbody tr").count()
        assert 4 == p.locator("#runs-table tbody tr").count()
        assert 4 == p.locator("svg.timeline:not(.keyed)").count()
        assert p.locator("#error pre").count() == 0 or "Traceback" in p.inner_text("#error pre")
        p.screenshot(path=str(shop_report.parent / "noscript.png"), full_page=True)
        opened.clean()
    finally:
        opened.close()


def test_the_screenshot_for_the_docs(page):
    """docs/report.png is this report, as a browser draws it (refreshed with UPDATE_DOCS_SHOT=1)."""
    target = Path(__file__).resolve().parent.parent / "docs" / "report.png"
    shot = page.page.screenshot(full_page=False)
    assert shot.startswith(b"\x89PNG")
    if os.environ.get("UPDATE_DOCS_SHOT") == "1":
        target.write_bytes(shot)
    page.clean()


# what a report must not do ---------------------------------------------------------------


def _tree(root: Path) -> dict[str, tuple[int, int, str]]:
    return {
        str(p.relative_to(root)): (
            p.stat().st_size,
            p.stat().st_mtime_ns,
            hashlib.sha256(p.read_bytes()).hexdigest(),
        )
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_state_same_bytes_and_nothing_written(shop, tmp_path):
    before = _tree(shop)
    a = _report(shop, tmp_path / "a.html", "--compare", "3").read_bytes()
    b = _report(shop, tmp_path / "b.html", "--compare", "3").read_bytes()
    assert a == b
    assert before == _tree(shop)
    assert len(a) <= 120_000  # docs/report.md: about 100 KB


def test_the_page_forbids_every_fetch(shop_report):
    text = shop_report.read_text()
    head = text[: text.index("</head>")]
    assert "default-src 'none'" in head
    assert "connect-src 'none'" in head
    assert "unsafe-inline" not in head
    assert "http://" not in text
    assert "https://" not in text


def test_run_and_compare_arguments(shop, tmp_path, capsys):
    last = _report(shop, tmp_path / "last.html", "--run", "last").read_text()
    assert 1 == last.count('class="panel run-timeline"')
    assert 2 == cli(["--state-dir", str(shop), "report", "-o", str(tmp_path / "x.html"), "--run", "9"])
    assert "no run 9" in capsys.readouterr().err
    assert 2 == cli(["--state-dir", str(shop), "report", "-o", str(tmp_path / "x.html"), "--compare", "nope"])
    capsys.readouterr()
    assert 2 == cli(["--state-dir", str(shop), "report", "-o", str(tmp_path / "x.html"), "--compare", "9"])
    assert "run 9 has not finished in this log" in capsys.readouterr().err
    assert 3 == cli(["--state-dir", str(tmp_path / "none"), "report", "-o", str(tmp_path / "x.html")])
    assert not (tmp_path / "none").exists()


def test_checkpoint_comparison(shop, tmp_path):
    text = _report(shop, tmp_path / "cp.html", "--compare", "checkpoint1").read_text()
    assert "checkpoint 1 → now" in text


def test_a_checkpoint_is_compared_with_now_slot_by_slot(tmp_path: Path):
    """--compare checkpointN sets the outputs then against the outputs now."""
    pipe = _two_runs(tmp_path / "state")
    rows = collect(pipe.store, None, compare="checkpoint1")["compare"]["rows"]
    assert [("value", "inputs changed")] == [(r["slot"], r["verdict"]) for r in rows]


def test_runs_compared_leave_out_the_slots_neither_holds(tmp_path: Path):
    """A slot first completed after both runs compared is in neither: not a row, not counted as the same."""
    pipe = Pipeline("grown", store=tmp_path / "state")
    steps = {name: pipe.step(name=name)(lambda: 1) for name in "abc"}
    for n in (1, 2, 3):
        with pipe:
            for name in "abc"[:n]:
                steps[name]()
    rows = collect(pipe.store, None, run=2, compare=1)["compare"]["rows"]
    assert [("a", "same"), ("b", "added")] == [(r["slot"], r["verdict"]) for r in rows]


def test_report_during_a_run_shows_what_is_known(tmp_path):
    pipe = Pipeline("live", store=tmp_path / "state")

    @pipe.step
    def first() -> int:
        return 1

    @pipe.step
    def second(x: int) -> int:
        out = pipe.report(tmp_path / "during.html")
        text = Path(out).read_text()
        assert "running" in text
        assert 'data-slot="first"' in text
        return x + 1

    with pipe:
        second(first())
    assert "completed" in Path(pipe.report(tmp_path / "after.html")).read_text()


def test_report_on_s3(s3, tmp_path):
    url = s3.url("report")
    pipe = Pipeline("remote", store=url)

    @pipe.step(key=lambda i: str(i))
    def square(i: int) -> int:
        return i * i

    with pipe:
        for i in range(3):
            square(i)
    text = Path(pipe.report(tmp_path / "s3.html")).read_text()
    assert 'data-slot="square/2"' in text
    assert "s3://" in text


# hostile strings -------------------------------------------------------------------------

HOSTILE = [
    "</script><script>alert(1)</script>",
    '<img src=x onerror="alert(2)">',
    "javascript:alert(3)",
    "\"'><svg onload=alert(4)>",
    "&lt;b&gt;entities&amp;",
    "\u2028line\u2029separators",
]


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    pipe = Pipeline("<img src=x onerror=alert(5)> pipe", store=root / "state", allow_pickle=False)

    @pipe.step(key=lambda s: s)
    def echo(s: str) -> dict[str, str]:
        return {s: s}

    @pipe.step
    def explode(items: list[str]) -> None:
        raise ValueError(" | ".join(items))

    def run() -> None:
        with pipe:
            for s in HOSTILE:
                echo(s)
            explode(HOSTILE)

    with pytest.raises(ValueError, match="onerror"):
        run()
    return _report(root / "state", root / "hostile.html")


def test_hostile_strings_show_as_text(browser, hostile_report):
    opened = Page(browser, hostile_report)
    try:
        p = opened.page
        assert 0 == p.locator("img").count()
        assert 0 == p.locator("main script, main svg[onload], a[href^='javascript']").count()
        slots = p.locator("#steps-table td.slot").all_inner_texts()
        for s in HOSTILE[:5]:
            assert any(s in text for text in slots), s
        assert "</script><script>alert(1)</script>" in p.inner_text("#error")
        assert p.title().startswith("<img src=x onerror=alert(5)> pipe")
        data = collect(LocalStore(hostile_report.parent / "state"), None)
        assert set(HOSTILE) <= {row["key"] for row in data["slots"]}
        opened.clean()
    finally:
        opened.close()


# 100k keyed slots -------------------------------------------------------------------------


@pytest.mark.slow
def test_a_100k_slot_report_is_small_and_quick(browser, tmp_path):
    pipe = Pipeline("wide", store=f"memory://report-100k-{os.getpid()}", durable=False)

    @pipe.step(key=lambda i: str(i))
    def item(i: int) -> int:
        return i

    with pipe:
        for i in range(100_000):
            item(i)
    path = Path(pipe.report(tmp_path / "wide.html"))
    size = path.stat().st_size
    assert size <= 2_000_000
    opened = Page(browser, path)
    try:
        p = opened.page
        ready_ms = int(p.get_attribute("html", "data-ready"))
        print(f"\n100k-slot report: {size:,} bytes, interactive after {ready_ms} ms in the browser")
        assert ready_ms <= 1000
        assert "100,000" == p.inner_text('[data-count="completed"] b')
        assert "100,000" in p.inner_text('#groups-table tr[data-step="item"]')
        p.fill("#steps-filter", "item/99")
        assert 0 < p.locator("#steps-table tbody tr:not([hidden])").count()
        assert 0 < _no_overlap(p)
        opened.clean()
    finally:
        opened.close()


def test_new_event_fields_reach_the_report(tmp_path):
    """A long key's own text, the step a nested step ran inside, and a batch's resumed rows."""
    pipe = Pipeline("fields", store=tmp_path / "state")
    long_key = "k" * 300 + "<end>"

    @pipe.step(key=lambda k: k)
    def inner(k: str) -> int:
        return len(k)

    @pipe.step
    def outer() -> int:
        return inner(long_key)

    with pipe:
        outer()
    events = _events(tmp_path / "state")
    started = [e for e in events if e["event"] == "step_started" and e["step"] == "inner"]
    assert long_key == started[0]["key"]
    assert "outer" == started[0]["parent"]
    row = next(r for r in collect(pipe.store, None)["slots"] if r["step"] == "inner")
    assert (long_key, "outer") == (row["key"], row["parent"])
    assert "inside outer" in Path(pipe.report(tmp_path / "r.html")).read_text()


def test_resumed_rows_are_recorded(shop):
    events = _events(shop)
    second_run = [i for i, e in enumerate(events) if e["event"] == "run_started"][1]
    batches = [e for e in events if e["event"] == "batch"]
    # run 1's progress events may have waited in memory when it was killed: its chunks are the record
    assert all(0 == e["resumed"] for e in events[:second_run] if e["event"] == "batch")
    assert max(e["resumed"] for e in batches) > 0  # run 2 resumed the rows run 1 committed
    assert any(e.get("failure", {}).get("type") == "ValueError" for e in batches)


def test_a_100_slot_report_is_small(tmp_path):
    pipe = Pipeline("hundred", store=tmp_path / "state", durable=False)

    @pipe.step(key=lambda i: str(i))
    def item(i: int) -> list[int]:
        return list(range(i))

    for _ in range(2):
        with pipe:
            for i in range(100):
                item(i)
    size = Path(pipe.report(tmp_path / "r.html")).stat().st_size
    assert size <= 120_000  # docs/report.md: about 100 KB


def test_two_runs_compared(shop, tmp_path):
    """--run 3 --compare 2: the state after run 3 against the state after run 2."""
    text = _report(shop, tmp_path / "two.html", "--run", "3", "--compare", "2").read_text()
    assert "after run 2 → after run 3" in text
    assert 'id="first-divergence"' in text


def test_a_session_is_reported_and_compared_with_another(tmp_path):
    """--session picks the session; --compare SESSION[@CHECKPOINT] aligns it with another, slot by slot."""
    state = tmp_path / "state"
    pipe = Pipeline("sessions", state_dir=state)

    @pipe.step
    def prompt(topic: str) -> str:
        return f"write about {topic}"

    @pipe.step
    def answer(prompt: str) -> str:
        return prompt.upper()

    for sid, topic in (("alice", "cats"), ("bob", "dogs")):
        with pipe.session(sid):
            answer(prompt(topic))
    out = tmp_path / "bob.html"
    assert 0 == cli(
        ["--state-dir", str(state), "--session", "bob", "report", "-o", str(out), "--compare", "alice"]
    )
    text = out.read_text()
    assert "session alice → session bob" in text
    assert 'id="first-divergence"' in text
    rows = text[text.index('id="first-divergence"') - 300 :]
    assert 'data-slot="prompt"' in rows  # the first slot to differ, in completion order
    assert "inputs changed" in text
    # the same through the API, from the session, and against a checkpoint of the other session
    same = pipe.session("bob").report(tmp_path / "api.html", compare="alice")
    assert "session alice → session bob" in Path(same).read_text()
    early = pipe.session("bob").report(tmp_path / "early.html", compare="alice@1")
    assert "session alice@1 → session bob" in Path(early).read_text()
    unknown = ["--session", "bob", "report", "-o", str(tmp_path / "x.html"), "--compare", "carol"]
    assert 2 == cli(["--state-dir", str(state), *unknown])


def _two_runs(state: Path) -> Pipeline:
    """A pipeline whose step ``value`` ran twice, with 1 then 2."""
    pipe = Pipeline("rolled", store=state)

    @pipe.step
    def value(x: int) -> int:
        return x

    for x in (1, 2):
        with pipe:
            value(x)
    return pipe


def test_a_rollback_restores_the_versions_compared(tmp_path):
    """After a rollback, "now" holds the restored output, not the one the rollback replaced."""
    pipe = _two_runs(tmp_path / "state")
    pipe.rollback(1)
    after_run_2 = collect(pipe.store, None, compare=2)["compare"]["rows"]
    assert ["inputs changed"] == [r["verdict"] for r in after_run_2 if r["slot"] == "value"]
    after_run_1 = collect(pipe.store, None, compare=1)["compare"]["rows"]
    assert {"same"} == {r["verdict"] for r in after_run_1}


def test_pipe_report_takes_a_run_number_as_an_int_or_a_string(tmp_path: Path):
    """CHANGELOG: pipe.report(run="2") works as run=2 does; a run the log does not hold is a UsageError."""
    from resumable import UsageError

    pipe = _two_runs(tmp_path / "state")
    as_int = Path(pipe.report(tmp_path / "int.html", run=2)).read_text()
    as_text = Path(pipe.report(tmp_path / "text.html", run="2")).read_text()
    assert as_int == as_text
    assert 1 == as_text.count('class="panel run-timeline"')  # run 2 alone
    with pytest.raises(UsageError):
        pipe.report(tmp_path / "none.html", run="9")


def test_a_reset_slot_is_removed_from_now(tmp_path: Path):
    """A slot forgotten by `reset` is no longer in the state compared as "now"."""
    pipe = _two_runs(tmp_path / "state")
    pipe.reset("value")
    rows = collect(pipe.store, None, compare=2)["compare"]["rows"]
    assert [("value", "removed")] == [(r["slot"], r["verdict"]) for r in rows]


KILLED_AFTER_STORE = """
import os, signal, sys
import resumable._journal
from resumable import Pipeline

record = resumable._journal.Journal.record

def dying_record(self, event, **fields):
    if event == "step_completed" and fields.get("slot") == "b" and os.environ.get("MODE") == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # b's output is stored, its completion not logged
    return record(self, event, **fields)

resumable._journal.Journal.record = dying_record
pipe = Pipeline("recovered", state_dir=sys.argv[1])

@pipe.step
def a() -> int:
    return 1

@pipe.step
def b(a: int) -> int:
    return a + 1

with pipe:
    b(a())
"""


def test_an_output_recovered_after_a_kill_ends_its_bar_when_it_was_stored(tmp_path: Path):
    """The next run logs b's completion as recovered: its bar, and the killed run, end when b's file was made."""
    script, state = tmp_path / "killed.py", tmp_path / "state"
    script.write_text(KILLED_AFTER_STORE)
    assert -signal.SIGKILL == _run(script, state, "kill").returncode
    assert 0 == _run(script, state).returncode
    assert ["b"] == [e["slot"] for e in _events(state) if e.get("recovered")]
    data = collect(LocalStore(state), None)
    first = data["timelines"][0]
    assert "killed" == first["status"]
    bars = {bar["slot"]: bar for row in first["rows"] for bar in row["bars"]}
    assert ("ran", False) == (bars["b"]["outcome"], bars["b"]["open"])
    assert bars["a"]["e"] <= bars["b"]["e"] == first["span"] < first["unknown_until"]
