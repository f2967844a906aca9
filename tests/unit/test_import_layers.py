"""The package's layering, read from the source (every import, lazy and TYPE_CHECKING ones included).

A package may import only from its own layer or the layers below it, and no two modules may import each
other, directly or around a loop. Nothing breaks a rule today. An exception that cannot be avoided goes in
``KNOWN_UPWARD`` or ``KNOWN_CYCLES`` with its reason; the test fails on anything new, and also on a listed
exception that is gone (then delete it from the list), so the lists only shrink.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"

LAYERS = [  # lowest first; names are sub-packages or top-level modules of ajet_hpc, or a package of
    # environments/ that sits apart from the rest of it (``environments.<name>``, see layer_of)
    {
        "moved",
        "logging_setup",
        "process_tree",
        "fault_injection",
        "config",
        "slurm",
        "tracking",
        "environments.sandbox",
        "environments.rewards",
    },
    {"engine", "algo"},
    {"storage"},
    {"trainer"},
    {"server"},
    {"client", "environments", "api"},
    {"inspect", "launch"},
    {"status", "cancel", "logs", "cli", "study"},
]

KNOWN_UPWARD: dict[tuple[str, str], str] = {}  # (importer, imported): why it is still there

KNOWN_CYCLES: dict[frozenset[str], str] = {}  # modules that import each other (lazy imports count): why


def import_graph() -> dict[str, set[str]]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ajet_hpc"):
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names if alias.name.startswith("ajet_hpc")]
            else:
                continue
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target not in (name, "ajet_hpc"):
                    graph[name].add(target)
    for name in modules:
        graph.setdefault(name, set())
    return graph


def unit_of(module: str) -> str:
    """The name ``LAYERS`` places ``module`` by: its sub-package (or top-level module) of ajet_hpc, or, below
    ``environments``, ``environments.<name>`` when LAYERS names that package apart (the sandbox and the
    rewards import nothing of ours and sit in the lowest layer; the environments import the client's API)."""
    parts = module.split(".")
    if parts[1] == "environments" and len(parts) > 2 and any(".".join(parts[1:3]) in n for n in LAYERS):
        return ".".join(parts[1:3])
    return parts[1]


def layer_of(module: str) -> int:
    if module == "ajet_hpc":  # the root __init__ runs before any module: it may import only the lowest layer
        return 0
    unit = unit_of(module)
    for index, names in enumerate(LAYERS):
        if unit in names:
            return index
    raise AssertionError(f"{module}: its package {unit!r} is in no layer; add it to LAYERS")


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(frozenset(component))
    return found


def test_no_package_imports_from_a_layer_above_it() -> None:
    graph = import_graph()
    upward = {(a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)}
    new = sorted(upward - KNOWN_UPWARD.keys())
    assert not new, f"imports from a higher layer (see LAYERS): {new}"
    gone = sorted(KNOWN_UPWARD.keys() - upward)
    assert not gone, f"these exceptions are fixed: delete them from KNOWN_UPWARD: {gone}"


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    new = [sorted(c) for c in found - KNOWN_CYCLES.keys()]
    assert not new, f"modules that import each other: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES.keys() - found]
    assert not gone, f"these cycles are broken: delete them from KNOWN_CYCLES: {gone}"


def test_an_environments_package_named_apart_has_its_own_layer() -> None:
    assert layer_of("ajet_hpc.environments.sandbox.runner") == 0
    assert layer_of("ajet_hpc.environments.rewards") == 0
    assert layer_of("ajet_hpc.environments.sources") == layer_of("ajet_hpc.client.runner")
    assert layer_of("ajet_hpc.environments.arithmetic.agent") == layer_of("ajet_hpc.environments")
    assert layer_of("ajet_hpc.api") == layer_of("ajet_hpc.client")


def test_the_graph_sees_lazy_imports() -> None:
    # jobs.py imports the server's preemption module inside a function: the graph must see it
    assert "ajet_hpc.server.preemption" in import_graph()["ajet_hpc.launch.jobs"]
