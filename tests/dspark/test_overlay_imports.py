# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the dspark-vllm project
"""The overlay's modules import one another without a circle (module-level and lazy
function-level imports alike), read from the overlay's source with ``ast``."""

import ast
from pathlib import Path

OVERLAY = Path(__file__).resolve().parents[2] / "overlay"


def overlay_modules(root: Path = OVERLAY) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the overlay."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The overlay modules ``module`` imports anywhere in its file (a package's import of
    its submodule included: ``from . import x`` and ``from .x import y``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known and name != module)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (module -> modules it imports), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph(root: Path = OVERLAY) -> dict[str, set[str]]:
    modules = overlay_modules(root)
    return {name: imported(name, path, set(modules)) for name, path in modules.items()}


def test_the_overlay_has_no_import_circle():
    graph = import_graph()
    assert "vllm.v1.spec_decode.dspark_proposer" in graph
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_check_finds_a_lazy_circle(tmp_path):
    """Control: a function-level import back to the importer is a circle."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import f\n")
    (package / "b.py").write_text("def f():\n    from pkg import a\n")
    assert find_cycle(import_graph(tmp_path)) == ["pkg.a", "pkg.b", "pkg.a"]
