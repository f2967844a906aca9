"""Agent for math tasks with a gold answer (``task.data["answer"]``, e.g. ``reasoning_gym:chain_sum``): ask
once, reward with math-verify (``environments.rewards.math_answer``), whatever form the answer takes."""

from __future__ import annotations

from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.environments.rewards.math_answer import math_reward
from ajet_hpc.environments.single_call import ask

INSTRUCTION = "Give the final answer in \\boxed{}."
MAX_TOKENS = 32


def solve(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    answer = ask(ctx, INSTRUCTION, MAX_TOKENS)
    return Outcome(reward=math_reward(answer, str(data["answer"])), metadata={"answer": answer})
