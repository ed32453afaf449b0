"""The core's modules import one way: no cycle, counting imports made only for type checking."""
from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core"


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for p in CORE.rglob("*.py"):
        parts = p.relative_to(CORE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in modules:
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}          # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [node, dep] if dep in path else [node, dep]
            if dep not in state:
                found = visit(dep, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [])
            if found:
                return found
    return None


def test_core_has_no_import_cycle():
    graph = import_graph()
    assert {"core.sched.scheduler", "core.beam_search", "core.kv.kv_interface"} <= set(graph)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_the_old_scheduler_beam_search_circle():
    graph = import_graph()
    graph["core.beam_search"] = graph["core.beam_search"] | {"core.sched.scheduler"}   # what it used to import
    assert find_cycle(graph) is not None


def test_core_imports_no_policies_sim_or_realexec():
    """Runtime modules only (`python -m core.bench` is a tool that picks default policies)."""
    for path in CORE.glob("*.py"):
        if path.stem == "bench":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                assert name.split(".")[0] not in ("policies", "sim", "realexec", "torch", "simpy", "numpy"), \
                    f"{path.name} imports {name}"
