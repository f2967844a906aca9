"""Old module paths still import, as the same module object, with a warning that names the new path
(ajet_hpc/moved.py). Each check runs in a fresh interpreter: an import is cached once per process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ajet_hpc.moved import MOVED, new_path


def test_an_old_path_and_everything_below_it_map_to_the_new_one() -> None:
    assert new_path("ajet_hpc.tasks") == "ajet_hpc.builtin_tasks"
    assert new_path("ajet_hpc.tasks.arithmetic") == "ajet_hpc.builtin_tasks.arithmetic"
    assert new_path("ajet_hpc.tasksx") is None
    assert new_path("ajet_hpc.builtin_tasks") is None


@pytest.mark.parametrize("old", sorted(MOVED))
def test_each_moved_path_imports_the_new_module_and_warns_once(old: str) -> None:
    expected = [f"{old} moved to {MOVED[old]}: import {MOVED[old]} (the old path will be removed)"]
    script = f"""
import importlib, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    old = importlib.import_module({old!r})
    again = importlib.import_module({old!r})
new = importlib.import_module({MOVED[old]!r})
assert old is new and again is new, (old, new)
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
    assert "ajet_hpc.tasks moved to ajet_hpc.builtin_tasks" in done.stderr


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
