"""Module paths that moved, kept importable for a while: the old path imports the new module and warns.

A user's agent, reward or tool written against an earlier release imports our modules by name; a rename must
not break it without a word. ``MOVED`` maps each old dotted path (a module or a whole package) to its new
one. ``install()`` (called by ``ajet_hpc/__init__.py``) puts a finder on ``sys.meta_path`` that answers an old
path, and everything below it, with the module at the new path, after a ``FutureWarning`` (shown by default,
unlike ``DeprecationWarning``, because the reader is a user running an agent, not a developer running
tests) that names the new path. The old name and the new one are the same module object, so ``isinstance``
and module state agree whichever path a caller used. ``python -m OLD`` runs the new module (or package's
``__main__``) too, after the same warning.

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

# old dotted path -> new dotted path. An entry covers the module and every module below it.
MOVED: dict[str, str] = {
    "ajet_hpc.tasks": "ajet_hpc.builtin_tasks",
    "ajet_hpc.inspect": "ajet_hpc.offline",  # it shadowed the standard library's inspect
}


def new_path(name: str) -> str | None:
    """The path ``name`` moved to, or None when neither it nor a package above it moved."""
    for old, new in MOVED.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return None


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.new}: import {self.new} (the old path will be removed)",
            FutureWarning,
            stacklevel=2,
        )
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed."""

    def is_package(self, fullname: str) -> bool:
        """Whether the new path is a package: ``python -m OLD`` then runs ``OLD.__main__`` (runpy)."""
        spec = importlib.util.find_spec(self.new)
        return spec is not None and spec.submodule_search_locations is not None

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m OLD`` (runpy runs the code, it imports no module)."""
        spec = importlib.util.find_spec(self.new)
        get_code = getattr(spec.loader, "get_code", None) if spec is not None else None
        return get_code(self.new) if get_code is not None else None


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_path(fullname)
        if new is None:
            return None
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
