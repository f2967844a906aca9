"""A tiny model taught one agent conversation by heart, so that tests see the real engine emit real tool
calls and answers (a random model almost never writes a well-formed tool call).

The whole conversation is rendered with the model's own chat template and the model is trained, with
teacher forcing, on the tokens of the assistant turns until greedy decoding reproduces every one of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOOLS = [  # the add tool of the built-in MCP server (calculator.mcp_server), as mcp_tools offers it
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def titled(tool: dict) -> dict:
    """``tool`` as pydantic's schemas give it (verifiers' MCP server lists it so): a title on every parameter,
    first, and one on the whole, last; the template renders keys in this order."""
    function, parameters = tool["function"], tool["function"]["parameters"]
    properties = {name: {"title": name.title(), **spec} for name, spec in parameters["properties"].items()}
    arguments = {**parameters, "properties": properties, "title": f"{function['name']}Arguments"}
    return {**tool, "function": {**function, "parameters": arguments}}


TITLED_TOOLS = [titled(tool) for tool in TOOLS]


def call(name: str, **arguments: int) -> dict:
    return {"id": "x", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


# (message the agent sends, answer the model must give): five model calls, two of them tool calls.
SCRIPT: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {"role": "user", "content": "What is 2+3? Use the tool."},
        {"content": "", "tool_calls": [call("add", a=2, b=3)]},
    ),
    ({"role": "tool", "content": "5", "tool_call_id": "x"}, {"content": "2+3 is 5."}),
    ({"role": "user", "content": "And 4+4?"}, {"content": "", "tool_calls": [call("add", a=4, b=4)]}),
    ({"role": "tool", "content": "8", "tool_call_id": "x"}, {"content": "4+4 is 8."}),
    ({"role": "user", "content": "Thanks!"}, {"content": "You are welcome."}),
]
SYSTEM = {"role": "system", "content": "You are a calculator agent."}


def conversation(turns: int = len(SCRIPT)) -> list[dict]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for sent, answer in SCRIPT[:turns]:
        messages += [sent, {"role": "assistant", **answer}]
    return messages


# What the model learns by heart: the whole script with the tool as our MCP agent offers it, and its first
# question (tool call, then answer) with the tool as verifiers offers it.
EXAMPLES = [(conversation(), TOOLS), (conversation(turns=2), TITLED_TOOLS)]


def _training_example(tokenizer, messages: list[dict], tools: list[dict]):
    """Token ids of the conversation and a mask over the assistant answers (plus their end token)."""
    ids: list[int] = []
    mask: list[int] = []
    done = 0
    for end in range(1, len(messages) + 1):
        if messages[end - 1]["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[: end - 1], tools=tools, add_generation_prompt=True, tokenize=False
        )
        full = tokenizer.apply_chat_template(messages[:end], tools=tools, tokenize=False)
        context = tokenizer(prompt[done:], add_special_tokens=False)["input_ids"]
        answer_text = full[len(prompt) :].rstrip("\n")  # the answer and its <|im_end|>
        answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        ids += context + answer
        mask += [0] * len(context) + [1] * len(answer)
        done = len(prompt) + len(answer_text)
    return ids, mask


def build_scripted_model(base: Path, dest: Path, examples=EXAMPLES, max_steps: int = 600) -> Path:
    """``dest``, built unless it holds a model; under a lock, so pytest-xdist workers sharing the folder
    build it once (the others wait, then find it)."""
    from filelock import FileLock

    with FileLock(dest.with_name(dest.name + ".lock")):
        if (dest / "config.json").is_file():
            return dest
        return _build_scripted_model(base, dest, examples, max_steps)


def _build_scripted_model(base: Path, dest: Path, examples, max_steps: int) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    batches = []
    for messages, tools in examples:
        ids, mask = _training_example(tokenizer, messages, tools)
        batches.append((torch.tensor([ids]), torch.tensor(ids[1:]), torch.tensor(mask[1:], dtype=torch.bool)))
    # Fused AdamW and logits only where the answers are: with tiny-qwen's 151,936-row vocabulary these make
    # a step about 2x cheaper.
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    torch.manual_seed(0)
    for _ in range(max_steps):
        optimizer.zero_grad()
        learnt = True
        for inputs, targets, weight in batches:
            hidden = model.model(inputs).last_hidden_state[0, :-1]
            logits = model.lm_head(hidden[weight])
            loss = torch.nn.functional.cross_entropy(logits, targets[weight])
            loss.backward()
            with torch.no_grad():
                learnt &= bool((logits.argmax(-1) == targets[weight]).all()) and loss.item() < 0.01
        optimizer.step()
        if learnt:
            break
    else:
        raise RuntimeError(
            f"the scripted model did not learn its script in {max_steps} steps (loss {loss:.3f})"
        )
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest
