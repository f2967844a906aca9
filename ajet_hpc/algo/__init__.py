"""The maths of training: GRPO advantages and loss, per-turn credit, samples and micro-batches.

Pure functions on lists and torch tensors; the trainer orchestrates them. Formulas: ``docs/grpo.md``.
"""

from ajet_hpc.algo.credit import episode_token_advantages, group_turn_advantages, turn_returns
from ajet_hpc.algo.grpo import (
    entropy_from_logits,
    group_advantages,
    group_index,
    kl_k3,
    normalise_in_groups,
    policy_loss,
    token_logprobs,
)
from ajet_hpc.algo.sample_tensors import Sample, collate, pack_micro_batches

__all__ = [
    "Sample",
    "collate",
    "entropy_from_logits",
    "episode_token_advantages",
    "group_advantages",
    "group_index",
    "group_turn_advantages",
    "kl_k3",
    "normalise_in_groups",
    "pack_micro_batches",
    "policy_loss",
    "token_logprobs",
    "turn_returns",
]
