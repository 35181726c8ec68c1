"""The house's shape, checked: the package's imports (module level and inside functions) form no circle, neither
between modules nor between the package's parts (the contract, dispatch, the ops, the backends, the model),
`dispatch/` (which decides) imports no backend (which implements), and no module reaches into another's private
names. Read from the source with `ast`, so a new circle or reach-in fails here, not in a review."""

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
    """The model (indexer, plan, pipeline, compressor, fp4, graphs, runner) reaches the backends only through
    dispatch, and the backends reach the model's facts only through the contract: no import either way."""
    model = {f"dsa_indexer.{name}" for name in ("indexer", "plan", "pipeline", "compressor", "fp4", "graphs", "runner")}
    edges = _imports(_modules())
    into_model = sorted((m, t) for m, targets in edges.items() if m.startswith("dsa_indexer.backends")
                        for t in targets if t in model)
    into_backends = sorted((m, t) for m, targets in edges.items() if m in model
                           for t in targets if t.startswith("dsa_indexer.backends"))
    assert into_model == [] and into_backends == []


# --- parts ---------------------------------------------------------------------------------------------------------
# The layers of docs/architecture.md's drawing. The contract holds what every layer builds on (contract/, the model
# configurations and RoPE tables, the environment-flag parser); ops.py is the public ops over dispatch; the model is
# everything a user or an engine drives (the Indexer and its step, the CLI, bench, testing, integrations).
CONTRACT_MODULES = {"contract", "config", "rope", "envflags"}


def _part(module: str) -> str:
    top = module.removeprefix("dsa_indexer").lstrip(".").split(".")[0]
    if top in CONTRACT_MODULES:
        return "contract"
    if top in ("dispatch", "backends", "ops"):
        return top
    return "model"


def _part_edges(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for module, targets in edges.items():
        parts.setdefault(_part(module), set()).update(_part(t) for t in targets if _part(t) != _part(module))
    return parts


def test_the_parts_form_no_circle():
    """A part-level circle (the contract importing dispatch that imports the contract, say) makes every part of it
    one piece; the op declarations live in contract/ and name no target, so none is left."""
    parts = _part_edges(_imports(_modules()))
    assert set(parts) == {"contract", "dispatch", "ops", "backends", "model"}
    assert _circles(parts) == []
    assert parts["contract"] == set(), "the contract imports no other part"
    assert parts["dispatch"] == {"contract"}, "dispatch imports only the contract"


def test_the_part_finder_sees_a_circle():
    assert _circles(_part_edges({"dsa_indexer.contract.x": {"dsa_indexer.dispatch.y"},
                                 "dsa_indexer.dispatch.y": {"dsa_indexer.contract.x"}})) == [["contract", "dispatch"]]


# --- private names ---------------------------------------------------------------------------------------------------
# Reach-ins left, each with why (none: the step memo's rework and the batch records made the shared names public).
ALLOWED_REACH_INS: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _reach_ins(modules: dict[str, Path]) -> set[tuple[str, str]]:
    """(module, other module's private name) for each ``from other import _name`` and each ``other._name`` (other
    imported as a module, or a name imported from it: ``Class._attr``)."""
    found = set()
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text())
        origin: dict[str, str] = {}  # local name -> the package module it comes from (or is)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                if base is None or base.split(".")[0] != "dsa_indexer":
                    continue
                for alias in node.names:
                    if f"{base}.{alias.name}" in modules:
                        origin[alias.asname or alias.name] = f"{base}.{alias.name}"
                        continue
                    origin[alias.asname or alias.name] = base
                    if _private(alias.name) and base != name:
                        found.add((name, f"{base}.{alias.name}"))
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules and alias.asname:
                        origin[alias.asname] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
                source = origin.get(node.value.id)
                if source is not None and source != name:
                    found.add((name, f"{source}.{node.attr}"))
    return found


def test_no_module_reaches_into_another_modules_private_names():
    reach_ins = _reach_ins(_modules())
    assert sorted(reach_ins - ALLOWED_REACH_INS) == []
    assert sorted(ALLOWED_REACH_INS - reach_ins) == [], "an allowed reach-in is gone: drop it from the list"


def test_the_reach_in_finder_sees_both_forms(tmp_path):
    (tmp_path / "a.py").write_text("def _helper():\n    pass\nclass Box:\n    _cache = {}\n")
    (tmp_path / "b.py").write_text("from .a import _helper\n")
    (tmp_path / "c.py").write_text("from . import a\nfrom .a import Box\na._helper()\nBox._cache.clear()\n")
    (tmp_path / "d.py").write_text("from .a import Box\nBox()\n")
    modules = {f"dsa_indexer.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    assert _reach_ins(modules) == {("dsa_indexer.b", "dsa_indexer.a._helper"),
                                   ("dsa_indexer.c", "dsa_indexer.a._helper"),
                                   ("dsa_indexer.c", "dsa_indexer.a._cache")}
