"""``builtin:propose_solve``: two models in one episode, each rewarded on its own terms.

A proposer model writes a sum of two digits (``3+4=``); a solver model answers it with the last digit of
the sum. The proposer's reward is shaped so that a random model already sees differences: 0.25 for each
well-formed part of ``d+d`` (a digit, the plus, a digit) and 0.25 more when the solver gets it right (it
learns to propose sums the solver can do). The solver earns the ``builtin:arithmetic`` reward on the
proposed sum, or on the task's own sum when the proposal is malformed. Used with two trainable servers
(``configs/two_models.yaml``): each model's episode ends with its own reward.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from ajet_hpc.environments.episode import Task

PROPOSAL = re.compile(r"\s*(\d)\s*\+\s*(\d)")


def tasks(seed: int = 0) -> Iterator[Task]:
    """An endless, reproducible stream; each task carries a fallback sum for a malformed proposal."""
    k = 0
    while True:
        rng = random.Random(f"propose-{seed}-{k}")
        a, b = rng.randrange(10), rng.randrange(10)
        yield Task(id=f"propose-{k}", data={"fallback": [a, b]})
        k += 1


def proposal_form(text: str) -> float:
    """0, 0.25, 0.5 or 0.75: how much of ``d+d`` the text starts with (spaces allowed)."""
    head = (text or "").replace(" ", "")
    score = 0.0
    for position, wanted in enumerate((str.isdigit, "+".__eq__, str.isdigit)):
        if len(head) <= position or not wanted(head[position]):
            break
        score += 0.25
    return score


def parse_proposal(text: str) -> tuple[int, int] | None:
    """The two digits of a proposal that starts with ``d+d``; None otherwise."""
    match = PROPOSAL.match(text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None
