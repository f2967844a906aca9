"""Reading tool calls out of the model's text, per output format (``serving.tool_parser``).

``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after or between text, as
Qwen2.5, Hermes and the built-in tiny model write them. A block that is not valid JSON stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ajet_hpc.server.http_schemas import FunctionCall, ToolCall

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_hermes(text: str) -> ParsedOutput:
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(text):
        try:
            payload = json.loads(match.group(1))
            name = payload["name"]
            arguments = payload.get("arguments", {})
            if not isinstance(name, str):
                raise TypeError("name is not a string")
        except (ValueError, KeyError, TypeError):
            continue  # not a well-formed call: it stays in the text
        kept.append(text[position : match.start()])
        position = match.end()
        encoded = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=encoded)))
    kept.append(text[position:])
    content = "".join(kept)
    if calls:
        content = content.strip()
    return ParsedOutput(content=content or (None if calls else ""), tool_calls=calls)


PARSERS = {"hermes": (parse_hermes, HERMES_OPEN)}


def holdback(text: str, markers: list[str]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers`` (not yet streamable)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker), len(text)), 0, -1):
            if marker.startswith(text[-size:]):
                longest = max(longest, size)
                break
    return longest
