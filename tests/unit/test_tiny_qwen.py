"""The built-in ``builtin:tiny-qwen``: Qwen2.5's vocabulary token for token, its chat format, the tied Qwen2
network, and why it exists (decoded answers re-tokenize to other ids)."""

from __future__ import annotations

import json

import pytest

from ajet_hpc.config import ServerConfig
from ajet_hpc.engine import tiny_qwen
from ajet_hpc.server.toolcalls import parse_hermes
from ajet_hpc.tracking import MODEL, ContextTracker

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

MIXED_TEXT = (
    "Hello world! It's 2024; we'll see.\n"
    "你好，世界。今天天气很好。\n"
    "def add(a: int, b: int) -> int:\n    return a + b  # two spaces\n\n"
    "<|im_start|>user\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 2}}\n</tool_call><|im_end|><|endoftext|>'
    "  trailing\t\ttabs 12345 café ✓"
)


def call(name: str, arguments: str | dict) -> dict:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen_tokenizer):
    return tiny_qwen_tokenizer


def test_encodes_token_for_token_like_tiktoken(tokenizer) -> None:
    reference = tiny_qwen.tiktoken_encoding()
    ids = tokenizer.encode(MIXED_TEXT, add_special_tokens=False)
    assert ids == reference.encode(MIXED_TEXT, allowed_special="all")
    assert tokenizer.decode(ids) == MIXED_TEXT
    assert tokenizer.encode("Hello world") == [9707, 1879]
    assert len(tokenizer) == 151665 == reference.n_vocab


def test_control_tokens_have_qwen25_ids_and_tool_tags_survive_decoding(tokenizer) -> None:
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ("<|endoftext|>", "<|im_end|>")}
    ids |= {token: tokenizer.convert_tokens_to_ids(token) for token in ("<tool_call>", "<|file_sep|>")}
    assert ids == {
        "<|endoftext|>": 151643,
        "<|im_end|>": 151645,
        "<tool_call>": 151657,
        "<|file_sep|>": 151664,
    }
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token) == (
        "<|im_end|>",
        "<|endoftext|>",
        None,
    )
    answer = tokenizer.encode('<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>')
    assert answer[0] == 151657 and answer[-2:] == [151658, 151645]  # whole tokens
    assert tokenizer.decode(answer, skip_special_tokens=True) == '<tool_call>\n{"name": "f"}\n</tool_call>'


def test_chat_template_renders_a_tools_conversation_as_qwen25_does(tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 2+3 and 4+4?"},
        {  # arguments as OpenAI sends them (a JSON string) and as Hugging Face examples do (a mapping)
            "role": "assistant",
            "content": "Adding both.",
            "tool_calls": [call("add", '{"a": 2, "b": 3}'), call("add", {"a": 4, "b": 4})],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "8"},
        {"role": "assistant", "content": "5 and 8."},
        {"role": "user", "content": "Thanks!"},
    ]
    expected = "\n".join(
        [
            "<|im_start|>system",
            "You are a calculator.",
            "",
            "# Tools",
            "",
            "You may call one or more functions to assist with the user query.",
            "",
            "You are provided with function signatures within <tools></tools> XML tags:",
            "<tools>",
            '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}',
            "</tools>",
            "",
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:",
            "<tool_call>",
            '{"name": <function-name>, "arguments": <args-json-object>}',
            "</tool_call><|im_end|>",
            "<|im_start|>user",
            "What is 2+3 and 4+4?<|im_end|>",
            "<|im_start|>assistant",
            "Adding both.",
            "<tool_call>",
            '{"name": "add", "arguments": {"a": 2, "b": 3}}',
            "</tool_call>",
            "<tool_call>",
            '{"name": "add", "arguments": {"a": 4, "b": 4}}',
            "</tool_call><|im_end|>",
            "<|im_start|>user",
            "<tool_response>",
            "5",
            "</tool_response>",
            "<tool_response>",
            "8",
            "</tool_response><|im_end|>",
            "<|im_start|>assistant",
            "5 and 8.<|im_end|>",
            "<|im_start|>user",
            "Thanks!<|im_end|>",
            "<|im_start|>assistant",
            "",
        ]
    )
    rendered = tokenizer.apply_chat_template(
        messages, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert rendered == expected


def test_chat_template_default_system_prompt(tokenizer) -> None:
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tools=TOOLS, tokenize=False
    )
    assert with_tools.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a")
    assert "\n\n# Tools\n\n" in with_tools


@pytest.mark.parametrize("content", ["", "Let me add."])
def test_servers_parser_reads_back_a_rendered_tool_call(tokenizer, content: str) -> None:
    """What the template writes for an assistant turn is what the model samples after the generation
    prompt; the server's hermes parser must give the same message back."""
    question = [{"role": "user", "content": "2+3?"}]
    reply = {"role": "assistant", "content": content, "tool_calls": [call("add", '{"a": 2, "b": 3}')]}
    prompt = tokenizer.apply_chat_template(question, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*question, reply], tools=TOOLS, tokenize=False)
    sampled = full[len(prompt) :].removesuffix("<|im_end|>\n")
    parsed = parse_hermes(sampled)
    assert parsed.content == (content or None)
    ((tool_call,),) = [parsed.tool_calls]
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("add", {"a": 2, "b": 3})
    returned = {**reply, "tool_calls": [call("add", tool_call.function.arguments)]}
    assert tokenizer.apply_chat_template([*question, returned], tools=TOOLS, tokenize=False) == full


def test_a_decoded_answer_can_retokenize_to_other_ids(tokenizer) -> None:
    """The model may sample "Hel" + "lo" where the text tokenizes as "Hello": the tracker keeps the sampled
    ids in the next prompt and reports the difference."""
    sampled = [tokenizer.convert_tokens_to_ids("Hel"), tokenizer.convert_tokens_to_ids("lo"), 151645]
    assert sampled == [32713, 385, 151645]
    assert tokenizer.decode(sampled) == "Hello<|im_end|>"
    assert tokenizer.encode("Hello<|im_end|>") == [9707, 151645] != sampled

    tracker = ContextTracker(tokenizer)
    messages = [{"role": "user", "content": "Greet me."}]
    plan = tracker.build_prompt(messages)
    reply = {"role": "assistant", "content": "Hello"}
    tracker.record(plan, sampled, [-1.0] * 3, reply, "stop", policy_version=0)
    follow_up = tracker.build_prompt([*messages, reply, {"role": "user", "content": "Again."}])
    ((start, end),) = follow_up.reused_spans
    assert follow_up.prompt_ids[start:end] == sampled
    assert {follow_up.token_authors[position] for position in range(start, end)} == {MODEL}
    assert [(event.message_index, event.kind) for event in follow_up.drift] == [
        (1, "retokenized_differently")
    ]
    tracker.record(follow_up, [9707, 151645], [-1.0] * 2, reply, "stop", policy_version=0)
    assert tracker.drift_counts() == {"retokenized_differently": 1}


def test_model_is_a_tied_two_layer_qwen2_with_qwen25_ids() -> None:
    model = tiny_qwen.build_model()
    config = model.config
    assert (config.model_type, config.vocab_size, config.num_hidden_layers) == ("qwen2", 151936, 2)
    assert config.hidden_size // config.num_attention_heads == 64  # vLLM's CPU kernels refuse 16
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (config.eos_token_id, config.pad_token_id) == (151645, 151643)
    assert model.generation_config.eos_token_id == [151645, 151643]
    assert sum(p.numel() for p in model.parameters()) == 19_743_872


def test_topology_accepts_the_builtin() -> None:
    assert (
        ServerConfig.model_validate({"name": "policy", "model": "builtin:tiny-qwen"}).engine.model
        == "builtin:tiny-qwen"
    )
    with pytest.raises(ValueError, match="builtin:tiny, builtin:tiny-qwen"):
        ServerConfig.model_validate({"name": "policy", "model": "builtin:tiny-llama"})
