"""The algorithms of ``trainer.algorithm`` as settings of the trainer's shared pieces (docs/algorithms.md).

Plain data, so that the launcher can check a topology against it before anything is submitted (and
without the tensor code); the maths of each algorithm is in its module of ``ajet_hpc.algo``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LOSS_AGGS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")
Baseline = Literal["group_std", "group_mean", "leave_one_out"]


@dataclass(frozen=True)
class Algorithm:
    """One policy-optimisation algorithm.

    ``baseline``: advantages within a task group: ``group_std`` standardises (GRPO), ``group_mean`` only
    subtracts the mean (Dr. GRPO), ``leave_one_out`` subtracts the mean of the other episodes (RLOO).
    ``batch_whiten``: afterwards, standardise over the batch's trained tokens (REINFORCE++).
    ``ratio``: the importance ratio of the clipped surrogate, per token or per sequence (GSPO).
    ``loss_agg``: the aggregation used when ``trainer.loss_agg`` is unset; ``loss_aggs`` those allowed.
    ``clip``: ``(clip_eps, clip_eps_high)`` used when the config does not set them; None: the config's.
    ``group_filter``: the batch must drop equal-reward groups and refill (DAPO's dynamic sampling).
    """

    name: str
    baseline: Baseline
    loss_agg: str = "token_mean"
    loss_aggs: tuple[str, ...] = LOSS_AGGS
    ratio: Literal["token", "sequence"] = "token"
    batch_whiten: bool = False
    clip: tuple[float, float] | None = None
    group_filter: bool = False

    def __post_init__(self) -> None:
        if self.loss_agg not in self.loss_aggs or not set(self.loss_aggs) <= set(LOSS_AGGS):
            raise ValueError(f"{self.name}: loss_agg {self.loss_agg!r} is not among {self.loss_aggs}")


_ALL = (
    # GRPO (Shao et al. 2024): group-standardised advantages, token-level clipped surrogate, token mean
    # over the batch (clip-higher by default: clip_eps_high 0.28). ajet_hpc.algo.grpo
    Algorithm(name="grpo", baseline="group_std"),
    # Dr. GRPO (Liu et al. 2025): no std, each sequence's token sum over a constant.
    # ajet_hpc.algo.grpo (normalise_in_groups, scale=False) and ajet_hpc.algo.loss_agg
    Algorithm(
        name="dr_grpo",
        baseline="group_mean",
        loss_agg="seq_mean_token_sum",
        loss_aggs=("seq_mean_token_sum",),
    ),
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, overlong shaping.
    # ajet_hpc.algo.dapo
    Algorithm(name="dapo", baseline="group_std", loss_aggs=("token_mean",), group_filter=True),
    # GSPO (Zheng et al. 2025): sequence-level ratio and clip, mean over sequences. ajet_hpc.algo.gspo
    Algorithm(
        name="gspo",
        baseline="group_std",
        loss_agg="seq_mean_token_mean",
        loss_aggs=("seq_mean_token_mean",),
        ratio="sequence",
        clip=(3e-4, 4e-4),
    ),
    # RLOO (Ahmadian et al. 2024): the other episodes' mean as the baseline. ajet_hpc.algo.rloo
    Algorithm(name="rloo", baseline="leave_one_out"),
    # REINFORCE++ (Hu et al. 2025): group mean, then batch-level whitening. ajet_hpc.algo.reinforce_pp
    Algorithm(name="reinforce_pp", baseline="group_mean", batch_whiten=True),
)

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in _ALL}


def algorithm(name: str) -> Algorithm:
    """The algorithm called ``name``; ``KeyError`` naming the known ones otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise KeyError(f"unknown algorithm {name!r}; algorithms are: {', '.join(ALGORITHMS)}") from None
