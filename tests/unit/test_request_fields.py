"""Which request fields a model call may carry (server/request_policy.py) and how the Responses API maps
onto chat (server/responses_api.py). The requests the real frameworks send are checked end to end in
tests/component/test_environments.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ajet_hpc.server import http_schemas as p
from ajet_hpc.server.errors import BadRequest
from ajet_hpc.server.request_policy import check_chat_fields
from ajet_hpc.server.responses_api import ResponsesRequest, stream_events, to_chat, to_response

USER = [{"role": "user", "content": "hi"}]
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}, "strict": True}}


def chat(**fields: Any) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "policy", "messages": USER, **fields})


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"tools": [ADD], "tool_choice": "auto", "parallel_tool_calls": True},
        {"response_format": {"type": "text"}, "frequency_penalty": 0, "logit_bias": {}},
        {
            "user": "u1",
            "metadata": {"a": "b"},
            "store": False,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"messages": [*USER, {"role": "assistant", "content": "x", "refusal": None, "annotations": []}]},
    ],
)
def test_fields_the_server_honours_or_that_change_nothing_pass(fields: dict[str, Any]) -> None:
    check_chat_fields(chat(**fields))


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "none"}, "tool_choice"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"top_logprobs": 3, "logprobs": True}, "top_logprobs"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"top_k": 5}, "top_k"),  # vLLM's extension: not this server's
        ({"tools": [{**ADD, "cache_control": {}}]}, "tools[0].cache_control"),
        (
            {"messages": [{"role": "user", "content": "x", "cache_control": {"type": "ephemeral"}}]},
            "messages[0].cache_control",
        ),
    ],
)
def test_every_field_it_would_not_honour_is_a_400_that_names_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(BadRequest) as refused:
        check_chat_fields(chat(**fields))
    assert refused.value.param == param and param.split("[")[0].split(".")[0] in refused.value.message


def responses(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "policy", **fields})


def test_a_responses_conversation_becomes_the_same_chat() -> None:
    request = responses(
        instructions="be brief",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Let me add."}],
            },
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
            {"type": "function_call_output", "call_id": "c1", "output": "5"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "0"}],
            },
        ],
        tools=[{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
        max_output_tokens=7,
        temperature=0.5,
    )
    body = to_chat(request)
    messages = [m.for_template() for m in body.messages]
    assert messages[:2] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]
    assert messages[2]["content"] == "Let me add." and [c["id"] for c in messages[2]["tool_calls"]] == [
        "c1",
        "c2",
    ]
    assert messages[3:] == [
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
        {"role": "tool", "content": "0", "tool_call_id": "c2"},
    ]
    assert body.max_tokens == 7 and body.temperature == 0.5 and body.tools is not None
    assert body.tools[0].function.name == "add"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ],
)
def test_what_the_responses_api_cannot_honour_is_a_400_that_names_it(
    fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as refused:
        to_chat(responses(**{"input": "hi", **fields}))
    assert refused.value.param == param


def answer(content: str | None, calls: list[p.ToolCall], finish: str) -> p.ChatCompletionResponse:
    message = p.ResponseMessage(content=content, tool_calls=calls or None)
    return p.ChatCompletionResponse(
        model="policy",
        choices=[p.ChatChoice(index=0, message=message, finish_reason=finish)],  # type: ignore[arg-type]
        usage=p.Usage(prompt_tokens=5, completion_tokens=3, total_tokens=8),
        policy_version=4,
    )


def test_the_answer_goes_back_as_a_response_and_as_its_stream_of_events() -> None:
    call = p.ToolCall(id="call_1", function=p.FunctionCall(name="add", arguments='{"a": 1}'))
    response = to_response(responses(input="hi"), answer("Adding.", [call], "tool_calls"))
    assert response["status"] == "completed" and response["usage"]["input_tokens"] == 5
    assert [item["type"] for item in response["output"]] == ["message", "function_call"]
    assert response["output"][1] | {"id": "x"} == {
        "type": "function_call",
        "id": "x",
        "call_id": "call_1",
        "name": "add",
        "arguments": '{"a": 1}',
        "status": "completed",
    }
    events = [json.loads(block.split("data: ", 1)[1]) for block in stream_events(response)]
    assert events[0]["type"] == "response.created" and events[-1] == {
        "type": "response.completed",
        "sequence_number": len(events) - 1,
        "response": response,
    }
    texts = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert texts == ["Adding."]
    cut = to_response(responses(input="hi"), answer("Add", [], "length"))
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
