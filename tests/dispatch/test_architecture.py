"""The house's shape, checked: the package's imports (module level and inside functions) form no circle, and
`dispatch/` (which decides) imports no backend (which implements). Read from the source with `ast`, so a new
circle fails here, not in a review."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "dsa_indexer"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from . import x`` counts x when x is a module)."""
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name and target != "dsa_indexer":
                    edges[name].add(target)
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    counter = 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_finder_sees_a_circle():
    """The check itself can fail: a two-module circle and a self-contained chain."""
    assert _circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_circles():
    """The last circle (indexer <-> pipeline) went with the per-step plan: strategies receive a `StepPlan`."""
    assert _circles(_imports(_modules())) == []


def test_the_pipeline_and_the_backends_never_see_the_module():
    """Strategies and steps take the plan: pipeline.py and the backends import neither `indexer` nor name `Indexer`."""
    edges = _imports(_modules())
    offenders = sorted(m for m, targets in edges.items()
                       if (m == "dsa_indexer.pipeline" or m.startswith("dsa_indexer.backends"))
                       and "dsa_indexer.indexer" in targets)
    assert offenders == []
    assert "Indexer" not in (PACKAGE / "pipeline.py").read_text()


def test_dispatch_imports_no_backend():
    edges = _imports(_modules())
    upward = sorted((m, t) for m, targets in edges.items() if m.startswith("dsa_indexer.dispatch")
                    for t in targets if t.startswith("dsa_indexer.backends") or t == "dsa_indexer.generic")
    assert upward == []


def test_no_backend_imports_the_model():
    """The model (indexer, plan, pipeline, compressor, fp4, graphs) reaches the backends only through dispatch, and the
    backends reach the model's facts only through the contract: no import either way."""
    model = {f"dsa_indexer.{name}" for name in ("indexer", "plan", "pipeline", "compressor", "fp4", "graphs")}
    edges = _imports(_modules())
    into_model = sorted((m, t) for m, targets in edges.items() if m.startswith("dsa_indexer.backends")
                        for t in targets if t in model)
    into_backends = sorted((m, t) for m, targets in edges.items() if m in model
                           for t in targets if t.startswith("dsa_indexer.backends"))
    assert into_model == [] and into_backends == []
