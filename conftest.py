"""
Every ``python`` code block of README.md and docs/ runs as a test (pytest-markdown-docs).

Each block runs on its own, as the script a reader would paste it into: in a fresh temporary
directory, with no ``RESUMABLE_*`` variable set, inside a pipeline of its own (state in
``./script-state``, so that a block may open a pipeline in ``./state``) that closes when the
block ends, as a script's run closes when the interpreter exits. A block that is not meant
to run is fenced as ``{.python notest}``, with an HTML comment above it saying why.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from pytest_markdown_docs.plugin import MarkdownInlinePythonItem, MarkdownTextFile

from resumable import Pipeline


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect the Markdown files named in ``testpaths`` (README.md, docs/)."""
    if file_path.suffix == ".md" and not parent.config.option.markdowndocs:
        return MarkdownTextFile.from_parent(parent, path=file_path)  # type: ignore[no-any-return]
    return None


@pytest.fixture(autouse=True)
def _docs_block(request: pytest.FixtureRequest) -> Iterator[None]:
    """A code block from the docs runs in an empty directory, in a run of its own."""
    if not isinstance(request.node, MarkdownInlinePythonItem):
        yield  # another test: nothing to set up (not even a temporary directory)
        return
    tmp_path: Path = request.getfixturevalue("tmp_path")
    monkeypatch: pytest.MonkeyPatch = request.getfixturevalue("monkeypatch")
    for name in list(os.environ):
        if name.startswith("RESUMABLE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("RESUMABLE_PROGRESS", "0")
    monkeypatch.chdir(tmp_path)
    with Pipeline("docs", state_dir=tmp_path / "script-state"):
        yield
