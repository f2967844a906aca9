"""GRPO maths as pure tensor functions: group advantages, token log-probabilities, the clipped loss.

The clipped surrogate here serves every algorithm (docs/algorithms.md); the formulas and the choices
behind them are written out in ``docs/grpo.md``. Nothing here knows about
DeepSpeed, ranks or files; the trainer orchestrates.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from ajet_hpc.algo.gspo import sequence_log_ratio


def group_index(group_ids: Sequence[Hashable]) -> Tensor:
    """Dense group numbers (long, ``[N]``) in order of first appearance: ``["b", "a", "b"] -> [0, 1, 0]``."""
    numbers: dict[Hashable, int] = {}
    return torch.tensor([numbers.setdefault(g, len(numbers)) for g in group_ids], dtype=torch.long)


def normalise_in_groups(
    values: Tensor, index: Tensor, *, weights: Tensor | None = None, eps: float = 1e-6, scale: bool = True
) -> Tensor:
    """``(v - mean_g) / (std_g + eps)`` with the (weighted) population mean and std of each value's group;
    with ``scale=False`` only ``v - mean_g`` (Dr. GRPO).

    ``index`` holds each value's group number (``0..G-1``); ``weights`` (positive, default 1) weight each
    value in its group's mean and variance: ``mean = Σ w v / Σ w``, ``var = Σ w (v - mean)² / Σ w``. A group
    whose values are all equal (a group of one included) gets exactly 0, whatever the rounding of its mean.
    Statistics are computed in float64; the result is float32.
    """
    if values.dim() != 1 or index.shape != values.shape:
        raise ValueError(f"values and index must be 1-D of equal length, got {values.shape}, {index.shape}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    v = values.detach().to(torch.float64)
    w = torch.ones_like(v) if weights is None else weights.detach().to(torch.float64)
    if w.shape != v.shape or bool((w <= 0).any()):
        raise ValueError("weights must be positive, one per value")
    if not bool(torch.isfinite(v).all()):
        raise ValueError("values must be finite")
    groups = int(index.max()) + 1
    total = v.new_zeros(groups).index_add_(0, index, w)
    mean = v.new_zeros(groups).index_add_(0, index, w * v) / total
    dev = v - mean[index]
    std = (v.new_zeros(groups).index_add_(0, index, w * dev**2) / total).sqrt()
    high = v.new_full((groups,), -torch.inf).scatter_reduce(0, index, v, "amax")
    low = v.new_full((groups,), torch.inf).scatter_reduce(0, index, v, "amin")
    equal = (high == low)[index]
    return torch.where(equal, 0.0, dev / (std[index] + eps) if scale else dev).to(torch.float32)


def group_advantages(rewards: Tensor, group_ids: Sequence[Hashable], eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward standardised within its group, ``(r - mean) / (std + eps)``.

    ``std`` is the population std (``unbiased=False``, divide by n). A group of one, or of equal rewards,
    gets advantage 0. ``rewards``: shape ``[N]``; ``group_ids``: one hashable per reward (e.g. the task id).
    Returns float32, shape ``[N]``.
    """
    if rewards.dim() != 1 or len(group_ids) != rewards.shape[0]:
        raise ValueError(
            f"rewards must be 1-D with one group id each, got shape {tuple(rewards.shape)} "
            f"and {len(group_ids)} group ids"
        )
    return normalise_in_groups(rewards, group_index(group_ids), eps=eps)


def _check_logits(logits: Tensor, input_ids: Tensor | None = None) -> None:
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape [B, T, V], got {tuple(logits.shape)}")
    if input_ids is not None and input_ids.shape != logits.shape[:2]:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} != logits [B, T] {tuple(logits.shape[:2])}")


def _shift_right(per_position: Tensor) -> Tensor:
    """Prepend a zero column: the value computed from position t-1 lands on position t."""
    return torch.cat([per_position.new_zeros(per_position.shape[0], 1), per_position], dim=1)


def token_logprobs(logits: Tensor, input_ids: Tensor, parents: Tensor | None = None) -> Tensor:
    """``out[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``; position 0 (no context) is 0.

    ``logits``: ``[B, T, V]`` from a causal LM (position t predicts token t+1); computed in float32.
    Returns float32 ``[B, T]``, aligned with ``input_ids`` and the samples' ``loss_mask`` / ``old_logprobs``.
    For tree-packed samples, ``parents[b, t]`` (long) is the position whose logits predict token t, -1
    where none does (then 0).
    """
    _check_logits(logits, input_ids)
    if parents is None:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        picked = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return _shift_right(picked)
    logp = torch.log_softmax(logits.float(), dim=-1)
    vocab = logp.shape[-1]
    flat = parents.clamp(min=0) * vocab + input_ids
    picked = logp.reshape(logp.shape[0], -1).gather(1, flat)
    return torch.where(parents >= 0, picked, 0.0)


def entropy_from_logits(logits: Tensor, parents: Tensor | None = None) -> Tensor:
    """Entropy (nats) of the distribution each token was drawn from, aligned like :func:`token_logprobs`.

    ``out[b, t] = H(p(· | input_ids[b, :t]))``, position 0 is 0. Float32 ``[B, T]``. ``parents`` as in
    :func:`token_logprobs`.
    """
    _check_logits(logits)
    if parents is None:
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        return _shift_right(-(logp.exp() * logp).sum(-1))
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return torch.where(parents >= 0, entropy.gather(1, parents.clamp(min=0)), 0.0)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(π || π_ref) per token, for tokens sampled from π.

    With ``d = ref_logprobs - logprobs``: ``exp(d) - d - 1``, which is >= 0, 0 where the two agree, and
    unbiased (its mean under π is the KL) with lower variance than ``-d``.
    """
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def _masked_mean(values: Tensor, mask: Tensor, count: int) -> float:
    return float(torch.where(mask, values, 0.0).sum()) / count if count else 0.0


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float,
    kl_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    weights: Tensor | None = None,
    normalizer: float | None = None,
    ratio_level: str = "token",
    sequence_ids: Tensor | None = None,
    token_scale: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The clipped surrogate of every algorithm, summed over the masked tokens and divided by ``normalizer``.

    Per masked token, with ``ratio = exp(logprobs - old_logprobs)``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A) + kl_coef * k3(lp, ref)

    ``loss = Σ_t weight_t * scale_t * is_t * loss_t / normalizer``. ``normalizer`` defaults to this call's
    masked-token count (a token mean); the trainer passes the step's divisor (its masked tokens, or its
    sequences: ``ajet_hpc.algo.loss_agg``) over all micro-batches and ranks, so that the micro-batch
    losses add up to the loss of the step as one big batch. Weights do not enter the normalizer.

    ``ratio_level="sequence"`` (GSPO) takes each token's ratio as its sequence's, ``exp`` of the sequence
    mean of the log-ratio (``sequence_ids`` from ``ajet_hpc.algo.sequences``). ``token_scale`` is the
    aggregation's per-token factor (``ajet_hpc.algo.loss_agg.token_scale``), ``is_weights`` the
    off-policy correction's (``ajet_hpc.algo.off_policy``); both default to 1 and carry no gradient.

    Tensors are ``[B, T]``; ``weights`` is ``[B, T]`` or per sample ``[B]`` (default 1). Positions outside
    ``loss_mask`` contribute nothing, not even NaN from extreme log-probabilities there. The KL term needs
    ``ref_logprobs``; with ``kl_coef=0`` and ``ref_logprobs`` given, the KL is only measured.

    Metrics (means over this call's masked tokens, unweighted): ``clip_frac`` (tokens whose clipped term is
    the one taken, ``clip_frac_low`` + ``clip_frac_high``), ``ratio_mean``, ``approx_kl`` (k3 estimate of
    KL(π_old || π)), ``kl`` (only with ``ref_logprobs``), and ``tokens`` (the masked-token count, to
    aggregate metrics over micro-batches as token-weighted means).
    """
    shape = logprobs.shape
    named = {"old_logprobs": old_logprobs, "advantages": advantages, "loss_mask": loss_mask}
    if ref_logprobs is not None:
        named["ref_logprobs"] = ref_logprobs
    _check_policy_loss_inputs(shape, named, kl_coef, ref_logprobs is not None, normalizer)

    mask = loss_mask != 0
    tokens = int(mask.sum())
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.float(), 0.0)
    if ratio_level == "sequence":
        if sequence_ids is None or sequence_ids.shape != shape:
            raise ValueError("ratio_level 'sequence' needs sequence_ids of the logprobs' shape")
        log_ratio = sequence_log_ratio(log_ratio, torch.where(mask, sequence_ids, -1))
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio_level {ratio_level!r}: token or sequence")
    ratio = torch.exp(log_ratio)
    adv = advantages.float()
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    kl = None
    if ref_logprobs is not None:
        kl = kl_k3(torch.where(mask, logprobs.float(), 0.0), torch.where(mask, ref_logprobs.float(), 0.0))
        per_token = per_token + kl_coef * kl

    w = _token_weights(mask, weights, token_scale, is_weights)  # weight_t * scale_t * is_t, 0 off the mask
    denominator = normalizer if normalizer is not None else max(tokens, 1)
    loss = torch.where(mask, per_token * w, 0.0).sum() / denominator
    return loss, _loss_metrics(ratio, log_ratio, adv, kl, mask, tokens, clip_eps, clip_eps_high)


def _check_policy_loss_inputs(
    shape: torch.Size, named: dict[str, Tensor], kl_coef: float, has_ref: bool, normalizer: float | None
) -> None:
    """Raise ValueError for a tensor of ``named`` whose shape is not the logprobs' ``shape``, a KL term
    without reference log-probabilities, or a normalizer that is not positive."""
    for name, tensor in named.items():
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, logprobs has {tuple(shape)}")
    if kl_coef < 0 or (kl_coef > 0 and not has_ref):
        raise ValueError(f"kl_coef={kl_coef} needs kl_coef >= 0, and ref_logprobs when it is > 0")
    if normalizer is not None and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0, got {normalizer}")


def _token_weights(
    mask: Tensor, weights: Tensor | None, token_scale: Tensor | None, is_weights: Tensor | None
) -> Tensor:
    """``weight_t * scale_t * is_t`` of ``policy_loss`` per position, 0 outside ``mask``; ``weights`` per
    token ``[B, T]`` or per sample ``[B]``; the scale and the off-policy weights carry no gradient."""
    w = mask.float()
    if weights is not None:
        weights = weights.float()
        w = w * (weights.unsqueeze(-1) if weights.dim() == 1 else weights)
    for factor in (token_scale, is_weights):
        if factor is not None:
            w = w * factor.detach().float()
    return w


def _loss_metrics(
    ratio: Tensor,
    log_ratio: Tensor,
    adv: Tensor,
    kl: Tensor | None,
    mask: Tensor,
    tokens: int,
    clip_eps: float,
    clip_eps_high: float,
) -> dict[str, float]:
    """The metrics of ``policy_loss`` (its docstring says which), means over the masked tokens."""
    with torch.no_grad():
        low = (ratio < 1 - clip_eps) & (adv < 0)
        high = (ratio > 1 + clip_eps_high) & (adv > 0)
        metrics = {
            "clip_frac_low": _masked_mean(low.float(), mask, tokens),
            "clip_frac_high": _masked_mean(high.float(), mask, tokens),
            "ratio_mean": _masked_mean(ratio, mask, tokens),
            "approx_kl": _masked_mean(ratio - 1 - log_ratio, mask, tokens),  # k3 estimate of KL(π_old || π)
            "tokens": float(tokens),
        }
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        if kl is not None:
            metrics["kl"] = _masked_mean(kl, mask, tokens)
    return metrics
