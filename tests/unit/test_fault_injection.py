"""Fault-injection hooks are read through ``ajet_hpc/fault_injection.py`` only, and say which they are; every
other ``AJET_`` variable the package spells is a production one, listed here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ajet_hpc import fault_injection

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"

PRODUCTION = {
    "AJET_LOG_LEVEL": "the user: every process's log level",
    "AJET_PYTHON": "the launcher, to a client array's script: the python of the group's runtime",
    "AJET_SANDBOX": "the user: bubblewrap or the rlimits fallback for model code",
    "AJET_SANDBOX_PYTHON": "the user: the interpreter model code runs with in the sandbox",
    "AJET_VERIFIERS_TASKSET": "the user: the verifiers taskset the agent runs",
    "AJET_VERIFIERS_API_KEY_": "the verifiers agent, to its harness: each episode's endpoint key (a prefix)",
    "AJET_RANK_GPUS": "the server, to its trainer ranks: the GPUs each rank binds to",
    "AJET_RESUME_AT_MOST": "the server, to its trainer ranks: the last step the coordinator recorded",
    "AJET_WEIGHT_SYNC": "the server, to its trainer ranks: the weight-sync backend",
    "AJET_ENGINE_WORKERS": "the server, to its trainer ranks: how many engine workers get each sync",
    "AJET_TRAINER_PARENT_PID": "the server, to its trainer ranks: the coordinator (rank 0 exits without it)",
    "AJET_TRAINER_PARENT_HOST": "the server, to its trainer ranks: the coordinator's host",
    "AJET_ENGINE_STOPPING_FILE": "the vLLM engine, to its processes: the file that lets SIGTERM through",
}
"""Each ``AJET_`` variable the package reads or sets that is not a test hook, with who sets it and what for.
A name spelled anywhere in the package (a call, a module constant, a docstring) must be here or a hook."""


def test_no_other_module_spells_a_hook() -> None:
    spelled = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "fault_injection.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "AJET_TEST_" in line
    ]
    assert spelled == []


def test_every_other_variable_the_package_spells_is_a_listed_production_one() -> None:
    """A knob read only by tests but named outside the ``AJET_TEST_`` prefix (a module constant holding its
    name, say) is caught here: it must become a hook or be listed as a production variable, with its use."""
    unknown = sorted(
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "fault_injection.py"
        for name in set(re.findall(r"\bAJET_[A-Z0-9_]+", path.read_text()))
        if name not in PRODUCTION and name not in fault_injection.HOOKS
    )
    assert unknown == []


def test_the_production_list_names_no_hook_and_nothing_gone() -> None:
    spelled = {
        name for path in PACKAGE.rglob("*.py") for name in re.findall(r"\bAJET_[A-Z0-9_]+", path.read_text())
    }
    assert [name for name in PRODUCTION if name.startswith("AJET_TEST_") or name not in spelled] == []


def test_every_hook_is_listed_in_the_reliability_doc() -> None:
    doc = (PACKAGE.parent / "docs" / "reliability.md").read_text()
    section = doc[doc.index("## Fault-injection hooks") :]
    assert [name for name in fault_injection.HOOKS if f"`{name}=" not in section] == []


def test_a_hook_is_armed_only_when_set_and_not_empty() -> None:
    hook = fault_injection.EXIT_AFTER_END
    assert fault_injection.armed(hook, {hook: "3"}) == "3"
    assert fault_injection.armed(hook, {hook: ""}) is None
    assert fault_injection.armed(hook, {}) is None


def test_an_unknown_hook_is_refused_with_the_known_ones_named() -> None:
    known = r"'AJET_TEST_TYPO' is not a fault-injection hook \(AJET_TEST_EXIT_AFTER_COMMIT, "
    with pytest.raises(ValueError, match=known):
        fault_injection.armed("AJET_TEST_TYPO", {})
