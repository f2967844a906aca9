"""Training samples and how they become tensors: one :class:`Sample` per sequence, micro-batches, padding.

A sample is one training sequence: one model call, several calls merged into their longest one, or a
prefix tree of calls packed depth-first (``parents`` set; see ``ajet_hpc.algo.merge``). Every per-token
list has one entry per token id; advantages and old log-probabilities are 0.0 where the loss mask is 0,
so padding and prompt tokens never enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_PER_TOKEN_FIELDS = ("loss_mask", "old_logprobs", "advantages")
_OPTIONAL_PER_TOKEN_FIELDS = ("weights", "parents")


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
    weight: float = 1.0  # loss weight of every token of the sample, unless `weights` is set
    weights: list[float] | None = None  # per-token loss weights (merged calls of unequal weights)
    parents: list[int] | None = None  # tree samples: position of each token's predecessor, -1 for none
    calls: list[int] = field(default_factory=list)  # the episode's call indices whose tokens train here

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("Sample.token_ids is empty: a sample needs at least one token")
        n = len(self.token_ids)
        for name in _PER_TOKEN_FIELDS + _OPTIONAL_PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(
                    f"Sample.{name} has {len(value)} entries but token_ids has {n}: give one entry per token"
                )
        mask = self.loss_mask if isinstance(self.loss_mask, (list, tuple)) else list(self.loss_mask)
        if mask.count(0) + mask.count(1) != n:  # every m in (0, 1), counted in C: merged samples are long
            raise ValueError("Sample.loss_mask must hold only 0 and 1")
        if self.parents is not None:
            if any(not -1 <= parent < i for i, parent in enumerate(self.parents)):
                raise ValueError("Sample.parents must point to an earlier position (or be -1)")
            if any(m and parent < 0 for m, parent in zip(self.loss_mask, self.parents, strict=True)):
                raise ValueError("Sample.loss_mask is 1 on a first token (parent -1), which has no context")

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
    """Right-pad ``samples`` to the longest one and stack them; tensors are ``[B, T]`` unless noted.

    Keys: ``input_ids`` (long, ``pad_id`` on padding), ``attention_mask`` (long, 1 on real tokens),
    ``loss_mask`` (long), ``old_logprobs``, ``advantages`` and ``weights`` (float32, each token's loss
    weight). Every padding position is 0 except ``input_ids``.

    When a sample is a tree (``parents`` set), three keys change or appear: ``attention_mask`` becomes a
    boolean ``[B, 1, T, T]`` mask (query i sees key j iff j is i or an ancestor of i; a padding position
    sees itself only), ``position_ids`` holds each token's depth in its own sequence, and ``parents`` (long)
    the position whose logits predict each token (-1: none). Plain samples in the same batch get the
    causal equivalents, so one forward serves both.
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
        out["weights"][row, :n] = torch.tensor(s.weights) if s.weights is not None else s.weight
    if any(s.parents is not None for s in samples):
        out.update(_tree_inputs(samples, t))
    return out


def _tree_inputs(samples: list[Sample], t: int) -> dict[str, Tensor]:
    b = len(samples)
    parents = torch.full((b, t), -1, dtype=torch.long)
    depth = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, 1, t, t), dtype=torch.bool)
    arange = torch.arange(t)
    for row, s in enumerate(samples):
        n = len(s)
        own = list(range(-1, n - 1)) if s.parents is None else s.parents
        parents[row, :n] = torch.tensor(own, dtype=torch.long)
        # depth first layout: j is an ancestor of i iff j <= i < end[j], end[j] = j + size of j's subtree
        size = [1] * n
        level = [0] * n
        for i in range(n - 1, -1, -1):
            if own[i] >= 0:
                size[own[i]] += size[i]
        for i in range(n):
            level[i] = level[own[i]] + 1 if own[i] >= 0 else 0
        end = torch.arange(t) + 1  # padding: itself only
        end[:n] = torch.arange(n) + torch.tensor(size)
        depth[row, :n] = torch.tensor(level)
        if n < t:
            depth[row, n:] = torch.arange(t - n) + (max(level) + 1)
        mask[row, 0] = (arange[None, :] <= arange[:, None]) & (arange[:, None] < end[None, :])
    return {"attention_mask": mask, "position_ids": depth, "parents": parents}
