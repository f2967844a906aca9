"""Multi-turn text games from TextArena (``textarena``, runtime ``envs/textarena.txt``), one model per seat.

Each task names a game, a seed and the game's settings (``data["env_id"]``, e.g. ``TicTacToe-v0``,
``data["seed"]``, ``data["env_kwargs"]``; ``builtin:prisoners_dilemma`` yields them). Seat i is played by
the group's i-th server, in the order of its ``servers`` list, so the group decides who trains:

- two trainable models: two servers, or two LoRA adapters of one server (``configs/textarena.yaml``);
- one player against a frozen model: a server (or the base of an adapter server) without a trainer.

Each move is one call, as TextArena's own agents play: the player's observation (TextArena's wrapper
puts the game so far in it) as the user message, the model's reply as the action. The game's own rewards
are each model's reward (``Outcome.rewards``); a game that runs past ``MAX_TURNS`` ends as a draw (0 for
all), with ``turn_cap`` in its metadata.
"""

from __future__ import annotations

from typing import Any

import textarena as ta

from ajet_hpc.environments.episode import EpisodeContext, Outcome

MAX_TURNS = 24
MAX_TOKENS = 16


def play(ctx: EpisodeContext) -> Outcome:
    data = ctx.task.data
    seats = list(ctx.models.values())
    env = ta.make(env_id=data["env_id"], **data.get("env_kwargs", {}))
    env.reset(num_players=len(seats), seed=data.get("seed"))
    moves: list[dict[str, Any]] = []
    done = False
    while not done and len(moves) < MAX_TURNS:
        seat, observation = env.get_observation()
        player = seats[seat]
        reply = player.client().chat.completions.create(
            model=player.name,
            messages=[{"role": "user", "content": str(observation)}],
            max_tokens=MAX_TOKENS,
            temperature=1.0,
        )
        action = reply.choices[0].message.content or ""
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
