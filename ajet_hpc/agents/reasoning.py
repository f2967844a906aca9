"""Agent for ``reasoning_gym:<dataset>`` tasks: ask the question once, reward with the dataset's verifier.

The answer is the text after the last ``Answer:`` when the model writes one, else the whole reply (stripped);
the episode's metadata names the dataset and keeps the answer that was scored.
"""

from __future__ import annotations

from ajet_hpc.agents.single_call import ask
from ajet_hpc.client.api import EpisodeContext, Outcome
from ajet_hpc.client.reasoning_gym_source import score

INSTRUCTION = "Answer with the final answer only, after 'Answer:'."
MAX_TOKENS = 32


def final_answer(reply: str) -> str:
    head, sep, tail = reply.rpartition("Answer:")
    return (tail if sep else head or reply).strip()


def solve(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    answer = final_answer(ask(ctx, INSTRUCTION, MAX_TOKENS))
    return Outcome(reward=score(data, answer), metadata={"dataset": data["dataset"], "answer": answer})
