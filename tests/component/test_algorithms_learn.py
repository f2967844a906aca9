"""Every algorithm learns the quickstart's task, cluster-free: the tiny model samples its answers in this
process and trains on them through the trainer's own sample build (``build_samples``: baselines,
whitening, merging) and objective (``ajet_hpc.algo.objective``), with the trainer's AdamW settings
(``ajet_hpc.trainer.ranks.zero``) and the quickstart's learning rate.

What is left out is the machinery that the other tests run (vLLM, DeepSpeed ranks, the server, clients):
here the question is only whether each algorithm's maths moves the reward. Sampling is exactly on-policy
(one optimizer step per batch, the batch sampled by the weights it trains), so the ratio is 1 and the
engine's log-probabilities are the trainer's; the off-policy weights are then 1, and the correction is
exercised by the quickstart runs instead. Fixed seeds; no wall times.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ajet_hpc.algo.grpo import token_logprobs
from ajet_hpc.algo.objective import Objective
from ajet_hpc.algo.sample_tensors import collate
from ajet_hpc.config import TrainerConfig
from ajet_hpc.config.algorithms import ALGORITHMS
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.environments.arithmetic import tasks as arithmetic
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.tracking.episode import EpisodeData
from ajet_hpc.tracking.timeline import Timeline
from ajet_hpc.trainer.coordinator.collector import Batch
from ajet_hpc.trainer.coordinator.episodes_to_samples import build_samples
from ajet_hpc.trainer.ranks import zero
from ajet_hpc.trainer.ranks.step import model_inputs

pytestmark = pytest.mark.slow

TASKS, REPEATS, STEPS, MAX_TOKENS = 8, 8, 14, 2  # the quickstart's batch and agent (max_tokens 2)

# Trainer settings beyond ``{"algorithm": name}``, the same as tools/bench/algorithms.py passes. Under the
# trainer's defaults dapo would train exactly what grpo trains: clip-higher (0.2 / 0.28) and
# skip_equal_groups with batch_policy tasks are grpo's defaults too, and dapo only checks that they are on.
# So dapo gets its own: those written out, and overlong shaping on (off by default). Its budget is the
# agent's (2 tokens) with a 1-token soft zone, so an answer that uses the whole budget loses 0.25 against
# one that stops at its first token; at the default penalty 1 a right digit would score what an empty
# answer scores (0). Nearly every answer here is 2 tokens long, so the shaping moves only the rare groups
# that hold an empty answer: with seed 1 dapo's step rewards stay within 0.03 of grpo's. This checks that
# dapo's pieces train, not that they differ from grpo on this task. Dynamic sampling is not exercised in
# this process: ``train`` drops the groups of equal rewards, as the collector does, but does not sample
# others in their place (the collector's refill and its bound are tests/unit/test_collector.py's).
SETTINGS: dict[str, dict[str, object]] = {
    "dapo": {
        "clip_eps": 0.2,
        "clip_eps_high": 0.28,
        "skip_equal_groups": True,
        "batch_policy": "tasks",
        "overlong": {"max_tokens": MAX_TOKENS, "buffer_tokens": 1, "penalty": 0.25},
    },
}


def sample_group(model, tokenizer, task, step: int, generator: torch.Generator) -> list[EpisodeData]:
    """``REPEATS`` answers of up to two tokens at temperature 1, as the built-in agent asks for them."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": task.data["question"]}], add_generation_prompt=True, tokenize=False
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt] * REPEATS)
    answers: list[list[int]] = [[] for _ in range(REPEATS)]
    logprobs: list[list[float]] = [[] for _ in range(REPEATS)]
    done = [False] * REPEATS
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logp = torch.log_softmax(model(input_ids=ids).logits[:, -1].float(), dim=-1)
            picked = torch.multinomial(logp.exp(), 1, generator=generator)
            for r in range(REPEATS):
                if not done[r]:
                    answers[r].append(int(picked[r]))
                    logprobs[r].append(float(logp[r, picked[r]]))
                    done[r] = int(picked[r]) == tokenizer.eos_token_id
            ids = torch.cat([ids, picked], dim=1)
    group: list[EpisodeData] = []
    for r in range(REPEATS):
        n = len(prompt) + len(answers[r])
        mask = [0] * len(prompt) + [1] * len(answers[r])
        finish = "stop" if done[r] else "length"
        timeline = Timeline(prompt, answers[r], logprobs[r], [0] * n, mask, [], None, step, finish)
        text = tokenizer.decode(answers[r], skip_special_tokens=True)
        group.append(
            Episode(
                model="policy",
                tracker=None,
                state=FINISHED,
                stored_timelines=[timeline],
                group="math",
                episode_id=f"{step}-{task.id}-{r}",
                task_id=task.id,
                repeat=r,
                reward=arithmetic.reward(text, task.data["answer"]),
            )
        )
    return group


def train(model_dir: Path, name: str, seed: int = 1) -> list[float]:
    """``STEPS`` steps of ``name``; the mean reward of each step's episodes."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    settings = {"algorithm": name, **SETTINGS.get(name, {})}
    config = TrainerConfig.model_validate(settings).resolved(ServingConfig(max_tokens=MAX_TOKENS))
    objective = Objective.of(config)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=0.003, betas=zero.ADAM_BETAS, eps=zero.ADAM_EPS, weight_decay=zero.WEIGHT_DECAY
    )
    generator = torch.Generator().manual_seed(seed)
    tasks = arithmetic.tasks(seed)
    rewards = []
    for step in range(STEPS):
        model.train(False)
        groups = [
            sample_group(model, tokenizer, task, step, generator) for task in itertools.islice(tasks, TASKS)
        ]
        rewards.append(statistics.fmean(e.reward or 0.0 for g in groups for e in g))
        kept = [g for g in groups if len({e.reward for e in g}) > 1] if config.skip_equal_groups else groups
        if not kept:
            continue
        samples, _ = build_samples(Batch(groups=kept, dropped_ids=[]), config)
        batch = collate(samples, pad_id=0)
        model.train(True)
        optimizer.zero_grad()
        logits = model(**model_inputs(batch, "sdpa")).logits
        logprobs = token_logprobs(logits, batch["input_ids"], batch.get("parents"))
        part = objective.micro_loss(logprobs, batch, float(objective.divisor(samples)))
        part.loss.backward()
        if zero.GRADIENT_CLIPPING:
            torch.nn.utils.clip_grad_norm_(model.parameters(), zero.GRADIENT_CLIPPING)
        optimizer.step()
    return rewards


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_raises_the_quickstart_reward(tiny_model: Path, name: str) -> None:
    rewards = train(tiny_model, name)
    first, last = statistics.fmean(rewards[:5]), statistics.fmean(rewards[-5:])
    assert last > first, f"{name}: reward of the last 5 steps {last:.3f} <= first 5 {first:.3f} ({rewards})"
