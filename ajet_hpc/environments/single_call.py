"""The one call of a single-turn agent: the task's question with an instruction, the reply's text."""

from __future__ import annotations

from ajet_hpc.environments.episode import EpisodeContext


def ask(ctx: EpisodeContext, instruction: str, max_tokens: int) -> str:
    """Ask the episode's model ``question`` + ``instruction`` once (temperature 1); its reply's text."""
    reply = ctx.model.client().chat.completions.create(
        model=ctx.model.name,
        messages=[{"role": "user", "content": f"{ctx.task.data['question']}\n{instruction}"}],
        max_tokens=max_tokens,
        temperature=1.0,
    )
    return reply.choices[0].message.content or ""
