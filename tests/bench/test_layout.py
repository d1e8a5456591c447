"""``bench/`` holds benchmark suites only, and its modules import each other without cycles."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def _bench_imports(path: Path) -> set[str]:
    """The ``bench`` modules ``path`` imports, at any depth (function-level imports count)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "bench":
                found.update(f"bench.{a.name}" for a in node.names)
            elif node.module.startswith("bench."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("bench."))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"bench.{p.stem}": p for p in BENCH.glob("*.py") if p.stem != "__init__"}
    return {m: _bench_imports(p) & set(modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle found by a depth-first walk, each as the modules along it."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return found


def test_bench_modules_import_each_other_without_cycles() -> None:
    graph = _graph()
    assert "bench.common" in graph["bench.offline"]
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_bench_holds_no_parity_cluster_or_gpu_code() -> None:
    names = [p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py")]
    assert [n for n in names if n.split("/")[0].startswith(("parity", "cluster", "gpu"))] == []
