"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: the request becomes a chat request,
is answered and recorded exactly as a chat call is, and the answer goes back as a Response.

Frameworks that call it by default (the OpenAI Agents SDK) therefore train like any other agent. What it
does not do, it refuses with a 400 naming the field (``request_policy``): server-side state
(``previous_response_id``, ``conversation``: send the whole conversation in ``input``, which is what the
Agents SDK does), built-in tools (web search, file search...), reasoning items and settings, structured
``text.format``. A streamed response is generated whole, then sent as the event sequence a client expects
(``response.created`` ... ``response.completed``), its text in one delta.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ajet_hpc.server import http_schemas as p
from ajet_hpc.server.errors import BadRequest
from ajet_hpc.server.request_policy import NO_EFFECT

REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation in input",
    "conversation": "conversations are not stored: send the whole conversation in input",
    "prompt": "stored prompts are not supported: send instructions and input",
    "background": "background responses are not supported",
    "reasoning": "the served model has no reasoning settings",
    "context_management": "context management is not supported",
    "top_logprobs": "only the sampled token's logprob is recorded",
    "max_tool_calls": "the number of tool calls is the model's to decide",
}
_MESSAGE_ROLES = ("system", "developer", "user", "assistant")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["disabled", "auto"] | None = None


def to_chat(request: ResponsesRequest) -> p.ChatCompletionRequest:
    """The chat request that answers ``request``, or a 400 naming what cannot be honoured."""
    _check_fields(request)
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = [{"role": "user", "content": request.input}] if isinstance(request.input, str) else request.input
    for index, item in enumerate(items):
        _add_item(messages, item, f"input[{index}]")
    tools = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(request.tools or ())]
    chat: dict[str, Any] = {"model": request.model, "messages": messages, "tools": tools or None}
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_tokens", "max_output_tokens"),
    ):
        value = getattr(request, theirs)
        if value is not None:
            chat[ours] = value
    return p.ChatCompletionRequest.model_validate(chat)


def _check_fields(request: ResponsesRequest) -> None:
    for field, value in (request.model_extra or {}).items():
        if field in NO_EFFECT or value is None:
            continue
        why = REFUSED.get(field, "this server does not know this field")
        raise BadRequest(f"unsupported field {field}: {why}", param=field, code="unsupported_field")
    if request.tool_choice not in (None, "auto"):
        raise _unsupported("tool_choice", "the model decides whether to call a tool; only 'auto' is honoured")
    if request.parallel_tool_calls is False:
        raise _unsupported("parallel_tool_calls", "every tool call the model writes is returned")
    if request.truncation == "auto":
        raise _unsupported("truncation", "prompts are never truncated; only 'disabled' is honoured")
    for name in request.include or ():
        raise _unsupported("include", f"{name!r} is not produced by this server")
    text = dict(request.text or {})
    text_format = text.pop("format", None)
    if text_format not in (None, {"type": "text"}):
        raise _unsupported("text.format", "the engine samples without constrained decoding")
    for key, value in text.items():
        if value is not None:
            raise _unsupported(f"text.{key}", "the served model has no such setting")


def _unsupported(field: str, why: str) -> BadRequest:
    return BadRequest(f"unsupported field {field}: {why}", param=field, code="unsupported_field")


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") in _MESSAGE_ROLES:
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
        call["function"]["arguments"] = item.get("arguments", "")
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # calls of one turn join its message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text(output, f"{where}.output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
    else:
        shown = kind if kind != "message" else f"message with role {item.get('role')!r}"
        raise BadRequest(
            f"{where}: unsupported input item {shown}", param=f"{where}.type", code="unsupported_field"
        )


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content: expected text or a list of text parts", param=f"{where}.content")
    parts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(
                f"{where}.content[{index}]: unsupported content part {kind!r} (text only)",
                param=f"{where}.content[{index}].type",
                code="unsupported_field",
            )
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise BadRequest(
            f"{where}: unsupported tool type {tool.get('type')!r} (function tools only)",
            param=f"{where}.type",
            code="unsupported_field",
        )
    unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
    if unknown:
        raise BadRequest(f"{where}.{unknown[0]}: unsupported field of a tool", param=f"{where}.{unknown[0]}")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def to_response(request: ResponsesRequest, answer: p.ChatCompletionResponse) -> dict[str, Any]:
    """The Response object of a chat answer (one choice)."""
    choice = answer.choices[0]
    output: list[dict[str, Any]] = []
    if choice.message.content:
        text = {"type": "output_text", "text": choice.message.content, "annotations": [], "logprobs": []}
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        )
    for call in choice.message.tool_calls or ():
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex[:24]}",
                "call_id": call.id,
                "name": call.function.name,
                "arguments": call.function.arguments,
                "status": "completed",
            }
        )
    incomplete = choice.finish_reason == "length"
    usage = answer.usage
    return {
        "id": f"resp_{uuid.uuid4().hex[:24]}",
        "object": "response",
        "created_at": float(answer.created),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": answer.model,
        "instructions": request.instructions,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": request.tools or [],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": (request.model_extra or {}).get("metadata") or {},
        "usage": {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens,
        },
        "policy_version": answer.policy_version,
    }


def stream_events(response: dict[str, Any]) -> Iterator[str]:
    """A finished Response as the server-sent events of a streamed one."""
    sequence = iter(range(1_000_000))

    def event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, "sequence_number": next(sequence), **fields})
        return f"event: {kind}\ndata: {data}\n\n"

    started = {**response, "status": "in_progress", "output": [], "usage": None}
    yield event("response.created", response=started)
    yield event("response.in_progress", response=started)
    for index, item in enumerate(response["output"]):
        if item["type"] == "message":
            yield event("response.output_item.added", output_index=index, item={**item, "content": []})
            part = item["content"][0]
            ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
            yield event("response.content_part.added", **ids, part={**part, "text": ""})
            yield event("response.output_text.delta", **ids, delta=part["text"], logprobs=[])
            yield event("response.output_text.done", **ids, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **ids, part=part)
        else:
            yield event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
            ids = {"item_id": item["id"], "output_index": index}
            yield event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **ids, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    yield event(done, response=response)
