"""Run inside a framework's client runtime: drive the real framework against a real server in the ways its
users do (tools, streaming with usage, tool_choice, structured output, parallel tool calls), record every
HTTP request it sends and the server's answer (through the framework's own HTTP client hooks), and print
them as JSON. ``tests/component/test_environments.py`` checks the answers.

    python tests/framework_shapes.py FRAMEWORK '{"base_url": ..., "api_key": ..., "model": ...}'
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

import httpx
from pydantic import BaseModel

SYSTEM = "You are a calculator agent."
QUESTION = "What is 2+3? Use the tool."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Sum(BaseModel):
    total: int


class Recorder:
    def __init__(self) -> None:
        self.exchanges: list[dict[str, Any]] = []

    def _request(self, request: httpx.Request) -> None:
        body = json.loads(request.content or b"{}")
        self.exchanges.append({"path": request.url.path, "body": body})

    def _answer(self, response: httpx.Response) -> None:
        error = None
        if response.status_code >= 400:
            try:
                error = response.json().get("error")
            except ValueError:
                error = {"message": response.text[:300]}
        reply = response.text if response.status_code < 400 else None
        self.exchanges[-1] |= {"status": response.status_code, "error": error, "reply": reply}

    def sync_client(self) -> httpx.Client:
        def on_response(response: httpx.Response) -> None:
            response.read()
            self._answer(response)

        return httpx.Client(event_hooks={"request": [self._request], "response": [on_response]})

    def async_client(self) -> httpx.AsyncClient:
        async def on_request(request: httpx.Request) -> None:
            self._request(request)

        async def on_response(response: httpx.Response) -> None:
            await response.aread()
            self._answer(response)

        return httpx.AsyncClient(event_hooks={"request": [on_request], "response": [on_response]})

    def openai(self, server: dict[str, Any]) -> Any:
        """An ``openai.AsyncOpenAI`` for ``server`` that records through this recorder (no retries)."""
        from openai import AsyncOpenAI

        return AsyncOpenAI(
            base_url=server["base_url"],
            api_key=server["api_key"],
            max_retries=0,
            http_client=self.async_client(),  # type: ignore[arg-type]  # the runtime's openai takes httpx
        )


def run_case(name: str, case: Callable[[Recorder], Any]) -> dict[str, Any]:
    recorder = Recorder()
    try:
        case(recorder)
        failure = None
    except Exception as exc:
        failure = f"{type(exc).__name__}: {str(exc)[:300]}"
    return {"case": name, "exchanges": recorder.exchanges, "failure": failure}


def openai_agents_cases(server: dict[str, Any]) -> dict[str, Callable[[Recorder], Any]]:
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)

    def agent(recorder: Recorder, **kwargs: Any) -> Any:
        client = recorder.openai(server)
        model = OpenAIResponsesModel(model=server["model"], openai_client=client)
        settings = ModelSettings(max_tokens=24, **kwargs.pop("settings", {}))
        return Agent(
            name="calc",
            instructions=SYSTEM,
            tools=[function_tool(add)],
            model=model,
            model_settings=settings,
            **kwargs,
        )

    def run(recorder: Recorder, **kwargs: Any) -> None:
        with contextlib.suppress(MaxTurnsExceeded, ModelBehaviorError):  # the model's doing, not the server's
            Runner.run_sync(agent(recorder, **kwargs), QUESTION, max_turns=2)

    def streamed(recorder: Recorder) -> None:
        async def consume() -> None:
            result = Runner.run_streamed(agent(recorder), QUESTION, max_turns=2)
            try:
                async for _ in result.stream_events():
                    pass
            except (MaxTurnsExceeded, ModelBehaviorError):
                pass

        asyncio.run(consume())

    return {
        "tools": run,
        "streamed": streamed,
        "parallel_tool_calls": lambda r: run(r, settings={"parallel_tool_calls": True}),
        "tool_choice_required": lambda r: run(r, settings={"tool_choice": "required"}),
        "structured_output": lambda r: run(r, output_type=Sum),
    }


def langgraph_cases(server: dict[str, Any]) -> dict[str, Callable[[Recorder], Any]]:
    import warnings

    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from langgraph.prebuilt import create_react_agent

    def model(recorder: Recorder, **kwargs: Any) -> ChatOpenAI:
        return ChatOpenAI(
            model=server["model"],
            base_url=server["base_url"],
            api_key=server["api_key"],
            max_retries=0,
            max_tokens=24,
            http_client=recorder.sync_client(),
            **kwargs,
        )

    def graph(recorder: Recorder) -> None:
        from langgraph.errors import GraphRecursionError

        try:
            agent = create_react_agent(model(recorder), [tool(add)], prompt=SYSTEM)
            agent.invoke({"messages": [("user", QUESTION)]}, {"recursion_limit": 5})
        except GraphRecursionError:
            pass

    return {
        "react_graph": graph,
        "stream_with_usage": lambda r: list(model(r, stream_usage=True).stream(QUESTION)),
        "tool_choice_any": lambda r: model(r).bind_tools([add], tool_choice="any").invoke(QUESTION),
        "parallel_tool_calls_false": lambda r: (
            model(r).bind_tools([add], parallel_tool_calls=False).invoke(QUESTION)
        ),
        "structured_output": lambda r: model(r).with_structured_output(Sum).invoke(QUESTION),
    }


def pydantic_ai_cases(server: dict[str, Any]) -> dict[str, Callable[[Recorder], Any]]:
    from pydantic_ai import Agent, UnexpectedModelBehavior, UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    def agent(recorder: Recorder, **kwargs: Any) -> Agent:
        client = recorder.openai(server)
        model = OpenAIResponsesModel(server["model"], provider=OpenAIProvider(openai_client=client))
        return Agent(model, instructions=SYSTEM, tools=[add], **kwargs)

    limits = UsageLimits(request_limit=2)

    def run(recorder: Recorder, settings: dict[str, Any] | None = None, **kwargs: Any) -> None:
        with contextlib.suppress(UsageLimitExceeded, UnexpectedModelBehavior):
            agent(recorder, **kwargs).run_sync(
                QUESTION, model_settings={"max_tokens": 24, **(settings or {})}, usage_limits=limits
            )

    def streamed(recorder: Recorder) -> None:
        async def consume() -> None:
            try:
                async with agent(recorder).run_stream(QUESTION, usage_limits=limits) as result:
                    async for _ in result.stream_text():
                        pass
            except (UsageLimitExceeded, UnexpectedModelBehavior):
                pass

        asyncio.run(consume())

    return {
        "tools": run,
        "streamed": streamed,
        "parallel_tool_calls_false": lambda r: run(r, settings={"parallel_tool_calls": False}),
        "structured_output": lambda r: run(r, output_type=Sum),
    }


FRAMEWORKS = {
    "openai-agents": openai_agents_cases,
    "langgraph": langgraph_cases,
    "pydantic-ai": pydantic_ai_cases,
}

if __name__ == "__main__":
    cases = FRAMEWORKS[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps([run_case(name, case) for name, case in cases.items()]))
