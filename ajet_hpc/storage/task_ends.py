"""End markers of client array tasks: how a server learns that no more episodes will come.

An array task whose task source is used up (every epoch of its shard run) writes
``RUN/data/clients/<group>/<index>.end.json`` with ``state: "exhausted"``; one whose runner was given up
after ``clients[].max_restarts`` writes ``state: "failed"``. A trainable server whose every feeding array
task has a marker, and whose collector still cannot form a batch, ends the run cleanly ("task sources
exhausted at step N of M") instead of idling to its time limit and requeueing itself.

A marker records the group settings that decide the task list (source, array size, max_tasks, epochs):
a marker written under other settings (a hot swap changed the group) does not count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.storage.rundir import RunDir

EXHAUSTED, FAILED = "exhausted", "failed"


def work_of(group: ClientGroupConfig) -> dict[str, object]:
    """The group settings that decide which tasks its array runs."""
    return {
        "tasks": group.tasks,
        "array": group.array,
        "max_tasks": group.max_tasks,
        "epochs": group.epochs,
    }


def mark_end(run: RunDir, group: ClientGroupConfig, index: int, state: str, detail: str = "") -> None:
    """Record that array task ``index`` of ``group`` will run no more episodes (``EXHAUSTED``/``FAILED``)."""
    if state not in (EXHAUSTED, FAILED):
        raise ValueError(f"end state must be {EXHAUSTED!r} or {FAILED!r}, not {state!r}")
    path = run.client_end_file(group.name, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, {"state": state, "detail": detail, "work": work_of(group), "time": time.time()})


def end_state(run: RunDir, group: ClientGroupConfig, index: int) -> str | None:
    """``EXHAUSTED``, ``FAILED`` or None (still working, or a marker of other group settings)."""
    found = read_json(run.client_end_file(group.name, index))
    if not isinstance(found, dict) or found.get("work") != work_of(group):
        return None
    return found.get("state")


@dataclass(frozen=True)
class Feeding:
    """The array tasks that feed a server, by end state."""

    working: int
    exhausted: int
    failed: int

    @property
    def all_ended(self) -> bool:
        return self.working == 0 and self.exhausted + self.failed > 0

    def describe(self) -> str:
        text = f"{self.exhausted} client task(s) used up their tasks"
        return text + (f", {self.failed} failed" if self.failed else "")


def feeding(run: RunDir, topology: Topology, server: str) -> Feeding:
    """How the array tasks of every client group that uses ``server`` stand."""
    counts = {None: 0, EXHAUSTED: 0, FAILED: 0}
    for group in topology.clients:
        if server in group.servers:
            for index in range(group.array):
                state = end_state(run, group, index)
                counts[state if state in counts else None] += 1
    return Feeding(working=counts[None], exhausted=counts[EXHAUSTED], failed=counts[FAILED])
