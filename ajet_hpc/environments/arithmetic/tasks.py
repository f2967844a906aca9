"""``builtin:arithmetic``: single-digit sums, answered with the last digit of the sum.

Learnable by the tiny random model on two CPU cores: the answer is one character out of a small alphabet,
and the reward is shaped (half for answering with a digit, half for the right digit).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from ajet_hpc.environments.episode import Task


def tasks(seed: int = 0) -> Iterator[Task]:
    """An endless, reproducible stream: task k is always the same sum."""
    k = 0
    while True:
        rng = random.Random(f"{seed}-{k}")
        a, b = rng.randrange(10), rng.randrange(10)
        yield Task(id=f"arith-{k}", data={"question": f"{a}+{b}=", "answer": str((a + b) % 10)})
        k += 1


def reward(answer: str, expected: str) -> float:
    """0.5 if the answer starts with a digit, 1.0 if that digit is the expected one."""
    answer = answer.strip()
    if not answer or not (answer[0].isascii() and answer[0].isdigit()):
        return 0.0
    return 1.0 if answer[0] == expected else 0.5
