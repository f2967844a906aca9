"""LangGraph (``langgraph`` + ``langchain-openai``, runtime ``envs/langgraph.txt``) as a trainable agent:
LangGraph's prebuilt ReAct graph over LangChain's ``ChatOpenAI`` with the calculator's tools. Only
``base_url`` and ``api_key`` are the episode's; ``ChatOpenAI`` calls chat completions by default.
"""

from __future__ import annotations

import warnings

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError

from ajet_hpc.environments.calculator.tools import SYSTEM, TOOLS, reward
from ajet_hpc.environments.episode import EpisodeContext, Outcome

with warnings.catch_warnings():  # create_react_agent is LangGraph's own; v1 points at langchain.agents
    warnings.simplefilter("ignore")
    from langgraph.prebuilt import create_react_agent

MAX_TURNS = 4
MAX_TOKENS = 48
LANGCHAIN_TOOLS = [tool(function) for function in TOOLS]


def solve(ctx: EpisodeContext) -> Outcome:
    model = ChatOpenAI(
        model=ctx.model.name,
        base_url=ctx.model.base_url,
        api_key=ctx.model.api_key,
        max_retries=0,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
    )
    graph = create_react_agent(model, LANGCHAIN_TOOLS, prompt=SYSTEM)
    try:
        state = graph.invoke(
            {"messages": [("user", ctx.task.data["question"])]}, {"recursion_limit": 2 * MAX_TURNS + 1}
        )
        answer = str(state["messages"][-1].content)
    except GraphRecursionError:
        answer = ""
    return Outcome(reward=reward(answer, ctx.task.data), metadata={"answer": answer})
