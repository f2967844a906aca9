"""Fault-injection hooks are read through ``ajet_hpc/fault_injection.py`` only, and say which they are."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet_hpc import fault_injection

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"


def test_no_other_module_spells_a_hook() -> None:
    spelled = [
        f"{path.relative_to(PACKAGE.parent)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "fault_injection.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "AJET_TEST_" in line
    ]
    assert spelled == []


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
