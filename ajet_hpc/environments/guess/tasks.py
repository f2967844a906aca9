"""``builtin:guess``: find a hidden digit in up to four guesses, with higher/lower feedback.

A multi-turn task with a tool (``guess``); each episode is one linear conversation.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from ajet_hpc.environments.episode import Task

MAX_TURNS = 4
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "guess",
            "description": "Guess the hidden digit; answers 'higher', 'lower' or 'correct'.",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        },
    }
]


def tasks(seed: int = 0) -> Iterator[Task]:
    k = 0
    while True:
        yield Task(id=f"guess-{k}", data={"secret": random.Random(f"{seed}-{k}").randrange(10)})
        k += 1


def feedback(guess: int, secret: int) -> str:
    return "correct" if guess == secret else ("higher" if secret > guess else "lower")
