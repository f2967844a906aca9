"""Episodes: begin, calls, end with a reward, abort, and dropping the ones that went quiet.

An episode is open from ``begin`` until ``end`` (finished), ``abort`` (aborted) or ``episode_timeout_s``
without a call (dropped, reported so that its task is run again). A closed episode is immutable: a late
``end`` or chat call for it is refused with 409. Closed episodes are handed to the sinks registered with
``on_closed`` (the batch collector and the store) and kept as summaries for ``/v1/status``. The registry
keeps the last ``keep_whole`` closed episodes whole (``GET /v1/episodes/<id>?timelines=true`` right after an
end) and only the summaries of the last ``keep_closed`` (a whole 8-turn episode holds about half a MiB of
tracker, timelines and messages; its summary about a KiB): the timelines of older ones are in the store.

Exactly once: an episode begun with a task id, a client group and a repeat has a key. The registry
remembers every key that ended (restored from the server store after a restart, ``restore_ended``): a
begin of an ended key is refused with the recorded result (409 ``episode_key_ended``), and an end of a
second episode of an ended key closes that episode as aborted and answers with the first one's result, so
that only one episode per key is ever trained. Ending the same episode twice with the same reward answers
the recorded result again (a retry after a lost answer); with another reward it is refused. A begin of a
key that is open in another episode aborts that one (its client died or gave up on it).
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

from ajet_hpc.server.errors import APIError, BadRequest, Conflict, NotFound
from ajet_hpc.server.http_schemas import EpisodeSummary
from ajet_hpc.tracking.context import ContextTracker
from ajet_hpc.tracking.episode import EpisodeState, Key, episode_key
from ajet_hpc.tracking.timeline import Timeline

log = logging.getLogger(__name__)

OPEN, FINISHED, ABORTED, DROPPED = (
    EpisodeState.OPEN,
    EpisodeState.FINISHED,
    EpisodeState.ABORTED,
    EpisodeState.DROPPED,
)


@dataclass(slots=True)
class Ended:
    """What the registry keeps of a key that ended: the result it recorded (compact: a run holds many)."""

    episode_id: str
    reward: float | None
    started_at: float
    ended_at: float
    calls: int
    policy_versions: list[int]


class Gone(APIError):
    status_code = 410
    error_type = "not_found_error"


@dataclass(slots=True)
class ClosedEpisode:
    """What the registry keeps of a closed episode past the last ``keep_whole``: its summary."""

    episode_id: str
    state: EpisodeState
    reward: float | None
    turn_rewards: list[float] | None
    reason: str | None
    kept: EpisodeSummary

    @classmethod
    def of(cls, episode: Episode) -> ClosedEpisode:
        return cls(
            episode.episode_id,
            episode.state,
            episode.reward,
            episode.turn_rewards,
            episode.reason,
            episode.summary(),
        )

    def summary(self) -> EpisodeSummary:
        return self.kept.model_copy()

    @property
    def timelines(self) -> list[Timeline]:
        raise Gone(
            f"the timelines of episode {self.episode_id} are no longer held by the server (it keeps only "
            "the most recently closed episodes whole); read them from the run's store "
            "(ajet-hpc inspect RUN show EPISODE_ID)",
            param="timelines",
            code="timelines_gone",
        )


@dataclass
class Episode:
    episode_id: str
    model: str
    tracker: ContextTracker | None  # None for an episode restored from the store (its timelines given)
    task_id: str | None = None
    group: str | None = None
    repeat: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    state: EpisodeState = OPEN
    started_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)
    calls_in_flight: int = 0
    reward: float | None = None
    turn_rewards: list[float] | None = None
    reason: str | None = None
    ended_at: float | None = None
    stored_timelines: list[Timeline] | None = None
    sampling: dict[str, Any] | None = None  # an eval episode's sampling settings, over what calls ask

    @property
    def timelines(self) -> list[Timeline]:
        if self.tracker is None:
            return self.stored_timelines or []
        return self.tracker.timelines

    @property
    def live_tracker(self) -> ContextTracker:
        """The tracker of an episode that takes calls (one restored from the store has none)."""
        if self.tracker is None:
            raise Conflict(f"episode {self.episode_id} was restored from the store and takes no calls")
        return self.tracker

    @property
    def key(self) -> Key | None:
        return episode_key(self.task_id, self.group, self.repeat)

    def summary(self) -> EpisodeSummary:
        timelines = self.timelines
        return EpisodeSummary(
            episode_id=self.episode_id,
            state=self.state,
            task_id=self.task_id,
            group=self.group,
            repeat=self.repeat,
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
        keep_whole: int = 64,
    ) -> None:
        """``tokenizer`` gives the engine's tokenizer (available once the engine has started);
        ``keep_history`` is the trackers' switch (``ServingConfig.keep_history``)."""
        self.model, self.tokenizer, self.timeout_s = model, tokenizer, timeout_s
        self.keep_history = keep_history
        self._open: dict[str, Episode] = {}
        self._closed: dict[str, Episode | ClosedEpisode] = {}
        self._closed_order: deque[str] = deque()
        self._whole_order: deque[str] = deque()  # the closed episodes still held whole, oldest first
        self._keep_closed, self._keep_whole = keep_closed, keep_whole
        self.counts: Counter[str] = Counter()
        self.dropped_recent: deque[EpisodeSummary] = deque(maxlen=50)
        self._sinks: list[Callable[[Episode], None]] = []
        self._ended: dict[Key, Ended] = {}
        self._open_by_key: dict[Key, str] = {}
        self._ended_per_task: Counter[tuple[str, str]] = Counter()

    def on_closed(self, sink: Callable[[Episode], None]) -> None:
        self._sinks.append(sink)

    # ----------------------------------------------------------------------------------------- lifecycle
    def begin(
        self, task_id: str | None, group: str | None, metadata: dict[str, Any], repeat: int | None = None
    ) -> Episode:
        """A new open episode. ``repeat`` defaults to ``metadata["repeat"]`` (how clients sent it before
        it was a field); with task and group it makes the key, which must not have ended yet."""
        if repeat is None and isinstance(metadata.get("repeat"), int) and metadata["repeat"] >= 0:
            repeat = metadata["repeat"]
        key = episode_key(task_id, group, repeat)
        if key is not None and key in self._ended:
            ended = self._ended[key]
            raise Conflict(
                f"task {task_id!r} repeat {repeat} of group {group!r} already ended as episode "
                f"{ended.episode_id} (reward {ended.reward}); it is not run again",
                code="episode_key_ended",
            )
        if repeat is not None:
            metadata = {**metadata, "repeat": repeat}
        earlier = self._open_by_key.get(key) if key is not None else None
        episode = Episode(
            episode_id=f"ep-{uuid.uuid4().hex}",
            model=self.model,
            tracker=ContextTracker(self.tokenizer(), keep_history=self.keep_history),
            task_id=task_id,
            group=group,
            repeat=repeat,
            metadata=dict(metadata),
        )
        self._open[episode.episode_id] = episode
        self.counts[OPEN] += 1
        if key is not None:
            self._open_by_key[key] = episode.episode_id
        if earlier is not None and earlier in self._open:  # its runner died or gave up on it: not waited for
            self._close(
                self._open[earlier], ABORTED, f"superseded by episode {episode.episode_id} of the same key"
            )
        return episode

    def lookup(self, episode_id: str) -> Episode | ClosedEpisode:
        episode = self._open.get(episode_id) or self._closed.get(episode_id)
        if episode is None:
            raise NotFound(f"unknown episode {episode_id!r}", param="episode_id", code="episode_not_found")
        return episode

    def get_open(self, episode_id: str) -> Episode:
        episode = self.lookup(episode_id)
        if not isinstance(episode, Episode) or episode.state != OPEN:
            raise Conflict(_closed_message(episode), param="episode_id", code=f"episode_{episode.state}")
        return episode

    def end(
        self,
        episode_id: str,
        reward: float,
        task_id: str | None,
        turn_rewards: list[float] | None,
        metadata: dict[str, Any],
        group: str | None = None,
        repeat: int | None = None,
    ) -> EpisodeSummary:
        """Finish an episode; the summary of the episode that holds its key (``duplicate`` set when that is
        an earlier one, or when this episode had already ended with the same reward)."""
        episode = self.lookup(episode_id)
        if episode.state == FINISHED and episode.reward == reward and episode.turn_rewards == turn_rewards:
            return episode.summary().model_copy(update={"duplicate": True})  # a retried end
        if not isinstance(episode, Episode) or episode.state != OPEN:
            raise Conflict(_closed_message(episode), param="episode_id", code=f"episode_{episode.state}")
        for name, given, held in (("task_id", task_id, episode.task_id), ("group", group, episode.group)):
            if given is not None and held is not None and given != held:
                raise Conflict(
                    f"episode {episode_id} belongs to {name} {held!r}, not {given!r}; nothing was changed",
                    param=name,
                    code="episode_key_mismatch",
                )
        if repeat is not None and episode.repeat is not None and repeat != episode.repeat:
            raise Conflict(
                f"episode {episode_id} is repeat {episode.repeat}, not {repeat}; nothing was changed",
                param="repeat",
                code="episode_key_mismatch",
            )
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
        key = episode.key
        if key is not None and key in self._ended:  # another episode of this key ended first: it counts
            ended = self._ended[key]
            self._close(episode, ABORTED, f"a second run of a key that episode {ended.episode_id} ended")
            log.warning(
                "episode %s: task %s repeat %d of group %s already ended as %s; this run is not trained",
                episode_id,
                key[1],
                key[2],
                key[0],
                ended.episode_id,
            )
            return self.ended_summary(key)
        episode.reward, episode.turn_rewards = reward, turn_rewards
        episode.task_id = task_id or episode.task_id
        episode.metadata.update(metadata)
        if episode.key is not None:
            self._remember(episode.key, episode)
        self._close(episode, FINISHED, None)
        return episode.summary()

    def abort(self, episode_id: str, reason: str) -> Episode:
        episode = self.get_open(episode_id)
        self._close(episode, ABORTED, reason)
        return episode

    # ------------------------------------------------------------------------------------------ keys
    def _remember(self, key: Key, episode: Episode) -> None:
        timelines = episode.timelines
        self._ended[key] = Ended(
            episode_id=episode.episode_id,
            reward=episode.reward,
            started_at=episode.started_at,
            ended_at=time.time(),
            calls=len(timelines),
            policy_versions=sorted({t.policy_version for t in timelines}),
        )
        self._ended_per_task[key[:2]] += 1

    def restore_ended(self, summaries: list[dict[str, Any]]) -> int:
        """Remember the keys of finished episodes from the server store (``EpisodeReader.summaries``);
        returns how many keys that made."""
        before = len(self._ended)
        for s in summaries:
            repeat = (s.get("metadata") or {}).get("repeat")
            key = episode_key(s.get("task_id"), s.get("group"), repeat if isinstance(repeat, int) else None)
            if s.get("state") != FINISHED or key is None or key in self._ended:
                continue
            self._ended[key] = Ended(
                episode_id=s["episode_id"],
                reward=s.get("reward"),
                started_at=float(s.get("started_at") or 0.0),
                ended_at=float(s.get("ended_at") or 0.0),
                calls=int(s.get("calls") or 0),
                policy_versions=list(s.get("policy_versions") or []),
            )
            self._ended_per_task[key[:2]] += 1
        return len(self._ended) - before

    def ended_summary(self, key: Key) -> EpisodeSummary:
        """The recorded result of an ended key, as the answer to a repeated end."""
        ended = self._ended[key]
        return EpisodeSummary(
            episode_id=ended.episode_id,
            state=FINISHED,
            task_id=key[1],
            group=key[0],
            repeat=key[2],
            reward=ended.reward,
            turn_rewards=None,
            calls=ended.calls,
            policy_versions=ended.policy_versions,
            drift=0,
            started_at=ended.started_at,
            ended_at=ended.ended_at,
            duplicate=True,
        )

    def ended_keys(self, group: str) -> list[tuple[Key, Ended]]:
        """Every ended key of a client group, with its recorded result."""
        return [(key, ended) for key, ended in self._ended.items() if key[0] == group]

    def ended_count(self, group: str, task_id: str) -> int:
        """How many repeats of one task of a group have ended (trained, waiting, or dropped as stale)."""
        return self._ended_per_task[(group, task_id)]

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

    def _close(self, episode: Episode, state: EpisodeState, reason: str | None) -> None:
        episode.state, episode.reason, episode.ended_at = state, reason, time.time()
        del self._open[episode.episode_id]
        if episode.key is not None and self._open_by_key.get(episode.key) == episode.episode_id:
            del self._open_by_key[episode.key]
        self._closed[episode.episode_id] = episode
        self._closed_order.append(episode.episode_id)
        self._whole_order.append(episode.episode_id)
        while len(self._whole_order) > self._keep_whole:  # the sinks hold the whole ones they still need
            older = self._whole_order.popleft()
            whole = self._closed.get(older)
            if isinstance(whole, Episode):
                self._closed[older] = ClosedEpisode.of(whole)
        while len(self._closed_order) > self._keep_closed:
            self._closed.pop(self._closed_order.popleft(), None)
        self.counts[OPEN] -= 1
        self.counts[state] += 1
        for sink in self._sinks:
            sink(episode)

    @property
    def open_count(self) -> int:
        return len(self._open)


def _closed_message(episode: Episode | ClosedEpisode) -> str:
    if episode.state == DROPPED:
        return f"episode {episode.episode_id} was dropped ({episode.reason}); its task is run again"
    return f"episode {episode.episode_id} is already {episode.state}; a closed episode cannot change"
