"""Pydantic AI (``pydantic-ai-slim[openai]``, runtime ``envs/pydantic-ai.txt``) as a trainable agent:
Pydantic AI's ``Agent`` with the calculator's tools, on the model class its ``openai:`` models use by
default (the Responses API). Only ``base_url`` and ``api_key`` are the episode's.
"""

from __future__ import annotations

from openai import AsyncOpenAI
from pydantic_ai import Agent, UsageLimitExceeded
from pydantic_ai.models.openai import OpenAIResponsesModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.usage import UsageLimits

from ajet_hpc.environments.calculator.tools import SYSTEM, TOOLS, reward
from ajet_hpc.environments.episode import EpisodeContext, Outcome

MAX_TURNS = 4
MAX_TOKENS = 48


def solve(ctx: EpisodeContext) -> Outcome:
    client = AsyncOpenAI(base_url=ctx.model.base_url, api_key=ctx.model.api_key, max_retries=0)
    model = OpenAIResponsesModel(ctx.model.name, provider=OpenAIProvider(openai_client=client))
    agent = Agent(model, instructions=SYSTEM, tools=list(TOOLS))
    try:
        result = agent.run_sync(
            ctx.task.data["question"],
            model_settings={"max_tokens": MAX_TOKENS},
            usage_limits=UsageLimits(request_limit=MAX_TURNS),
        )
        answer = str(result.output)
    except UsageLimitExceeded:
        answer = ""
    return Outcome(reward=reward(answer, ctx.task.data), metadata={"answer": answer})
