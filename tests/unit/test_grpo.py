"""GRPO maths against hand-computed numbers: advantages, logprobs, the clipped loss, credit, batching.

Every expected value is written out as a number worked by hand (the derivation in the comment next to it),
never recomputed with the code under test.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TypedDict

import pytest
import torch

from ajet_hpc.algo import (
    Sample,
    collate,
    entropy_from_logits,
    episode_token_advantages,
    group_advantages,
    group_turn_advantages,
    kl_k3,
    pack_micro_batches,
    policy_loss,
    token_logprobs,
    turn_returns,
)


class Clip(TypedDict):
    clip_eps: float
    clip_eps_high: float


class ClipKl(Clip):
    kl_coef: float


CLIP: Clip = {"clip_eps": 0.2, "clip_eps_high": 0.28}
SQRT_1_5 = 1.2247449  # sqrt(3/2)


def _t(rows: Sequence[Sequence[float]] | Sequence[Sequence[Sequence[float]]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _close(actual: torch.Tensor | float | list[float], expected: list | float, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float32),
        torch.tensor(expected, dtype=torch.float32),
        atol=atol,
        rtol=0,
    )


# --- group advantages ------------------------------------------------------------------------------------


def test_group_advantages_two_interleaved_groups() -> None:
    # group a = [1, 0, 0, 1]: mean 0.5, population std 0.5 -> [1, -1, -1, 1]
    # group b = [2, 4, 6]: mean 4, population var (4 + 0 + 4) / 3 = 8/3, std 1.63299
    #   -> [-2 / 1.63299, 0, 2 / 1.63299] = [-sqrt(1.5), 0, sqrt(1.5)]
    rewards = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 6.0, 1.0])
    ids = ["a", "b", "a", "b", "a", "b", "a"]
    _close(group_advantages(rewards, ids, eps=0.0), [1, -SQRT_1_5, -1, 0, -1, SQRT_1_5, 1])
    # the default eps: 0.5 / (0.5 + 1e-6) = 0.999998
    _close(group_advantages(rewards, ids)[0], 0.999998)


def test_group_advantages_equal_rewards_and_groups_of_one_are_zero() -> None:
    # 0.1 is not exact in binary: the group's mean may miss 0.1 by an ulp; the advantage must still be 0
    rewards = torch.tensor([0.1, 0.1, 0.1, 5.0, 3.0, 3.0], dtype=torch.float32)
    adv = group_advantages(rewards, [7, 7, 7, "one", ("x", 1), ("x", 1)])
    assert adv.tolist() == [0.0] * 6
    assert adv.dtype == torch.float32


def test_group_advantages_rejects_mismatched_ids() -> None:
    with pytest.raises(ValueError, match="group id"):
        group_advantages(torch.tensor([1.0, 2.0]), ["a"])


# --- log-probabilities, entropy, KL ----------------------------------------------------------------------

# row 0: position 0 logits [0, ln 3] -> p = [1/4, 3/4]; position 1 logits [ln 2, ln 2] -> p = [1/2, 1/2]
# row 1: position 0 logits [0, 0] -> p = [1/2, 1/2]; position 1 logits [0, ln 3] -> p = [1/4, 3/4]
# the last position's logits predict the token after the sequence and are never used
LOGITS = _t(
    [
        [[0.0, math.log(3)], [math.log(2), math.log(2)], [7.0, -3.0]],
        [[0.0, 0.0], [0.0, math.log(3)], [-5.0, 9.0]],
    ]
)
IDS = torch.tensor([[1, 1, 0], [0, 0, 1]])


def test_token_logprobs_hand_values() -> None:
    # row 0: token 1 after position 0 -> ln 3/4 = -0.2876821; token 0 after position 1 -> ln 1/2 = -0.6931472
    # row 1: token 0 after position 0 -> ln 1/2; token 1 after position 1 -> ln 3/4
    expected = [[0.0, -0.2876821, -0.6931472], [0.0, -0.6931472, -0.2876821]]
    _close(token_logprobs(LOGITS, IDS), expected)
    low_precision = token_logprobs(LOGITS.to(torch.bfloat16), IDS)
    assert low_precision.dtype == torch.float32
    assert low_precision.shape == (2, 3)


def test_entropy_from_logits_hand_values() -> None:
    # H([1/4, 3/4]) = 1/4 ln 4 + 3/4 ln 4/3 = 0.3465736 + 0.2157616 = 0.5623351; H([1/2, 1/2]) = ln 2
    expected = [[0.0, 0.5623351, 0.6931472], [0.0, 0.6931472, 0.5623351]]
    _close(entropy_from_logits(LOGITS), expected)


def test_logits_shape_errors() -> None:
    with pytest.raises(ValueError, match="input_ids"):
        token_logprobs(LOGITS, IDS[:, :2])
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        entropy_from_logits(LOGITS[0])


def test_kl_k3_zero_at_equality_and_hand_values() -> None:
    lp = torch.tensor([-0.3, -2.0, -7.5])
    assert kl_k3(lp, lp).tolist() == [0.0, 0.0, 0.0]
    # d = ref - lp = ln 2: 2 - ln 2 - 1 = 0.3068528;  d = -ln 2: 1/2 + ln 2 - 1 = 0.1931472
    lp = torch.tensor([math.log(0.25), math.log(0.5)])
    ref = torch.tensor([math.log(0.5), math.log(0.25)])
    _close(kl_k3(lp, ref), [0.3068528, 0.1931472])
    generator = torch.Generator().manual_seed(0)
    assert (kl_k3(torch.randn(100, generator=generator), torch.randn(100, generator=generator)) >= 0).all()


# --- policy loss -----------------------------------------------------------------------------------------


def test_policy_loss_at_ratio_one_is_minus_mean_masked_advantage() -> None:
    adv = _t([[1, 2, 3], [-4, 5, 0]])
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    lp = _t([[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.0]])
    loss, metrics = policy_loss(lp, lp.clone(), adv, mask, **CLIP)
    _close(loss, -1 / 3)  # masked advantages 2, 3, -4: mean 1/3
    assert metrics == {
        "clip_frac_low": 0.0,
        "clip_frac_high": 0.0,
        "clip_frac": 0.0,
        "ratio_mean": 1.0,
        "approx_kl": 0.0,
        "tokens": 3.0,
    }


def test_policy_loss_clipped_positive_advantage() -> None:
    # A = 2, ratio 1.5: min(1.5 * 2, 1.28 * 2) = 2.56 -> loss -2.56
    loss, metrics = policy_loss(_t([[math.log(1.5)]]), _t([[0.0]]), _t([[2.0]]), torch.ones(1, 1), **CLIP)
    _close(loss, -2.56)
    assert metrics["clip_frac_high"] == 1.0 and metrics["clip_frac_low"] == 0.0
    _close(metrics["ratio_mean"], 1.5)
    _close(metrics["approx_kl"], 0.0945349)  # 1.5 - 1 - ln 1.5


def test_policy_loss_clipped_negative_advantage() -> None:
    # A = -1, ratio 0.5: min(0.5 * -1, 0.8 * -1) = -0.8 -> loss 0.8
    loss, metrics = policy_loss(_t([[math.log(0.5)]]), _t([[0.0]]), _t([[-1.0]]), torch.ones(1, 1), **CLIP)
    _close(loss, 0.8)
    assert metrics["clip_frac_low"] == 1.0 and metrics["clip_frac"] == 1.0


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    # tokens: (A=2, r=1.5) clipped high; (A=-1, r=0.5) clipped low; (A=1, r=0.5) and (A=-1, r=1.5) unclipped
    # (the pessimistic min keeps the unclipped term); the fifth token is masked out.
    # loss = (-2.56 + 0.8 - 0.5 + 1.5) / 4 = -0.19; d loss / d lp = -A * r / 4 on unclipped tokens:
    # -1 * 0.5 / 4 = -0.125 and 1 * 1.5 / 4 = 0.375
    lp = torch.tensor(
        [[math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5), -50.0]], requires_grad=True
    )
    adv = _t([[2.0, -1.0, 1.0, -1.0, 3.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = policy_loss(lp, torch.zeros(1, 5), adv, mask, **CLIP)
    loss.backward()
    _close(loss, -0.19)
    assert lp.grad is not None
    _close(lp.grad, [[0.0, 0.0, -0.125, 0.375, 0.0]])
    assert metrics["clip_frac"] == 0.5 and metrics["tokens"] == 4.0


def test_policy_loss_kl_penalty_hand_value() -> None:
    # ratio 1, A = 0: only the KL term, 0.1 * (2 - ln 2 - 1) = 0.0306853
    lp = _t([[math.log(0.25), -9.0]])
    ref = _t([[math.log(0.5), 0.0]])
    mask = torch.tensor([[1, 0]])
    loss, metrics = policy_loss(
        lp, lp.clone(), torch.zeros(1, 2), mask, kl_coef=0.1, ref_logprobs=ref, **CLIP
    )
    _close(loss, 0.0306853)
    _close(metrics["kl"], 0.3068528)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(lp, lp, torch.zeros(1, 2), mask, kl_coef=0.1, **CLIP)


def test_policy_loss_sample_weights() -> None:
    # ratio 1; masked advantages 1 (weight 2) and 4 (weight 0.5): -(2 * 1 + 0.5 * 4) / 2 tokens = -2
    lp = torch.zeros(2, 2)
    adv = _t([[1.0, 9.0], [4.0, 9.0]])
    mask = torch.tensor([[1, 0], [1, 0]])
    loss, _ = policy_loss(lp, lp, adv, mask, weights=torch.tensor([2.0, 0.5]), **CLIP)
    _close(loss, -2.0)
    loss_bt, _ = policy_loss(lp, lp, adv, mask, weights=_t([[2.0, 2.0], [0.5, 0.5]]), **CLIP)
    _close(loss_bt, -2.0)


def test_masked_positions_with_extreme_values_stay_finite() -> None:
    # a padding position whose logprob is -200 (exp(200) overflows float32) must not turn the loss into NaN
    lp = torch.tensor([[-0.5, -200.0]], requires_grad=True)
    old = _t([[-0.5, 0.0]])
    ref = _t([[-0.5, 0.0]])
    loss, metrics = policy_loss(
        lp, old, _t([[1.0, 1.0]]), torch.tensor([[1, 0]]), kl_coef=1.0, ref_logprobs=ref, **CLIP
    )
    loss.backward()
    _close(loss, -1.0)
    assert lp.grad is not None
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0.0
    assert metrics["kl"] == 0.0 and metrics["approx_kl"] == 0.0


def test_micro_batches_with_global_normalizer_add_up_to_the_full_batch() -> None:
    generator = torch.Generator().manual_seed(3)
    shape = (4, 6)
    lp_full = (torch.randn(shape, generator=generator) * 0.3 - 1.0).requires_grad_(True)
    old = lp_full.detach() + torch.randn(shape, generator=generator) * 0.3
    ref = lp_full.detach() + torch.randn(shape, generator=generator) * 0.2
    adv = torch.randn(shape, generator=generator)
    mask = (torch.rand(shape, generator=generator) > 0.4).long()
    weights = torch.tensor([1.0, 0.5, 2.0, 1.5])
    options: ClipKl = {"kl_coef": 0.05, **CLIP}

    full, _ = policy_loss(lp_full, old, adv, mask, ref_logprobs=ref, weights=weights, **options)
    full.backward()

    lp_parts = lp_full.detach().clone().requires_grad_(True)
    total_tokens = int(mask.sum())
    summed = torch.zeros(())
    for rows in (slice(0, 1), slice(1, 4)):  # unequal micro-batches: a plain mean of means would differ
        part, _ = policy_loss(
            lp_parts[rows],
            old[rows],
            adv[rows],
            mask[rows],
            ref_logprobs=ref[rows],
            weights=weights[rows],
            normalizer=total_tokens,
            **options,
        )
        part.backward()
        summed = summed + part.detach()
    torch.testing.assert_close(summed, full.detach())
    torch.testing.assert_close(lp_parts.grad, lp_full.grad)


def test_policy_loss_rejects_bad_inputs() -> None:
    lp = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.zeros(1, 3), torch.ones(1, 2), **CLIP)
    with pytest.raises(ValueError, match="normalizer"):
        policy_loss(lp, lp, lp, torch.ones(1, 2), normalizer=0, **CLIP)


# --- per-turn credit -------------------------------------------------------------------------------------


def test_turn_returns_hand_values() -> None:
    # gamma 0.5, r = [1, 0, 2], final 1:
    # G2 = 1 + 2 = 3; G1 = 1 + 0 + 0.5 * 2 = 2; G0 = 1 + 1 + 0 + 0.25 * 2 = 2.5
    assert turn_returns([1.0, 0.0, 2.0], 1.0, 0.5) == [2.5, 2.0, 3.0]
    # gamma 1: plain reward-to-go plus the final reward
    assert turn_returns([1.0, 0.0, 2.0], 1.0, 1.0) == [4.0, 3.0, 3.0]
    assert turn_returns([0.0, 0.0], 0.7, 0.9) == [0.7, 0.7]
    assert turn_returns([], 1.0, 1.0) == []
    with pytest.raises(ValueError, match="gamma"):
        turn_returns([1.0], 0.0, 1.5)


def test_per_turn_credit_hand_example() -> None:
    # episode A: final 1, turn rewards [0, 2], gamma 0 -> returns [1, 3]; episode B: final 0, one turn -> [0]
    returns = [turn_returns([0.0, 2.0], 1.0, 0.0), turn_returns([0.0], 0.0, 0.0)]
    assert returns == [[1.0, 3.0], [0.0]]
    # each episode counts once: A's turns weigh 1/2 each, B's turn 1 (total 2)
    # mean = (0.5 * 1 + 0.5 * 3 + 1 * 0) / 2 = 1; var = (0.5 * 0 + 0.5 * 4 + 1 * 1) / 2 = 1.5, std = 1.2247449
    # advantages: A = [0, 2 / 1.2247449 = 1.6329932], B = [-1 / 1.2247449 = -0.8164966]
    per_turn = group_turn_advantages(returns, eps=0.0)
    _close(per_turn[0], [0.0, 1.6329932])
    _close(per_turn[1], [-0.8164966])
    tokens = episode_token_advantages(
        returns, [(0, 0), (0, 1), (1, 0)], [[0, 1, 1], [0, 0, 1, 1], [0, 1]], eps=0.0
    )
    _close(tokens[0], [0.0, 0.0, 0.0])
    _close(tokens[1], [0.0, 0.0, 1.6329932, 1.6329932])
    _close(tokens[2], [0.0, -0.8164966])


def test_without_turn_rewards_credit_reduces_to_group_advantages() -> None:
    # episodes of 1, 2 and 3 turns with final rewards 1, 0, 0.5 and no per-turn rewards.
    # group_advantages([1, 0, 0.5]): mean 0.5, population std sqrt(1/6) = 0.4082483
    #   -> [0.5 / 0.4082483, -0.5 / 0.4082483, 0] = [sqrt(1.5), -sqrt(1.5), 0]
    # (weighting turns instead of episodes would give mean 2.5 / 6 and different numbers)
    finals = [1.0, 0.0, 0.5]
    returns = [turn_returns([0.0] * n, final, 0.9) for n, final in zip((1, 2, 3), finals, strict=True)]
    sample_turns = [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    masks = [[0, 1, 1]] * len(sample_turns)
    tokens = episode_token_advantages(returns, sample_turns, masks)
    episode_adv = group_advantages(torch.tensor(finals), ["task"] * 3)
    _close(episode_adv, [SQRT_1_5, -SQRT_1_5, 0.0], atol=1e-5)
    for (episode, _), row in zip(sample_turns, tokens, strict=True):
        _close(row, [0.0, float(episode_adv[episode]), float(episode_adv[episode])])


def test_credit_edge_cases() -> None:
    # a group of one episode has no baseline: zeros, as group_advantages gives a group of one
    assert group_turn_advantages([[1.0, 3.0]]) == [[0.0, 0.0]]
    with pytest.raises(ValueError, match="no turns"):
        group_turn_advantages([[1.0], []])
    with pytest.raises(ValueError, match="episode 2 turn 0"):
        episode_token_advantages([[1.0], [0.0]], [(2, 0)], [[1]])


# --- samples, micro-batches, collate ---------------------------------------------------------------------


def _sample(n: int, weight: float = 1.0, start: int = 10) -> Sample:
    return Sample(
        token_ids=list(range(start, start + n)),
        loss_mask=[0] + [1] * (n - 1),
        old_logprobs=[0.0] + [-0.5] * (n - 1),
        advantages=[0.0] + [1.5] * (n - 1),
        policy_version=3,
        episode_id="ep",
        task_id="task",
        weight=weight,
    )


def test_sample_rejects_unequal_lengths_naming_the_field() -> None:
    with pytest.raises(ValueError, match="advantages"):
        Sample([1, 2], [0, 1], [0.0, -1.0], [0.0], 0, "ep", "task")
    with pytest.raises(ValueError, match="loss_mask"):
        Sample([1, 2], [0, 2], [0.0, -1.0], [0.0, 1.0], 0, "ep", "task")


def test_pack_micro_batches_hand_example() -> None:
    # lengths by index: 3, 9, 4, 4, 2, 12, 1; budget 10; longest first: 12 | 9 | 4 4 | 3 2 1
    # [5] alone (12 > budget); 9 + 4 would pad to 18; 4, 4 pad to 8, a third would pad to 12; 3, 2, 1 pad to 9
    samples = [_sample(n) for n in (3, 9, 4, 4, 2, 12, 1)]
    assert pack_micro_batches(samples, 10) == [[5], [1], [2, 3], [0, 4, 6]]
    assert pack_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="token_budget"):
        pack_micro_batches(samples, 0)


def test_pack_micro_batches_respects_the_budget() -> None:
    rng = random.Random(5)
    for budget in (16, 64, 100):
        samples = [_sample(rng.randint(1, 80)) for _ in range(40)]
        batches = pack_micro_batches(samples, budget)
        assert sorted(i for batch in batches for i in batch) == list(range(40))
        for batch in batches:
            padded = max(len(samples[i]) for i in batch) * len(batch)
            assert padded <= budget or len(batch) == 1


def test_collate_right_pads() -> None:
    batch = collate([_sample(3, weight=2.0), _sample(1, weight=0.5, start=7)], pad_id=99)
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "loss_mask",
        "old_logprobs",
        "advantages",
        "weights",
        "sequence_ids",
    }
    assert batch["input_ids"].tolist() == [[10, 11, 12], [7, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [0, 0, 0]]
    assert batch["old_logprobs"].tolist() == [[0.0, -0.5, -0.5], [0.0, 0.0, 0.0]]
    assert batch["advantages"].tolist() == [[0.0, 1.5, 1.5], [0.0, 0.0, 0.0]]
    assert batch["weights"].tolist() == [[2.0, 2.0, 2.0], [0.5, 0.0, 0.0]]
    assert batch["input_ids"].dtype == torch.long and batch["advantages"].dtype == torch.float32
    with pytest.raises(ValueError, match="at least one"):
        collate([], pad_id=0)
