"""One array task of an eval group (``<group>-eval``, ``config.evaluation``): the rounds of held-out tasks.

The task asks the evaluated model's server which round it has to run (``GET /v1/eval/round``, a long poll:
no file is read while the server answers), runs its share of the held-out tasks ``samples_per_task`` times
each with the group's agent (``GroupTask.run_tasks``: the same episodes, stores and exactly-once as
training, with task ids ``s<step>/<task>`` and ``metadata.eval_step``), reports the round done
(``POST /v1/eval/done``), and asks again, until the server says training is over. A round cut by a
requeue (of either side) is run again from the task's store: what it committed is not run twice.
"""

from __future__ import annotations

import logging

from ajet_hpc.client.discovery import ServerFinished, ServerGone
from ajet_hpc.client.handshake import ServerNotTrusted
from ajet_hpc.client.runner import GroupTask, Tally, group_task
from ajet_hpc.client.session import EpisodeRejected, ServerAway
from ajet_hpc.client.task_sources import assigned_tasks
from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.config.evaluation import evaluated_model
from ajet_hpc.environments.episode import Task
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.tracking.episode import EVAL_STEP, round_task_id, split_round_task_id

log = logging.getLogger(__name__)


class EvalGroupTask(GroupTask):
    """The episodes of one array task of an eval group, round after round."""

    def __init__(self, run: RunDir, topology: Topology, group: ClientGroupConfig, index: int) -> None:
        evaluated = topology.evaluated_by(group.name)
        if evaluated is None or evaluated.eval is None:
            raise ValueError(f"{group.name} is not an eval group")
        super().__init__(run, group, index, evaluated.eval.samples_per_task)
        model = evaluated_model(topology, evaluated)
        assert model is not None  # the topology's checks (config.evaluation.eval_issues)
        self.model = model
        self.rounds = 0

    def run(self) -> Tally:
        try:
            for name in self.group.servers:
                self.connect(name)
            while not (self.finished.is_set() or self.stopping.is_set()):
                self._next_round()
        except ServerFinished as exc:
            log.info("no more eval rounds: %s", exc)
        except ServerGone:
            pass
        except ServerNotTrusted as exc:
            self.stop_untrusted(exc)
        log.info("eval task %s[%d]: %d round(s) run", self.group.name, self.index, self.rounds)
        return self.tally

    def _next_round(self) -> None:
        api = self.connect(self.model)
        try:
            answer = api.eval_round(self.group.name, self.index)
        except ServerAway as exc:
            log.warning("server %s away while asked for an eval round (%s)", self.model, exc)
            self.connect(self.model, known_url=api.url)
            return
        if answer["finished"]:
            log.info("training of %s is over: no more eval rounds", self.model)
            self.finished.set()
            return
        if answer["step"] is not None:
            self.run_round(int(answer["step"]))

    def run_round(self, step: int, report: bool = True) -> None:
        """Run this task's share of the round at ``step`` and report it done (unless not ``report``: an
        offline eval, ``ajet-hpc eval``, has no rounds to report to)."""
        log.info("eval round of %s at step %d: running its share", self.group.name, step)
        self.episode_meta = {EVAL_STEP: step}
        self.halted.clear()
        shard = assigned_tasks(self.group, self.index, base_dir=self.rundir.root.parent)
        self.run_tasks(Task(id=round_task_id(step, task.id), data=task.data) for task in shard)
        if self.halted.is_set():
            log.warning(
                "eval round of %s at step %d closed before this task ran its share", self.group.name, step
            )
            return
        if self.finished.is_set() or self.stopping.is_set() or not report:
            return
        ended = sum(1 for key in self.store.committed() if _step_of(key[0]) == step)
        try:
            accepted = self.connect(self.model).eval_done(self.group.name, self.index, step, ended)
        except (ServerAway, EpisodeRejected) as exc:  # asked again once the server is back
            log.warning("eval round at step %d: report not delivered (%s)", step, exc)
            return
        self.rounds += 1
        log.info(
            "eval round of %s at step %d: %d episode(s) of this task%s",
            self.group.name,
            step,
            ended,
            "" if accepted else " (the round had closed already)",
        )

    def _attempt(self, task: Task, repeat: int) -> None:
        try:
            super()._attempt(task, repeat)
        except EpisodeRejected as exc:
            if exc.code == "eval_round_closed":  # timed out at the server: the rest of the share is moot
                self.halted.set()
            raise


def _step_of(task_id: str) -> int | None:
    parsed = split_round_task_id(task_id)
    return None if parsed is None else parsed[0]


def make_worker(run: RunDir, topology: Topology, group: ClientGroupConfig, index: int) -> GroupTask:
    """The worker of an array task of ``group``: an eval group's rounds, or a training group's tasks."""
    if topology.evaluated_by(group.name) is not None:
        return EvalGroupTask(run, topology, group, index)
    return group_task(run, topology, group, index)
