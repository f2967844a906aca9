"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): the importance ratio and its clipping
per sequence, from the length-normalised sequence likelihood::

    s_i = exp( 1/|y_i| Σ_t (log π(y_t) - log π_old(y_t)) )
    loss = 1/S Σ_i -min(s_i A_i, clip(s_i, 1 - ε_low, 1 + ε_high) A_i)

Advantages are GRPO's. The ratio stays near 1 at any length, so the clip range is small: (3e-4, 4e-4)
unless ``clip_eps`` / ``clip_eps_high`` are set. Each sequence counts once: ``seq_mean_token_mean``
(its tokens share ``s_i`` and ``A_i``, so their mean is the sequence's term).
"""

from __future__ import annotations

import torch
from torch import Tensor


def sequence_log_ratio(log_ratio: Tensor, sequence_ids: Tensor) -> Tensor:
    """Each trained token's sequence mean of ``log_ratio`` (``[B, T]``; 0 where ``sequence_ids`` is -1).

    ``sequence_ids`` numbers the micro-batch's sequences ``0..S-1`` (``ajet_hpc.algo.sequences``). The
    result keeps the gradient: every token of a sequence gets ``1/|y|`` of each token's."""
    trained = sequence_ids >= 0
    if not bool(trained.any()):
        return torch.zeros_like(log_ratio)
    ids = sequence_ids.clamp(min=0).reshape(-1)
    count = int(sequence_ids.max()) + 1
    values = torch.where(trained, log_ratio, 0.0).reshape(-1)
    sums = values.new_zeros(count).index_add(0, ids, values)
    lengths = values.new_zeros(count).index_add(0, ids, trained.reshape(-1).to(values.dtype))
    mean = sums / lengths.clamp(min=1)
    return torch.where(trained, mean[ids].reshape(log_ratio.shape), 0.0)
