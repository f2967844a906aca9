"""Tools over MCP for agents: the tool list of an MCP server as the ``tools`` of a chat call, tool calls
executed through MCP and their results fed back, until the model answers.

An ``McpToolbox`` holds one MCP connection per client process, shared by every episode that runs in it:
a command (``["python", "-m", "my_server"]``), started beside the task on stdio, or the URL of a running
server (streamable HTTP). The connection lives in a thread of its own with its event loop (the ``mcp``
client is asynchronous, agents are plain functions in runner threads); the stdio server ends with the
client process (it reads EOF when its parent dies).

The built-in example (``solve``) talks to ``calculator.mcp_server``: tasks of ``builtin:tools`` ask for a
sum, a product or a stored value, and name the tools the model is offered.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ajet_hpc.environments.calculator.tools import SYSTEM, reward
from ajet_hpc.environments.episode import EpisodeContext, Outcome

MAX_TURNS = 4
MAX_TOKENS = 48
CONNECT_TIMEOUT_S = 60.0
CALL_TIMEOUT_S = 30.0


class McpToolError(RuntimeError):
    """The MCP server could not be reached or answered a call with a protocol error."""


class McpToolbox:
    """One MCP server's tools, for any number of agent threads."""

    def __init__(self, server: str | Sequence[str], env: dict[str, str] | None = None) -> None:
        if isinstance(server, str) and not server.startswith(("http://", "https://")):
            raise ValueError(f"MCP server {server!r}: give a command as a list, or an http(s) URL")
        self.server = server if isinstance(server, str) else list(server)
        self.env = env
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: Any = None
        self._closing: asyncio.Event | None = None
        self._held: Future[None] | None = None
        self._tools: list[dict[str, Any]] | None = None

    def openai_tools(self, names: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The server's tools as OpenAI function tools (those in ``names``, in that order, when given)."""
        tools = self._ensure_tools()
        if names is None:
            return tools
        by_name = {tool["function"]["name"]: tool for tool in tools}
        missing = [name for name in names if name not in by_name]
        if missing:
            raise McpToolError(f"MCP server {self.server} has no tool {missing} (it has {sorted(by_name)})")
        return [by_name[name] for name in names]

    def call(self, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one tool; (its text for the model, whether the server called it an error)."""
        result = self._run(self._client.call_tool(name, arguments), CALL_TIMEOUT_S)
        text = "\n".join(
            getattr(part, "text", "") or json.dumps(part.model_dump()) for part in result.content
        )
        return text, bool(result.is_error)

    def close(self) -> None:
        with self._lock:
            if self._loop is not None and self._closing is not None:
                self._loop.call_soon_threadsafe(self._closing.set)
                if self._held is not None:
                    self._held.result(timeout=10)
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = self._client = self._held = None

    def _ensure_tools(self) -> list[dict[str, Any]]:
        if self._tools is None:
            listed = self._run(self._client_ready().list_tools(), CALL_TIMEOUT_S)
            self._tools = [openai_tool(tool) for tool in listed.tools]
        return self._tools

    def _client_ready(self) -> Any:
        with self._lock:
            if self._client is None:
                self._connect()
            return self._client

    def _connect(self) -> None:
        from mcp import Client, StdioServerParameters

        if isinstance(self.server, str):
            target: Any = self.server
        else:
            target = StdioServerParameters(command=self.server[0], args=self.server[1:], env=self.env)
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="mcp-toolbox", daemon=True).start()
        ready: Future[Any] = Future()

        async def hold() -> None:
            self._closing = asyncio.Event()
            try:
                async with Client(target) as client:
                    ready.set_result(client)
                    await self._closing.wait()
            except BaseException as exc:
                if not ready.done():
                    ready.set_exception(exc)
                raise

        self._loop = loop
        self._held = asyncio.run_coroutine_threadsafe(hold(), loop)
        try:
            self._client = ready.result(timeout=CONNECT_TIMEOUT_S)
        except Exception as exc:
            self._loop = None
            loop.call_soon_threadsafe(loop.stop)
            raise McpToolError(f"cannot connect to MCP server {self.server}: {exc!r}") from exc
        atexit.register(self.close)

    def _run(self, coroutine: Any, timeout_s: float) -> Any:
        if self._loop is None:
            raise McpToolError(f"MCP server {self.server} is not connected")
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=timeout_s)
        except Exception as exc:
            raise McpToolError(f"MCP server {self.server}: {exc!r}") from exc


def openai_tool(tool: Any) -> dict[str, Any]:
    """An MCP tool as an OpenAI function tool. The titles pydantic puts in generated schemas (``"title":
    "A"`` for a parameter ``a``) are dropped: they repeat the names and cost prompt tokens."""
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description or "",
            "parameters": _without_titles(tool.input_schema),
        },
    }


def _without_titles(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_without_titles(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "title":
            continue
        if key in _NAMED and isinstance(value, dict):  # names of parameters, even one called "title"
            out[key] = {name: _without_titles(sub) for name, sub in value.items()}
        else:
            out[key] = _without_titles(value)
    return out


_NAMED = ("properties", "patternProperties", "$defs", "definitions")


@dataclass
class ToolLoop:
    """What a tool-using conversation did: the final answer and every tool call, in order."""

    answer: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0


def run_tool_loop(
    ctx: EpisodeContext,
    toolbox: McpToolbox,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    max_turns: int = MAX_TURNS,
    max_tokens: int = MAX_TOKENS,
) -> ToolLoop:
    """Chat with the episode's model, executing its tool calls through ``toolbox``, until it answers
    without a tool call or ``max_turns`` model calls were made."""
    client = ctx.model.client()
    loop = ToolLoop()
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model=ctx.model.name, messages=messages, tools=tools, max_tokens=max_tokens, temperature=1.0
        )
        loop.turns += 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            loop.answer = message.content or ""
            break
        for call in message.tool_calls:
            text, is_error = _call(toolbox, call.function.name, call.function.arguments)
            loop.calls.append(
                {"tool": call.function.name, "arguments": call.function.arguments, "result": text}
            )
            if is_error:
                loop.calls[-1]["error"] = True
            messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
    return loop


def _call(toolbox: McpToolbox, name: str, arguments: str) -> tuple[str, bool]:
    """A model's tool call: arguments that are no JSON object go back to the model as an error."""
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        return f"error: the arguments are not JSON ({exc.msg})", True
    if not isinstance(parsed, dict):
        return "error: the arguments must be a JSON object", True
    return toolbox.call(name, parsed)


CALCULATOR = McpToolbox([sys.executable, "-m", "ajet_hpc.environments.calculator.mcp_server"])


def solve(ctx: EpisodeContext) -> Outcome:
    """The built-in example: the task's question with the tools it names, reward 1 when the final answer
    contains the expected number."""
    data = ctx.task.data
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": data["question"]}]
    loop = run_tool_loop(ctx, CALCULATOR, messages, CALCULATOR.openai_tools(data.get("tools")))
    metadata = {"answer": loop.answer, "tool_calls": loop.calls, "turns": loop.turns}
    return Outcome(reward=reward(loop.answer, data), metadata=metadata)
