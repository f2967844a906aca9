"""The OpenAI Agents SDK (``openai-agents``, runtime ``envs/openai-agents.txt``) as a trainable agent: the
SDK's own ``Agent`` and ``Runner`` with the calculator's function tools. Only the client is ours: the
episode's ``base_url`` and ``api_key``. The SDK calls the Responses API by default, which the server
answers and records like chat (``server/responses_api.py``); tracing, which would export to OpenAI, is off.
"""

from __future__ import annotations

from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from agents.models.openai_responses import OpenAIResponsesModel
from openai import AsyncOpenAI

from ajet_hpc.environments.calculator.tools import SYSTEM, TOOLS, reward
from ajet_hpc.environments.episode import EpisodeContext, Outcome

MAX_TURNS = 4
MAX_TOKENS = 48
set_tracing_disabled(True)
FUNCTION_TOOLS = [function_tool(tool) for tool in TOOLS]


def solve(ctx: EpisodeContext) -> Outcome:
    client = AsyncOpenAI(base_url=ctx.model.base_url, api_key=ctx.model.api_key, max_retries=0)
    agent = Agent(
        name="calculator",
        instructions=SYSTEM,
        tools=FUNCTION_TOOLS,
        model=OpenAIResponsesModel(model=ctx.model.name, openai_client=client),
        model_settings=ModelSettings(max_tokens=MAX_TOKENS),
    )
    try:
        answer = str(Runner.run_sync(agent, ctx.task.data["question"], max_turns=MAX_TURNS).final_output)
    except (MaxTurnsExceeded, ModelBehaviorError):  # too many turns, or an answer cut at max_tokens
        answer = ""
    return Outcome(reward=reward(answer, ctx.task.data), metadata={"answer": answer})
