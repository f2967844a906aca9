"""RLOO (Ahmadian et al. 2024, "Back to basics: revisiting REINFORCE-style optimization"): the baseline of
an episode is the mean reward of the *other* episodes of its group::

    A_i = r_i - 1/(n-1) Σ_{j != i} r_j  =  n/(n-1) · (r_i - mean(r))

An unbiased baseline (it does not depend on the episode's own sample), without std scaling. Used with the
shared clipped surrogate; a group of one gets 0.
"""

from __future__ import annotations

import torch
from torch import Tensor


def leave_one_out(values: Tensor, index: Tensor) -> Tensor:
    """``v_i - mean_{j != i, same group} v_j`` for each value; 0 in a group of one. Float32.

    ``index`` holds each value's group number (``0..G-1``), as in
    :func:`ajet_hpc.algo.grpo.normalise_in_groups`.
    """
    v = values.detach().to(torch.float64)
    return (v - others_mean(values, index)).to(torch.float32)


def others_mean(values: Tensor, index: Tensor) -> Tensor:
    """Per value, the mean of the other values of its group (float64); the value itself in a group of one
    (so that its advantage is 0)."""
    if values.dim() != 1 or index.shape != values.shape:
        raise ValueError(f"values and index must be 1-D of equal length, got {values.shape}, {index.shape}")
    v = values.detach().to(torch.float64)
    if v.numel() == 0:
        return v
    groups = int(index.max()) + 1
    count = v.new_zeros(groups).index_add_(0, index, torch.ones_like(v))[index]
    total = v.new_zeros(groups).index_add_(0, index, v)[index]
    return torch.where(count > 1, (total - v) / (count - 1).clamp(min=1), v)
