"""The batch collector: decides when finished episodes make a training batch, and turns them into samples.

Policies (``trainer.batch_policy``):

- ``tasks`` (AgentJet's default): ready when ``tasks_per_batch`` tasks each have ``repeats`` finished
  episodes. Episodes of one task form its GRPO group.
- ``episodes``: ready when ``tasks_per_batch * repeats`` episodes finished, whatever their tasks; groups
  are the task ids among them (a group of one gets advantage 0).

With ``skip_equal_groups`` a complete group whose rewards are all equal is dropped (its advantages would
be zero) and counted. ``max_staleness`` bounds the policy lag of a sample: an episode whose oldest call was
served by a policy more than ``max_staleness`` versions behind the trained one is dropped and counted;
0 means strictly on-policy (the server then admits no new episode while the trainer steps).
"""

from __future__ import annotations

import asyncio
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from ajet_hpc.config import TrainerConfig
from ajet_hpc.server.episodes import FINISHED, Episode


@dataclass
class Batch:
    groups: list[list[Episode]]
    skipped_equal: int = 0
    dropped_stale: int = 0

    @property
    def episodes(self) -> list[Episode]:
        return [episode for group in self.groups for episode in group]

    def rewards(self) -> list[float]:
        return [float(episode.reward or 0.0) for episode in self.episodes]


@dataclass
class CollectorStats:
    skipped_equal: int = 0
    dropped_stale: int = 0
    received: int = 0


@dataclass
class BatchCollector:
    config: TrainerConfig
    stats: CollectorStats = field(default_factory=CollectorStats)

    def __post_init__(self) -> None:
        self._pending: OrderedDict[str, list[Episode]] = OrderedDict()  # task id -> finished episodes
        self._changed = asyncio.Event()
        self._version = 0

    # The registry calls this for every closed episode (finished, aborted, dropped).
    def add(self, episode: Episode) -> None:
        if episode.state != FINISHED or not episode.timelines:
            return
        self.stats.received += 1
        self._pending.setdefault(episode.task_id or episode.episode_id, []).append(episode)
        self._changed.set()

    def set_policy_version(self, version: int) -> None:
        self._version = version

    def _is_stale(self, episode: Episode) -> bool:
        oldest = min(timeline.policy_version for timeline in episode.timelines)
        return self._version - oldest > self.config.max_staleness

    def _drop_stale(self) -> int:
        dropped = 0
        for task_id in list(self._pending):
            fresh = [e for e in self._pending[task_id] if not self._is_stale(e)]
            dropped += len(self._pending[task_id]) - len(fresh)
            if fresh:
                self._pending[task_id] = fresh
            else:
                del self._pending[task_id]
        self.stats.dropped_stale += dropped
        return dropped

    def try_batch(self) -> Batch | None:
        """A batch if one is ready now (removing its episodes from the pending pool)."""
        dropped = self._drop_stale()
        repeats, wanted = self.config.repeats, self.config.tasks_per_batch
        if self.config.batch_policy == "episodes":
            if sum(len(group) for group in self._pending.values()) < wanted * repeats:
                return None
            groups, budget = [], wanted * repeats
            for task_id in list(self._pending):
                take = self._pending[task_id][:budget]
                self._pending[task_id] = self._pending[task_id][len(take) :]
                if not self._pending[task_id]:
                    del self._pending[task_id]
                groups.append(take)
                budget -= len(take)
                if not budget:
                    break
            return Batch(groups, dropped_stale=dropped)
        groups: list[list[Episode]] = []
        skipped = 0
        for task_id in list(self._pending):
            episodes = self._pending[task_id]
            if len(episodes) < repeats:
                continue
            group, rest = episodes[:repeats], episodes[repeats:]
            if rest:
                self._pending[task_id] = rest
            else:
                del self._pending[task_id]
            if self.config.skip_equal_groups and len({e.reward for e in group}) == 1:
                skipped += 1
                continue
            groups.append(group)
            if len(groups) == wanted:
                break
        self.stats.skipped_equal += skipped
        if len(groups) < wanted:  # not enough yet: put the complete groups back for the next try
            for group in reversed(groups):
                task = group[0].task_id or group[0].episode_id
                self._pending[task] = group + self._pending.get(task, [])
                self._pending.move_to_end(task, last=False)
            return None
        return Batch(groups, skipped_equal=skipped, dropped_stale=dropped)

    async def next_batch(self) -> Batch:
        while True:
            batch = self.try_batch()
            if batch is not None:
                return batch
            self._changed.clear()
            await self._changed.wait()


def reward_stats(batch: Batch) -> tuple[float, float]:
    rewards = batch.rewards()
    return statistics.fmean(rewards), (statistics.pstdev(rewards) if len(rewards) > 1 else 0.0)
