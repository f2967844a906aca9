"""The calculator every tool-using example shares: its tools as plain Python functions (served over MCP by
``calculator_mcp``, handed to the agent frameworks as their own tools) and the reward of an answer."""

from __future__ import annotations

import re
from typing import Any

from ajet_hpc.environments.calculator.tasks import KEYS as TABLE

SYSTEM = "You are a calculator agent."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def lookup(key: str) -> int:
    """The number stored under a key."""
    if key not in TABLE:
        raise ValueError(f"no key {key!r}; the keys are {sorted(TABLE)}")
    return TABLE[key]


TOOLS = (add, multiply, lookup)


def reward(answer: str, data: dict[str, Any]) -> float:
    """1 when the answer holds the task's number (``data["answer"]``), else 0."""
    return 1.0 if str(data["answer"]) in re.findall(r"-?\d+", answer or "") else 0.0
