"""docs/architecture.md's "Entry points" table lists every program the system starts and every one a user
runs, so it cannot go stale: each ``-m ajet_hpc...`` launch in the source, each module with a ``__main__``,
each console script and plugin of pyproject.toml, each ``ajet-hpc`` command and each ``sbatch/`` script must
be in it, and each module it names must exist."""

from __future__ import annotations

import re
import tomllib

from test_import_layers import PACKAGE, launched_modules, package_modules

from ajet_hpc.cli import COMMANDS

REPO = PACKAGE.parent
PYTHON_M = re.compile(r"python -m (ajet_hpc(?:\.\w+)*)")


def table() -> list[list[str]]:
    """The rows of the table, each a list of its cells."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("\n## Entry points\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| ")
    ]
    assert rows and rows[0][0] == "entry point", "the table's header changed"
    return rows[1:]


def first_column() -> str:
    return "\n".join(row[0] for row in table())


def listed_modules() -> set[str]:
    return set(PYTHON_M.findall(first_column()))


def started_modules() -> dict[str, str]:
    """Each module that something starts with ``-m`` or that has a ``__main__``: where it was found."""
    found: dict[str, str] = {}
    for name, path in package_modules().items():
        source = path.read_text()
        for module in launched_modules(source):
            found.setdefault(module, f"launched by {name}")
        if path.name == "__main__.py":
            found.setdefault(name.removesuffix(".__main__"), str(path.relative_to(REPO)))
        elif re.search(r"^if __name__ == .__main__.:", source, re.MULTILINE):
            found.setdefault(name, f"{path.relative_to(REPO)} has a __main__ guard")
    return found


def test_every_started_module_is_in_the_table() -> None:
    started = started_modules()
    assert (
        "ajet_hpc.launch.keeper" in started and "ajet_hpc.trainer.ranks.worker" in started
    )  # the scan sees them
    missing = {module: why for module, why in started.items() if module not in listed_modules()}
    assert not missing, f"add these to the Entry points table of docs/architecture.md: {missing}"


def test_every_module_in_the_table_exists() -> None:
    gone = sorted(listed_modules() - package_modules().keys())
    assert not gone, f"the Entry points table names modules that no longer exist: {gone}"


def test_console_scripts_plugins_commands_and_sbatch_scripts_are_in_the_table() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = [
        *project.get("scripts", {}),
        *(n for group in project.get("entry-points", {}).values() for n in group),
    ]
    assert "ajet-hpc" in names
    first = first_column()
    missing = [name for name in names if f"`{name}`" not in first]
    missing += [
        f"sbatch/{p.name}"
        for p in sorted((REPO / "sbatch").glob("*.sbatch"))
        if f"sbatch/{p.name}" not in first
    ]
    whole = "\n".join(" | ".join(row) for row in table())
    missing += [f"ajet-hpc {command}" for command in COMMANDS if f"`ajet-hpc {command}`" not in whole]
    assert not missing, f"add these to the Entry points table of docs/architecture.md: {missing}"
