"""Scores of an eval round: mean reward and pass@k with the unbiased estimator, per task and overall.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): of ``n`` samples of a
task, ``c`` passed; the chance that at least one of ``k`` samples drawn without replacement passes is
``1 - C(n - c, k) / C(n, k)``. The round's pass@k is its mean over the tasks with at least ``k`` samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one task with ``n`` samples of which ``c`` passed (``1 ≤ k ≤ n``)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass(frozen=True)
class TaskScore:
    samples: int
    passed: int
    reward_mean: float

    def as_row(self) -> dict[str, Any]:
        return {"n": self.samples, "passed": self.passed, "reward_mean": round(self.reward_mean, 6)}


@dataclass(frozen=True)
class RoundScore:
    """What an eval round measured: ``pass_at`` maps k (1..samples_per_task) to pass@k."""

    episodes: int
    reward_mean: float | None  # None: no episode ended
    pass_at: dict[int, float]
    tasks: dict[str, TaskScore]

    def metrics(self) -> dict[str, Any]:
        """The round's scalar columns, as metrics.jsonl and the trackers take them."""
        mean = None if self.reward_mean is None else round(self.reward_mean, 6)
        row: dict[str, Any] = {"eval_episodes": self.episodes, "eval_reward_mean": mean}
        row.update({f"eval_pass@{k}": round(value, 6) for k, value in self.pass_at.items()})
        return row


def score_round(
    rewards: Mapping[str, Sequence[float]], threshold: float, samples_per_task: int
) -> RoundScore:
    """Score the rewards of a round's episodes by task (``reward >= threshold`` passes); pass@k for each
    ``k`` up to ``samples_per_task``, over the tasks that have at least ``k`` episodes."""
    tasks = {
        task: TaskScore(len(values), sum(v >= threshold for v in values), sum(values) / len(values))
        for task, values in rewards.items()
        if values
    }
    every = [v for values in rewards.values() for v in values]
    pass_at = {}
    for k in range(1, samples_per_task + 1):
        scored = [pass_at_k(t.samples, t.passed, k) for t in tasks.values() if t.samples >= k]
        if scored:
            pass_at[k] = sum(scored) / len(scored)
    return RoundScore(
        episodes=len(every),
        reward_mean=sum(every) / len(every) if every else None,
        pass_at=pass_at,
        tasks=tasks,
    )
