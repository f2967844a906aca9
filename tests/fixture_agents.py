"""Agents used by tests through the real client runner (imported in jobs as ``tests.fixture_agents``)."""

from __future__ import annotations

import time

from ajet_hpc.agents import arithmetic
from ajet_hpc.client.api import EpisodeContext, Outcome


def slow_arithmetic(ctx: EpisodeContext) -> Outcome:
    """The built-in arithmetic agent, then a pause: episodes last long enough to be interrupted."""
    reward = arithmetic.solve(ctx)
    time.sleep(0.4)
    return Outcome(
        reward=reward, transcript={"task": ctx.task.id, "repeat": ctx.repeat}, metadata={"slow": True}
    )
