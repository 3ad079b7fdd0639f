"""
The package's structure: one-way layers, no import cycle.

Every import in the package is counted, at module level, inside functions and under
``TYPE_CHECKING`` alike: a module may only import modules of its own layer or below
(docs/architecture.md draws them).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "resumable"

# Bottom to top; a module imports only from its own layer or from those below it.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundations", {"exceptions", "_warn", "_checksum", "_units", "_slots"}),
    (
        "stores",
        {
            "_stores",
            "_stores._base",
            "_stores._local",
            "_stores._memory",
            "_stores._fsspec",
            "_stores._lease",
            "_stores._prefix",
        },
    ),
    (
        "codec and fingerprints",
        {
            "_codec_types",
            "_codec_arrays",
            "_codec",
            "_chunklog",
            "_manifest",
            "_files",
            "_fingerprint",
            "_codehash",
            "_codeshape",
            "_plan",
        },
    ),
    ("state records", {"_journal", "_history", "_why", "_verify", "_sessions_index", "_sessions", "_diff"}),
    ("session", {"_session"}),
    (
        "public API",
        {
            "_context",
            "_exit",
            "_step",
            "_runner",
            "_pipeline",
            "_batch_input",
            "_batch_chunks",
            "_batch_ledger",
            "_batch_exec",
            "_batch",
            "_clean",
            "_conformance",
            "_render",
            "_report_data",
            "_report",
            "_cli",
            "_sessions_cli",
            "testing",
            "__init__",
            "__main__",
        },
    ),
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1]) if parts[-1] == "__init__" and len(parts) > 1 else ".".join(parts)
        found[name] = path
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The package modules *name* imports, everywhere in its source."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            elif (node.module or "").startswith("resumable"):
                target = (node.module or "").removeprefix("resumable").lstrip(".")
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                out.add(sub if sub in MODULES else target or "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("resumable."):
                    out.add(alias.name.removeprefix("resumable."))
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str) -> int:
    return next(i for i, (_, members) in enumerate(LAYERS) if name in members)


def test_every_module_has_a_layer():
    placed = set().union(*(members for _, members in LAYERS))
    assert set() == set(MODULES) - placed, "place new modules in LAYERS (and in docs/architecture.md)"


def test_there_is_no_import_cycle():
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name: str):
    """A module imports only from its own layer or below."""
    upward = sorted(dep for dep in GRAPH[name] if _layer(dep) > _layer(name))
    assert [] == upward, f"{name} ({LAYERS[_layer(name)][0]}) imports from above: {upward}"
