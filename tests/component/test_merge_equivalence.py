"""Merged samples train exactly like the calls they came from: the tiny model in float32, one forward of
the packed tree (ancestor mask, depth positions) against one forward per call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from ajet_hpc.algo import merge, tree_packing
from ajet_hpc.algo.grpo import policy_loss, token_logprobs
from ajet_hpc.algo.objective import Objective
from ajet_hpc.algo.sample_tensors import Sample, collate
from ajet_hpc.config import TrainerConfig
from ajet_hpc.config.algorithms import ALGORITHMS
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.trainer.ranks.step import model_inputs


def calls(vocab: int, seed: int = 0) -> list[Sample]:
    """An episode with a retried turn, a branch that samples the same first answer token as another, and a
    second agent with its own prompt. Old logprobs and advantages differ per token and per call."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(5, vocab, (n,), generator=g).tolist()  # noqa: E731

    def call(prefix: list[int], answer: list[int], index: int) -> Sample:
        n, m = len(prefix), len(answer)
        return Sample(
            token_ids=prefix + answer,
            loss_mask=[0] * n + [1] * m,
            old_logprobs=[0.0] * n + (-torch.rand(m, generator=g) * 4 - 1).tolist(),
            advantages=[0.0] * n + [float(index) - 1.5] * m,
            policy_version=0,
            episode_id="ep",
            task_id="t",
            calls=[index],
        )

    prompt = ids(40)
    a1 = ids(6)
    turn2 = prompt + a1 + ids(12)
    a2, a2_retry = ids(7), ids(5)
    a2_twin = [a2[0], *ids(4)]  # same first sampled token as a2: two branches must keep it apart
    turn3 = turn2 + a2 + ids(10)
    other_agent = ids(25)
    return [
        call(prompt, a1, 0),
        call(turn2, a2_retry, 1),
        call(turn2, a2, 2),
        call(turn2, a2_twin, 3),
        call(turn3, ids(8), 4),
        call(other_agent, ids(6), 5),
    ]


def forward(model, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Per-token logprobs of one forward over the collated samples, the batch, and its trained positions."""
    batch = collate(samples, pad_id=0)
    logits = model(**model_inputs(batch, model.config._attn_implementation)).logits
    logprobs = token_logprobs(logits, batch["input_ids"], batch.get("parents"))
    mask = batch["loss_mask"] == 1
    return logprobs, batch, mask


def flat_loss(samples: list[Sample], model, normalizer: float) -> tuple[torch.Tensor, list[tuple]]:
    """The GRPO loss of the samples, and (advantage, old logprob, logprob, weight) per trained token."""
    logprobs, batch, mask = forward(model, samples)
    loss, _ = policy_loss(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        batch["loss_mask"],
        clip_eps=0.2,
        clip_eps_high=0.28,
        weights=batch["weights"],
        normalizer=normalizer,
    )
    trained = sorted(
        zip(
            batch["advantages"][mask].tolist(),
            batch["old_logprobs"][mask].tolist(),
            logprobs[mask].tolist(),
            batch["weights"][mask].tolist(),
            strict=True,
        )
    )
    return loss, trained


@pytest.mark.parametrize(
    ("builtin", "attention"), [("tiny_model", "sdpa"), ("tiny_model", "eager"), ("tiny_qwen_model", "sdpa")]
)
def test_linear_and_tree_merging_give_the_loss_logprobs_and_gradients_of_separate_calls(
    request: pytest.FixtureRequest, builtin: str, attention: str
) -> None:
    """On the Llama of builtin:tiny and on the Qwen2 of tiny-qwen (attention biases, tied embeddings, a
    151,936-row vocabulary; sdpa only: the attention code is the same as the Llama's)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(
        request.getfixturevalue(builtin), dtype=torch.float32, attn_implementation=attention
    )
    model.train(False)
    per_call = calls(model.config.vocab_size)
    linear, snaps = merge.merge_linear(per_call)
    assert [len(s.calls) for s in linear] == [3, 1, 1, 1] and snaps == []
    tree = tree_packing.pack_tree(linear)
    assert len(tree) < sum(len(s) for s in linear) < sum(len(s) for s in per_call)
    normalizer = float(sum(sum(s.loss_mask) for s in per_call))

    results = {}
    for name, samples in {"calls": per_call, "linear": linear, "tree": [tree]}.items():
        model.zero_grad()
        loss, trained = flat_loss(samples, model, normalizer)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results[name] = (loss.detach(), trained, grads.clone())

    reference_loss, reference_tokens, reference_grads = results["calls"]
    for name in ("linear", "tree"):
        loss, trained, grads = results[name]
        assert len(trained) == len(reference_tokens) == normalizer
        assert abs(float(loss - reference_loss)) < 1e-5, name
        for (adv, old, lp, w), (adv0, old0, lp0, w0) in zip(trained, reference_tokens, strict=True):
            assert (adv, old, w) == (adv0, old0, w0)
            assert abs(lp - lp0) < 1e-5, name
        assert (grads - reference_grads).abs().max() < 1e-5, name


def test_episode_weighting_is_the_same_merged_or_not(tiny_model: Path) -> None:
    """With per-token weights (each episode weighing the same), merging keeps each token's weight."""
    from ajet_hpc.trainer.coordinator.episodes_to_samples import weigh_episodes

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    first = calls(model.config.vocab_size, seed=1)
    second = [
        Sample(**{**s.__dict__, "episode_id": "ep2", "calls": [k]})
        for k, s in enumerate(calls(model.config.vocab_size, seed=2)[:2])
    ]
    samples = first + second
    weigh_episodes(samples)
    totals: dict[str, float] = {}
    for s in samples:
        totals[s.episode_id] = totals.get(s.episode_id, 0.0) + s.weight * sum(s.loss_mask)
    assert totals["ep"] == pytest.approx(totals["ep2"])
    normalizer = float(sum(sum(s.loss_mask) for s in samples))
    merged = [
        tree_packing.pack_tree(merge.merge_linear(first)[0]),
        tree_packing.pack_tree(merge.merge_linear(second)[0]),
    ]
    with torch.no_grad():
        separate, _ = flat_loss(samples, model, normalizer)
        together, _ = flat_loss(merged, model, normalizer)
    assert abs(float(separate - together)) < 1e-5


OBJECTIVES: dict[str, dict[str, Any]] = {
    **{name: {"algorithm": name} for name in ALGORITHMS},
    "grpo+seq_mean_token_mean": {"algorithm": "grpo", "loss_agg": "seq_mean_token_mean"},
    "grpo+tis": {"recompute_logprobs": True, "off_policy": {"mode": "tis", "cap": 1.1}},
    "rloo+mis/sequence": {
        "algorithm": "rloo",
        "recompute_logprobs": True,
        "off_policy": {"mode": "mis", "level": "sequence", "low": 0.7, "high": 1.4},
    },
    "gspo+tis/sequence": {
        "algorithm": "gspo",
        "recompute_logprobs": True,
        "off_policy": {"mode": "tis", "level": "sequence", "cap": 1.5},
    },
}


def test_every_algorithm_trains_merged_samples_like_the_calls_they_came_from(tiny_model: Path) -> None:
    """The loss and gradients of each algorithm (its ratio level, loss aggregation, and off-policy weights
    at token and sequence level) are the same on the calls, their linear merge and their packed tree. The
    engine's log-probabilities are the model's own plus noise, so that the weights differ from 1."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.train(False)
    per_call = calls(model.config.vocab_size, seed=3)
    with torch.no_grad():
        noise = torch.Generator().manual_seed(4)
        for sample in per_call:
            logprobs, _, _ = forward(model, [sample])
            shifted = logprobs[0] + (torch.rand(logprobs.shape[1], generator=noise) - 0.5) * 0.6
            sample.old_logprobs = torch.where(torch.tensor(sample.loss_mask) == 1, shifted, 0.0).tolist()
    linear, _ = merge.merge_linear(per_call)
    layouts = {"calls": per_call, "linear": linear, "tree": [tree_packing.pack_tree(linear)]}
    for name, settings in OBJECTIVES.items():
        objective = Objective.of(
            TrainerConfig.model_validate(settings).resolved(ServingConfig(max_tokens=16))
        )
        divisors = {objective.divisor(samples) for samples in layouts.values()}
        assert len(divisors) == 1, (name, divisors)
        divisor = float(divisors.pop())
        results = {}
        for layout, samples in layouts.items():
            model.zero_grad()
            logprobs, batch, _ = forward(model, samples)
            part = objective.micro_loss(logprobs, batch, divisor)
            part.loss.backward()
            grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
            results[layout] = (float(part.loss.detach()), grads, int(part.hit.sum()))
        loss0, grads0, hits0 = results["calls"]
        assert grads0.abs().max() > 0, name
        for layout in ("linear", "tree"):
            loss, grads, hits = results[layout]
            assert abs(loss - loss0) < 1e-5, (name, layout)
            assert (grads - grads0).abs().max() < 1e-5, (name, layout)
            assert hits == hits0, (name, layout)
        if "off_policy" in settings:
            assert hits0 > 0, name  # the correction does act on this batch
