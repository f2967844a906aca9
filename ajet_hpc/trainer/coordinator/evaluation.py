"""Eval rounds of one trained model: when they open, who runs them, when they close, what they score.

A round of eval group ``g-eval`` at step ``S`` opens once the engine serves policy ``S`` (at the start with
``eval.at_start``, after every ``eval.every_steps``-th step, and after the last step). The coordinator
sends no further batch to the ranks until it closes, so every episode of the round is served by policy
``S``. Each array task of the eval group learns of the round by long-polling ``GET /v1/eval/round``, runs
its share of the held-out tasks (task id ``s<S>/<id>``, repeats ``0..samples_per_task-1``), and reports
``POST /v1/eval/done``; when every task has, the round is scored from the episodes the server ended
(``algo/pass_at_k.py``), one eval row goes to metrics.jsonl and the trackers, and training goes on. A
round still open after ``eval.timeout_s`` closes with what it has, its row marked incomplete.

Exactly once across requeues: a round whose row is in metrics.jsonl is complete and never runs again (a
resume drops rows past its checkpoint: those steps, and their rounds, run again). A round cut by a
preemption opens again at the same step; its episodes that ended are in the server store (restored keys)
and in the eval tasks' stores, so none runs twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet_hpc.algo.pass_at_k import score_round
from ajet_hpc.config.evaluation import EvalConfig
from ajet_hpc.tracking.episode import split_round_task_id
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.experiment_trackers import Trackers

log = logging.getLogger(__name__)

ROUND_POLL_S = 20.0
"""Longest a ``GET /v1/eval/round`` waits for a round before it answers that none is open."""


@dataclass(frozen=True)
class EvalPlan:
    """The rounds one eval group runs against this model."""

    group: str  # the eval group's name (its episodes' group)
    evaluates: str  # the client group whose agent it runs
    config: EvalConfig
    array: int  # array tasks that each report a round done

    def due(self, step: int, total_steps: int) -> bool:
        if step == 0:
            return self.config.at_start
        return step % self.config.every_steps == 0 or step == total_steps


@dataclass
class _Round:
    step: int
    opened_at: float
    expected: dict[int, int] = field(default_factory=dict)  # array index -> episodes it ran (done)


Ended = Callable[[str], Iterable[tuple[tuple[str, str, int], Any]]]


class EvalRounds:
    """The eval rounds of one model, on the server's event loop (the router and the coordinator)."""

    def __init__(
        self,
        model: str,
        plans: list[EvalPlan],
        total_steps: int,
        metrics_path: Path,
        ended_keys: Ended,
        written: Callable[[], Awaitable[bool]],
        trackers: Callable[[], Trackers | None] = lambda: None,
    ) -> None:
        self.model, self.total_steps, self.metrics_path = model, total_steps, metrics_path
        self.plans = {plan.group: plan for plan in plans}
        self.ended_keys, self.written, self.trackers = ended_keys, written, trackers
        self.open: dict[str, _Round] = {}
        self.finished = False  # training is over: no round opens any more, eval tasks stop
        self._changed = asyncio.Event()
        self.completed: dict[str, dict[int, dict[str, Any]]] = {}
        self.reload()

    def reload(self) -> None:
        """The rounds completed so far, from metrics.jsonl (called again after a resume trimmed it)."""
        self.completed = {group: {} for group in self.plans}
        for row in metrics.read_eval_rows(self.metrics_path, self.model):
            if row.get(metrics.EVAL) in self.completed:
                self.completed[row[metrics.EVAL]][int(row["step"])] = row

    def plan_of(self, group: str) -> EvalPlan | None:
        return self.plans.get(group)

    # ----------------------------------------------------------------------------- the coordinator's side
    def open_due(self, step: int, final: bool = False) -> list[str]:
        """Open the rounds due at ``step`` (the engine serves policy ``step``; every round when ``final``:
        training ended there) that are not complete; returns their groups."""
        opened = []
        for group, plan in self.plans.items():
            due = final or plan.due(step, self.total_steps)
            if due and step not in self.completed[group] and group not in self.open:
                self.open[group] = _Round(step, time.monotonic())
                opened.append(group)
                log.info("eval round of %s at step %d is open", group, step)
        if opened:
            self._wake()
        return opened

    async def wait_closed(self, poll_s: float = 1.0) -> None:
        """Until every open round is closed: complete, or past its ``timeout_s`` (then closed with what it
        has)."""
        while self.open:
            for group, current in list(self.open.items()):
                plan = self.plans[group]
                if time.monotonic() - current.opened_at > plan.config.timeout_s:
                    log.warning(
                        "eval round of %s at step %d timed out after %.0f s with %d of %d array tasks done",
                        group,
                        current.step,
                        plan.config.timeout_s,
                        len(current.expected),
                        plan.array,
                    )
                    await self._close(group, complete=False)
            if self.open:
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), poll_s)

    def finish(self) -> None:
        """Training is over: long-polls answer ``finished``, so the eval tasks stop."""
        self.finished = True
        self._wake()

    # ------------------------------------------------------------------------------ the eval tasks' side
    def round_for(self, group: str, index: int) -> int | None:
        """The step of the round this array task has to run (open, not reported by it), or None."""
        current = self.open.get(group)
        if current is None or index in current.expected:
            return None
        return current.step

    async def wait_round(self, group: str, index: int, timeout_s: float = ROUND_POLL_S) -> int | None:
        """``round_for``, waiting up to ``timeout_s`` for a round to open."""
        deadline = time.monotonic() + timeout_s
        while True:
            step = self.round_for(group, index)
            if step is not None or self.finished:
                return step
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), left)
            except TimeoutError:
                return None

    async def report_done(self, group: str, index: int, step: int, episodes: int) -> bool:
        """Array task ``index`` ran its share of the round at ``step`` (``episodes``: how many it ended or
        found ended). False when no such round is open (closed meanwhile, or another step): nothing
        changes. The last report closes the round."""
        current = self.open.get(group)
        if current is None or current.step != step:
            return False
        current.expected[index] = episodes
        if len(current.expected) >= self.plans[group].array:
            await self._close(group, complete=True)
        return True

    # ------------------------------------------------------------------------------------------ scoring
    def rewards_of(self, group: str, step: int) -> dict[str, list[float]]:
        """Held-out task id -> rewards of the round's ended episodes."""
        rewards: dict[str, list[float]] = {}
        for key, ended in self.ended_keys(group):
            parsed = split_round_task_id(key[1])
            if parsed is not None and parsed[0] == step:
                rewards.setdefault(parsed[1], []).append(float(ended.reward or 0.0))
        return rewards

    async def _close(self, group: str, complete: bool) -> None:
        current = self.open.get(group)
        if current is None:
            return
        await self.written()  # the round's episodes are in the store before its row is written
        if self.open.get(group) is not current:
            return
        del self.open[group]
        plan = self.plans[group]
        ev = plan.config
        score = score_round(self.rewards_of(group, current.step), ev.success_threshold, ev.samples_per_task)
        row: dict[str, Any] = {
            metrics.EVAL: group,
            "model": self.model,
            "step": current.step,
            "evaluates": plan.evaluates,
            **score.metrics(),
            "eval_expected": sum(current.expected.values()),
            "eval_complete": complete,
            "eval_round_s": round(time.monotonic() - current.opened_at, 3),
            "eval_tasks": {task: s.as_row() for task, s in sorted(score.tasks.items())},
        }
        best = self._best(group, row)
        row.update(eval_best_step=best["step"], **{"eval_best_pass@1": best.get("eval_pass@1")})
        row["time"] = time.time()
        metrics.append_eval_row(self.metrics_path, row)
        self.completed[group][current.step] = row
        trackers = self.trackers()
        if trackers is not None:
            trackers.log({"step": current.step, **{f"{group}/{k}": v for k, v in score.metrics().items()}})
        log.info(
            "eval %s at step %d: reward %s  pass@1 %s  over %d episode(s) of %d task(s)%s; best step %s",
            group,
            current.step,
            _fmt(score.reward_mean),
            _fmt(score.pass_at.get(1)),
            score.episodes,
            len(score.tasks),
            "" if complete else " (incomplete: timed out)",
            best["step"],
        )
        self._wake()

    def _best(self, group: str, row: dict[str, Any]) -> dict[str, Any]:
        """The row with the highest pass@1 so far (then mean reward; the earlier step on a tie)."""

        def rank(r: dict[str, Any]) -> tuple[float, float, int]:
            return (_num(r.get("eval_pass@1")), _num(r.get("eval_reward_mean")), -int(r["step"]))

        return max([*self.completed[group].values(), row], key=rank)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def _num(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("-inf")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
