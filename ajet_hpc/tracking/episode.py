"""What every layer knows about an episode: its states, its key, and what a closed one offers to read.

The server owns the live episode (``ajet_hpc.server.episodes.Episode``, with its context tracker); the
store writes closed ones and gives back ``EpisodeRecord`` (``ajet_hpc.storage.records``); the
trainer's collector and sample builder take either. They meet here, below all three, so that neither the
trainer nor the store imports the server.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Any, Protocol

from ajet_hpc.tracking.timeline import Timeline


class EpisodeState(StrEnum):
    """An episode's state; the values are what the API answers and the stores record."""

    OPEN = "open"
    FINISHED = "finished"  # ended with a reward: trainable
    ABORTED = "aborted"  # the client gave up on it (or a second episode of an ended key)
    DROPPED = "dropped"  # no call for episode_timeout_s: its task runs again

    @classmethod
    def closed(cls) -> tuple[EpisodeState, ...]:
        return (cls.FINISHED, cls.ABORTED, cls.DROPPED)


Key = tuple[str, str, int]
"""(client group, task id, repeat): what a client runs once and the trainer trains once."""


def episode_key(task_id: str | None, group: str | None, repeat: int | None) -> Key | None:
    if task_id is None or group is None or repeat is None:
        return None
    return (group, task_id, int(repeat))


class EpisodeData(Protocol):
    """What the trainer and the store read of a closed episode (a live one or a stored record)."""

    @property
    def episode_id(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def task_id(self) -> str | None: ...
    @property
    def group(self) -> str | None: ...
    @property
    def state(self) -> str: ...
    @property
    def reward(self) -> float | None: ...
    @property
    def turn_rewards(self) -> Sequence[float] | None: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def metadata(self) -> dict[str, Any]: ...
    @property
    def started_at(self) -> float: ...
    @property
    def ended_at(self) -> float | None: ...
    @property
    def timelines(self) -> list[Timeline]: ...


EVAL_STEP = "eval_step"
"""The metadata key the server sets on an eval episode: the step whose policy it evaluates
(``trainer/coordinator/evaluation.py``). Such an episode is stored, scored and never trained."""


def is_eval(metadata: dict[str, Any] | None) -> bool:
    """Whether an episode's metadata marks it as an eval episode."""
    return bool(metadata) and metadata.get(EVAL_STEP) is not None  # type: ignore[union-attr]


def round_task_id(step: int, task_id: str) -> str:
    """The task id of held-out task ``task_id`` in the round at ``step``: every round's keys are new."""
    return f"s{step}/{task_id}"


def split_round_task_id(task_id: str) -> tuple[int, str] | None:
    """(step, held-out task id) of a round task id; None for another id."""
    head, sep, rest = task_id.partition("/")
    if not sep or not head.startswith("s") or not head[1:].isdigit():
        return None
    return int(head[1:]), rest
