"""Agent for ``builtin:guess``: up to four guesses, as tool calls or a bare digit in the text.

Feedback goes back as a tool message when the model called the tool, else as a user message, so every
episode stays one linear conversation. Reward: 1 when found, else a little for each well-formed guess.
"""

from __future__ import annotations

import json

from ajet_hpc.environments.episode import EpisodeContext, Outcome
from ajet_hpc.environments.guess.tasks import MAX_TURNS, TOOLS, feedback


def _read_guess(message) -> int | None:
    for call in message.tool_calls or []:
        try:
            return int(json.loads(call.function.arguments)["n"])
        except (ValueError, KeyError, TypeError):
            return None
    first = (message.content or "").strip()[:1]
    return int(first) if first.isascii() and first.isdigit() else None  # not "²" or "₀": int() refuses them


def solve(ctx: EpisodeContext) -> Outcome:
    client, secret = ctx.model.client(), ctx.task.data["secret"]
    messages: list[dict] = [{"role": "user", "content": "Guess my digit (0-9)."}]
    well_formed = 0
    for turn in range(MAX_TURNS):
        reply = client.chat.completions.create(
            model=ctx.model.name, messages=messages, tools=TOOLS, max_tokens=24, temperature=1.0
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        guess = _read_guess(message)
        if guess is None:
            messages.append({"role": "user", "content": "Answer with one digit."})
            continue
        well_formed += 1
        said = feedback(guess, secret)
        if message.tool_calls:
            messages.append({"role": "tool", "content": said, "tool_call_id": message.tool_calls[0].id})
        else:
            messages.append({"role": "user", "content": said})
        if said == "correct":
            return Outcome(reward=1.0, metadata={"turns": turn + 1})
    return Outcome(reward=0.1 * well_formed, metadata={"turns": MAX_TURNS})
