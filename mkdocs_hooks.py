"""
MkDocs hook: show the docstrings' Sphinx roles (:func:`step`, :class:`~.Pipeline`) as code.

The docstrings are written for ``help()`` and IDEs as much as for the site; mkdocstrings
renders their Google-style sections but leaves reStructuredText roles as text.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):<code>(~?)\.?([^<]*)</code>")


def _code(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"<code>{target.rsplit('.', 1)[-1] if short else target}</code>"


def on_page_content(html: str, **_: Any) -> str:
    """Replace each role with the plain code it names (``~`` keeps only the last name)."""
    return _ROLE.sub(_code, html)
