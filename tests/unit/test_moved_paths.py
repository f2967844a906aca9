"""Old module paths still import, as the same module object, with a warning that names the new path
(ajet_hpc/moved.py). Each check runs in a fresh interpreter: an import is cached once per process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from ajet_hpc.moved import MOVED, is_split, new_path


def test_an_old_path_and_everything_below_it_map_to_the_new_one() -> None:
    assert new_path("ajet_hpc.tasks") == "ajet_hpc.environments"
    assert new_path("ajet_hpc.tasks.arithmetic") == "ajet_hpc.environments.arithmetic.tasks"
    assert new_path("ajet_hpc.tasksx") is None
    assert new_path("ajet_hpc.environments") is None
    assert new_path("ajet_hpc.sandbox.runner") == "ajet_hpc.environments.sandbox.runner"
    assert new_path("ajet_hpc.rewards.math_answer") == "ajet_hpc.environments.rewards.math_answer"


def test_the_longest_entry_wins_and_a_split_package_answers_only_its_entries() -> None:
    assert new_path("ajet_hpc.agents.arithmetic") == "ajet_hpc.environments.arithmetic.agent"
    assert new_path("ajet_hpc.agents.calculator") == "ajet_hpc.environments.calculator.tools"
    assert new_path("ajet_hpc.agents.calculator_mcp") == "ajet_hpc.environments.calculator.mcp_server"
    assert new_path("ajet_hpc.builtin_tasks.tools") == "ajet_hpc.environments.calculator.tasks"
    assert is_split("ajet_hpc.agents") and not is_split("ajet_hpc.sandbox")
    # not ajet_hpc.environments.sources: a module the old package never had does not import
    assert new_path("ajet_hpc.agents.sources") is None


def test_every_new_path_exists() -> None:
    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, (old, new)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_moved_path_imports_the_new_module_and_warns_once(old: str) -> None:
    """A module: the same object as the new one (its own spec kept). A split package: an empty package of
    the old name (its modules are checked by their own entries). Each warns once, for each old path it
    imports, naming the new one."""
    parents = [p for p in MOVED if old.startswith(p + ".") and is_split(p)]
    expected = [
        f"{o} moved to {MOVED[o]}: import {MOVED[o]} (the old path will be removed)" for o in [*parents, old]
    ]
    script = f"""
import importlib, importlib.util, sys, warnings
try:
    importlib.import_module({MOVED[old]!r})
except ModuleNotFoundError as exc:  # an adapter whose framework lives only in its client runtime
    if exc.name and not exc.name.startswith("ajet_hpc"):
        # not importable here: the old path still finds the new module's file (imported for real by the
        # environments' component runs, in the runtime that has the framework)
        found = importlib.util.find_spec({old!r})
        assert found is not None and found.origin == importlib.util.find_spec({MOVED[old]!r}).origin, found
        print("needs", exc.name)
        sys.exit(0)
    raise
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = importlib.import_module({old!r})
    again = importlib.import_module({old!r})
new = importlib.import_module({MOVED[old]!r})
if {is_split(old)!r}:
    assert old.__name__ == {old!r} and old.__path__ == [] and again is old, old
else:
    assert old is new and again is new, (old, new)
    assert new.__spec__.name == {MOVED[old]!r}, new.__spec__
messages = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
assert messages == {expected!r}, messages
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_warning_is_shown_by_default_to_a_user_running_an_agent() -> None:
    """No filter set: a FutureWarning reaches stderr (a DeprecationWarning outside __main__ would not)."""
    done = subprocess.run(
        [sys.executable, "-c", "import ajet_hpc.tasks.arithmetic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ajet_hpc.tasks.arithmetic moved to ajet_hpc.environments.arithmetic.tasks" in done.stderr


def test_from_a_split_package_import_a_module_gives_the_module_not_a_folder() -> None:
    """``from ajet_hpc.agents import arithmetic`` is the agent module, even once the environment's folder
    ``ajet_hpc.environments.arithmetic`` is imported (an alias of the whole package would give the folder)."""
    script = (
        "import ajet_hpc.environments.arithmetic.tasks\n"
        "from ajet_hpc.agents import arithmetic\n"
        "from ajet_hpc.builtin_tasks import arithmetic as tasks\n"
        "assert arithmetic.__name__ == 'ajet_hpc.environments.arithmetic.agent', arithmetic\n"
        "assert tasks.__name__ == 'ajet_hpc.environments.arithmetic.tasks', tasks\n"
        "import ajet_hpc.agents.nope\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "No module named 'ajet_hpc.agents.nope'" in done.stderr, done.stderr


def test_python_m_an_old_path_runs_the_new_module() -> None:
    """The built-in MCP server started by its old module path (as a user's toolbox command may still say):
    it runs, reads EOF on stdin and ends."""
    command = [sys.executable, "-m", "ajet_hpc.agents.calculator_mcp"]
    done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert (
        "ajet_hpc.agents.calculator_mcp moved to ajet_hpc.environments.calculator.mcp_server" in done.stderr
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_python_dash_m_runs_a_moved_package_with_the_warning(tmp_path) -> None:
    """``python -m ajet_hpc.inspect`` (the package is ``ajet_hpc.offline`` now) still runs the inspector:
    runpy runs the new ``__main__``'s code through the alias, after the warning."""
    command = [sys.executable, "-m", "ajet_hpc.inspect"]
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: python -m ajet_hpc.offline"), done.stdout[:200]
    assert "ajet_hpc.inspect moved to ajet_hpc.offline" in done.stderr
    missing = tmp_path / "no-run"
    done = subprocess.run([*command, str(missing), "summary"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]  # the inspector's own answer to a bad run directory
    assert f"error: {missing} is not a run directory" in done.stderr
