"""Agents used by tests through the real client runner (imported in jobs as ``tests.fixture_agents``)."""

from __future__ import annotations

import time

from ajet_hpc.environments.arithmetic import agent as arithmetic
from ajet_hpc.environments.episode import EpisodeContext, Outcome


def slow_arithmetic(ctx: EpisodeContext) -> Outcome:
    """The built-in arithmetic agent, then a pause: episodes last long enough to be interrupted."""
    reward = arithmetic.solve(ctx)
    time.sleep(0.4)
    return Outcome(
        reward=reward, transcript={"task": ctx.task.id, "repeat": ctx.repeat}, metadata={"slow": True}
    )


def probe_version(ctx: EpisodeContext) -> Outcome:
    """The built-in arithmetic agent, reporting which ``ajet_dep_probe`` its runtime gave it (tests of
    client runtimes: each group's env file pins its own version)."""
    import sys
    from importlib import metadata

    # installed only in the group's runtime, never in the server's environment (nor mypy's)
    import ajet_dep_probe  # type: ignore[import-not-found]

    return Outcome(
        reward=arithmetic.solve(ctx),
        metadata={
            "probe_version": ajet_dep_probe.__version__,
            "probe_metadata_version": metadata.version("ajet_dep_probe"),
            "python_prefix": sys.prefix,
        },
    )


def arithmetic_swapped(ctx: EpisodeContext) -> float:
    """The built-in arithmetic agent under another name: a hot-swap test tells its episodes apart."""
    return arithmetic.solve(ctx)


def sandbox_attack(ctx: EpisodeContext) -> Outcome:
    """The code agent (``code.agent``) with the model's reply replaced by the task's hostile code. A fake
    by necessity: a random model never writes a fork bomb. The call to the model is real and recorded;
    the sandbox, the hidden tests and the reward are the agent's own."""
    from ajet_hpc.environments.code import agent as code
    from ajet_hpc.environments.single_call import ask

    ask(ctx, "", 4)
    return code.check(ctx.task.data["attack"], ctx.task.data)
