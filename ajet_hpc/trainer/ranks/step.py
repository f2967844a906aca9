"""One training step on one rank: its shard of the batch in micro-batches, one optimizer step for all.

Every rank reads the whole batch, so every rank computes the same plan: the shards (balanced by tokens),
each rank's micro-batches, and the step's masked-token count, which divides every micro-batch's loss so
that the micro-batch losses of all ranks add up to the loss of the batch as one big batch. DeepSpeed
averages gradients over the ranks; the loss is multiplied by the world size to make that average the sum.

Ranks with fewer micro-batches than the busiest rank run zero-weight copies of one of their micro-batches
(or of the batch's first sample): ZeRO-2/3 communicate inside every forward/backward, so all ranks must
run the same number of them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from ajet_hpc.algo import off_policy
from ajet_hpc.algo.objective import Objective
from ajet_hpc.algo.output_layer import model_logprobs
from ajet_hpc.algo.sample_tensors import (
    Sample,
    collate,
    dense_tree_mask_of,
    pack_micro_batches,
    tree_block_mask,
)
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.trainer.ranks import lora
from ajet_hpc.trainer.ranks.distributed import shard_by_tokens
from ajet_hpc.trainer.ranks.zero import Models


@dataclass(frozen=True)
class MicroBatch:
    indices: list[int]  # into the batch's samples
    scale: float  # 1.0, or 0.0 for a padding pass


def plan_micro_batches(
    samples: list[Sample], world_size: int, rank: int, token_budget: int
) -> list[MicroBatch]:
    """This rank's micro-batches, padded to the busiest rank's count (see the module doc)."""
    shards = shard_by_tokens([len(s) for s in samples], world_size)
    plans = [
        [[shard[i] for i in mb] for mb in pack_micro_batches([samples[i] for i in shard], token_budget)]
        for shard in shards
    ]
    count = max(len(p) for p in plans)
    mine = [MicroBatch(mb, 1.0) for mb in plans[rank]]
    filler = plans[rank][-1] if plans[rank] else [0]  # the smallest of its own, or the first sample
    return mine + [MicroBatch(filler, 0.0)] * (count - len(mine))


_SUMS = ("loss", "tokens", "clip", "kl", "entropy", "mismatch_kl", "is_hit")


def train_step(
    models: Models, samples: list[Sample], config: TrainerConfig, pad_id: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Forward/backward every micro-batch of this rank, then one optimizer step (all ranks together).

    Returns the step's metrics, equal on every rank: ``loss`` (the batch's loss), ``kl`` (to the
    reference, 0 without one), ``entropy`` and ``clip_frac`` (means over the batch's masked tokens),
    ``grad_norm`` (before clipping), ``tokens`` (masked tokens) and ``samples``; and the engine/trainer gap
    (:func:`off_policy_metrics`).

    The algorithm (``config.algorithm``, ``ajet_hpc.config.algorithms``) sets the ratio's level and the loss
    aggregation (``config.loss_agg`` where it leaves it open); ``config.off_policy`` weighs each term by
    the importance weight between the engine's and the trainer's log-probabilities.
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    engine = models.engine
    objective = Objective.of(config)
    normalizer = objective.divisor(samples)
    sums = dict.fromkeys(_SUMS, 0.0)
    log_ws: list[np.ndarray] = []
    attention = getattr(engine.module.config, "_attn_implementation", "sdpa")
    dtype = next(engine.module.parameters()).dtype
    for micro in plan_micro_batches(samples, world_size, rank, config.micro_batch_tokens):
        batch = {
            k: v.to(models.device)
            for k, v in collate(
                [samples[i] for i in micro.indices], pad_id, dense_tree_mask=attention != "flex_attention"
            ).items()
        }
        inputs = model_inputs(batch, attention, dtype)
        head = _output_layer_plan(config)
        logprobs, entropy = model_logprobs(
            engine,
            inputs,
            batch["loss_mask"],
            batch.get("parents"),
            entropy=True,
            chunk_tokens=head.chunk_tokens,
            min_chunks=head.min_chunks,
        )
        assert entropy is not None  # asked for above
        ref = None
        if models.reference is not None or models.reference_is_base:
            ref = _reference_logprobs(models, inputs, batch, head)
        part = objective.micro_loss(logprobs, batch, float(normalizer), ref)
        loss, metrics = part.loss, part.metrics
        engine.backward(loss * (micro.scale * world_size), scale_wrt_gas=False)
        with torch.no_grad():
            mask = batch["loss_mask"] != 0
            tokens = metrics["tokens"] * micro.scale
            sums["loss"] += float(loss) * micro.scale
            sums["tokens"] += tokens
            sums["clip"] += metrics["clip_frac"] * tokens
            sums["kl"] += metrics.get("kl", 0.0) * tokens
            sums["entropy"] += float(torch.where(mask, entropy, 0.0).sum()) * micro.scale
            sums["mismatch_kl"] += objective.mismatch_kl_sum(logprobs, batch, part.trained) * micro.scale
            sums["is_hit"] += float(part.hit.sum()) * micro.scale
            if micro.scale:
                log_ws.append(part.log_w[part.trained].cpu().numpy())
        del logprobs, entropy, loss
    totals = torch.tensor([sums[k] for k in _SUMS], dtype=torch.float64, device=models.device)
    dist.all_reduce(totals)
    total = dict(zip(_SUMS, totals.tolist(), strict=True))
    if not math.isfinite(total["loss"]):
        # Every rank sees the same sum, so every rank stops here: no optimizer step with NaN gradients.
        raise FloatingPointError(f"the step's loss is {total['loss']}: no optimizer step taken")
    engine.step()
    grad_norm = engine.get_global_grad_norm()
    n = max(total["tokens"], 1.0)
    return {
        "loss": total["loss"],
        "kl": total["kl"] / n,
        "entropy": total["entropy"] / n,
        "clip_frac": total["clip"] / n,
        "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "tokens": round(total["tokens"]),
        "samples": len(samples),
    }, off_policy_metrics(total, _gathered(log_ws), objective.correction)


def off_policy_metrics(
    total: dict[str, float], log_w: np.ndarray, correction: off_policy.Correction
) -> dict[str, float]:
    """The engine/trainer gap of the step: ``mismatch_kl`` (k3 estimate of KL(engine || trainer) per
    trained token), quantiles of the importance weights (``is_ratio_p01`` .. ``p99``, min, max; per token,
    at the configured level), and under ``tis`` / ``mis`` the share of trained tokens truncated
    (``is_truncated_frac``) or masked (``is_masked_frac``)."""
    n = max(total["tokens"], 1.0)
    out = {"mismatch_kl": total["mismatch_kl"] / n, **off_policy.ratio_quantiles(log_w)}
    if correction.mode == "tis":
        out["is_truncated_frac"] = total["is_hit"] / n
    elif correction.mode == "mis":
        out["is_masked_frac"] = total["is_hit"] / n
    return out


def _gathered(parts: list[np.ndarray]) -> np.ndarray:
    """This step's log-weights of every rank, in one array (the same on every rank)."""
    mine = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    every: list[np.ndarray | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return np.concatenate([part for part in every if part is not None])


def model_inputs(
    batch: dict[str, torch.Tensor], attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The forward's arguments for a collated batch: ids and mask, plus position ids for tree samples.

    A tree batch's mask takes the form its attention kernel takes: SDPA gets the boolean ``[B, 1, T, T]``
    mask (True = may attend); eager attention adds its mask to the scores, so it gets 0 / the dtype's
    minimum instead; FlexAttention (``flex_attention``, chosen on GPUs by
    :func:`ajet_hpc.algo.sample_tensors.tree_attention`) gets a ``BlockMask`` built from ``tree_ends``
    that never grows quadratically. The dense forms are built here when the batch was collated without
    them. Other kernels (flash attention) take no arbitrary mask: tree merging is refused there.
    """
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "position_ids" not in batch:
        return inputs
    inputs["position_ids"] = batch["position_ids"]
    if attn_implementation == "flex_attention":
        if torch.is_grad_enabled() and batch["input_ids"].device.type == "cpu":
            raise ValueError(
                "tree-packed samples with 'flex_attention' train on GPUs only (FlexAttention has no backward "
                "on the CPU): load the model with 'sdpa' there"
            )
        inputs["attention_mask"] = tree_block_mask(batch["tree_ends"])
        return inputs
    if attn_implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"tree-packed samples need 'sdpa', 'eager' or 'flex_attention' attention (a tree mask); the "
            f"model uses {attn_implementation!r}: set trainer.merge.mode to 'linear' or load it with sdpa"
        )
    mask = batch["attention_mask"]
    if mask.dim() == 2:
        mask = dense_tree_mask_of(batch["tree_ends"])
    inputs["attention_mask"] = mask
    if attn_implementation == "eager":
        inputs["attention_mask"] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return inputs


@dataclass(frozen=True)
class HeadPlan:
    """How ``model_logprobs`` runs the output layer (see ``_output_layer_plan``)."""

    chunk_tokens: int
    min_chunks: int = 0


def _output_layer_plan(config: TrainerConfig) -> HeadPlan:
    """How the output layer runs: chunks of ``logits_chunk_tokens`` rows, except under ZeRO-3, where every
    head call gathers the head's weight in a collective: there it runs once per micro-batch on all the
    trained rows (at least once, on a zero row, where there are none), the same calls on every rank. Several
    calls per micro-batch (chunks, or their recompute) desynchronised the ranks' collectives in DeepSpeed
    0.19 even with equal call counts (tests/component/test_trainer.py with chunks of 3 rows)."""
    if config.zero_stage == 3:
        return HeadPlan(chunk_tokens=2**62, min_chunks=1)
    return HeadPlan(chunk_tokens=config.logits_chunk_tokens)


def _reference_logprobs(
    models: Models, inputs: dict[str, torch.Tensor], batch: dict[str, torch.Tensor], head: HeadPlan
) -> torch.Tensor:
    """The reference policy's logprobs: the frozen reference model, or under LoRA the base itself (the
    policy's own module with its adapter disabled)."""
    if models.reference_is_base:
        module, context = models.engine, lora.base_only(models.engine.module)
    elif models.reference is not None:
        module, context = models.reference, contextlib.nullcontext()
    else:
        raise ValueError("reference log-probabilities asked for without a reference model (kl_coef is 0)")
    with torch.no_grad(), context:
        logprobs, _ = model_logprobs(
            module,
            inputs,
            batch["loss_mask"],
            batch.get("parents"),
            chunk_tokens=head.chunk_tokens,
            min_chunks=head.min_chunks,
        )
        return logprobs
