"""The floors of the code base (docs/design.md §4): imports run downwards only, in no circle.

Every module under the four packages is mapped to a floor; every import it makes (at the
top or inside a function, read with ``ast``, nothing is run) must reach its own floor or
one the table below lets it use. Then no module may reach itself through imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("presto_sd", "drafter_service", "verifier_service", "orchestrator", "presto_pb")

# floor -> the floors it may import (besides its own); bottom first
MAY_IMPORT: dict[str, set[str]] = {
    "method": set(),
    "models": {"method"},
    "engine": {"method", "models"},
    "embedded": {"method", "engine", "models"},
    "loop": {"method", "engine"},
    "presto_pb": set(),
    "rpc": {"method", "engine", "presto_pb"},
    "services": {"method", "engine", "models", "embedded", "rpc", "presto_pb"},
    "orchestrator": {"method", "engine", "models", "embedded", "loop", "rpc", "services", "presto_pb"},
    "app": {"method", "engine", "models", "embedded", "loop", "rpc", "services", "orchestrator", "presto_pb"},
}


def floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] in ("drafter_service", "verifier_service"):
        return "services"
    if parts[0] in ("orchestrator", "presto_pb"):
        return parts[0]
    if parts[0] == "presto_sd" and len(parts) > 1 and parts[1] in MAY_IMPORT:
        return parts[1]
    if module == "presto_sd":
        return "method"  # the package itself: a docstring and a version
    raise AssertionError(f"{module}: on no floor (add it to tests/test_floors.py and docs/design.md)")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> set[str]:
    """The project modules ``path`` imports (``from a import b`` counts ``a.b`` if it is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


def project_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {m: {i for i in imports_of(p, m) if i in files and i != m} for m, p in files.items()}


def wrong_way(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} ({floor_of(m)}) imports {i} ({floor_of(i)})"
            for m, deps in sorted(graph.items()) for i in sorted(deps)
            if floor_of(i) != floor_of(m) and floor_of(i) not in MAY_IMPORT[floor_of(m)]]


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import circle, each once (a depth-first search; the graph is small)."""
    found, done = [], set()

    def visit(m: str, stack: list[str]) -> None:
        if m in stack:
            found.append(stack[stack.index(m):] + [m])
            return
        if m in done:
            return
        for i in sorted(graph.get(m, ())):
            visit(i, [*stack, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])
    return found


def test_every_import_runs_downwards():
    assert wrong_way(project_graph()) == []


def test_no_import_circle():
    assert circles(project_graph()) == []


def test_the_checks_catch_a_wrong_way_import_and_a_circle():
    graph = {"presto_sd.method.tree": {"presto_sd.app.cli"}, "presto_sd.app.cli": {"presto_sd.method.tree"},
             "orchestrator.client": {"presto_sd.loop.generate"}, "presto_sd.loop.generate": set()}
    assert wrong_way(graph) == ["presto_sd.method.tree (method) imports presto_sd.app.cli (app)"]
    assert circles(graph) == [["presto_sd.app.cli", "presto_sd.method.tree", "presto_sd.app.cli"]]


def test_every_module_is_on_a_floor():
    for m in project_graph():
        floor_of(m)


def test_the_orchestrator_client_loads_neither_ray_nor_torch():
    code = ("import sys, orchestrator.client; "
            "print(sorted(m for m in ('ray', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
