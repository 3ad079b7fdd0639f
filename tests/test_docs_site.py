"""The documentation site builds with `mkdocs build --strict`, offline, and documents every public name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import resumable
from tests.conftest import ROOT


def test_site_builds_strict(tmp_path: Path):
    """`mkdocs build --strict` succeeds: no broken link or anchor, no docstring it cannot render."""
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = ["build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)]
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", *build],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    assert 0 == done.returncode, done.stdout + done.stderr
    reference = (site / "reference" / "index.html").read_text()
    missing = [name for name in resumable.__all__ if f'id="resumable.{name}"' not in reference]
    assert [] == missing
    # Nothing is fetched when a page is read: no web fonts, no scripts or styles from elsewhere.
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert "fonts.googleapis.com" not in text, page
        assert '<script src="http' not in text, page
        assert '<link rel="stylesheet" href="http' not in text, page
