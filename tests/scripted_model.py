"""A tiny model taught one agent conversation by heart, so that tests see the real engine emit real tool
calls and answers (a random model almost never writes a well-formed tool call).

The whole conversation is rendered with the model's own chat template and the model is trained, with
teacher forcing, on the tokens of the assistant turns until greedy decoding reproduces every one of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TOOLS = [  # the add tool of the built-in MCP server (agents.calculator_mcp), as agents.mcp_tools offers it
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


def conversation() -> list[dict]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for sent, answer in SCRIPT:
        messages += [sent, {"role": "assistant", **answer}]
    return messages


def _training_example(tokenizer):
    """Token ids of the whole conversation and a mask over the assistant answers (plus their end token)."""
    messages = conversation()
    ids: list[int] = []
    mask: list[int] = []
    done = 0
    for end in range(1, len(messages) + 1):
        if messages[end - 1]["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(
            messages[: end - 1], tools=TOOLS, add_generation_prompt=True, tokenize=False
        )
        full = tokenizer.apply_chat_template(messages[:end], tools=TOOLS, tokenize=False)
        context = tokenizer(prompt[done:], add_special_tokens=False)["input_ids"]
        answer_text = full[len(prompt) :].rstrip("\n")  # the answer and its <|im_end|>
        answer = tokenizer(answer_text, add_special_tokens=False)["input_ids"]
        ids += context + answer
        mask += [0] * len(context) + [1] * len(answer)
        done = len(prompt) + len(answer_text)
    return ids, mask


def build_scripted_model(base: Path, dest: Path, max_steps: int = 600) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (dest / "config.json").is_file():
        return dest
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids, mask = _training_example(tokenizer)
    inputs = torch.tensor([ids])
    targets = torch.tensor(ids[1:])
    weight = torch.tensor(mask[1:], dtype=torch.bool)
    # Fused AdamW and logits only where the answers are: with tiny-qwen's 151,936-row vocabulary these make
    # a step about 2x cheaper (about 110 steps, 30 s on 2 cores; the character-level tiny model takes 3 s).
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    torch.manual_seed(0)
    for _ in range(max_steps):
        hidden = model.model(inputs).last_hidden_state[0, :-1]
        logits = model.lm_head(hidden[weight])
        loss = torch.nn.functional.cross_entropy(logits, targets[weight])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            margin_ok = (logits.argmax(-1) == targets[weight]).all() and loss.item() < 0.01
        if margin_ok:
            break
    else:
        raise RuntimeError(
            f"the scripted model did not learn its script in {max_steps} steps (loss {loss:.3f})"
        )
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest
