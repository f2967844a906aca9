"""``builtin:prisoners_dilemma``: TextArena's Iterated Prisoner's Dilemma (``textarena.agent``), two
rounds of one message each then a simultaneous choice, one task per seed: both players act every round,
whatever they write. Other games: a ``.jsonl`` source with ``{"id": ..., "env_id": "<TextArena id>",
"seed": N, "env_kwargs": {...}}`` lines (``env_kwargs`` go to ``textarena.make``)."""

from __future__ import annotations

from collections.abc import Iterator

from ajet_hpc.environments.episode import Task

COUNT = 1000
GAME = {"env_id": "IteratedPrisonersDilemma-v0", "env_kwargs": {"num_rounds": 2, "communication_turns": 1}}


def tasks() -> Iterator[Task]:
    for seed in range(COUNT):
        yield Task(id=f"pd-{seed}", data={**GAME, "seed": seed})
