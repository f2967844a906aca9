"""``trainer.samples.build_samples`` against the code it replaced (kept below as the slow reference): per-
token advantage loops, every episode's call samples built a second time to vet it, a finiteness check
over every token. Seeded random batches with every kind of fault (rewards that are not finite or
overflow the group's statistics, turn rewards that do not fit, timelines whose samples cannot be built,
episodes without calls) and every merge mode must give the same samples, merge statistics, drops and
reasons, in the same order.
"""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np

from ajet_hpc.algo import tree_packing
from ajet_hpc.algo.credit import group_turn_advantages
from ajet_hpc.algo.merge import MergeStats
from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config import MergeConfig, TrainerConfig
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.tracking.episode import EpisodeData
from ajet_hpc.tracking.timeline import Timeline
from ajet_hpc.trainer.coordinator import episodes_to_samples as trainer_samples
from ajet_hpc.trainer.coordinator.collector import Batch

# ---- the reference: build_samples before (verbatim but for the names) ----------------------------------


def ref_build_samples(batch: Batch, config: TrainerConfig, decode=None):
    faults = [(e, reason) for e in batch.episodes if (reason := ref_episode_fault(e, config)) is not None]
    for episode, reason in faults:
        trainer_samples._drop(batch, [episode], reason)
    while True:
        try:
            return ref_build(batch, config, decode)
        except trainer_samples._Faulty as fault:
            trainer_samples._drop(batch, fault.episodes, fault.reason)


def ref_episode_fault(episode: EpisodeData, config: TrainerConfig) -> str | None:
    if not episode.timelines:
        return "it recorded no model call"
    reward = float(episode.reward or 0.0)
    if not math.isfinite(reward):
        return f"reward is {reward}: not a finite number"
    turns = episode.turn_rewards
    if turns:
        if len(turns) != len(episode.timelines):
            return f"turn_rewards has {len(turns)} values for {len(episode.timelines)} recorded calls"
        bad = next((i for i, r in enumerate(turns) if not math.isfinite(float(r))), None)
        if bad is not None:
            return f"turn_rewards[{bad}] is {turns[bad]}: not a finite number"
    try:
        ref_call_samples([episode], config.turn_gamma)
    except Exception as exc:
        return f"its samples cannot be built: {type(exc).__name__}: {exc}"
    return None


def ref_build(batch: Batch, config: TrainerConfig, decode):
    per_call = []
    for group in batch.groups:
        with trainer_samples._blame(group, "the task group's advantages"):
            built = ref_call_samples(group, config.turn_gamma)
        if not all(np.isfinite(np.asarray(s.advantages, np.float64)).all() for e in built for s in e):
            raise trainer_samples._Faulty(
                group, "the task group's advantages are not finite (rewards too large?)"
            )
        per_call.append(built)
    if config.loss_weighting == "episode":
        trainer_samples.weigh_episodes([s for group in per_call for episode in group for s in episode])
    stats = MergeStats()
    samples: list[Sample] = []
    for group, group_samples in zip(batch.groups, per_call, strict=True):
        merged_group: list[Sample] = []
        for episode, calls in zip(group, group_samples, strict=True):
            stats.samples_before += len(calls)
            stats.tokens_before += sum(len(s) for s in calls)
            for timeline in episode.timelines:
                for event in timeline.drift:
                    stats.drift[event.kind] = stats.drift.get(event.kind, 0) + 1
            with trainer_samples._blame([episode], "merging"):
                merged, snaps = trainer_samples.merge_episode(episode, calls, config.merge, decode)
            stats.add_snaps(snaps)
            merged_group.extend(merged)
        if config.merge.mode == "tree" and config.merge.tree_scope == "group" and len(merged_group) > 1:
            with trainer_samples._blame(group, "packing the task group's tree"):
                merged_group = [tree_packing.pack_tree(merged_group)]
        samples.extend(merged_group)
    stats.samples_after = len(samples)
    stats.tokens_after = sum(len(s) for s in samples)
    return samples, stats


def ref_call_samples(group: list[EpisodeData], gamma: float) -> list[list[Sample]]:
    returns = [trainer_samples._episode_returns(episode, gamma) for episode in group]
    calls = [(e, t) for e, episode in enumerate(group) for t in range(len(episode.timelines))]
    timelines = [timeline for episode in group for timeline in episode.timelines]
    turns = group_turn_advantages(returns)
    rows = zip(calls, timelines, strict=True)
    advantages = [[turns[e][t] if m else 0.0 for m in tl.loss_mask] for (e, t), tl in rows]
    out: list[list[Sample]] = [[] for _ in group]
    for (e, t), timeline, per_token in zip(calls, timelines, advantages, strict=True):
        episode = group[e]
        out[e].append(
            Sample(
                token_ids=timeline.token_ids,
                loss_mask=list(timeline.loss_mask),
                old_logprobs=[0.0] * len(timeline.prompt_ids) + list(timeline.response_logprobs),
                advantages=per_token,
                policy_version=timeline.policy_version,
                episode_id=episode.episode_id,
                task_id=episode.task_id or episode.episode_id,
                calls=[t],
            )
        )
    return out


# ---- random batches -------------------------------------------------------------------------------------


def random_timelines(rng: random.Random) -> list[Timeline]:
    """Calls that continue, fork and restart; now and then a loss mask with a hole, a mask that trains
    nothing, a mask with a 2 (its sample cannot be built), an empty call (nor this one)."""
    out: list[Timeline] = []
    context = [rng.randint(0, 20) for _ in range(rng.randint(1, 6))]
    for _ in range(rng.randint(0, 6)):
        kind = rng.random()
        if kind < 0.03:
            out.append(Timeline([], [], [], [], [], [], None, 0, "stop"))
            continue
        answer = [rng.randint(0, 20) for _ in range(rng.randint(1, 4))]
        mask = [0] * len(context) + [1] * len(answer)
        if kind < 0.08:
            mask[-1] = 2
        elif kind < 0.15:
            mask = [0] * len(mask)
        elif kind < 0.25 and len(answer) > 2:
            mask[len(context) + 1] = 0
        out.append(
            Timeline(
                list(context),
                answer,
                [-rng.uniform(0.1, 2.0) for _ in answer],
                [0] * len(mask),
                mask,
                [],
                None,
                rng.randint(0, 2),
                "stop",
            )
        )
        if rng.random() < 0.8:  # the conversation goes on (else the next call forks here)
            context = context + answer + [rng.randint(0, 20) for _ in range(rng.randint(0, 3))]
        if rng.random() < 0.1:  # summarised
            context = [*context[:2], 21]
    return out


def random_episode(rng: random.Random, task: int, e: int) -> Episode:
    timelines = random_timelines(rng)
    reward = rng.choice([0.0, 0.5, 1.0, 1.0, -1.0, math.nan, math.inf, 1e308, -1e308, 2.0])
    turn_rewards = None
    roll = rng.random()
    if roll < 0.2:
        turn_rewards = [rng.choice([0.0, 0.1, -0.5]) for _ in timelines]
    elif roll < 0.25:
        turn_rewards = [0.1] * (len(timelines) + 1)
    elif roll < 0.28 and timelines:
        turn_rewards = [math.nan] * len(timelines)
    return Episode(
        model="policy",
        tracker=None,
        state=FINISHED,
        stored_timelines=timelines,
        group="g",
        episode_id=f"t{task}e{e}",
        task_id=f"t{task}",
        repeat=e,
        reward=reward,
        turn_rewards=turn_rewards,
    )


def random_batch(rng: random.Random, clean: bool) -> Batch:
    groups: list[list[EpisodeData]] = []
    for task in range(rng.randint(1, 4)):
        group = [random_episode(rng, task, e) for e in range(rng.randint(1, 4))]
        if clean:
            for episode in group:
                episode.reward, episode.turn_rewards = rng.choice([0.0, 1.0, 0.5]), None
                assert episode.stored_timelines is not None  # random_episode stores its timelines
                good = [t for t in episode.stored_timelines if t.token_ids and 2 not in t.loss_mask]
                episode.stored_timelines[:] = good or random_timelines(random.Random(0))[:1]
        groups.append(list(group))
    return Batch(groups=groups, dropped_ids=["before"])


def _outcome(batch: Batch, built) -> tuple:
    ids = [[e.episode_id for e in g] for g in batch.groups]
    return built, list(batch.invalid.items()), list(batch.dropped_ids), ids


def test_build_samples_equals_the_reference_on_random_batches_with_faults() -> None:
    configs = [
        TrainerConfig(),
        TrainerConfig(merge=MergeConfig(mode="none")),
        TrainerConfig(merge=MergeConfig(mode="tree"), loss_weighting="episode", turn_gamma=0.5),
        TrainerConfig(merge=MergeConfig(mode="tree", tree_scope="group")),
    ]
    dropped = clean_runs = 0
    for seed in range(400):
        clean = seed % 4 == 0
        config = configs[seed % len(configs)]
        got_batch, want_batch = (
            random_batch(random.Random(seed), clean),
            random_batch(random.Random(seed), clean),
        )
        got = want = None
        with contextlib.suppress(Exception):
            want = ref_build_samples(want_batch, config)
        with contextlib.suppress(Exception):
            got = trainer_samples.build_samples(got_batch, config)
        assert _outcome(got_batch, got) == _outcome(want_batch, want), f"seed {seed}"
        dropped += len(want_batch.invalid)
        clean_runs += not want_batch.invalid and want is not None
    assert dropped > 100 and clean_runs > 50, (dropped, clean_runs)  # both paths are taken


def test_call_samples_equal_the_reference() -> None:
    for seed in range(100):
        batch = random_batch(random.Random(seed), clean=True)
        for group in batch.groups:
            assert trainer_samples.call_samples(group, 0.9) == ref_call_samples(group, 0.9), f"seed {seed}"
