"""Training samples and how they become tensors: one :class:`Sample` per sequence, micro-batches, padding.

A sample is one training sequence (today: one model call = one timeline). Every per-token list has one
entry per token id; advantages and old log-probabilities are 0.0 where the loss mask is 0, so padding and
prompt tokens never enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "advantages")


@dataclass
class Sample:
    """One training sequence: its token ids, which of them are trained, and with what advantage."""

    token_ids: list[int]
    loss_mask: list[int]  # 1 on trainable tokens (the model's own sampled tokens), else 0
    old_logprobs: list[float]  # per token: the engine's logprob on trainable tokens, 0.0 elsewhere
    advantages: list[float]  # per token: 0.0 where loss_mask is 0
    policy_version: int  # the policy version that sampled the trainable tokens
    episode_id: str
    task_id: str
    weight: float = 1.0  # loss weight of the whole sample (episode weighting, later merging)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("Sample.token_ids is empty: a sample needs at least one token")
        n = len(self.token_ids)
        for name in _PER_TOKEN_FIELDS:
            got = len(getattr(self, name))
            if got != n:
                raise ValueError(
                    f"Sample.{name} has {got} entries but token_ids has {n}: give one entry per token"
                )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError("Sample.loss_mask must hold only 0 and 1")

    def __len__(self) -> int:
        return len(self.token_ids)


def pack_micro_batches(samples: list[Sample], token_budget: int) -> list[list[int]]:
    """Group sample indices into micro-batches whose padded size fits ``token_budget``.

    The padded size of a micro-batch is ``longest sample * number of samples`` (what :func:`collate`
    allocates). Each micro-batch fits the budget, except that a single sample longer than the budget gets a
    micro-batch of its own.

    Order: samples are taken longest first (a stable sort, so equal lengths keep their input order) and
    filled greedily, which keeps padding small and puts the largest activations in the first micro-batch,
    where an out-of-memory error shows at once. Within a micro-batch indices are ascending. The order does not
    change the step's gradient: the loss of each micro-batch is divided by the step's global token count
    (see :func:`ajet_hpc.algo.grpo.policy_loss`). The result is deterministic for a given input.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = len(samples[i])
        if current and max(longest, n) * (len(current) + 1) > token_budget:
            batches.append(sorted(current))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(sorted(current))
    return batches


def collate(samples: list[Sample], pad_id: int) -> dict[str, Tensor]:
    """Right-pad ``samples`` to the longest one and stack them; every tensor has shape ``[B, T]``.

    Keys: ``input_ids`` (long, ``pad_id`` on padding), ``attention_mask`` (long, 1 on real tokens),
    ``loss_mask`` (long), ``old_logprobs``, ``advantages`` and ``weights`` (float32; ``weights`` holds the
    sample's weight on each of its tokens). Every padding position is 0 except ``input_ids``.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    b, t = len(samples), max(len(s) for s in samples)
    out = {
        "input_ids": torch.full((b, t), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((b, t), dtype=torch.long),
        "loss_mask": torch.zeros((b, t), dtype=torch.long),
        "old_logprobs": torch.zeros((b, t), dtype=torch.float32),
        "advantages": torch.zeros((b, t), dtype=torch.float32),
        "weights": torch.zeros((b, t), dtype=torch.float32),
    }
    for row, s in enumerate(samples):
        n = len(s)
        out["input_ids"][row, :n] = torch.tensor(s.token_ids, dtype=torch.long)
        out["attention_mask"][row, :n] = 1
        out["loss_mask"][row, :n] = torch.tensor(s.loss_mask, dtype=torch.long)
        out["old_logprobs"][row, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        out["advantages"][row, :n] = torch.tensor(s.advantages, dtype=torch.float32)
        out["weights"][row, :n] = s.weight
    return out
