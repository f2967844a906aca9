"""``builtin:tictactoe``: TextArena's Tic Tac Toe, one task per seed (``agents.textarena_game``). Other
games: a ``.jsonl`` source with ``{"id": ..., "env_id": "<TextArena id>", "seed": N}`` lines."""

from __future__ import annotations

from collections.abc import Iterator

from ajet_hpc.client.api import Task

COUNT = 1000


def tasks() -> Iterator[Task]:
    for seed in range(COUNT):
        yield Task(id=f"tictactoe-{seed}", data={"env_id": "TicTacToe-v0", "seed": seed})
