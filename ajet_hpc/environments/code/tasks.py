"""``builtin:code``: write one small Python function, checked by hidden tests (``code.agent`` runs them in
the sandbox).

Each task names a function and says what it must do; ``data["tests"]`` holds its hidden cases as
``[arguments, expected]`` pairs computed here by a reference implementation. The agent never shows them to
the model. 600 tasks from six families with drawn constants, in a stable order.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from ajet_hpc.environments.episode import Task

COUNT = 600
CASES = 5

Family = tuple[str, str, str, Callable[[int], Callable[..., Any]], Callable[[random.Random], list[Any]]]


def _ints(rng: random.Random) -> list[Any]:
    return [rng.randint(-50, 50)]


def _lists(rng: random.Random) -> list[Any]:
    return [[rng.randint(-9, 9) for _ in range(rng.randint(0, 5))]]


def _words(rng: random.Random) -> list[Any]:
    return ["".join(rng.choice("abcab xyz") for _ in range(rng.randint(0, 8)))]


FAMILIES: list[Family] = [  # name, parameters, what it does, reference(k), drawn arguments
    ("add_k", "x", "returns x plus {k}", lambda k: lambda x: x + k, _ints),
    (
        "scale",
        "xs",
        "returns the list xs with every element multiplied by {k}",
        lambda k: lambda xs: [v * k for v in xs],
        _lists,
    ),
    (
        "is_multiple",
        "n",
        "returns True when n is a multiple of {k}, else False",
        lambda k: lambda n: n % k == 0,
        _ints,
    ),
    ("clip", "x", "returns x limited to the range -{k}..{k}", lambda k: lambda x: max(-k, min(k, x)), _ints),
    (
        "count_a",
        "s",
        "returns how many times the letter 'a' occurs in s, plus {k}",
        lambda k: lambda s: s.count("a") + k,
        _words,
    ),
    (
        "sum_above",
        "xs",
        "returns the sum of the elements of xs greater than {k}",
        lambda k: lambda xs: sum(v for v in xs if v > k),
        _lists,
    ),
]


def tasks(seed: int = 0) -> Iterator[Task]:
    rng = random.Random(seed)
    for index in range(COUNT):
        name, params, does, make, draw = FAMILIES[index % len(FAMILIES)]
        k = rng.randint(2, 9)
        reference = make(k)
        cases = [draw(rng) for _ in range(CASES)]
        question = (
            f"Write a Python function `{name}({params})` that {does.format(k=k)}. "
            "Reply with the code only, in a ```python block."
        )
        tests = [[args, reference(*args)] for args in cases]
        yield Task(id=f"code-{index}", data={"question": question, "function": name, "tests": tests})
