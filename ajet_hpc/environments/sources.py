"""Task sources, as a client group names them in ``tasks:``: ``builtin:<name>`` (the task sets we ship,
``BUILTIN``), ``reasoning_gym:<dataset>[?k=v&...]`` (``environments/reasoning_gym/source.py``), a JSONL
file, or ``module.path:callable``.

``check(spec)`` is the form of a spec alone, with nothing imported: the launcher runs it on every group
before anything is written or submitted (``source_issues``), so a malformed spec exits 2 naming the field.
``open_source(spec)`` reads the tasks, in the client task (sharding and epochs: ``client/task_sources.py``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet_hpc.config.errors import ConfigIssue
from ajet_hpc.config.fields import BUILTIN_PREFIX, check_entry_point, check_name
from ajet_hpc.environments.episode import Task
from ajet_hpc.environments.reasoning_gym import source as reasoning_gym_source

if TYPE_CHECKING:
    from ajet_hpc.config import Topology

_ENV = "ajet_hpc.environments"
# ``builtin:<name>`` -> the module whose ``tasks()`` yields them
BUILTIN = {
    "arithmetic": f"{_ENV}.arithmetic.tasks",
    "arithmetic_eval": f"{_ENV}.arithmetic.eval_tasks",
    "code": f"{_ENV}.code.tasks",
    "guess": f"{_ENV}.guess.tasks",
    "propose_solve": f"{_ENV}.propose_solve.tasks",
    "prisoners_dilemma": f"{_ENV}.textarena.tasks",
    "tools": f"{_ENV}.calculator.tasks",
}


class TaskSourceError(ValueError):
    """A task source cannot be loaded or yields something that is not a task; the message says which."""


def check(spec: str) -> None:
    """Raise ``ValueError`` naming the expected form when ``spec`` is no task source (nothing is imported)."""
    if spec.startswith(reasoning_gym_source.PREFIX):
        reasoning_gym_source.parse_spec(spec)
    elif spec.startswith(BUILTIN_PREFIX):
        try:
            check_name(spec.removeprefix(BUILTIN_PREFIX))
        except ValueError:
            raise ValueError(f"invalid builtin task set {spec!r}; use 'builtin:<name>'") from None
    elif spec.endswith(".jsonl"):
        if spec == ".jsonl" or spec.endswith("/.jsonl") or "\n" in spec:
            raise ValueError(f"invalid task file {spec!r}")
    else:
        try:
            check_entry_point(spec)
        except ValueError:
            raise ValueError(
                f"invalid task source {spec!r}; use 'builtin:<name>', 'reasoning_gym:<dataset>', a path "
                "ending in '.jsonl', or 'module.path:callable'"
            ) from None


def source_issues(topology: Topology) -> list[ConfigIssue]:
    """One issue per client group (``clients[i].tasks``) or evaluation (``clients[i].eval.tasks``) whose task
    source is malformed: the launcher's check before it writes or submits anything."""
    issues = []
    for index, group in enumerate(topology.clients):
        specs = [(f"clients[{index}].tasks", group.tasks)]
        if group.eval is not None:
            specs.append((f"clients[{index}].eval.tasks", group.eval.tasks))
        for path, spec in specs:
            try:
                check(spec)
            except ValueError as exc:
                issues.append(ConfigIssue(path, str(exc)))
    return issues


def import_entry(spec: str) -> Callable[..., Any]:
    """The object named by ``module.path:name``."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskSourceError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    try:
        return getattr(module, attribute)
    except AttributeError as exc:
        raise TaskSourceError(f"{module_name!r} has no {attribute!r} (from {spec!r})") from exc


def _as_task(item: Any, position: int, origin: str) -> Task:
    if isinstance(item, Task):
        return item
    if not isinstance(item, dict):
        raise TaskSourceError(f"{origin}: item {position} is a {type(item).__name__}, not a task object")
    data = dict(item)
    task_id = str(data.pop("id", f"{Path(origin).stem}-{position}"))
    return Task(id=task_id, data=data)


def _jsonl(path: Path) -> Iterator[Task]:
    if not path.is_file():
        raise TaskSourceError(f"task file {path} does not exist")
    with path.open() as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskSourceError(f"{path}:{number}: not JSON ({exc.msg})") from exc
            yield _as_task(item, number, str(path))


def open_source(spec: str, base_dir: Path | None = None) -> Iterator[Task]:
    """A fresh iterator over every task of ``spec``, in a stable order."""
    if spec.startswith(reasoning_gym_source.PREFIX):
        try:
            return reasoning_gym_source.tasks(spec)
        except (ImportError, ValueError) as exc:
            raise TaskSourceError(str(exc)) from exc
    if spec.startswith(BUILTIN_PREFIX):
        name = spec.removeprefix(BUILTIN_PREFIX)
        if name not in BUILTIN:
            raise TaskSourceError(f"no built-in task source {name!r}")
        return iter(importlib.import_module(BUILTIN[name]).tasks())
    if spec.endswith(".jsonl"):
        path = Path(spec)
        return _jsonl(path if path.is_absolute() or base_dir is None else base_dir / path)
    produced: Iterable[Any] = import_entry(spec)()
    return (_as_task(item, n, spec) for n, item in enumerate(produced))
