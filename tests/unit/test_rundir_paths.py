"""``storage/rundir.py`` is the only speller of run-directory paths: any other module that joins one of the
run directory's file or folder names onto a path (``run.root / "metrics.jsonl"``) fails here; it asks
`RunDir` instead (``run.metrics_file``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"
RUNDIR = PACKAGE / "storage" / "rundir.py"


def run_names() -> set[str]:
    """The names RunDir joins onto the run's root or its folders (``self.root / "ckpt"``), and the
    module-level names it joins (``TOPOLOGY_FILE``): read from rundir.py, so a new member counts at once."""
    tree = ast.parse(RUNDIR.read_text())
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name) and isinstance(node.value.value, str)
    }
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            if isinstance(node.right, ast.Constant) and isinstance(node.right.value, str):
                names.add(node.right.value)
            elif isinstance(node.right, ast.Name) and node.right.id in constants:
                names.add(constants[node.right.id])
    return names


def spelled_paths(source: str, names: set[str]) -> list[str]:
    """Where ``source`` joins one of ``names`` onto a path (``x / "name"``, ``os.path.join(x, "name")``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        parts: list[ast.expr] = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            parts = [node.right]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "os.path.join":
            parts = node.args[1:]
        for part in parts:
            if isinstance(part, ast.Constant) and part.value in names:
                found.append(f"{part.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_rundir_spells_the_run_directory_s_names() -> None:
    names = run_names()
    assert {"metrics.jsonl", "models", "ckpt", "data", "servers", "logs", "topology.yaml"} <= names


def test_no_other_module_spells_a_run_path() -> None:
    names = run_names()
    found = {
        str(path.relative_to(PACKAGE.parent)): spelled
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != RUNDIR and (spelled := spelled_paths(path.read_text(), names))
    }
    assert found == {}


def test_the_check_finds_a_spelled_path_and_passes_a_rundir_member() -> None:
    names = run_names()
    bad = 'rows = read_rows(run.root / "metrics.jsonl")\nstore = os.path.join(root, "ckpt", name)\n'
    assert spelled_paths(bad, names) == [
        "1: run.root / 'metrics.jsonl'",
        "2: os.path.join(root, 'ckpt', name)",
    ]
    good = 'rows = read_rows(run.metrics_file)\nif route == "models":\n    pass\nkey = prefix / "answer"\n'
    assert spelled_paths(good, names) == []
