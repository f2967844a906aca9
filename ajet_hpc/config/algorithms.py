"""The algorithms of ``trainer.algorithm``: one object each, with its settings, defaults and checks.

Plain data, so that the launcher can check a topology against it before anything is submitted (and
without the tensor code); the maths of each algorithm is in its module of ``ajet_hpc.algo``. A trainer
config gives its algorithm as ``TrainerConfig.spec`` (looked up here, once), checks itself against it
with :meth:`Algorithm.issues` (``config.rules``) and fills in its defaults with :meth:`Algorithm.defaults`
(``TrainerConfig.resolved``); docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from ajet_hpc.config.errors import ConfigIssue

AlgorithmName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"]
"""The policy-optimisation algorithms of ``trainer.algorithm`` (``ajet_hpc/algo/``, docs/algorithms.md)."""
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]
LOSS_AGGS: tuple[str, ...] = get_args(LossAgg)
Baseline = Literal["group_std", "group_mean", "leave_one_out"]


class TrainerSettings(Protocol):
    """What an algorithm reads of a trainer config (``config.trainer.TrainerConfig``, which imports this
    module)."""

    @property
    def algorithm(self) -> str: ...
    @property
    def loss_agg(self) -> str | None: ...
    @property
    def skip_equal_groups(self) -> bool: ...
    @property
    def batch_policy(self) -> str: ...
    @property
    def model_fields_set(self) -> Set[str]: ...


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

    def defaults(self, trainer: TrainerSettings) -> dict[str, object]:
        """The fields of ``trainer`` this algorithm fills where the config leaves them unset: its clip
        range (``clip_eps``, ``clip_eps_high``, each unless the config sets it) and its ``loss_agg``."""
        update: dict[str, object] = {}
        if self.clip is not None:
            low, high = self.clip
            if "clip_eps" not in trainer.model_fields_set:
                update["clip_eps"] = low
            if "clip_eps_high" not in trainer.model_fields_set:
                update["clip_eps_high"] = high
        if trainer.loss_agg is None:
            update["loss_agg"] = self.loss_agg
        return update

    def issues(self, where: str, trainer: TrainerSettings) -> list[ConfigIssue]:
        """What ``trainer`` (at path ``where``) sets that this algorithm cannot run with: a ``loss_agg`` it
        is not defined with (GSPO's loss is a mean over sequences), and for DAPO a batch without the
        dynamic sampling it is defined with."""
        issues = []
        if trainer.loss_agg is not None and trainer.loss_agg not in self.loss_aggs:
            issues.append(
                ConfigIssue(
                    f"{where}.loss_agg",
                    f"algorithm {self.name!r} is defined with loss_agg {' or '.join(self.loss_aggs)}, "
                    f"not {trainer.loss_agg!r}: drop {where}.loss_agg or pick another algorithm",
                )
            )
        if self.group_filter and not (trainer.skip_equal_groups and trainer.batch_policy == "tasks"):
            issues.append(
                ConfigIssue(
                    f"{where}.skip_equal_groups",
                    f"algorithm {self.name!r} refills a batch with task groups whose rewards differ: it "
                    f"needs {where}.skip_equal_groups: true and {where}.batch_policy: tasks",
                )
            )
        return issues


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
