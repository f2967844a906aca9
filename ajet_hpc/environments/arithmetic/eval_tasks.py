"""``builtin:arithmetic_eval``: 16 held-out sums for the quickstart's eval rounds.

Drawn like ``builtin:arithmetic`` (same reward, same agent) from another seed, with ids of their own
(``arith-eval-<k>``): the questions come from the same small space of sums, the episodes are never trained.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from ajet_hpc.environments.arithmetic.tasks import tasks as arithmetic_tasks
from ajet_hpc.environments.episode import Task

COUNT = 16


def tasks() -> Iterator[Task]:
    for k, task in enumerate(itertools.islice(arithmetic_tasks(seed=1_000_003), COUNT)):
        yield Task(id=f"arith-eval-{k}", data=task.data)
