"""Agent for ``reasoning_gym:<dataset>`` tasks: ask the question once, reward with the dataset's verifier.

The answer is the text after the last ``Answer:`` when the model writes one, else the whole reply (stripped);
the episode's metadata names the dataset and keeps the answer that was scored.
"""

from __future__ import annotations

from ajet_hpc.builtin_tasks.reasoning_gym_source import score
from ajet_hpc.client.api import EpisodeContext, Outcome

INSTRUCTION = "Answer with the final answer only, after 'Answer:'."
MAX_TOKENS = 32


def final_answer(reply: str) -> str:
    head, sep, tail = reply.rpartition("Answer:")
    return (tail if sep else head or reply).strip()


def solve(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    reply = ctx.model.client().chat.completions.create(
        model=ctx.model.name,
        messages=[{"role": "user", "content": f"{data['question']}\n{INSTRUCTION}"}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    answer = final_answer(reply.choices[0].message.content or "")
    return Outcome(reward=score(data, answer), metadata={"dataset": data["dataset"], "answer": answer})
