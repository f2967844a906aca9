"""What an agent receives and returns. An agent is a plain function ``solve(ctx) -> float | Outcome``.

It talks to the model(s) with any OpenAI client at ``ctx.model.base_url`` with ``ctx.model.api_key``: every
call it makes is recorded under the episode, and the reward it returns closes the episode.
"""

from __future__ import annotations

from collections.abc import Iterable
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
        """An ``openai.OpenAI`` client for this episode. Its own retries are off: a failed call is the
        agent's to see, and the runner retries a whole episode whose call the server answered with a 5xx
        (a bounded number of times, ``runner.SERVER_ERROR_ATTEMPTS``)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, **kwargs)


@dataclass
class Outcome:
    """What an episode earned.

    ``reward`` goes to every model of the episode, unless ``rewards`` names a model's own reward (agents
    that use several models reward each on its own terms). ``turn_rewards``: one per model answer, in
    order (optional); with several models, a dict from model name to that model's list.
    """

    reward: float
    turn_rewards: list[float] | dict[str, list[float]] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    transcript: Any = None  # the agent's own record of the episode (JSON-serialisable), kept by the client
    rewards: dict[str, float] | None = None

    def reward_for(self, model: str) -> float:
        if self.rewards is not None and model in self.rewards:
            return float(self.rewards[model])
        return float(self.reward)

    def turn_rewards_for(self, model: str) -> list[float] | None:
        if isinstance(self.turn_rewards, dict):
            return self.turn_rewards.get(model)
        return self.turn_rewards

    def check_models(self, models: Iterable[str]) -> None:
        """Raise ValueError when ``rewards`` or ``turn_rewards`` name a model the episode does not use."""
        known = set(models)
        named = set(self.rewards or ()) | (
            set(self.turn_rewards) if isinstance(self.turn_rewards, dict) else set()
        )
        unknown = sorted(named - known)
        if unknown:
            raise ValueError(
                f"the outcome rewards models {unknown} that this group does not use "
                f"(its models: {sorted(known)})"
            )


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
