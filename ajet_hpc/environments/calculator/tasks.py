"""``builtin:tools``: questions answered with the tools of the built-in MCP server
(``calculator.mcp_server``): a sum, a product or a stored value. Each task names the tools its agent
offers (``data["tools"]``) and the answer (``data["answer"]``); 300 tasks in a stable order."""

from __future__ import annotations

import random
from collections.abc import Iterator

from ajet_hpc.environments.episode import Task

COUNT = 300
KEYS = {"alpha": 17, "beta": 42, "gamma": 7, "delta": 123, "omega": 999}  # the calculator's lookup table


def tasks(seed: int = 0) -> Iterator[Task]:
    rng = random.Random(seed)
    for index in range(COUNT):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        kind = index % 3
        if kind == 0:
            data = {"question": f"What is {a}+{b}? Use the tool.", "tools": ["add"], "answer": a + b}
        elif kind == 1:
            data = {"question": f"What is {a}*{b}? Use the tool.", "tools": ["multiply"], "answer": a * b}
        else:
            key = rng.choice(sorted(KEYS))
            question = f"What number is stored under {key!r}? Use the tool."
            data = {"question": question, "tools": ["lookup"], "answer": KEYS[key]}
        yield Task(id=f"tools-{index}", data=data)
