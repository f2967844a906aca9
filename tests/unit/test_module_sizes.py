"""The package's sizes (issue 44, STYLE.md 7): no module of ``ajet_hpc/`` over ``MODULE_LIMIT`` lines and no
function (or method) over ``FUNCTION_LIMIT``, read from the source with ``ast``.

An item that cannot be split along a clean seam goes in ``EXCEPTIONS``, named with its reason in
docs/architecture.md ("Size exceptions"), at most three of them. The test fails on anything new over a
limit, and also on a listed exception that is under its limit now (then delete it from the list, and from
the docs), so the list only shrinks.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"
ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"

MODULE_LIMIT = 600  # lines of a module, its docstring and comments included
FUNCTION_LIMIT = 80  # lines of a function, from its ``def`` (decorators aside) to its last line

# "ajet_hpc/x/y.py" for a module, "ajet_hpc/x/y.py:Class.method" for a function: why it stays over
EXCEPTIONS: dict[str, str] = {}
MAX_EXCEPTIONS = 3


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function of a module, nested ones included, with its qualified name (``Class.method``)."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                found.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def oversized() -> dict[str, int]:
    """Every module and function of the package over its limit, with its length in lines."""
    over = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE.parent).as_posix()
        source = path.read_text(encoding="utf-8")
        lines = len(source.splitlines())
        if lines > MODULE_LIMIT:
            over[name] = lines
        for qualified, function in _functions(ast.parse(source, filename=str(path))):
            length = (function.end_lineno or function.lineno) - function.lineno + 1
            if length > FUNCTION_LIMIT:
                over[f"{name}:{qualified}"] = length
    return over


def test_no_module_or_function_is_over_its_limit_unless_named() -> None:
    new = {name: lines for name, lines in oversized().items() if name not in EXCEPTIONS}
    assert not new, (
        f"over the limits ({MODULE_LIMIT} lines a module, {FUNCTION_LIMIT} a function): {new}; split them "
        "by concept (STYLE.md 7), or, where no clean seam exists, name them in EXCEPTIONS and in "
        "docs/architecture.md, 'Size exceptions', with the reason"
    )


def test_every_named_exception_is_still_over_its_limit() -> None:
    over = oversized()
    gone = sorted(name for name in EXCEPTIONS if name not in over)
    assert not gone, f"no longer over the limit: {gone}; delete them from EXCEPTIONS and the docs"


def test_the_exceptions_are_few_and_named_in_the_architecture_page() -> None:
    assert len(EXCEPTIONS) <= MAX_EXCEPTIONS
    text = ARCHITECTURE.read_text(encoding="utf-8")
    assert re.search(r"^#+ Size exceptions$", text, re.MULTILINE), "no 'Size exceptions' in the docs"
    unnamed = [name for name in EXCEPTIONS if f"`{name}`" not in text]
    assert not unnamed, f"not named in docs/architecture.md, 'Size exceptions': {unnamed}"


def test_the_walk_finds_methods_and_nested_functions() -> None:
    source = "class A:\n    def f(self):\n        def g():\n            pass\n\nasync def h():\n    pass\n"
    names = [name for name, _ in _functions(ast.parse(source))]
    assert names == ["A.f", "A.f.g", "h"]
