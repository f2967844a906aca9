"""What an agent receives and returns. An agent is a plain function ``solve(ctx) -> float | Outcome``.

It talks to the model(s) with any OpenAI client at ``ctx.model.base_url`` with ``ctx.model.api_key``: every
call it makes is recorded under the episode, and the reward it returns closes the episode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Task:
    """One task of a task source; ``id`` is stable across runs and restarts."""

    id: str
    data: dict[str, Any]


@dataclass(frozen=True)
class ModelHandle:
    """One trainable model as the agent sees it: an OpenAI endpoint scoped to this episode."""

    name: str
    base_url: str
    api_key: str

    def client(self, **kwargs: Any):
        """An ``openai.OpenAI`` client for this episode (retries off: a failed call is the agent's to see)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)


@dataclass
class Outcome:
    """What an episode earned. ``turn_rewards``: one per model answer, in order (optional)."""

    reward: float
    turn_rewards: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    transcript: Any = None  # the agent's own record of the episode (JSON-serialisable), kept by the client


@dataclass(frozen=True)
class EpisodeContext:
    task: Task
    models: dict[str, ModelHandle]
    repeat: int  # which of the task's repeats this episode is (0-based)

    @property
    def model(self) -> ModelHandle:
        """The model, when the group uses exactly one server."""
        if len(self.models) != 1:
            raise AttributeError(
                f"this group uses several models ({', '.join(self.models)}): use ctx.models[...]"
            )
        return next(iter(self.models.values()))


def as_outcome(value: float | Outcome) -> Outcome:
    if isinstance(value, Outcome):
        return value
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"an agent must return a float reward or an Outcome, not {type(value).__name__}")
    return Outcome(reward=float(value))
