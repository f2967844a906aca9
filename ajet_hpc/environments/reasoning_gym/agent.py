"""Agent for ``reasoning_gym:<dataset>`` tasks: ask the question once, reward with the dataset's verifier.

The answer is the text after the last ``Answer:`` when the model writes one, else the whole reply (stripped);
the episode's metadata names the dataset and keeps the answer that was scored.
"""

from __future__ import annotations

from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.environments.reasoning_gym.source import score as reasoning_gym_score
from ajet_hpc.environments.single_call import ask

INSTRUCTION = "Answer with the final answer only, after 'Answer:'."
MAX_TOKENS = 32


def final_answer(reply: str) -> str:
    head, sep, tail = reply.rpartition("Answer:")
    return (tail if sep else head or reply).strip()


def solve(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    answer = final_answer(ask(ctx, INSTRUCTION, MAX_TOKENS))
    return Outcome(
        reward=reasoning_gym_score(data, answer), metadata={"dataset": data["dataset"], "answer": answer}
    )
