"""The algorithms of ``trainer.algorithm`` and the off-policy correction, checked against their formulas.

Every expected value here is worked out in the test from the formula of docs/algorithms.md, in plain
Python floats, token by token: the loss of a tiny hand-made batch and its gradient with respect to the
trainer's log-probabilities (the only thing the model's gradient flows through). The code under test is
the trainer's own objective (``ajet_hpc.algo.objective``) on batches collated the way the trainer
collates them, and the sample build (``ajet_hpc.trainer.coordinator.episodes_to_samples``) for the advantages.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, get_args

import pytest
import torch

from ajet_hpc.algo.objective import Objective
from ajet_hpc.algo.sample_tensors import Sample, collate
from ajet_hpc.config import ConfigError, MergeConfig, TrainerConfig, load_topology
from ajet_hpc.config.algorithms import ALGORITHMS, AlgorithmName, algorithm
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.trainer import OverlongConfig
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.tracking.episode import EpisodeData
from ajet_hpc.tracking.timeline import Timeline
from ajet_hpc.trainer.coordinator.collector import Batch
from ajet_hpc.trainer.coordinator.episodes_to_samples import build_samples

LOW, HIGH = 0.2, 0.28

# ---- the batch: two samples, three answers (sequences) ----------------------------------------------
# sample 0: prompt, answer of 3 tokens (A = +1), a turn marker, answer of 2 tokens (A = -0.5)
# sample 1: two prompt tokens, answer of 2 tokens (A = +2)
MASKS = [[0, 1, 1, 1, 0, 1, 1], [0, 0, 1, 1]]
ADV: list[list[float]] = [[0, 1, 1, 1, 0, -0.5, -0.5], [0, 0, 2, 2]]
ENGINE: list[list[float]] = [
    [0, -1.0, -2.0, -0.5, 0, -1.5, -1.0],
    [0, 0, -0.7, -1.2],
]  # log μ, recorded by the engine
# log π of the trainer: ratios exp(lp - old) of 1.105, 1.492 (clipped high), 1, 0.741 (clipped low), 1.051,
# 0.905, 1.35 (clipped high)
TRAINER = [[0, -0.9, -1.6, -0.5, 0, -1.8, -0.95], [0, 0, -0.8, -0.9]]
SEQUENCES = [[(0, 1), (0, 2), (0, 3)], [(0, 5), (0, 6)], [(1, 2), (1, 3)]]  # (row, position) per answer


def samples() -> list[Sample]:
    return [
        Sample(
            token_ids=list(range(5, 5 + len(mask))),
            loss_mask=mask,
            old_logprobs=engine,
            advantages=adv,
            policy_version=0,
            episode_id=f"e{i}",
            task_id="t",
        )
        for i, (mask, adv, engine) in enumerate(zip(MASKS, ADV, ENGINE, strict=True))
    ]


def trainer_logprobs(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    values = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
    for row, lp in enumerate(TRAINER):
        values[row, : len(lp)] = torch.tensor(lp)
    return values.requires_grad_(True)


def run(objective: Objective) -> tuple[float, dict[tuple[int, int], float], Any]:
    """The objective's loss on the batch, its gradient per trained token, and the micro-batch result."""
    batch = collate(samples(), pad_id=0)
    lp = trainer_logprobs(batch)
    part = objective.micro_loss(lp, batch, float(objective.divisor(samples())))
    part.loss.backward()
    assert lp.grad is not None
    grads = {(r, t): float(lp.grad[r, t]) for seq in SEQUENCES for r, t in seq}
    untrained = [float(lp.grad[r, t]) for r in range(2) for t in range(lp.shape[1]) if (r, t) not in grads]
    assert untrained == [0.0] * len(untrained)
    return float(part.loss.detach()), grads, part


# ---- the formulas, by hand ----------------------------------------------------------------------------


def clipped(log_ratio: float, adv: float, low: float = LOW, high: float = HIGH) -> tuple[float, float]:
    """PPO's ``-min(r A, clip(r, 1 - low, 1 + high) A)`` and its derivative in ``log r``: ``-r A`` where
    the unclipped term is the smaller, 0 where the clipped constant is taken."""
    r = math.exp(log_ratio)
    c = min(max(r, 1 - low), 1 + high)
    if r * adv <= c * adv:
        return -r * adv, -r * adv
    return -c * adv, 0.0


def tokens() -> list[tuple[int, int]]:
    return [token for seq in SEQUENCES for token in seq]


def log_ratio(token: tuple[int, int]) -> float:
    r, t = token
    return TRAINER[r][t] - ENGINE[r][t]


def adv(token: tuple[int, int]) -> float:
    r, t = token
    return float(ADV[r][t])


def close(got: float, want: float) -> None:
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def close_grads(got: dict[tuple[int, int], float], want: dict[tuple[int, int], float]) -> None:
    assert got.keys() == want.keys()
    for token in want:
        assert got[token] == pytest.approx(want[token], rel=1e-5, abs=1e-6), token


# ---- the loss of each algorithm ----------------------------------------------------------------------


def test_grpo_dapo_rloo_and_reinforce_pp_share_the_token_mean_clipped_loss() -> None:
    """``Σ_t -min(r_t A_t, clip(r_t) A_t) / T`` over the batch's T trained tokens, for every algorithm whose
    loss is the token-level one (they differ in their advantages, below)."""
    terms = {token: clipped(log_ratio(token), adv(token)) for token in tokens()}
    want_loss = sum(value for value, _ in terms.values()) / 7
    want_grads = {token: slope / 7 for token, (_, slope) in terms.items()}
    # one number worked out on paper, so that the helper above is checked too
    by_hand = (-math.exp(0.1) - 1.28 - 1.0 + 0.4 + 0.5 * math.exp(0.05) - 2 * math.exp(-0.1) - 2 * 1.28) / 7
    close(want_loss, by_hand)
    for name in ("grpo", "dapo", "rloo", "reinforce_pp"):
        loss, grads, part = run(Objective.of(TrainerConfig(algorithm=name).resolved(ServingConfig())))
        close(loss, want_loss)
        close_grads(grads, want_grads)
        assert part.metrics["tokens"] == 7


def test_dr_grpo_divides_each_sequence_token_sum_by_a_constant() -> None:
    """``Σ_t ℓ_t / (L S)``: L = token_sum_norm, S = 3 sequences."""
    config = TrainerConfig(algorithm="dr_grpo", token_sum_norm=16).resolved(ServingConfig())
    loss, grads, _ = run(Objective.of(config))
    terms = {token: clipped(log_ratio(token), adv(token)) for token in tokens()}
    close(loss, sum(v for v, _ in terms.values()) / (16 * 3))
    close_grads(grads, {token: slope / (16 * 3) for token, (_, slope) in terms.items()})


def test_seq_mean_token_mean_averages_each_answer_then_the_answers() -> None:
    """GRPO's token ratio with ``loss_agg: seq_mean_token_mean``: ``1/S Σ_s 1/|s| Σ_{t in s} ℓ_t``."""
    loss, grads, _ = run(
        Objective.of(
            TrainerConfig(algorithm="grpo", loss_agg="seq_mean_token_mean").resolved(ServingConfig())
        )
    )
    want_loss, want_grads = 0.0, {}
    for seq in SEQUENCES:
        for token in seq:
            value, slope = clipped(log_ratio(token), adv(token))
            want_loss += value / len(seq) / 3
            want_grads[token] = slope / len(seq) / 3
    close(loss, want_loss)
    close_grads(grads, want_grads)


def test_gspo_clips_the_length_normalised_sequence_ratio() -> None:
    """``s = exp(mean_t log r_t)`` per sequence, ``1/S Σ_s -min(s A, clip(s) A)``; each token's gradient
    is ``1/|s|`` of its sequence's. GSPO's own clip range, (3e-4, 4e-4), comes from ``resolved``."""
    config = TrainerConfig(algorithm="gspo").resolved(ServingConfig())
    assert (config.clip_eps, config.clip_eps_high) == (3e-4, 4e-4)
    # the clip range is so narrow that every sequence but the one at ratio 1 clips: widen it to see both
    wide = Objective.of(config.model_copy(update={"clip_eps": 0.2, "clip_eps_high": 0.28}))
    for objective, (low, high) in ((Objective.of(config), (3e-4, 4e-4)), (wide, (0.2, 0.28))):
        loss, grads, _ = run(objective)
        want_loss, want_grads = 0.0, {}
        for seq in SEQUENCES:
            mean_log_ratio = sum(log_ratio(token) for token in seq) / len(seq)
            value, slope = clipped(mean_log_ratio, adv(seq[0]), low, high)
            want_loss += value / 3
            want_grads.update({token: slope / len(seq) / 3 for token in seq})
        close(loss, want_loss)
        close_grads(grads, want_grads)
    # under the narrow range the first answer (s = exp(0.5/3)) clips, its gradient is 0
    assert grads[(0, 1)] != 0.0
    assert run(Objective.of(config))[1][(0, 1)] == 0.0


# ---- off-policy correction ------------------------------------------------------------------------------


def corrected(mode: str, level: str) -> Objective:
    """GRPO with the trainer's own log-probabilities as the clipped ratio's denominator (ratio 1) and the
    engine's in the importance weight."""
    return Objective.of(
        TrainerConfig.model_validate(
            {
                "recompute_logprobs": True,
                "off_policy": {"mode": mode, "level": level, "cap": 1.25, "low": 0.8, "high": 1.25},
            }
        ).resolved(ServingConfig())
    )


def weight(token: tuple[int, int], level: str) -> float:
    if level == "token":
        return math.exp(log_ratio(token))
    seq = next(s for s in SEQUENCES if token in s)
    return math.exp(sum(log_ratio(u) for u in seq))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
def test_the_correction_weighs_each_term_by_the_engine_to_trainer_ratio(mode: str, level: str) -> None:
    """With ratio 1 every term is ``-A_t`` (slope ``-A_t``); ``tis`` multiplies it by ``min(w, 1.25)``,
    ``mis`` by ``w`` inside [0.8, 1.25] and 0 outside; ``w = π/μ`` per token or per sequence (product)."""
    loss, grads, part = run(corrected(mode, level))
    want_loss, want_grads, hits = 0.0, {}, 0
    for token in tokens():
        w = weight(token, level)
        if mode == "none":
            factor = 1.0
        elif mode == "tis":
            factor, hits = min(w, 1.25), hits + (w > 1.25)
        else:
            inside = 0.8 <= w <= 1.25
            factor, hits = (w if inside else 0.0), hits + (not inside)
        want_loss += -adv(token) * factor / 7
        want_grads[token] = -adv(token) * factor / 7
    close(loss, want_loss)
    close_grads(grads, want_grads)
    assert int(part.hit.sum()) == hits
    if mode != "none":
        assert 0 < hits < 7  # the batch has tokens on both sides of the bounds


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_a_stale_half_of_the_batch_is_reweighted_and_the_fresh_half_is_not(mode: str) -> None:
    """Half the answers sampled by the trained policy itself (μ = π: w = 1), half by a stale one that
    gave each of their tokens 1/1.5 of π's probability (w = 1.5 per token, 2.25 per two-token sequence).
    Under tis (cap 2) a stale token's term is ×1.5, and a stale sequence's ×2; under mis ([0.5, 2]) a stale
    token's is ×1.5, and a stale sequence is dropped. The fresh half trains as without correction."""
    rows = 4
    fresh = [[0.0, -1.0, -2.0]] * 2  # engine log-probabilities equal the trainer's
    stale = [[0.0, -1.0 - math.log(1.5), -2.0 - math.log(1.5)]] * 2
    batch_samples = [
        Sample(
            token_ids=[5, 6, 7],
            loss_mask=[0, 1, 1],
            old_logprobs=engine,
            advantages=[0.0, a, a],
            policy_version=0,
            episode_id=f"e{i}",
            task_id="t",
        )
        for i, (engine, a) in enumerate(zip(fresh + stale, [1.0, -1.0, 1.0, -1.0], strict=True))
    ]
    batch = collate(batch_samples, pad_id=0)
    for level, stale_factor in (("token", 1.5), ("sequence", 2.0 if mode == "tis" else 0.0)):
        objective = Objective.of(
            TrainerConfig.model_validate(
                {"recompute_logprobs": True, "off_policy": {"mode": mode, "level": level}}
            ).resolved(ServingConfig())
        )
        lp = torch.tensor([[0.0, -1.0, -2.0]] * rows, requires_grad=True)
        part = objective.micro_loss(lp, batch, float(objective.divisor(batch_samples)))
        part.loss.backward()
        assert lp.grad is not None
        for row in range(rows):
            a = batch_samples[row].advantages[1]
            factor = 1.0 if row < 2 else stale_factor
            assert lp.grad[row, 1:].tolist() == pytest.approx([-a * factor / 8] * 2), (level, row)
        close(float(part.loss.detach()), 0.0)  # advantages ±1 in pairs with the same factor


# ---- advantages: each algorithm's baseline ----------------------------------------------------------


def episode(task: str, e: int, reward: float, answer: int = 2) -> Episode:
    timeline = Timeline([1, 2, 3], list(range(4, 4 + answer)), [-0.5] * answer, [0] * (3 + answer),
                        [0] * 3 + [1] * answer, [], None, 0, "stop")  # fmt: skip
    return Episode(
        model="policy",
        tracker=None,
        state=FINISHED,
        stored_timelines=[timeline],
        group="g",
        episode_id=f"{task}-{e}",
        task_id=task,
        repeat=e,
        reward=reward,
    )


def advantages(config: TrainerConfig, groups: list[list[EpisodeData]]) -> dict[str, float]:
    """Per episode, the advantage of its trained tokens (all equal) in the built samples."""
    built, _ = build_samples(Batch(groups=groups, dropped_ids=[]), config)
    out = {}
    for sample in built:
        trained = {float(a) for a, m in zip(sample.advantages, sample.loss_mask, strict=True) if m}
        assert len(trained) == 1
        out[sample.episode_id] = trained.pop()
    return out


REWARDS = {"a": [1.0, 0.0, 0.5], "b": [1.0, 0.0, 1.0]}


def groups() -> list[list[EpisodeData]]:
    return [[episode(task, e, r) for e, r in enumerate(rewards)] for task, rewards in REWARDS.items()]


def by_hand(baseline) -> dict[str, float]:
    return {f"{task}-{e}": baseline(rewards, e) for task, rewards in REWARDS.items() for e in range(3)}


def test_each_algorithm_s_baseline() -> None:
    none = MergeConfig(mode="none")
    eps = 1e-6

    def standardised(r: list[float], e: int) -> float:
        return (r[e] - statistics.fmean(r)) / (statistics.pstdev(r) + eps)

    def centred(r: list[float], e: int) -> float:
        return r[e] - statistics.fmean(r)

    def leave_one_out(r: list[float], e: int) -> float:
        return r[e] - statistics.fmean(r[:e] + r[e + 1 :])

    for name, want in (
        ("grpo", by_hand(standardised)),
        ("dapo", by_hand(standardised)),
        ("dr_grpo", by_hand(centred)),
        ("rloo", by_hand(leave_one_out)),
    ):
        got = advantages(TrainerConfig.model_validate({"algorithm": name, "merge": none}), groups())
        assert got == pytest.approx(want, abs=1e-5), name
    assert by_hand(leave_one_out)["a-0"] == 0.75  # 1 - mean(0, 0.5)

    # REINFORCE++: centred in the group, then standardised over the batch's trained tokens (2 per episode)
    centred_all = by_hand(centred)
    mean = statistics.fmean(centred_all.values())
    std = statistics.pstdev(centred_all.values())
    got = advantages(TrainerConfig(algorithm="reinforce_pp", merge=none), groups())
    assert got == pytest.approx({k: (v - mean) / (std + eps) for k, v in centred_all.items()}, abs=1e-5)


def test_dapo_overlong_shaping_lowers_the_reward_of_long_answers() -> None:
    """L = 8, B = 4: an answer of n > 4 tokens loses ``(n - 4) / 4`` up to 8 and 1 past it."""
    lengths = [2, 6, 9]
    group: list[EpisodeData] = [episode("a", e, 1.0, answer=n) for e, n in enumerate(lengths)]
    config = TrainerConfig(
        algorithm="dapo",
        skip_equal_groups=True,
        merge=MergeConfig(mode="none"),
        overlong=OverlongConfig(max_tokens=8, buffer_tokens=4),
    )
    shaped = [1.0, 1.0 - 2 / 4, 1.0 - 1.0]
    want = {
        f"a-{e}": (s - statistics.fmean(shaped)) / (statistics.pstdev(shaped) + 1e-6)
        for e, s in enumerate(shaped)
    }
    assert advantages(config, [group]) == pytest.approx(want, abs=1e-5)


# ---- settings and config errors --------------------------------------------------------------------------


def test_resolved_fills_what_the_topology_leaves_unset() -> None:
    serving = ServingConfig(max_tokens=96)
    plain = TrainerConfig(overlong=OverlongConfig()).resolved(serving)
    assert plain.token_sum_norm == 96 and plain.overlong is not None and plain.overlong.max_tokens == 96
    assert (plain.clip_eps, plain.clip_eps_high) == (0.2, 0.28)
    kept = TrainerConfig(
        algorithm="gspo", clip_eps=0.01, token_sum_norm=7, overlong=OverlongConfig(max_tokens=5)
    ).resolved(serving)
    assert (kept.clip_eps, kept.clip_eps_high, kept.token_sum_norm) == (0.01, 4e-4, 7)
    assert kept.overlong is not None and kept.overlong.max_tokens == 5
    assert Objective.of(TrainerConfig(algorithm="gspo").resolved(serving)).loss_agg == "seq_mean_token_mean"
    assert Objective.of(TrainerConfig(algorithm="dr_grpo").resolved(serving)).loss_agg == "seq_mean_token_sum"
    assert plain.loss_agg == "token_mean" and kept.loss_agg == "seq_mean_token_mean"  # the algorithm's
    assert plain.resolved(serving) == plain  # resolving twice changes nothing
    with pytest.raises(ValueError, match="resolved"):  # the algorithm's defaults are filled in one place
        Objective.of(TrainerConfig(algorithm="dr_grpo"))
    assert set(ALGORITHMS) == {"grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"}
    assert set(get_args(AlgorithmName)) == set(ALGORITHMS)  # the config's choices are the algorithms
    with pytest.raises(KeyError, match="algorithms are: grpo"):
        algorithm("ppo")


def topology(trainer: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": {"name": "t"},
        "servers": [{"name": "policy", "model": "builtin:tiny", "trainer": trainer}],
        "clients": [{"name": "m", "agent": "a:b", "tasks": "builtin:arithmetic", "servers": ["policy"]}],
    }


@pytest.mark.parametrize(
    ("trainer", "path", "words"),
    [
        ({"off_policy": {"mode": "mis"}}, "servers[0].trainer.off_policy.mode", "recompute_logprobs"),
        (
            {"algorithm": "gspo", "loss_agg": "token_mean"},
            "servers[0].trainer.loss_agg",
            "seq_mean_token_mean",
        ),
        (
            {"algorithm": "dr_grpo", "loss_agg": "token_mean"},
            "servers[0].trainer.loss_agg",
            "seq_mean_token_sum",
        ),
        ({"algorithm": "dapo", "skip_equal_groups": False}, "servers[0].trainer.skip_equal_groups", "tasks"),
        ({"algorithm": "dapo", "batch_policy": "episodes"}, "servers[0].trainer.skip_equal_groups", "tasks"),
        ({"algorithm": "ppo"}, "servers[0].trainer.algorithm", "dr_grpo"),
        ({"off_policy": {"mode": "tis", "cap": 0}}, "servers[0].trainer.off_policy.cap", "greater than 0"),
        ({"off_policy": {"mode": "mis", "low": 2, "high": 1}}, "servers[0].trainer.off_policy", "below high"),
    ],
)
def test_impossible_combinations_name_their_fields(trainer: dict, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_topology(topology(trainer))
    issues = {issue.path: issue.message for issue in info.value.issues}
    assert path in issues, issues
    assert words in issues[path]


def test_the_possible_combinations_load() -> None:
    for trainer in (
        {"algorithm": "dapo", "skip_equal_groups": True},
        {"algorithm": "gspo", "recompute_logprobs": True, "off_policy": {"mode": "tis", "level": "sequence"}},
        {
            "algorithm": "rloo",
            "loss_agg": "seq_mean_token_mean",
            "recompute_logprobs": True,
            "off_policy": {"mode": "mis"},
        },
        {"algorithm": "reinforce_pp", "loss_agg": "seq_mean_token_sum", "token_sum_norm": 64},
    ):
        load_topology(topology(trainer))
