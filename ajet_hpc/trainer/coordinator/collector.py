"""The batch collector: decides when finished episodes make a training batch, and turns them into samples.

Policies (``trainer.batch_policy``):

- ``tasks`` (AgentJet's default): ready when ``tasks_per_batch`` tasks each have ``repeats`` finished
  episodes. Episodes of one task form its GRPO group.
- ``episodes``: ready when ``tasks_per_batch * repeats`` episodes finished, whatever their tasks; groups
  are the task ids among them (a group of one gets advantage 0).

With ``skip_equal_groups`` a complete group whose rewards are all equal is dropped (its advantages would
be zero) and counted, up to ``EQUAL_GROUPS_PER_TASK`` per task of a batch since the last batch: a policy
that has sharpened until it answers every task alike makes nearly every group equal, and skipping them
all would hold the trainer until the run's time ran out. Past that, equal groups are kept (logged once a
batch) and the run trains on. ``max_staleness`` bounds the policy lag of a sample: an episode whose oldest
call was served by a policy more than ``max_staleness`` versions behind the trained one is dropped and
counted; 0 means strictly on-policy (the server then admits no new episode while the trainer steps).

Eval episodes (``tracking.episode.is_eval``) are never collected: their rounds score them.

A task group that can no longer complete is dropped and counted (``dropped_incomplete``): when the
repeats it lacks have already ended elsewhere (dropped as stale, or lost with a step), no client runs them
again. A repeat that ended but is not yet in the server store (``announce``d, not yet ``add``-ed) is still
coming: the trainer takes an episode only once it is stored. After a restart, ``restore`` puts back the
finished episodes no step consumed (read from the server store); every batch names the ids it consumes
(trained, or dropped here) for the server's journal.
Episodes whose samples cannot be built are dropped when the batch is built (``Batch.invalid``,
``trainer.samples``); a batch left with none is ``carry_over``-ed: the next batch reports its drops.

The coordinator may take the next batch while the ranks still train the current step (docs/architecture.md,
"The coordinator's step"): ``next_batch(version=n)`` judges staleness against the policy that will train
it, not the one serving now; a batch it then cannot send goes back with ``put_back`` (nothing consumed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import statistics
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ajet_hpc.config import TrainerConfig
from ajet_hpc.tracking.episode import EpisodeData, EpisodeState, is_eval

log = logging.getLogger(__name__)


@dataclass
class Batch:
    groups: list[list[EpisodeData]]
    skipped_equal: int = 0
    dropped_stale: int = 0
    shortfall: dict[str, int] = field(default_factory=dict)  # with ratios: tasks a client group owed
    dropped_incomplete: int = 0
    recovered: int = 0  # episodes of this batch restored from the store after a restart
    recovered_ids: list[str] = field(default_factory=list)  # their ids
    collect_s: float = 0.0  # the collector's own time for this batch: every try since the previous batch
    dropped_ids: list[str] = field(default_factory=list)  # consumed without training since the last batch
    invalid: dict[str, str] = field(default_factory=dict)  # episode id -> why it could not be built (samples)

    @property
    def dropped_invalid(self) -> int:
        """Episodes dropped because their samples could not be built (``trainer.samples.build_samples``)."""
        return len(self.invalid)

    @property
    def episodes(self) -> list[EpisodeData]:
        return [episode for group in self.groups for episode in group]

    def rewards(self) -> list[float]:
        return [float(episode.reward or 0.0) for episode in self.episodes]

    def tasks_per_client_group(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for group in self.groups:
            name = group[0].group or ""
            counts[name] = counts.get(name, 0) + 1
        return counts


@dataclass
class CollectorStats:
    skipped_equal: int = 0
    dropped_stale: int = 0
    dropped_incomplete: int = 0
    received: int = 0
    recovered: int = 0


Key = tuple[str, str]  # (client group, task id): the same task id in two groups is two tasks


def _trainable(episode: EpisodeData) -> bool:
    """A finished episode with calls, not an eval episode: what `announce` counts and `add` collects."""
    finished = episode.state == EpisodeState.FINISHED and bool(episode.timelines)
    return finished and not is_eval(episode.metadata)


EQUAL_GROUPS_PER_TASK = 8
"""Equal-reward groups skipped since the last batch, per task of a batch, past which they are kept."""
INCOMPLETE_SCAN_KEYS = 256
"""Tasks waiting in the pool above which `_drop_incomplete` looks through it at most once a second."""


class _Pool(OrderedDict[Key, list[EpisodeData]]):
    """The finished episodes waiting for a batch, per task, and how many complete task groups they make
    (``len // repeats`` per task), kept as the pool changes: an episode's arrival then costs no scan of
    the pool (thousands of episodes wait in it when thousands are open). Lists are replaced, never
    changed in place (``append``)."""

    def __init__(self, repeats: int) -> None:
        super().__init__()
        self.repeats = repeats
        self.complete = 0

    def __setitem__(self, key: Key, episodes: list[EpisodeData]) -> None:
        old = self.get(key)
        self.complete += len(episodes) // self.repeats - (0 if old is None else len(old) // self.repeats)
        super().__setitem__(key, episodes)

    def __delitem__(self, key: Key) -> None:
        self.complete -= len(self[key]) // self.repeats
        super().__delitem__(key)

    def append(self, key: Key, episode: EpisodeData) -> None:
        self[key] = [*self.get(key, ()), episode]


@dataclass
class BatchCollector:
    """``mix`` (client group -> share of a batch's tasks, summing to 1) makes every batch hold
    ``quotas(tasks_per_batch, mix)`` tasks of each group. A group that is short of its quota while the
    others' are complete holds the batch back for ``mix_wait_s``; then the batch trains without the
    missing tasks (never filled with other groups' tasks) and ``Batch.shortfall`` reports them."""

    config: TrainerConfig
    stats: CollectorStats = field(default_factory=CollectorStats)
    mix: dict[str, float] | None = None
    repeats_of: dict[str, int] | None = None  # client group -> repeats its clients run of each task
    ended_count: Callable[[str, str], int] | None = None  # (group, task) -> repeats that ended so far

    def __post_init__(self) -> None:
        self._pending = _Pool(self.config.repeats)  # finished episodes per task
        self._changed = asyncio.Event()
        self._version = 0
        self._quotas = quotas(self.config.tasks_per_batch, self.mix) if self.mix else None
        self._short_since: float | None = None
        self._dropped_ids: list[str] = []
        self._since_batch = {"dropped_stale": 0, "skipped_equal": 0, "dropped_incomplete": 0}
        self._equal_kept = False  # equal-reward groups kept for the batch being gathered (logged once)
        self._restored: set[str] = set()
        self._invalid: dict[str, str] = {}  # carried over from a batch that trained nothing
        self._collect_s = 0.0  # time spent in tries since the last batch
        self._in_transit: Counter[Key] = Counter()  # finished, on their way to the store (``announce``)
        self._incomplete_checked = -math.inf  # when `_drop_incomplete` last looked through the pool
        self.closed = False  # set once training is over: later episodes are recorded, not collected

    # The registry calls this for every closed episode (finished, aborted, dropped).
    def announce(self, episode: EpisodeData) -> None:
        """A closed episode that `add` will get once the server store holds it (the server calls this on
        close, `add` once written): until then its task group counts it as coming."""
        if _trainable(episode):
            self._in_transit[_key(episode)] += 1

    # The recorder calls this for every closed episode once it is stored.
    def add(self, episode: EpisodeData) -> None:
        if not _trainable(episode):  # aborted, dropped, empty, or an eval episode (scored by its round)
            return  # never announced either: an aborted repeat must not take a finished one's place
        key = _key(episode)
        if self._in_transit[key] > 1:
            self._in_transit[key] -= 1
        else:
            self._in_transit.pop(key, None)
        if self.closed:
            return
        self.stats.received += 1
        self._pending.append(key, episode)
        self._changed.set()

    def restore(self, episodes: Sequence[EpisodeData]) -> None:
        """Finished episodes of an earlier life of the server that no step consumed, oldest first."""
        for episode in episodes:
            self.add(episode)
            self._restored.add(episode.episode_id)
        self.stats.recovered += len(episodes)

    def note_dropped_stale(self, episode_ids: list[str]) -> None:
        """Episodes of an earlier life of the server found too stale to restore: reported with the next
        batch like the ones dropped here."""
        self._dropped_ids += episode_ids
        self._since_batch["dropped_stale"] += len(episode_ids)
        self.stats.dropped_stale += len(episode_ids)

    def carry_over(self, batch: Batch) -> None:
        """A batch that trains nothing (each of its episodes was dropped as invalid): what it consumed and
        dropped is reported with the next batch instead."""
        self._dropped_ids = batch.dropped_ids + self._dropped_ids
        self._invalid = {**batch.invalid, **self._invalid}
        for name in self._since_batch:
            self._since_batch[name] += getattr(batch, name)

    def put_back(self, batch: Batch) -> None:
        """A batch taken but never sent to the ranks (the step before it failed, or the job stops): its
        episodes wait in the pool again, in front, and what it dropped is reported with the next batch."""
        for group in reversed(batch.groups):
            key = _key(group[0])
            self._pending[key] = group + self._pending.get(key, [])
            self._pending.move_to_end(key, last=False)
        self._restored |= set(batch.recovered_ids)
        self.carry_over(batch)
        self._collect_s += batch.collect_s
        self._changed.set()

    def set_policy_version(self, version: int) -> None:
        self._version = version

    def _is_stale(self, episode: EpisodeData, version: int) -> bool:
        oldest = min(timeline.policy_version for timeline in episode.timelines)
        return version - oldest > self.config.max_staleness

    def _drop_stale(self, version: int) -> int:
        dropped = 0
        for key in list(self._pending):
            fresh: list[EpisodeData] = []
            stale: list[EpisodeData] = []
            for episode in self._pending[key]:
                (stale if self._is_stale(episode, version) else fresh).append(episode)
            dropped += len(stale)
            self._dropped_ids += [e.episode_id for e in stale]
            if not stale:
                continue
            if fresh:
                self._pending[key] = fresh
            else:
                del self._pending[key]
        self.stats.dropped_stale += dropped
        self._since_batch["dropped_stale"] += dropped
        return dropped

    def _drop_incomplete(self) -> None:
        """Drop the unfinished task group of each task whose missing repeats can no longer arrive. A large
        pool (thousands of open episodes) is looked through at most once a second: the check reads every
        task's count of ended repeats, and nothing is lost by dropping a dead group a second later."""
        if self.repeats_of is None or self.ended_count is None or self.config.batch_policy != "tasks":
            return
        now = time.monotonic()
        if len(self._pending) > INCOMPLETE_SCAN_KEYS and now - self._incomplete_checked < 1.0:
            return
        self._incomplete_checked = now
        repeats = self.config.repeats
        for key in list(self._pending):
            group, task = key
            if group not in self.repeats_of:
                continue
            episodes = self._pending[key]
            partial = len(episodes) % repeats
            coming = self.repeats_of[group] - self.ended_count(group, task) + self._in_transit[key]
            if not partial or partial + coming >= repeats:
                continue
            kept, gone = episodes[: len(episodes) - partial], episodes[len(episodes) - partial :]
            log.warning(
                "task %s of group %s: %d repeat(s) wait for %d more that can no longer run; dropped",
                task,
                group,
                partial,
                repeats - partial,
            )
            self._dropped_ids += [e.episode_id for e in gone]
            self._since_batch["dropped_incomplete"] += 1
            self.stats.dropped_incomplete += 1
            if kept:
                self._pending[key] = kept
            else:
                del self._pending[key]

    def _finish(self, batch: Batch) -> Batch:
        """Hand over what was dropped since the last batch (ids and counts): the batch reports it."""
        batch.dropped_ids, self._dropped_ids = self._dropped_ids, []
        batch.invalid, self._invalid = self._invalid, {}
        batch.dropped_stale = self._since_batch["dropped_stale"]
        batch.skipped_equal = self._since_batch["skipped_equal"]
        batch.dropped_incomplete = self._since_batch["dropped_incomplete"]
        self._since_batch = dict.fromkeys(self._since_batch, 0)
        self._equal_kept = False
        batch.recovered_ids = [e.episode_id for e in batch.episodes if e.episode_id in self._restored]
        batch.recovered = len(batch.recovered_ids)
        self._restored -= set(batch.recovered_ids)
        return batch

    def try_batch(self, now: float | None = None, version: int | None = None) -> Batch | None:
        """A batch if one is ready now (removing its episodes from the pending pool). ``version``: the
        policy version that will train it (staleness is judged against it); default the current one."""
        started = time.perf_counter()
        batch = self._try_batch(now, self._version if version is None else version)
        self._collect_s += time.perf_counter() - started
        if batch is None:
            return None
        batch = self._finish(batch)
        batch.collect_s, self._collect_s = self._collect_s, 0.0
        return batch

    def _try_batch(self, now: float | None, version: int) -> Batch | None:
        repeats, wanted = self.config.repeats, self.config.tasks_per_batch
        self._drop_incomplete()
        if self.config.batch_policy == "tasks" and self._quotas is None and self._pending.complete < wanted:
            return None  # too few task groups, stale or not: no scan of every episode waiting
        dropped = self._drop_stale(version)
        if self.config.batch_policy == "episodes":
            if sum(len(group) for group in self._pending.values()) < wanted * repeats:
                return None
            groups, budget = [], wanted * repeats
            for key in list(self._pending):
                take = self._pending[key][:budget]
                self._pending[key] = self._pending[key][len(take) :]
                if not self._pending[key]:
                    del self._pending[key]
                groups.append(take)
                budget -= len(take)
                if not budget:
                    break
            return Batch(groups, dropped_stale=dropped)
        groups, skipped = self._complete_groups(repeats)
        self.stats.skipped_equal += skipped
        self._since_batch["skipped_equal"] += skipped
        taken = self._choose(groups, wanted, time.monotonic() if now is None else now)
        if taken is None:  # not ready: put the complete groups back, in front, for the next try
            for group in reversed(groups):
                key = _key(group[0])
                self._pending[key] = group + self._pending.get(key, [])
                self._pending.move_to_end(key, last=False)
            return None
        chosen, shortfall = taken
        chosen_ids = {id(group) for group in chosen}
        for group in reversed([g for g in groups if id(g) not in chosen_ids]):
            key = _key(group[0])
            self._pending[key] = group + self._pending.get(key, [])
            self._pending.move_to_end(key, last=False)
        return Batch(chosen, skipped_equal=skipped, dropped_stale=dropped, shortfall=shortfall)

    def _complete_groups(self, repeats: int) -> tuple[list[list[EpisodeData]], int]:
        """Every complete task group now pending (taken out of the pool), minus equal-reward ones."""
        groups, skipped, kept = [], 0, 0
        limit = EQUAL_GROUPS_PER_TASK * self.config.tasks_per_batch - self._since_batch["skipped_equal"]
        for key in list(self._pending):
            episodes = self._pending[key]
            whole = len(episodes) - len(episodes) % repeats
            for start in range(0, whole, repeats):
                group = episodes[start : start + repeats]
                if self.config.skip_equal_groups and len({e.reward for e in group}) == 1:
                    if skipped < limit:
                        skipped += 1
                        self._dropped_ids += [e.episode_id for e in group]
                        continue
                    kept += 1
                groups.append(group)
            episodes = episodes[whole:]
            if episodes:
                self._pending[key] = episodes
            else:
                del self._pending[key]
        if kept and not self._equal_kept:
            self._equal_kept = True
            log.warning(
                "trainer.skip_equal_groups: %d task groups skipped since the last step had equal rewards "
                "(the policy answers each task alike); keeping such groups until this step's batch forms",
                self._since_batch["skipped_equal"] + skipped,
            )
        return groups, skipped

    def _choose(
        self, groups: list[list[EpisodeData]], wanted: int, now: float
    ) -> tuple[list[list[EpisodeData]], dict[str, int]] | None:
        """The task groups of the next batch and the shortfall per client group; None: wait."""
        if self._quotas is None:
            return (groups[:wanted], {}) if len(groups) >= wanted else None
        by_client: dict[str, list[list[EpisodeData]]] = {}
        for group in groups:
            by_client.setdefault(group[0].group or "", []).append(group)
        chosen = [g for name, quota in self._quotas.items() for g in by_client.get(name, [])[:quota]]
        short = {
            name: quota - len(by_client.get(name, [])[:quota])
            for name, quota in self._quotas.items()
            if len(by_client.get(name, [])) < quota
        }
        if not short:
            self._short_since = None
            return chosen, {}
        if len(short) == len(self._quotas):  # no group has its share yet: keep collecting
            self._short_since = None
            return None
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since < self.config.mix_wait_s:
            return None
        self._short_since = None
        return chosen, short

    async def next_batch(self, version: int | None = None) -> Batch:
        """The next batch, once one is ready; ``version`` as in `try_batch`."""
        while True:
            batch = self.try_batch(version=version)
            if batch is not None:
                if batch.shortfall:
                    log.warning(
                        "batch without the share of slow client groups after %.0f s: missing tasks %s",
                        self.config.mix_wait_s,
                        batch.shortfall,
                    )
                return batch
            self._changed.clear()
            timeout = None
            if self._short_since is not None:  # wake up when the wait for a slow group's share ends
                timeout = max(0.1, self._short_since + self.config.mix_wait_s - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout)


def quotas(total: int, mix: dict[str, float]) -> dict[str, int]:
    """``total`` tasks split by ``mix`` (largest remainders; ties by order): 10 x {a .7, b .3} -> 7, 3."""
    exact = {name: total * share for name, share in mix.items()}
    counts = {name: int(value) for name, value in exact.items()}
    order = sorted(mix, key=lambda name: -(exact[name] - counts[name]))
    for name in order[: total - sum(counts.values())]:
        counts[name] += 1
    return counts


def _key(episode: EpisodeData) -> Key:
    return (episode.group or "", episode.task_id or episode.episode_id)


def reward_by_group(batch: Batch) -> dict[str, float]:
    """Mean reward of the batch's episodes per client group (a dataset per group, in a mix)."""
    rewards: dict[str, list[float]] = {}
    for episode in batch.episodes:
        rewards.setdefault(episode.group or "", []).append(float(episode.reward or 0.0))
    return {group: statistics.fmean(values) for group, values in sorted(rewards.items())}


def reward_stats(batch: Batch) -> tuple[float, float]:
    rewards = batch.rewards()
    return statistics.fmean(rewards), (statistics.pstdev(rewards) if len(rewards) > 1 else 0.0)


def staleness_histogram(episodes: Sequence[EpisodeData], trained_version: int) -> dict[str, int]:
    """How many of the batch's model calls were served how many policy versions behind the policy that
    trained on them (``{"0": n0, "1": n1, ...}``, by lag)."""
    lags = Counter(trained_version - t.policy_version for e in episodes for t in e.timelines)
    return {str(lag): lags[lag] for lag in sorted(lags)}
