"""Task sources: ``builtin:<name>``, ``reasoning_gym:<dataset>`` (``client/reasoning_gym_source.py``),
a JSONL file, or ``module:callable``; sharded over array tasks and repeated for ``epochs`` passes.

Pass ``e > 0`` over a source renames each task ``<id>@<e>``: a (client group, task id, repeat) key then
names one episode over the whole run, which is what makes results exactly-once and resumable (the store
knows which keys are committed, whichever pass they belong to).
"""

from __future__ import annotations

import importlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ajet_hpc.client import reasoning_gym_source
from ajet_hpc.client.api import Task
from ajet_hpc.config.fields import REASONING_GYM_PREFIX

if TYPE_CHECKING:
    from ajet_hpc.config import ClientGroupConfig


class TaskSourceError(ValueError):
    """A task source cannot be loaded or yields something that is not a task; the message says which."""


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
    if spec.startswith(REASONING_GYM_PREFIX):
        try:
            return reasoning_gym_source.tasks(spec)
        except (ImportError, ValueError) as exc:
            raise TaskSourceError(str(exc)) from exc
    if spec.startswith("builtin:"):
        name = spec.removeprefix("builtin:")
        try:
            module = importlib.import_module(f"ajet_hpc.builtin_tasks.{name}")
        except ImportError as exc:
            raise TaskSourceError(f"no built-in task source {name!r}") from exc
        return iter(module.tasks())
    if spec.endswith(".jsonl"):
        path = Path(spec)
        return _jsonl(path if path.is_absolute() or base_dir is None else base_dir / path)
    produced: Iterable[Any] = import_entry(spec)()
    return (_as_task(item, n, spec) for n, item in enumerate(produced))


def shard(tasks: Iterable[Task], index: int, count: int, limit: int | None = None) -> Iterator[Task]:
    """This array task's share: every ``count``-th task from position ``index`` (of the first ``limit``)."""
    head = tasks if limit is None else itertools.islice(tasks, limit)
    return itertools.islice(head, index, None, count)


def epoch_task_id(task_id: str, epoch: int) -> str:
    """The id of a task in pass ``epoch`` (0-based) over its source: unchanged in the first pass."""
    return task_id if epoch == 0 else f"{task_id}@{epoch}"


def epochs(open_shard: Callable[[], Iterable[Task]], count: int) -> Iterator[Task]:
    """``count`` passes over the tasks ``open_shard()`` yields (called once per pass: a source is read
    afresh, so it needs no memory of the tasks), ids renamed by ``epoch_task_id``."""
    for epoch in range(count):
        for task in open_shard():
            yield task if epoch == 0 else Task(id=epoch_task_id(task.id, epoch), data=task.data)


def assigned_tasks(group: ClientGroupConfig, index: int, base_dir: Path | None = None) -> Iterator[Task]:
    """Every task array task ``index`` of ``group`` runs, in order: its shard of the group's source (of the
    first ``max_tasks``), ``group.epochs`` times."""

    def open_shard() -> Iterator[Task]:
        return shard(open_source(group.tasks, base_dir=base_dir), index, group.array, group.max_tasks)

    return epochs(open_shard, group.epochs)
