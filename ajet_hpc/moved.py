"""Module paths that moved, kept importable for a while: the old path imports the new module and warns.

A user's agent, reward or tool written against an earlier release imports our modules by name; a rename must
not break it without a word. ``MOVED`` maps each old dotted path (a module or a whole package) to its new
one. ``install()`` (called by ``ajet_hpc/__init__.py``) puts a finder on ``sys.meta_path`` that answers an old
path, and everything below it, with the module at the new path, after a ``FutureWarning`` (shown by default,
unlike ``DeprecationWarning``, because the reader is a user running an agent, not a developer running
tests) that names the new path. The old name and the new one are the same module object, so ``isinstance``
and module state agree whichever path a caller used. ``python -m <old path>`` runs the new module.

The longest entry that covers a path wins. A package whose modules went to different places (``agents``,
``builtin_tasks``: one folder per environment now) is *split*: it has entries for its modules, and its own
entry names where they went. Its old path imports as an empty package of that name (so ``from
ajet_hpc.agents import arithmetic`` asks for ``ajet_hpc.agents.arithmetic``, which has its own entry), and a
module below it without an entry does not import.

The public API agents and tools are meant to import lives in ``ajet_hpc.api``; paths there do not move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

_ENV = "ajet_hpc.environments"
# each built-in task set (``tasks: builtin:<name>``, the name unchanged) and each shipped agent, by old name
_TASK_SETS = {
    "arithmetic": f"{_ENV}.arithmetic.tasks",
    "arithmetic_eval": f"{_ENV}.arithmetic.eval_tasks",
    "code": f"{_ENV}.code.tasks",
    "guess": f"{_ENV}.guess.tasks",
    "propose_solve": f"{_ENV}.propose_solve.tasks",
    "prisoners_dilemma": f"{_ENV}.textarena.tasks",
    "tools": f"{_ENV}.calculator.tasks",
}
_AGENTS = {
    "arithmetic": f"{_ENV}.arithmetic.agent",
    "code": f"{_ENV}.code.agent",
    "guess": f"{_ENV}.guess.agent",
    "propose_solve": f"{_ENV}.propose_solve.agent",
    "reasoning": f"{_ENV}.reasoning_gym.agent",
    "math_answer": f"{_ENV}.math_answer.agent",
    "single_call": f"{_ENV}.single_call",
    "calculator": f"{_ENV}.calculator.tools",
    "calculator_mcp": f"{_ENV}.calculator.mcp_server",
    "mcp_tools": f"{_ENV}.mcp_tools",
    "langgraph_agent": f"{_ENV}.calculator.langgraph_agent",
    "openai_agents_sdk": f"{_ENV}.calculator.openai_agents_sdk",
    "pydantic_ai_agent": f"{_ENV}.calculator.pydantic_ai_agent",
    "textarena_game": f"{_ENV}.textarena.agent",
    "verifiers_env": f"{_ENV}.verifiers.adapter",
    "verifiers_example": f"{_ENV}.verifiers.example",
    "verifiers_tools_example": f"{_ENV}.verifiers.tools_example",
}

# old dotted path -> new dotted path. An entry covers the module and every module below it (longest wins).
MOVED: dict[str, str] = {
    "ajet_hpc.tasks": _ENV,  # renamed builtin_tasks, then split into the environments' folders
    **{f"ajet_hpc.tasks.{name}": new for name, new in _TASK_SETS.items()},
    "ajet_hpc.builtin_tasks": _ENV,
    **{f"ajet_hpc.builtin_tasks.{name}": new for name, new in _TASK_SETS.items()},
    "ajet_hpc.agents": _ENV,
    **{f"ajet_hpc.agents.{name}": new for name, new in _AGENTS.items()},
    "ajet_hpc.rewards": f"{_ENV}.rewards",
    "ajet_hpc.sandbox": f"{_ENV}.sandbox",
    "ajet_hpc.client.reasoning_gym_source": f"{_ENV}.reasoning_gym.source",
    "ajet_hpc.inspect": "ajet_hpc.offline",  # it shadowed the standard library's inspect
    # what an agent receives and returns, beside what uses it (the client imports environments, not back)
    "ajet_hpc.client.api": f"{_ENV}.episode",
}


def _entry(name: str) -> str | None:
    """The longest old path in ``MOVED`` that is ``name`` or a package above it."""
    covering = [old for old in MOVED if name == old or name.startswith(old + ".")]
    return max(covering, key=len, default=None)


def is_split(old: str) -> bool:
    """Whether the old package ``old`` has entries for modules below it (it did not move as a whole)."""
    return any(other.startswith(old + ".") for other in MOVED)


def new_path(name: str) -> str | None:
    """The path ``name`` moved to, or None when neither it nor a package above it moved (or it lies below a
    split package without an entry of its own)."""
    old = _entry(name)
    if old is None or (name != old and is_split(old)):
        return None
    return MOVED[old] + name[len(old) :]


def _warn(old: str, new: str) -> None:
    warnings.warn(
        f"{old} moved to {new}: import {new} (the old path will be removed)", FutureWarning, stacklevel=3
    )


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed; give it back its own spec, which the import
        system has just replaced with the old path's."""
        module.__spec__ = self.spec

    def is_package(self, fullname: str) -> bool:
        """Whether the new path is a package: ``python -m OLD`` then runs ``OLD.__main__`` (runpy)."""
        spec = importlib.util.find_spec(self.new)
        return spec is not None and spec.submodule_search_locations is not None

    def get_code(self, fullname: str) -> CodeType | None:
        """For ``python -m <old path>``: the new module's code (runpy runs the code, it imports no module)."""
        _warn(fullname, self.new)
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{self.new} has no code to run", name=self.new)
        return loader.get_code(self.new)


class _SplitPackage(importlib.abc.Loader):
    """An old package whose modules moved apart: an empty package of the old name."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new)
        module = ModuleType(spec.name, f"Moved: its modules are now under {self.new} (ajet_hpc/moved.py).")
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: each module below it is answered by its own entry."""


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_path(fullname)
        if new is None:
            return None
        if fullname in MOVED and is_split(fullname):
            return importlib.util.spec_from_loader(fullname, _SplitPackage(new), is_package=True)
        found = importlib.util.find_spec(new)  # its origin: what ``python -m OLD`` puts in sys.argv[0]
        return importlib.util.spec_from_loader(
            fullname, _Alias(new), origin=found.origin if found is not None else None
        )


def install() -> None:
    """Answer the old paths (once per interpreter)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        # First: a folder left behind at an old path (a stale __pycache__) would otherwise import as an
        # empty namespace package.
        sys.meta_path.insert(0, _MovedFinder())
