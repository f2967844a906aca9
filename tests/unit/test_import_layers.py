"""The package's layering, read from the source (every import, lazy and TYPE_CHECKING ones included, and
every process a module starts with ``-m ajet_hpc...``).

A package may import only from its own layer or the layers below it, and no two modules may import each
other, directly or around a loop. Starting a module as a process (``[python, "-m", "ajet_hpc.x.y"]``, or
``-m ajet_hpc.x.y`` in a command string given to ``subprocess``/``shlex.split``/``os.system``) depends on it
as an import does, so it counts for the layers; it counts for no cycle (a process started is no import, and
a module may start the process that imports it: ``launch/keeper_start.py`` starts ``launch/keeper.py``).
Nothing breaks a rule today. An exception that cannot be avoided goes in ``KNOWN_UPWARD`` or
``KNOWN_CYCLES`` with its reason; the test fails on anything new, and also on a listed exception that is gone
(then delete it from the list), so the lists only shrink.
"""

from __future__ import annotations

import ast
import itertools
import re
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
    {"client", "environments"},
    {"offline", "launch", "api"},  # api re-exports environments for users' code; the package never imports it
    {"status", "cancel", "logs", "cli", "study"},
]

KNOWN_UPWARD: dict[tuple[str, str], str] = {}  # (importer, imported): why it is still there

KNOWN_CYCLES: dict[frozenset[str], str] = {}  # modules that import each other (lazy imports count): why


def package_modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULE_FLAGS = ("-m", "--module")  # python's, torchrun's
COMMAND_IN_STRING = re.compile(r"(?:^|\s)(?:-m|--module)\s+(ajet_hpc(?:\.\w+)*)")
STARTS_PROCESSES = {  # subprocess's, os.system, shlex.split, asyncio's
    *("Popen", "run", "call", "check_call", "check_output", "system", "split"),
    *("create_subprocess_exec", "create_subprocess_shell"),
}


def _text(node: ast.AST) -> str | None:
    """A string literal's text (an f-string's literal parts, its fields as spaces); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(str(part.value) if isinstance(part, ast.Constant) else " " for part in node.values)
    return None


def launched_modules(source: str) -> set[str]:
    """The ``ajet_hpc`` modules that this source starts as processes: a ``"-m"`` (or ``"--module"``) element
    of a list or tuple followed by a literal module name, or ``-m ajet_hpc...`` in a string given to a call
    that starts a process. A message that names a command for the user (``python -m ajet_hpc.status RUN``
    in a print or an error) starts nothing and is not counted."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.List | ast.Tuple):
            texts = [_text(element) for element in node.elts]
            for flag, module in itertools.pairwise(texts):
                if flag in MODULE_FLAGS and module is not None and module.startswith("ajet_hpc"):
                    found.add(module)
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in STARTS_PROCESSES:
                for arg in node.args:
                    found.update(COMMAND_IN_STRING.findall(_text(arg) or ""))
    return found


def _resolve(target: str, modules: dict[str, Path]) -> str:
    while target not in modules and "." in target:
        target = target.rsplit(".", 1)[0]
    return target


def launch_graph() -> dict[str, set[str]]:
    """Each module -> the package modules it starts as processes (``launched_modules``)."""
    modules = package_modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for target in launched_modules(path.read_text()):
            target = _resolve(target, modules)
            if target in modules and target != name:
                graph[name].add(target)
    return graph


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
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
                target = _resolve(target, modules)
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


def upward(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets if layer_of(b) > layer_of(a)}


def test_no_package_imports_from_a_layer_above_it() -> None:
    graph = import_graph()
    for name, launched in launch_graph().items():
        graph[name] |= launched
    upward_edges = upward(graph)
    new = sorted(upward_edges - KNOWN_UPWARD.keys())
    assert not new, f"imports or -m launches from a higher layer (see LAYERS): {new}"
    gone = sorted(KNOWN_UPWARD.keys() - upward_edges)
    assert not gone, f"these exceptions are fixed: delete them from KNOWN_UPWARD: {gone}"


def test_no_import_cycles() -> None:
    found = cycles(import_graph())
    new = [sorted(c) for c in found - KNOWN_CYCLES.keys()]
    assert not new, f"modules that import each other: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES.keys() - found]
    assert not gone, f"these cycles are broken: delete them from KNOWN_CYCLES: {gone}"


def test_no_two_packages_import_each_other() -> None:
    """Packages of one layer may import each other's modules, but not both ways (directly or around a
    loop): within a layer the packages still form an order (the client imports environments, not back)."""
    units: dict[str, set[str]] = defaultdict(set)
    for a, targets in import_graph().items():
        for b in targets:
            if a != "ajet_hpc" and unit_of(a) != unit_of(b):
                units[unit_of(a)].add(unit_of(b))
    found = cycles(
        {unit: units.get(unit, set()) for unit in {*units, *(b for t in units.values() for b in t)}}
    )
    assert not found, f"packages that import each other: {[sorted(c) for c in found]}"


def test_an_environments_package_named_apart_has_its_own_layer() -> None:
    assert layer_of("ajet_hpc.environments.sandbox.runner") == 0
    assert layer_of("ajet_hpc.environments.rewards") == 0
    assert layer_of("ajet_hpc.environments.sources") == layer_of("ajet_hpc.client.runner")
    assert layer_of("ajet_hpc.environments.arithmetic.agent") == layer_of("ajet_hpc.environments")
    assert layer_of("ajet_hpc.api") > layer_of("ajet_hpc.environments")  # nothing of the package imports it


def test_the_graph_sees_lazy_imports() -> None:
    # jobs.py imports the server's preemption module inside a function: the graph must see it
    assert "ajet_hpc.server.preemption" in import_graph()["ajet_hpc.launch.jobs"]


TRAINER_SIDES = {  # the trainer's two processes, each importing only its own modules and the protocol
    "ajet_hpc.trainer.coordinator": "ajet_hpc.trainer.ranks",
    "ajet_hpc.trainer.ranks": "ajet_hpc.trainer.coordinator",
}


def test_the_trainer_s_coordinator_and_ranks_share_only_the_protocol() -> None:
    # the coordinator runs in the server process, the ranks under torchrun/srun: what both need is protocol's
    graph = import_graph()
    crossing = sorted(
        (a, b)
        for a, targets in graph.items()
        for b in targets
        for side, other in TRAINER_SIDES.items()
        if (a == side or a.startswith(side + ".")) and (b == other or b.startswith(other + "."))
    )
    assert not crossing, f"the trainer's coordinator and ranks import each other: {crossing}"
    protocol = [
        (a, b) for a, targets in graph.items() if a.startswith("ajet_hpc.trainer.protocol") for b in targets
    ]
    upward = sorted((a, b) for a, b in protocol if any(b.startswith(side) for side in TRAINER_SIDES))
    assert not upward, f"the trainer's protocol imports a side of it: {upward}"


def test_the_graph_sees_launches() -> None:
    launches = launch_graph()
    assert "ajet_hpc.launch.keeper" in launches["ajet_hpc.launch.keeper_start"]  # a Popen argv
    assert (
        "ajet_hpc.trainer.ranks.worker" in launches["ajet_hpc.trainer.coordinator.rank_launcher"]
    )  # a list built apart
    assert "ajet_hpc.launch.server_job" in launches["ajet_hpc.launch.plan"]  # the hetjob's srun step
    assert "ajet_hpc.launch" in launches["ajet_hpc.study.trial_supervisor"]
    assert "ajet_hpc.client" in launches["ajet_hpc.client.task_supervisor"]


def test_an_upward_launch_is_an_upward_edge() -> None:
    """The server starting the keeper itself (as before issue 44) fails the layer test."""
    source = """
import shlex, subprocess, sys
subprocess.Popen([sys.executable, "-m", "ajet_hpc.launch.keeper", "RUN", "policy"])
subprocess.run(shlex.split(f"{sys.executable} -u -m ajet_hpc.status {'RUN'}"))
torchrun = ["python", "-m", "torch.distributed.run", "--module", "ajet_hpc.trainer.worker"]
print("then: python -m ajet_hpc.cancel RUN")  # a hint for the user, no launch
"""
    launched = launched_modules(source)
    assert launched == {"ajet_hpc.launch.keeper", "ajet_hpc.status", "ajet_hpc.trainer.worker"}
    graph = {"ajet_hpc.server.process": launched}
    assert upward(graph) == {
        ("ajet_hpc.server.process", "ajet_hpc.launch.keeper"),
        ("ajet_hpc.server.process", "ajet_hpc.status"),
    }
