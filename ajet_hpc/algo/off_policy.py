"""Off-policy correction: importance weights between the engine that sampled and the policy that trains.

The engine records ``log μ(y_t)`` for every token it samples (``old_logprobs``), possibly several policy
versions ago (``max_staleness``) and always with its own kernels; the trainer computes ``log π(y_t)``
in its forward. With ``recompute_logprobs`` the clipped ratio is taken against ``π`` itself, and the gap
to ``μ`` is corrected by a constant weight per token (Yao et al. 2025, "Your efficient RL framework
secretly brings you off-policy RL training"; Liu et al. 2025, masked importance sampling)::

    token level:     w_t = exp(log π(y_t) - log μ(y_t))
    sequence level:  w_t = Π_{u in seq(t)} exp(log π(y_u) - log μ(y_u))
    tis:             loss term × min(w, cap)
    mis:             loss term × w if low <= w <= high, else × 0 (the token, or the whole sequence, is out)

The weights carry no gradient. Masked tokens still count in the step's divisor, so a masked token lowers
the loss's scale instead of raising the others'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

LOG_W_LIMIT = 30.0  # log-weights are clamped to ±30 before exp (a long sequence's product overflows)


@dataclass(frozen=True)
class Correction:
    """``trainer.off_policy`` as the loss needs it."""

    mode: str = "none"  # none | tis | mis
    level: str = "token"  # token | sequence
    cap: float = 2.0
    low: float = 0.5
    high: float = 2.0


def log_weights(
    trainer_logprobs: Tensor, engine_logprobs: Tensor, sequence_ids: Tensor, level: str
) -> Tensor:
    """``log w`` per trained token (0 elsewhere), at the token or sequence level; no gradient."""
    trained = sequence_ids >= 0
    log_w = torch.where(trained, trainer_logprobs.detach().float() - engine_logprobs.float(), 0.0)
    if level == "token":
        return log_w
    if level != "sequence":
        raise ValueError(f"unknown off-policy level {level!r}: token or sequence")
    if not bool(trained.any()):
        return log_w
    flat = sequence_ids.clamp(min=0).reshape(-1)
    sums = log_w.new_zeros(int(sequence_ids.max()) + 1).index_add(0, flat, log_w.reshape(-1))
    return torch.where(trained, sums[flat].reshape(log_w.shape), 0.0)


def weights(log_w: Tensor, trained: Tensor, correction: Correction) -> tuple[Tensor | None, Tensor]:
    """The loss weights (None with mode ``none``) and, per token, whether it was truncated or masked."""
    w = torch.exp(log_w.clamp(-LOG_W_LIMIT, LOG_W_LIMIT))
    if correction.mode == "none":
        return None, torch.zeros_like(trained)
    if correction.mode == "tis":
        hit = trained & (w > correction.cap)
        return torch.where(trained, w.clamp(max=correction.cap), 0.0), hit
    if correction.mode == "mis":
        hit = trained & ((w < correction.low) | (w > correction.high))
        return torch.where(trained & ~hit, w, 0.0), hit
    raise ValueError(f"unknown off-policy mode {correction.mode!r}: none, tis or mis")


def mismatch_kl(trainer_logprobs: Tensor, engine_logprobs: Tensor, trained: Tensor) -> Tensor:
    """Per token, the k3 estimate of KL(μ || π) for tokens sampled from μ: ``exp(d) - 1 - d`` with
    ``d = log π - log μ`` (>= 0; its mean under μ is the KL). 0 where not trained."""
    d = torch.where(trained, trainer_logprobs.detach().double() - engine_logprobs.double(), 0.0)
    # float64 and expm1: the gap is often ~1e-6 per token, whose k3 (~d²/2) float32 rounding would swamp
    return (torch.expm1(d.clamp(max=LOG_W_LIMIT)) - d).clamp(min=0)


QUANTILES = (0.01, 0.05, 0.5, 0.95, 0.99)


def ratio_quantiles(log_w: np.ndarray) -> dict[str, float]:
    """Quantiles of the weights ``exp(log_w)`` of the given (trained) tokens, as ``is_ratio_pNN``, and
    their min and max; with no token, nothing."""
    if log_w.size == 0:
        return {}
    values = np.exp(np.quantile(log_w.astype(np.float64), QUANTILES))
    out = {f"is_ratio_p{round(q * 100):02d}": float(v) for q, v in zip(QUANTILES, values, strict=True)}
    out["is_ratio_min"] = float(np.exp(log_w.min()))
    out["is_ratio_max"] = float(np.exp(log_w.max()))
    return out
