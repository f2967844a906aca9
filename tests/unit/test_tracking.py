"""Context tracking on the tiny tokenizer: recorded answers reused token for token, drift, authors.

The tests marked ``ON_BOTH`` also run on tiny-qwen's tokenizer (Qwen2.5's byte-level BPE and chat format)."""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ajet_hpc.engine.tiny import CHAT_TEMPLATE, build_tokenizer
from ajet_hpc.environments.guess.tasks import TOOLS as GUESS_TOOLS
from ajet_hpc.server.http_schemas import ChatMessage
from ajet_hpc.server.toolcalls import parse_hermes
from ajet_hpc.tracking import MODEL, SYSTEM, TOOL, USER, ContextTracker, DriftEvent, PromptPlan, Timeline

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


ON_BOTH = pytest.mark.parametrize("tokenizer", ["tiny", "tiny-qwen"], indirect=True)


@pytest.fixture(scope="module")
def tokenizer(request: pytest.FixtureRequest):
    """The tiny tokenizer, or tiny-qwen's for the tests parametrized with ``ON_BOTH``."""
    if getattr(request, "param", "tiny") == "tiny-qwen":
        return request.getfixturevalue("tiny_qwen_tokenizer")
    return build_tokenizer()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def sampled_text(tokenizer, reply: dict[str, Any]) -> str:
    """What a model sampled to get ``reply``: the template's rendering of the assistant turn after the
    generation prompt, stop token included (tool calls in the tokenizer's own format)."""
    question = [{"role": "user", "content": "?"}]
    prompt = tokenizer.apply_chat_template(question, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(
        [*question, {"role": "assistant", **reply}], tools=TOOLS, tokenize=False
    )
    return full[len(prompt) :].rstrip("\n")


def serve(
    tracker: ContextTracker,
    messages: list[dict[str, Any]],
    reply: dict[str, Any],
    response_ids: list[int],
    tools: list[dict[str, Any]] | None = None,
    finish_reason: str = "stop",
) -> tuple[PromptPlan, Timeline]:
    """One model call as the server makes it: plan, 'sample' ``response_ids``, record."""
    plan = tracker.build_prompt(messages, tools)
    logprobs = [-0.5] * len(response_ids)
    return plan, tracker.record(plan, response_ids, logprobs, reply, finish_reason, policy_version=3)


def author_runs(tokenizer, ids: list[int], authors: list[int]) -> list[tuple[int, str]]:
    runs: list[tuple[int, list[int]]] = []
    for token, author in zip(ids, authors, strict=True):
        if runs and runs[-1][0] == author:
            runs[-1][1].append(token)
        else:
            runs.append((author, [token]))
    return [(author, tokenizer.decode(tokens)) for author, tokens in runs]


@ON_BOTH
def test_five_calls_with_tools_reuse_every_answer_verbatim(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    turns: list[
        tuple[dict[str, Any], str | None]
    ] = [  # (reply message returned to the agent, what the agent adds next)
        ({"content": None, "tool_calls": [call("get_weather", '{"city": "Paris"}')]}, "tool:sunny"),
        ({"content": "It is sunny."}, "user:And Rome?"),
        (
            {"content": "Checking.", "tool_calls": [call("get_weather", '{"city": "Rome"}', "c2")]},
            "tool:rain",
        ),
        ({"content": "Rainy in Rome."}, "user:Thanks!"),
        ({"content": "You're welcome."}, None),
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    previous: Timeline | None = None
    responses: list[list[int]] = []
    for reply, then in turns:
        sampled = sampled_text(tokenizer, reply)
        plan, timeline = serve(
            tracker, messages, {"role": "assistant", **reply}, encode(tokenizer, sampled), TOOLS
        )
        assert plan.drift == []
        if previous is not None:  # a linear conversation: each prompt extends the previous call's tokens
            assert plan.prompt_ids[: len(previous.token_ids)] == previous.token_ids
        assert [plan.prompt_ids[start:end] for start, end in plan.reused_spans] == responses
        assert [plan.token_authors[start] for start, _ in plan.reused_spans] == [MODEL] * len(responses)
        assert sum(a == MODEL for a in plan.token_authors) == sum(len(r) for r in responses)
        assert timeline.loss_mask == [0] * len(plan.prompt_ids) + [1] * len(timeline.response_ids)
        assert timeline.token_authors == plan.token_authors + [MODEL] * len(timeline.response_ids)
        assert timeline.messages == [*messages, {"role": "assistant", **reply}]
        assert (timeline.tools, timeline.policy_version, timeline.response_logprobs[0]) == (TOOLS, 3, -0.5)
        responses.append(timeline.response_ids)
        previous = timeline
        messages = [*messages, {"role": "assistant", **reply}]
        if then:
            role, _, content = then.partition(":")
            extra = {"tool_call_id": "call_1"} if role == "tool" else {}
            messages.append({"role": role, "content": content, **extra})
    assert len(tracker.timelines) == 5 and tracker.drift_counts() == {}


@ON_BOTH
def test_first_prompt_is_the_templates_own_tokenization(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plan = ContextTracker(tokenizer).build_prompt(messages, TOOLS)
    expected = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert plan.text == expected
    assert plan.prompt_ids == encode(tokenizer, expected)
    assert (plan.reused_spans, plan.drift) == ([], [])


@ON_BOTH
def test_authors_per_token(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    serve(
        tracker, messages, {"role": "assistant", "content": "Hello!"}, encode(tokenizer, "Hello!<|im_end|>")
    )
    messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    plan = tracker.build_prompt(messages)
    assert author_runs(tokenizer, plan.prompt_ids, plan.token_authors) == [
        (SYSTEM, "<|im_start|>system\nBe brief.<|im_end|>\n"),
        (USER, "<|im_start|>user\nHi<|im_end|>\n"),
        (SYSTEM, "<|im_start|>assistant\n"),  # scaffolding of an assistant turn is context
        (MODEL, "Hello!<|im_end|>"),  # what the model sampled, stop token included
        (SYSTEM, "\n"),
        (USER, "<|im_start|>user\nBye<|im_end|>\n"),
        (SYSTEM, "<|im_start|>assistant\n"),  # the generation prompt
    ]


def test_tool_preamble_is_system_and_tool_results_are_tool(tokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "{}")]},
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    plan = ContextTracker(tokenizer).build_prompt(messages, TOOLS)
    runs = author_runs(tokenizer, plan.prompt_ids, plan.token_authors)
    assert [author for author, _ in runs] == [SYSTEM, USER, SYSTEM, TOOL, SYSTEM]
    assert runs[0][1].startswith("<|im_start|>system\n# Tools") and runs[0][1].endswith(
        "</tool_call><|im_end|>\n"
    )
    assert runs[1][1] == "<|im_start|>user\nGo<|im_end|>\n"
    assert runs[3][1] == "<|im_start|>tool\ndone<|im_end|>\n"
    assert [event.kind for event in plan.drift] == ["answer_not_found"]  # the agent wrote that tool call


@ON_BOTH
def test_answer_sampled_in_odd_tokens_is_reused_and_reported(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    reply = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city": "Paris"}')]}
    text = sampled_text(tokenizer, reply)
    assert text.startswith("<tool_call>") and text.endswith("</tool_call><|im_end|>")
    # The model spelled the tag character by character; the text re-tokenizes to the added token <tool_call>.
    odd = [tokenizer.convert_tokens_to_ids(char) for char in "<tool_call>"] + encode(tokenizer, text[11:])
    assert tokenizer.decode(odd) == text and odd != encode(tokenizer, text)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"}]
    serve(tracker, messages, reply, odd, TOOLS)
    messages += [reply, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    plan, _ = serve(
        tracker, messages, {"role": "assistant", "content": "Sunny."}, encode(tokenizer, "Sunny."), TOOLS
    )
    assert [(event.message_index, event.kind) for event in plan.drift] == [(1, "retokenized_differently")]
    ((start, end),) = plan.reused_spans
    assert plan.prompt_ids[start:end] == odd
    assert plan.prompt_ids != encode(tokenizer, plan.text) and tokenizer.decode(plan.prompt_ids) == plan.text
    assert tracker.drift_counts() == {"retokenized_differently": 1}


def test_edited_answer_is_not_found_and_used_as_context(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    messages = [{"role": "user", "content": "Hi"}]
    serve(
        tracker, messages, {"role": "assistant", "content": "Hello!"}, encode(tokenizer, "Hello!<|im_end|>")
    )
    messages += [{"role": "assistant", "content": "Hello there!"}, {"role": "user", "content": "Bye"}]
    plan = tracker.build_prompt(messages)
    assert plan.drift == [DriftEvent(1, "answer_not_found", plan.drift[0].detail)]
    assert plan.reused_spans == [] and MODEL not in plan.token_authors
    assert plan.prompt_ids == encode(tokenizer, plan.text)


def test_same_reply_in_two_branches_reuses_each_branchs_own_tokens(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><|im_end|>'
    canonical = encode(tokenizer, text)
    odd = [tokenizer.convert_tokens_to_ids(char) for char in "<tool_call>"] + canonical[1:]
    reply = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{}")]}
    branches = {"first": odd, "second": canonical}
    for question, ids in branches.items():
        serve(tracker, [{"role": "user", "content": question}], reply, ids, TOOLS)
    for question, ids in branches.items():
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": question},
            reply,
            {"role": "tool", "content": "ok"},
        ]
        plan = tracker.build_prompt(messages, TOOLS)
        ((start, end),) = plan.reused_spans
        assert plan.prompt_ids[start:end] == ids


def test_reserialized_arguments_match_but_template_text_differs(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    sampled = '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris"}}</tool_call><|im_end|>'
    reply = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", '{"city":"Paris"}')]}
    serve(tracker, [{"role": "user", "content": "Go"}], reply, encode(tokenizer, sampled), TOOLS)
    sent_back = {**reply, "tool_calls": [call("get_weather", json.dumps({"city": "Paris"}))]}
    plan = tracker.build_prompt(
        [{"role": "user", "content": "Go"}, sent_back, {"role": "tool", "content": "x"}], TOOLS
    )
    assert [(event.message_index, event.kind) for event in plan.drift] == [(1, "template_dropped_content")]
    assert plan.reused_spans == [] and plan.prompt_ids == encode(tokenizer, plan.text)

    keeping = ContextTracker(tokenizer, keep_history=True)  # the sampled call text goes back whole
    _, first = serve(keeping, [{"role": "user", "content": "Go"}], reply, encode(tokenizer, sampled), TOOLS)
    kept = keeping.build_prompt(
        [{"role": "user", "content": "Go"}, sent_back, {"role": "tool", "content": "x"}], TOOLS
    )
    assert [(event.message_index, event.kind) for event in kept.drift] == [(1, "history_kept")]
    assert kept.prompt_ids[: len(first.token_ids)] == first.token_ids


def test_truncated_answer_and_other_stop_token_are_reused(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    truncated = encode(tokenizer, "It is su")  # finish_reason length: no stop token; the template closes it
    eot = [*encode(tokenizer, "Bye."), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    serve(
        tracker,
        [{"role": "user", "content": "a"}],
        {"role": "assistant", "content": "It is su"},
        truncated,
        finish_reason="length",
    )
    serve(tracker, [{"role": "user", "content": "b"}], {"role": "assistant", "content": "Bye."}, eot)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "It is su"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "Bye."},
        {"role": "user", "content": "c"},
    ]
    plan = tracker.build_prompt(messages)
    assert plan.drift == []
    assert [plan.prompt_ids[start:end] for start, end in plan.reused_spans] == [truncated, eot[:-1]]
    assert plan.prompt_ids == encode(tokenizer, plan.text)  # the template's own <|im_end|> closes both

    keeping = ContextTracker(tokenizer, keep_history=True)  # the answer keeps its own stop token
    serve(keeping, [{"role": "user", "content": "b"}], {"role": "assistant", "content": "Bye."}, eot)
    kept = keeping.build_prompt(messages[2:])
    assert [(event.message_index, event.kind) for event in kept.drift] == [(1, "history_kept")]
    start, end = kept.reused_spans[0]
    assert kept.prompt_ids[start:end] == eot
    assert kept.prompt_ids[end:] == encode(
        tokenizer, "\n<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_that_rewrites_earlier_turns_is_reported(tokenizer) -> None:
    # Like reasoning templates: answers before the last user turn lose their <think> part.
    stripping = build_tokenizer()  # the tiny tokenizer with another template
    stripping.chat_template = (
        "{% set ns = namespace(last=0) %}"
        "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last = loop.index0 %}{% endif %}"
        "{% endfor %}"
        + CHAT_TEMPLATE.replace(
            "{{ message.content or '' }}{% for call",
            "{% if loop.index0 < ns.last %}{{ (message.content or '').split('</think>')[-1] }}"
            "{% else %}{{ message.content or '' }}{% endif %}{% for call",
        )
    )
    tracker = ContextTracker(stripping)
    answer = "<think>hmm</think>Hi!"
    serve(
        tracker,
        [{"role": "user", "content": "a"}],
        {"role": "assistant", "content": answer},
        encode(stripping, answer + "<|im_end|>"),
    )
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": answer}]
    plan = tracker.build_prompt([*messages, {"role": "user", "content": "b"}])
    assert {(event.message_index, event.kind) for event in plan.drift} == {
        (1, "template_not_incremental"),
        (1, "template_dropped_content"),
    }
    assert plan.prompt_ids == encode(stripping, plan.text) and "hmm" not in plan.text
    assert tracker.build_prompt(messages).drift == []  # after the last user turn the answer is kept

    # keep_history: the recorded answer, reasoning included, goes into the prompt whole, and the first
    # call (prompt + answer) is then a token prefix of the second: the two merge
    keeping = ContextTracker(stripping, keep_history=True)
    _, first = serve(
        keeping,
        [{"role": "user", "content": "a"}],
        {"role": "assistant", "content": answer},
        encode(stripping, answer + "<|im_end|>"),
    )
    kept = keeping.build_prompt([*messages, {"role": "user", "content": "b"}])
    assert {(event.message_index, event.kind) for event in kept.drift} == {
        (1, "template_not_incremental"),
        (1, "history_kept"),
    }
    assert kept.prompt_ids[: len(first.token_ids)] == first.token_ids
    start, end = kept.reused_spans[0]
    assert kept.prompt_ids[start:end] == first.response_ids
    assert all(kept.token_authors[p] == MODEL for p in range(start, end))


def test_timeline_round_trips_through_json(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call><|im_end|>'
    odd = [tokenizer.convert_tokens_to_ids(char) for char in "<tool_call>"] + encode(tokenizer, text)[1:]
    reply = {"role": "assistant", "content": None, "tool_calls": [call("get_weather", "{}")]}
    serve(tracker, [{"role": "user", "content": "Go"}], reply, odd, TOOLS)
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Go"},
        reply,
        {"role": "tool", "content": "x"},
    ]
    _, timeline = serve(
        tracker, messages, {"role": "assistant", "content": "ok"}, encode(tokenizer, "ok"), TOOLS
    )
    assert timeline.drift and timeline.reused_spans
    data = json.loads(json.dumps(timeline.to_dict()))
    assert Timeline.from_dict(data) == timeline
    assert timeline.token_ids == timeline.prompt_ids + timeline.response_ids


def test_timeline_checks_its_lengths() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Timeline([1], [2, 3], [0.0], [0, 3, 3], [0, 1, 1], [], None, 0, "stop")
    with pytest.raises(ValueError, match="loss_mask"):
        Timeline([1], [2], [0.0], [0, 3], [1], [], None, 0, "stop")


def test_record_rejects_logprobs_of_another_length(tokenizer) -> None:
    tracker = ContextTracker(tokenizer)
    plan = tracker.build_prompt([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="logprobs"):
        tracker.record(plan, [5, 6], [0.0], {"role": "assistant", "content": "x"}, "stop", 0)
    assert tracker.timelines == []


def test_the_plan_owns_a_deep_copy_of_the_request_whatever_it_holds(tokenizer) -> None:
    from ajet_hpc.tracking.context import owned_copy

    shared = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": shared}]},
        {"role": "tool", "content": "sunny", "extra": (1, 2.5, True, {"deep": [shared]})},
    ]
    copied = owned_copy(messages)
    assert copied == messages and copied is not messages
    assert copied[1]["tool_calls"][0]["function"] is not shared
    # shared parts stay shared with each other, as with copy.deepcopy
    assert copied[2]["extra"][3]["deep"][0] is copied[1]["tool_calls"][0]["function"]
    unpicklable = [{"role": "user", "content": "hi", "hook": lambda: None}]
    fallback = owned_copy(unpicklable)  # a lambda does not pickle: deep-copied instead
    assert fallback[0] is not unpicklable[0] and fallback[0]["content"] == "hi"

    tracker = ContextTracker(tokenizer)
    plan = tracker.build_prompt(messages, TOOLS)
    messages[0]["content"] = "changed by the caller afterwards"
    assert plan.messages[0]["content"] == "Weather?"
    assert plan.tools == TOOLS and plan.tools is not TOOLS and plan.tools[0] is not TOOLS[0]


def test_an_answer_of_special_tokens_is_not_found_in_the_assistant_header(tokenizer) -> None:
    """The model sampled ``<|im_start|><|im_end|>`` (its reply's text is empty). Without its stop token the
    answer's text is the header's own first marker; it was once "found" there, the answer's ids were not
    spliced and nothing was reported, so the call was no prefix of the next and its episode trained as two
    samples (test_quickstart.py's guessing game: 17 samples for 16 episodes, once)."""
    special = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_start|>", "<|im_end|>")]
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]
    then = [*messages, {"role": "user", "content": "b"}]

    plain = ContextTracker(tokenizer)
    serve(plain, messages[:1], messages[1], special)
    plan = plain.build_prompt(then)
    assert [(event.message_index, event.kind) for event in plan.drift] == [(1, "template_dropped_content")]
    assert plan.reused_spans == [] and plan.prompt_ids == encode(tokenizer, plan.text)

    keeping = ContextTracker(tokenizer, keep_history=True)
    _, first = serve(keeping, messages[:1], messages[1], special)
    kept = keeping.build_prompt(then)
    assert [(event.message_index, event.kind) for event in kept.drift] == [(1, "history_kept")]
    assert kept.prompt_ids[: len(first.token_ids)] == first.token_ids


@functools.cache
def _sampled(tokenizer) -> st.SearchStrategy[list[int]]:
    """What a model may sample: any token (special ones, tool-call tags and a well-formed call often), up to
    24 of them (the guessing game's max_tokens), ending on a stop token or cut at the length."""
    stops = [tokenizer.convert_tokens_to_ids(token) for token in ("<|im_end|>", "<|endoftext|>")]
    pieces = ["<tool_call>", '{"name": "guess", "arguments": {"n": 3}}', "</tool_call>", "5", " ", "\n"]
    others = sorted(set(tokenizer.get_vocab().values()) - set(stops))
    token = st.one_of(
        st.sampled_from(others).map(lambda t: [t]),
        st.sampled_from([*tokenizer.all_special_ids, *(encode(tokenizer, piece) for piece in pieces)]).map(
            lambda t: t if isinstance(t, list) else [t]
        ),
    )
    body = st.lists(token, max_size=12).map(lambda parts: [t for p in parts for t in p if t not in stops])
    return st.tuples(body, st.sampled_from([None, *stops])).map(
        lambda drawn: drawn[0][:24] if drawn[1] is None else [*drawn[0][:23], drawn[1]]
    )


@ON_BOTH
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_with_keep_history_every_call_extends_the_last_whatever_was_sampled(tokenizer, data) -> None:
    """keep_history's promise, over whatever a model samples in a guessing-game episode (the answers parsed
    and sent back as the server and the agent do): each call's prompt and answer are a token prefix of the
    next call's prompt, so linear merging makes one sample of the episode."""
    tracker = ContextTracker(tokenizer, keep_history=True)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Guess my digit (0-9)."}]
    timelines = []
    for _ in range(4):
        answer = data.draw(_sampled(tokenizer))
        parsed = parse_hermes(tokenizer.decode(answer, skip_special_tokens=True))
        reply: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            reply["tool_calls"] = [tool_call.model_dump() for tool_call in parsed.tool_calls]
        sent = [ChatMessage.model_validate(message).for_template() for message in messages]
        finish = "stop" if answer and answer[-1] in tokenizer.all_special_ids else "length"
        timelines.append(serve(tracker, sent, reply, answer, GUESS_TOOLS, finish)[1])
        messages.append({key: value for key, value in reply.items() if value is not None})
        if parsed.tool_calls:
            messages.append({"role": "tool", "content": "higher", "tool_call_id": parsed.tool_calls[0].id})
        else:
            messages.append({"role": "user", "content": "Answer with one digit."})
    for earlier, later in itertools.pairwise(timelines):
        assert later.prompt_ids[: len(earlier.token_ids)] == earlier.token_ids, tokenizer.decode(
            earlier.response_ids
        )
