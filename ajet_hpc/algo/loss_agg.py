"""How the token loss terms of a step add up to its loss (``trainer.loss_agg``).

With ``ℓ_t`` a trained token's (weighted) term, ``T`` the step's trained tokens, ``S`` its sequences
(``ajet_hpc.algo.sequences``) and ``|y|`` the length of a token's sequence:

- ``token_mean``:          ``Σ_t ℓ_t / T`` (every token of the batch weighs the same; DAPO, GRPO here);
- ``seq_mean_token_sum``:  ``Σ_t ℓ_t / (L · S)`` with ``L = token_sum_norm`` (Dr. GRPO);
- ``seq_mean_token_mean``: ``Σ_t ℓ_t / (|y| · S)`` (each sequence's mean, then the mean over sequences;
  the original GRPO, GSPO).

Each is a per-token factor (:func:`token_scale`) and a step-wide divisor (:func:`step_divisor`), so the
micro-batches of all ranks add up to the loss of the batch as one (``ajet_hpc.trainer.ranks.step``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ajet_hpc.algo.sequences import sequence_lengths


def token_scale(loss_agg: str, sequence_ids: Tensor, token_sum_norm: int | None = None) -> Tensor | None:
    """The per-token factor of ``loss_agg`` (``[B, T]``, float32), or None where it is 1 everywhere."""
    if loss_agg == "token_mean":
        return None
    if loss_agg == "seq_mean_token_sum":
        if token_sum_norm is None or token_sum_norm < 1:
            raise ValueError(f"seq_mean_token_sum needs token_sum_norm >= 1, got {token_sum_norm}")
        return torch.full(sequence_ids.shape, 1.0 / token_sum_norm, device=sequence_ids.device)
    if loss_agg == "seq_mean_token_mean":
        lengths = sequence_lengths(sequence_ids)
        return torch.where(lengths > 0, 1.0 / lengths.clamp(min=1), 0.0)
    raise ValueError(f"unknown loss_agg {loss_agg!r}: token_mean, seq_mean_token_sum or seq_mean_token_mean")


def step_divisor(loss_agg: str, tokens: int, sequences: int) -> int:
    """What the step's summed terms are divided by: its trained tokens, or its sequences."""
    count = tokens if loss_agg == "token_mean" else sequences
    if count < 1:
        raise ValueError("the batch has no trainable token (every loss_mask is all 0)")
    return count
