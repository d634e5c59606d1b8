"""The floors of ARCHITECTURE.md, checked: the import contracts in pyproject.toml hold,
every top-level module of ``fleet`` stands on a floor, every place the map names
exists, and no module outgrows one sitting. No services.

The contracts are import-linter's (a dev dependency), run as ``lint-imports`` from the
same environment as the tests, so that a failure prints the offending import chain.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLEET = ROOT / "fleet"
MAX_LINES = 450
HARD_LINES = 650

# Top-level modules outside the floors, and why: the entry point of ``python -m fleet``
# (it only imports the CLI) and the gevent patch that must run before anything else.
OFF_FLOOR = {"__init__", "__main__", "_pool_patch"}


def _contracts() -> list[dict[str, object]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, object]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def _lint_imports() -> str:
    beside = Path(sys.executable).parent / "lint-imports"
    found = str(beside) if beside.exists() else shutil.which("lint-imports")
    if found is None:
        pytest.fail("lint-imports is missing: install the dev extra (pip install -e '.[dev]')")
    return found


@pytest.mark.parametrize("contract", [str(c["id"]) for c in _contracts()])
def test_import_contract_holds(contract: str) -> None:
    done = subprocess.run(
        [_lint_imports(), "--no-cache", "--no-logo", "--contract", contract],
        cwd=ROOT,
        # The tree this test file is in, whatever the environment has installed.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _contract(contract_id: str) -> dict[str, object]:
    (found,) = [c for c in _contracts() if c["id"] == contract_id]
    return found


def _top_level_modules() -> set[str]:
    return (
        {p.stem for p in FLEET.glob("*.py")} | {p.parent.name for p in FLEET.glob("*/__init__.py")}
    ) - OFF_FLOOR


def test_every_top_level_module_stands_on_a_floor() -> None:
    """A module added at the top of ``fleet`` must be placed on a floor, or the floors
    contract would not see it import upward."""
    layers = _contract("floors")["layers"]
    assert isinstance(layers, list)
    placed = {
        name.strip().strip("()")
        for layer in layers
        for name in str(layer).replace("|", ":").split(":")
    }
    assert sorted(_top_level_modules() - placed) == []


def test_every_top_level_module_but_the_store_is_kept_from_sql() -> None:
    sources = _contract("sql-in-the-store")["source_modules"]
    assert isinstance(sources, list)
    kept = {str(name).removeprefix("fleet.") for name in sources}
    assert sorted(_top_level_modules() - kept - {"store"}) == []


def test_the_operator_tools_write_only_through_fleet() -> None:
    """Invariant 13's first half: the CLI, the console, the demo and the metrics never
    reach the store's writer, not even as an attribute (``fleet.runtime.ledger``), which
    no import contract would see."""
    reaching = [
        str(path.relative_to(ROOT))
        for floor in ("ops", "console")
        for path in sorted((FLEET / floor).rglob("*.py"))
        if re.search(r"\.ledger\b", path.read_text())
    ]
    assert reaching == []


def _defines(path: Path, name: str) -> bool:
    """Whether the module defines ``name`` (a function, a class, ``Class.method`` or a
    module-level constant)."""
    text = path.read_text()
    return all(
        re.search(rf"^\s*(?:async def|def|class) {part}\b|^{part}\b.*=", text, re.MULTILINE)
        for part in name.split(".")
    )


def _architecture() -> str:
    return (ROOT / "ARCHITECTURE.md").read_text()


def test_every_place_architecture_md_names_exists() -> None:
    """A map that names a module, function or test that is gone misleads: each
    ``path`` and ``path::name`` in ARCHITECTURE.md must be in the tree."""
    named = set(re.findall(r"`((?:fleet|tests|tasks)/[\w/]+\.py)(?:::([\w.]+))?`", _architecture()))
    assert named, "ARCHITECTURE.md names no module"
    missing = sorted(
        f"{path}::{name}" if name else path
        for path, name in named
        if not (ROOT / path).is_file() or (name and not _defines(ROOT / path, name))
    )
    assert missing == []


def test_architecture_md_gives_every_module_a_room() -> None:
    text = _architecture()
    roomless = [
        str(path.relative_to(ROOT))
        for path in sorted(FLEET.rglob("*.py"))
        if "migrations" not in path.parts
        and path.name != "__init__.py"
        and f"`{path.relative_to(ROOT)}`" not in text
    ]
    assert roomless == []


def test_no_module_is_over_the_line_cap() -> None:
    """Small enough to read in one sitting; generated migrations excepted. Past
    ``MAX_LINES`` a module is a warning sign (is it one concern?), not a reason to
    split it; past ``HARD_LINES`` it is too long to read."""
    lines = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in sorted(FLEET.rglob("*.py"))
        if "migrations" not in path.parts
    }
    long = {path: n for path, n in lines.items() if n > MAX_LINES}
    if long:
        warnings.warn(f"modules past {MAX_LINES} lines: {long}", stacklevel=1)
    assert {path: n for path, n in long.items() if n > HARD_LINES} == {}


def _circles(graph: Any) -> list[list[str]]:
    """The import circles among ``graph``'s modules (strongly connected components of
    more than one module, imports made only for type checking and inside functions
    included: a circle there is still two modules that cannot be read apart)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in graph.find_modules_directly_imported_by(module):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            circle = []
            while True:
                other = stack.pop()
                circle.append(other)
                if other == module:
                    break
            if len(circle) > 1:
                found.append(sorted(circle))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles_in_fleet() -> None:
    import grimp

    assert _circles(grimp.build_graph("fleet")) == []


def test_a_circle_is_found() -> None:
    class Graph:
        modules = {"a", "b", "c"}
        edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}

        def find_modules_directly_imported_by(self, module: str) -> set[str]:
            return self.edges[module]

    assert _circles(Graph()) == [["a", "b"]]
