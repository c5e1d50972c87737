"""The package layout's promises: no import cycles, lower layers never import higher ones.

Imports are read with `ast` (function-level and relative imports included), so the test
sees the graph as written rather than what one interpreter happened to load.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rollout", "spec", "kernels", "weight_sync", "recipes")


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module that `import name` loads, or None for outside packages."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {r for r in map(_resolve, names) if r and r != module}
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


# (layer, what it may import from the project besides itself)
ALLOWED = [
    ("kernels", ()),
    ("rollout.config", ()),
    ("rollout.models", ("kernels", "rollout.config")),
    ("weight_sync", ("rollout.models",)),
    # (learned drafters are model layers over the pool: spec/draft_head.py, spec/head_drafter.py; what a step and
    # speculation share is spec/step.py's, so spec imports nothing of the engine)
    ("spec", ("kernels", "rollout.config", "rollout.models")),
    ("rollout.engine", ("kernels", "rollout.config", "rollout.models", "spec")),
    ("rollout.server", ("kernels", "rollout.config", "rollout.models", "rollout.engine", "spec",
                        "weight_sync")),
]


@pytest.mark.parametrize("layer,allowed", ALLOWED, ids=[layer for layer, _ in ALLOWED])
def test_lower_layers_never_import_higher_ones(layer, allowed):
    offending = {
        module: sorted(d for d in deps if not _within(d, (layer, *allowed)))
        for module, deps in GRAPH.items()
        if _within(module, (layer,))
    }
    assert {m: d for m, d in offending.items() if d} == {}


def test_the_graph_is_read():
    # Guards the test itself: a parser that saw nothing would pass the checks above.
    assert "rollout.engine.step_loop" in GRAPH["rollout.engine.engine"]
    assert "kernels.attention" in GRAPH["rollout.models.llama"]


def test_the_engine_stays_a_house_a_newcomer_can_change():
    """Roles are collaborators (intake, the step loop, weights, memory, counters): the Engine class at
    most 300 lines, and no function under rollout/engine/ over 60."""
    long = []
    for path in (ROOT / "rollout" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and node.name == "Engine":
                assert size <= 300, f"Engine is {size} lines"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > 60:
                long.append(f"{path.name}:{node.name} ({size} lines)")
    assert long == []
