"""Which request fields a model call may carry, and the 400 that names any other.

A training server must not answer a request it did not honour as asked: a silently dropped
``response_format`` or ``tool_choice`` gives the agent an answer of another kind than it asked for, and
the policy is then trained on it. So every field is one of:

- **honoured** (sampling, tools, streaming and its usage, stop, seed, n, logprobs...);
- **accepted with no effect on the answer** (``NO_EFFECT``): what OpenAI uses for billing, storage or
  routing, and ``strict`` on function tools (recorded as sent; decoding is not constrained, so the
  policy learns the schema from its reward: docs/environments.md says so);
- **refused** with a 400 whose ``param`` names the field: values the engine cannot honour (a
  ``response_format`` other than text, ``tool_choice`` other than auto, ``parallel_tool_calls: false``,
  penalties, ``logit_bias``, ``top_logprobs``, audio...) and every field this server does not know.
"""

from __future__ import annotations

from typing import Any

from ajet_hpc.server.errors import BadRequest

NO_EFFECT = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)
"""Fields OpenAI uses outside sampling (billing, logging, caching): accepted, nothing to honour."""

WHY_NOT = {
    "response_format": "the engine samples without constrained decoding: ask for the format in the prompt "
    "and reward it",
    "tool_choice": "the model decides whether to call a tool; only 'auto' (or none given) is honoured",
    "parallel_tool_calls": "every tool call the model writes is returned; only true (or none given) is "
    "honoured",
    "frequency_penalty": "sampling penalties would sample from another distribution than the one trained",
    "presence_penalty": "sampling penalties would sample from another distribution than the one trained",
    "logit_bias": "a logit bias would sample from another distribution than the one trained",
    "top_logprobs": "only the sampled token's logprob is returned (logprobs: true)",
    "modalities": "text is the only modality",
    "audio": "text is the only modality",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "there is no built-in web search",
    "reasoning_effort": "the served model has no reasoning-effort setting",
    "verbosity": "the served model has no verbosity setting",
    "functions": "the deprecated functions field is not supported: use tools",
    "function_call": "the deprecated function_call field is not supported: use tools and tool_choice",
}


def _refuse(field: str, value: Any, why: str | None = None) -> BadRequest:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    reason = why or WHY_NOT.get(field) or "this server does not know this field"
    return BadRequest(f"unsupported field {field} = {shown}: {reason}", param=field, code="unsupported_field")


_EMPTY: tuple[Any, ...] = (None, 0, 0.0, False, "", [], {})
_HARMLESS = {  # a field -> the values of it that ask for nothing this server does not do
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "parallel_tool_calls": lambda v: v in (None, True),
    "modalities": lambda v: v in (None, ["text"]),
}
_ECHOED = ("refusal", "annotations", "audio", "reasoning_content")  # reply fields clients send back, empty


def check_chat_fields(body: Any) -> None:
    """Raise a 400 naming the first field of a chat request (``http_schemas.ChatCompletionRequest``)
    this server would not honour."""
    declared = {
        "frequency_penalty": body.frequency_penalty,
        "presence_penalty": body.presence_penalty,
        "top_logprobs": body.top_logprobs,
    }
    for field, value in declared.items():
        if value not in _EMPTY:
            raise _refuse(field, value)
    if body.tool_choice not in (None, "auto"):
        raise _refuse("tool_choice", body.tool_choice)
    for field, value in (body.model_extra or {}).items():
        check = _HARMLESS.get(field)
        harmless = check(value) if check else field in WHY_NOT and value in _EMPTY
        if field not in NO_EFFECT and not harmless:
            raise _refuse(field, value)
    for index, tool in enumerate(body.tools or ()):
        unknown = sorted(set(tool.model_extra or ()) | (set(tool.function.model_extra or ()) - {"strict"}))
        if unknown:
            raise _refuse(
                f"tools[{index}].{unknown[0]}", "...", "this server does not know this field of a tool"
            )
    for index, message in enumerate(body.messages):
        for key, value in (message.model_extra or {}).items():
            if not (key in _ECHOED and value in _EMPTY):
                raise _refuse(
                    f"messages[{index}].{key}", value, "this server does not know this field of a message"
                )
