"""A client group's tasks for one array task: its shard of the group's source (``environments/sources.py``),
repeated for ``epochs`` passes.

Pass ``e > 0`` over a source renames each task ``<id>@<e>``: a (client group, task id, repeat) key then
names one episode over the whole run, which is what makes results exactly-once and resumable (the store
knows which keys are committed, whichever pass they belong to).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ajet_hpc.environments.episode import Task
from ajet_hpc.environments.sources import open_source

if TYPE_CHECKING:
    from ajet_hpc.config import ClientGroupConfig


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
