"""Agent for ``builtin:arithmetic``: ask once, score the first character of the answer."""

from __future__ import annotations

from ajet_hpc.environments.arithmetic.tasks import reward
from ajet_hpc.environments.episode import EpisodeContext


def solve(ctx: EpisodeContext) -> float:
    reply = ctx.model.client().chat.completions.create(
        model=ctx.model.name,
        messages=[{"role": "user", "content": ctx.task.data["question"]}],
        max_tokens=2,
        temperature=1.0,
    )
    return reward(reply.choices[0].message.content or "", ctx.task.data["answer"])
