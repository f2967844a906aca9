"""A trainer's objective: its algorithm's loss, aggregation and off-policy correction, on one micro-batch.

``Objective.of(trainer)`` reads what the loss needs from a resolved ``trainer`` (its algorithm's and
its server's defaults filled in: ``TrainerConfig.resolved``); :meth:`Objective.divisor` gives the step's
divisor from all its samples and :meth:`Objective.micro_loss` one micro-batch's share of the step's loss,
so that the micro-batches of every rank add up to the loss of the batch as one
(``ajet_hpc.trainer.ranks.step``). The formulas are in docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ajet_hpc.algo import off_policy
from ajet_hpc.algo.grpo import policy_loss
from ajet_hpc.algo.loss_agg import step_divisor, token_scale
from ajet_hpc.algo.sample_tensors import Sample, trained_count
from ajet_hpc.algo.sequences import sequence_count
from ajet_hpc.config.trainer import TrainerConfig


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's loss and what the step's metrics add up from it."""

    loss: Tensor
    metrics: dict[str, float]  # policy_loss's
    trained: Tensor  # [B, T] bool: the tokens the loss trains
    log_w: Tensor  # [B, T] log importance weight engine -> trainer (0 where not trained)
    hit: Tensor  # [B, T] bool: truncated (tis) or masked (mis)


@dataclass(frozen=True)
class Objective:
    ratio_level: str = "token"
    loss_agg: str = "token_mean"
    token_sum_norm: int | None = None
    clip_eps: float = 0.2
    clip_eps_high: float = 0.28
    kl_coef: float = 0.0
    recompute_logprobs: bool = False
    correction: off_policy.Correction = field(default_factory=off_policy.Correction)

    @classmethod
    def of(cls, trainer: TrainerConfig) -> Objective:
        """The objective of a resolved ``trainer`` (``TrainerConfig.resolved``)."""
        if trainer.loss_agg is None:
            raise ValueError("Objective.of needs a resolved trainer config: trainer.resolved(serving)")
        return cls(
            ratio_level=trainer.spec.ratio,
            loss_agg=trainer.loss_agg,
            token_sum_norm=trainer.token_sum_norm,
            clip_eps=trainer.clip_eps,
            clip_eps_high=trainer.clip_eps_high,
            kl_coef=trainer.kl_coef,
            recompute_logprobs=trainer.recompute_logprobs,
            correction=off_policy.Correction(**trainer.off_policy.model_dump()),
        )

    def divisor(self, samples: Sequence[Sample]) -> int:
        """What the step's summed token terms are divided by (``ajet_hpc.algo.loss_agg``)."""
        tokens = sum(trained_count(s.loss_mask) for s in samples)  # an int8 array's sum() would wrap
        sequences = sum(sequence_count(s.loss_mask, s.parents) for s in samples)
        return step_divisor(self.loss_agg, tokens, sequences)

    def micro_loss(
        self,
        logprobs: Tensor,
        batch: dict[str, Tensor],
        normalizer: float,
        ref_logprobs: Tensor | None = None,
    ) -> MicroLoss:
        """The micro-batch's loss from the trainer's ``logprobs`` (with gradient) and the collated
        ``batch`` (``ajet_hpc.algo.sample_tensors.collate``: its ``old_logprobs`` are the engine's)."""
        engine_logprobs = batch["old_logprobs"]
        old = logprobs.detach() if self.recompute_logprobs else engine_logprobs
        trained = (batch["loss_mask"] != 0) & (batch["sequence_ids"] >= 0)
        level = self.correction.level
        log_w = off_policy.log_weights(logprobs, engine_logprobs, batch["sequence_ids"], level)
        is_weights, hit = off_policy.weights(log_w, trained, self.correction)
        loss, metrics = policy_loss(
            logprobs,
            old,
            batch["advantages"],
            batch["loss_mask"],
            clip_eps=self.clip_eps,
            clip_eps_high=self.clip_eps_high,
            kl_coef=self.kl_coef,
            ref_logprobs=ref_logprobs,
            weights=batch["weights"],
            normalizer=float(normalizer),
            ratio_level=self.ratio_level,
            sequence_ids=batch["sequence_ids"],
            token_scale=token_scale(self.loss_agg, batch["sequence_ids"], self.token_sum_norm),
            is_weights=is_weights,
        )
        return MicroLoss(loss, metrics, trained, log_w.detach(), hit)

    def mismatch_kl_sum(self, logprobs: Tensor, batch: dict[str, Tensor], trained: Tensor) -> float:
        """The micro-batch's summed k3 estimate of KL(engine || trainer) over its trained tokens."""
        gap = off_policy.mismatch_kl(logprobs, batch["old_logprobs"], trained)
        return float(torch.where(trained, gap, 0.0).sum())
