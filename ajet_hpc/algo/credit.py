"""Per-turn credit: turn rewards -> turn returns -> advantages normalised in the task group -> tokens.

An episode has turns (one model call each, today) and a final reward; a turn may also receive its own
reward. Each turn's return is its discounted reward-to-go plus the final reward; returns are standardised
within the task group, every episode counting once; each sample's trainable tokens get its turn's
advantage. Without per-turn rewards this is exactly :func:`ajet_hpc.algo.grpo.group_advantages` of the
episodes' final rewards. See ``docs/grpo.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ajet_hpc.algo.grpo import normalise_in_groups
from ajet_hpc.algo.rloo import others_mean
from ajet_hpc.algo.sample_tensors import is_binary, mask_runs
from ajet_hpc.config.algorithms import Baseline


def turn_returns(turn_rewards: Sequence[float], final_reward: float, gamma: float) -> list[float]:
    """``G_t = final_reward + Σ_{k >= t} gamma^(k - t) * r_k`` for each turn t.

    The final reward is not discounted: every turn shares the outcome fully, so with no per-turn rewards
    all turns of an episode get the episode reward. ``gamma`` (0..1) discounts later per-turn rewards only.
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    returns = [0.0] * len(turn_rewards)
    to_go = 0.0
    for t in reversed(range(len(turn_rewards))):
        to_go = turn_rewards[t] + gamma * to_go
        returns[t] = final_reward + to_go
    return returns


def group_turn_advantages(
    returns: Sequence[Sequence[float]], eps: float = 1e-6, baseline: Baseline = "group_std"
) -> list[list[float]]:
    """The turn advantages of one task group, by the algorithm's ``baseline`` (``config.algorithms``).

    ``returns[e][t]`` is the return of turn t of episode e. ``group_std``: ``(G - mean) / (std + eps)``,
    mean and population std weighting each turn by ``1 / (turns of its episode)``, so every episode counts
    once however many turns it took. ``group_mean``: ``G - mean`` (the same mean). ``leave_one_out``:
    ``G - mean of the other episodes' mean returns``. A group whose returns are all equal (one episode with
    one turn included) gets zeros; a group of one episode gets zeros too, as a group of one does in
    :func:`ajet_hpc.algo.grpo.group_advantages`.
    """
    for e, turns in enumerate(returns):
        if not turns:
            raise ValueError(f"episode {e} has no turns: drop it from the group or give it one")
    if len(returns) < 2:
        return [[0.0] * len(turns) for turns in returns]
    values = torch.tensor([g for turns in returns for g in turns], dtype=torch.float64)
    weights = torch.tensor([1.0 / len(turns) for turns in returns for _ in turns], dtype=torch.float64)
    if baseline == "leave_one_out":
        flat = _leave_one_out(returns, values)
    elif baseline in ("group_std", "group_mean"):
        flat = normalise_in_groups(
            values,
            torch.zeros(len(values), dtype=torch.long),
            weights=weights,
            eps=eps,
            scale=baseline == "group_std",
        )
    else:
        raise ValueError(f"unknown baseline {baseline!r}: group_std, group_mean or leave_one_out")
    out, start = [], 0
    for turns in returns:
        out.append(flat[start : start + len(turns)].tolist())
        start += len(turns)
    return out


def _leave_one_out(returns: Sequence[Sequence[float]], values: torch.Tensor) -> torch.Tensor:
    """``G_{e,t} - mean_{e' != e} m_{e'}``, ``m_e`` being episode e's mean return (float32; 0 if all
    equal)."""
    if bool((values == values[0]).all()):
        return torch.zeros(len(values), dtype=torch.float32)
    means = torch.tensor([sum(turns) / len(turns) for turns in returns], dtype=torch.float64)
    baseline = others_mean(means, torch.zeros(len(returns), dtype=torch.long))
    per_turn = torch.repeat_interleave(baseline, torch.tensor([len(turns) for turns in returns]))
    return (values - per_turn).to(torch.float32)


def episode_token_advantages(
    returns: Sequence[Sequence[float]],
    sample_turns: Sequence[tuple[int, int]],
    loss_masks: Sequence[Sequence[int]],
    eps: float = 1e-6,
) -> list[list[float]]:
    """Per-token advantages of a task group's samples: each sample's turn advantage on its trainable tokens.

    ``returns[e][t]``: return of turn t of episode e (from :func:`turn_returns`); ``sample_turns[i]``:
    ``(episode, turn)`` of sample i; ``loss_masks[i]``: its loss mask. Returns, per sample, one advantage per
    token, 0.0 where the loss mask is 0 (ready for :class:`ajet_hpc.algo.sample_tensors.Sample.advantages`).
    """
    if len(sample_turns) != len(loss_masks):
        raise ValueError(f"{len(sample_turns)} sample_turns but {len(loss_masks)} loss_masks: one per sample")
    advantages = group_turn_advantages(returns, eps=eps)
    out = []
    for i, ((e, t), mask) in enumerate(zip(sample_turns, loss_masks, strict=True)):
        if not (0 <= e < len(returns) and 0 <= t < len(returns[e])):
            raise ValueError(f"sample {i} points to episode {e} turn {t}, which the returns do not have")
        out.append(masked_row(advantages[e][t], mask))
    return out


def masked_row(value: float, mask: Sequence[int]) -> list[float]:
    """``[value if m else 0.0 for m in mask]``, built from the mask's runs of 1s as slices (a call's mask is
    its whole prompt, 0s, then its answer: a per-token Python loop over it cost seconds per step at real
    batch sizes). A mask with other values than 0 and 1 takes the loop."""
    mask = mask if isinstance(mask, list) else list(mask)
    if not is_binary(mask):
        return [value if m else 0.0 for m in mask]
    row = [0.0] * len(mask)
    for start, end in mask_runs(mask):
        row[start:end] = [value] * (end - start)
    return row
