"""Multi-turn text games from TextArena (``textarena``, runtime ``envs/textarena.txt``), one model per seat.

Each task names a game and a seed (``data["env_id"]``, e.g. ``TicTacToe-v0``, and ``data["seed"]``;
``builtin:tictactoe`` yields them). Seat i is played by the group's i-th server, in the order of its
``servers`` list, so the group decides who trains:

- two trainable models: two servers, or two LoRA adapters of one server (``configs/textarena.yaml``);
- one player against a frozen model: a server (or the base of an adapter server) without a trainer.

Each seat keeps its own conversation: TextArena's observation for that player as a user message, the
model's reply as the action. The game's own rewards are each model's reward (``Outcome.rewards``); a game
that runs past ``MAX_TURNS`` ends as a draw (0 for all), with ``turn_cap`` in its metadata.
"""

from __future__ import annotations

from typing import Any

import textarena as ta

from ajet_hpc.client.api import EpisodeContext, Outcome

MAX_TURNS = 24
MAX_TOKENS = 8
DEFAULT_GAME = "TicTacToe-v0"


def play(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    seats = list(ctx.models.values())
    env = ta.make(env_id=data.get("env_id", DEFAULT_GAME))
    env.reset(num_players=len(seats), seed=data.get("seed"))
    conversations: list[list[dict[str, Any]]] = [[] for _ in seats]
    moves: list[dict[str, Any]] = []
    done = False
    while not done and len(moves) < MAX_TURNS:
        seat, observation = env.get_observation()
        player, conversation = seats[seat], conversations[seat]
        conversation.append({"role": "user", "content": str(observation)})
        reply = player.client().chat.completions.create(
            model=player.name, messages=conversation, max_tokens=MAX_TOKENS, temperature=1.0
        )
        action = reply.choices[0].message.content or ""
        conversation.append({"role": "assistant", "content": action})
        moves.append({"seat": seat, "model": player.name, "action": action})
        done, _ = env.step(action=action)
    if not done:
        return Outcome(
            reward=0.0, rewards=dict.fromkeys(ctx.models, 0.0), metadata={"moves": moves, "turn_cap": True}
        )
    game_rewards, game_info = env.close()
    rewards = {seats[seat].name: float(value) for seat, value in game_rewards.items()}
    reasons = {seats[seat].name: info.get("reason", "") for seat, info in game_info.items()}
    metadata = {"moves": moves, "game_rewards": rewards, "reasons": reasons, "seats": [s.name for s in seats]}
    return Outcome(reward=rewards[seats[0].name], rewards=rewards, metadata=metadata)
