"""DAPO (Yu et al. 2025, "DAPO: an open-source LLM RL system at scale").

GRPO's advantages and clipped surrogate with:

- clip-higher: ``clip_eps_high`` above ``clip_eps`` (0.2 / 0.28, the trainer's defaults);
- a token-level loss: every trained token of the batch weighs the same (``loss_agg: token_mean``);
- dynamic sampling: groups whose rewards are all equal are dropped and the batch waits for other groups
  in their place (``skip_equal_groups`` with ``batch_policy: tasks``: the collector refills);
- overlong reward shaping (``trainer.overlong``, :func:`overlong_penalty`).
"""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment of an answer of ``length`` tokens (a value <= 0 added to its reward).

    With ``L = max_tokens`` and ``B = buffer_tokens``: ``0`` up to ``L - B``; ``penalty * (L - B - n) / B``
    for ``L - B < n <= L`` (falling linearly to ``-penalty``); ``-penalty`` past ``L``.
    """
    if max_tokens < 1 or not 1 <= buffer_tokens <= max_tokens:
        raise ValueError(f"need 1 <= buffer_tokens ({buffer_tokens}) <= max_tokens ({max_tokens})")
    free = max_tokens - buffer_tokens
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return penalty * (free - length) / buffer_tokens
    return -penalty
