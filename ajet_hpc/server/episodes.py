"""Episodes: begin, calls, end with a reward, abort, and dropping the ones that went quiet.

An episode is open from ``begin`` until ``end`` (finished), ``abort`` (aborted) or ``episode_timeout_s``
without a call (dropped, reported so that its task is run again). A closed episode is immutable: a late
``end`` or chat call for it is refused with 409. Closed episodes are handed to the sinks registered with
``on_closed`` (the batch collector and the store) and kept as summaries for ``/v1/status``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from ajet_hpc.server.errors import BadRequest, Conflict, NotFound
from ajet_hpc.server.protocol import EpisodeSummary
from ajet_hpc.tracking.context import ContextTracker
from ajet_hpc.tracking.timeline import Timeline

log = logging.getLogger(__name__)

OPEN, FINISHED, ABORTED, DROPPED = "open", "finished", "aborted", "dropped"


@dataclass
class Episode:
    episode_id: str
    model: str
    tracker: ContextTracker
    task_id: str | None = None
    group: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    state: str = OPEN
    started_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)
    calls_in_flight: int = 0
    reward: float | None = None
    turn_rewards: list[float] | None = None
    reason: str | None = None
    ended_at: float | None = None

    @property
    def timelines(self) -> list[Timeline]:
        return self.tracker.timelines

    def summary(self) -> EpisodeSummary:
        timelines = self.timelines
        return EpisodeSummary(
            episode_id=self.episode_id,
            state=self.state,  # type: ignore[arg-type]
            task_id=self.task_id,
            group=self.group,
            reward=self.reward,
            turn_rewards=self.turn_rewards,
            calls=len(timelines),
            policy_versions=sorted({t.policy_version for t in timelines}),
            drift=sum(len(t.drift) for t in timelines),
            reason=self.reason,
            started_at=self.started_at,
            ended_at=self.ended_at,
        )


class EpisodeRegistry:
    """Every episode of one server, open and recently closed."""

    def __init__(
        self,
        model: str,
        tokenizer: Callable[[], PreTrainedTokenizerBase],
        timeout_s: float,
        keep_closed: int = 10_000,
        keep_history: bool = False,
    ) -> None:
        """``tokenizer`` gives the engine's tokenizer (available once the engine has started);
        ``keep_history`` is the trackers' switch (``ServingConfig.keep_history``)."""
        self.model, self.tokenizer, self.timeout_s = model, tokenizer, timeout_s
        self.keep_history = keep_history
        self._open: dict[str, Episode] = {}
        self._closed: dict[str, Episode] = {}
        self._closed_order: deque[str] = deque()
        self._keep_closed = keep_closed
        self.counts: Counter[str] = Counter()
        self.dropped_recent: deque[EpisodeSummary] = deque(maxlen=50)
        self._sinks: list[Callable[[Episode], None]] = []

    def on_closed(self, sink: Callable[[Episode], None]) -> None:
        self._sinks.append(sink)

    # ----------------------------------------------------------------------------------------- lifecycle
    def begin(self, task_id: str | None, group: str | None, metadata: dict[str, Any]) -> Episode:
        episode = Episode(
            episode_id=f"ep-{uuid.uuid4().hex}",
            model=self.model,
            tracker=ContextTracker(self.tokenizer(), keep_history=self.keep_history),
            task_id=task_id,
            group=group,
            metadata=dict(metadata),
        )
        self._open[episode.episode_id] = episode
        self.counts[OPEN] += 1
        return episode

    def lookup(self, episode_id: str) -> Episode:
        episode = self._open.get(episode_id) or self._closed.get(episode_id)
        if episode is None:
            raise NotFound(f"unknown episode {episode_id!r}", param="episode_id", code="episode_not_found")
        return episode

    def get_open(self, episode_id: str) -> Episode:
        episode = self.lookup(episode_id)
        if episode.state != OPEN:
            raise Conflict(_closed_message(episode), param="episode_id", code=f"episode_{episode.state}")
        return episode

    def end(
        self,
        episode_id: str,
        reward: float,
        task_id: str | None,
        turn_rewards: list[float] | None,
        metadata: dict[str, Any],
    ) -> Episode:
        episode = self.get_open(episode_id)
        if episode.calls_in_flight:
            raise Conflict(
                f"episode {episode_id} still has {episode.calls_in_flight} call(s) in flight; end it after "
                "they return",
                code="calls_in_flight",
            )
        calls = len(episode.timelines)
        if turn_rewards is not None and len(turn_rewards) != calls:
            raise BadRequest(
                f"turn_rewards has {len(turn_rewards)} values but the episode recorded {calls} model "
                "answers (one per answer, in order; a call with n answers counts n)",
                param="turn_rewards",
            )
        if task_id is not None and episode.task_id is not None and task_id != episode.task_id:
            raise BadRequest(
                f"task_id {task_id!r} differs from {episode.task_id!r} given at begin", param="task_id"
            )
        episode.reward, episode.turn_rewards = reward, turn_rewards
        episode.task_id = task_id or episode.task_id
        episode.metadata.update(metadata)
        self._close(episode, FINISHED, None)
        return episode

    def abort(self, episode_id: str, reason: str) -> Episode:
        episode = self.get_open(episode_id)
        self._close(episode, ABORTED, reason)
        return episode

    def sweep(self, now: float | None = None) -> list[Episode]:
        """Drop open episodes idle for longer than the timeout (none with a call in flight)."""
        now = time.monotonic() if now is None else now
        idle = [
            e for e in self._open.values() if not e.calls_in_flight and now - e.last_activity > self.timeout_s
        ]
        for episode in idle:
            reason = f"no call for {now - episode.last_activity:.0f}s (episode_timeout_s={self.timeout_s:g})"
            self._close(episode, DROPPED, reason)
            self.dropped_recent.append(episode.summary())
            log.warning(
                "dropped episode %s (task %s, group %s): %s; its task will be run again",
                episode.episode_id,
                episode.task_id,
                episode.group,
                reason,
            )
        return idle

    async def run_sweeper(self, interval_s: float | None = None) -> None:
        interval = interval_s if interval_s is not None else max(0.05, min(5.0, self.timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    def _close(self, episode: Episode, state: str, reason: str | None) -> None:
        episode.state, episode.reason, episode.ended_at = state, reason, time.time()
        del self._open[episode.episode_id]
        self._closed[episode.episode_id] = episode
        self._closed_order.append(episode.episode_id)
        while len(self._closed_order) > self._keep_closed:
            self._closed.pop(self._closed_order.popleft(), None)
        self.counts[OPEN] -= 1
        self.counts[state] += 1
        for sink in self._sinks:
            sink(episode)

    @property
    def open_count(self) -> int:
        return len(self._open)


def _closed_message(episode: Episode) -> str:
    if episode.state == DROPPED:
        return f"episode {episode.episode_id} was dropped ({episode.reason}); its task is run again"
    return f"episode {episode.episode_id} is already {episode.state}; a closed episode cannot change"
