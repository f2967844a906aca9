"""REINFORCE++ (Hu et al. 2025, "REINFORCE++: a simple and efficient approach for aligning LLMs"), in its
group-baseline form for sampled groups: subtract the group's mean reward, then standardise over the whole
batch (its trained tokens), not within the group::

    a_i = r_i - mean_group(r)          A_t = (a_t - mean_batch(a)) / (std_batch(a) + eps)

Batch-level normalisation keeps the scale of a group whose rewards barely differ, which per-group std
would blow up. The KL to the reference stays a loss term (``kl_coef``), as in the rest of the trainer.
"""

from __future__ import annotations

import numpy as np


def whiten_stats(values: np.ndarray) -> tuple[float, float]:
    """Mean and population std (float64) of the batch's trained-token advantages."""
    values = np.asarray(values, np.float64)
    if values.size == 0:
        return 0.0, 0.0
    return float(values.mean()), float(values.std())
