"""From a batch of finished episodes to training samples: credit, loss weights, then timeline merging.

1. One sample per recorded model call, with GRPO advantages per task group. Without per-turn rewards every
   answer of an episode gets the episode's group-normalised reward; with them (``turn_rewards``, one per
   answer) answer k's tokens get the normalised return of turn k (``ajet_hpc.algo.credit``, docs/grpo.md).
2. Loss weights: ``token`` leaves every trained token at weight 1; ``episode`` gives the tokens of each
   episode the weight that makes every episode count the same.
3. Merging (``trainer.merge``, docs/merging.md): linear within each episode, then optionally a prefix tree
   per episode or per task group. Weights and advantages are per token, so merging changes no loss term.

`MergeStats` reports samples and tokens before and after, snap points (calls the conversation continues but
that did not merge, and why) and the drift the server recorded in the batch's calls.

An episode that cannot be built (a reward that is not finite, turn rewards that do not fit its calls, any
error while its samples are made or merged) is dropped from the batch with its reason (``Batch.invalid``,
logged, counted as ``dropped_invalid`` in the step's metrics) and the rest of the batch is built: one bad
episode never stops training. A failure that belongs to a whole task group drops that group.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np

from ajet_hpc.algo import merge, tree_packing
from ajet_hpc.algo.credit import group_turn_advantages, masked_row, turn_returns
from ajet_hpc.algo.dapo import overlong_penalty
from ajet_hpc.algo.merge import MergeStats, Snap
from ajet_hpc.algo.reinforce_pp import whiten_stats
from ajet_hpc.algo.sample_tensors import ARRAY_TYPES, Sample, as_arrays, binary_runs, trained_count
from ajet_hpc.config import MergeConfig, TrainerConfig
from ajet_hpc.config.algorithms import Baseline
from ajet_hpc.config.trainer import OverlongConfig
from ajet_hpc.tracking.episode import EpisodeData
from ajet_hpc.tracking.timeline import TEMPLATE_DROPPED_CONTENT, Timeline
from ajet_hpc.trainer.coordinator.collector import Batch

log = logging.getLogger(__name__)


class _Faulty(Exception):
    """Building failed because of these episodes (one, or a whole task group)."""

    def __init__(self, episodes: list[EpisodeData], reason: str) -> None:
        super().__init__(reason)
        self.episodes, self.reason = episodes, reason


@contextlib.contextmanager
def _blame(episodes: list[EpisodeData], what: str) -> Iterator[None]:
    try:
        yield
    except _Faulty:
        raise
    except Exception as exc:
        raise _Faulty(episodes, f"{what} failed: {type(exc).__name__}: {exc}") from exc


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (back on after, if it was on).

    A step's build allocates a few large lists per model call (6,400 calls and 16M call tokens at a real
    batch): every few hundred allocations start a collection, and the older generations' collections walk
    every list alive, token by token. That tripled the build's time (0.30 -> 0.84 s for the per-call
    samples of 256 episodes). Nothing in the build makes reference cycles; what is garbage is collected
    by reference counting, and any cycle by the next collection after the block."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def build_samples(
    batch: Batch, config: TrainerConfig, decode: Callable[[list[int]], str] | None = None
) -> tuple[list[Sample], MergeStats]:
    """The batch's training samples and what merging did. ``decode`` is needed for text-level merging.

    Episodes at fault are first looked for one by one (``episode_fault``) and dropped from ``batch``; a
    failure that shows only when the groups are built drops the episodes it belongs to, and the build starts
    over without them. Every drop lands in ``batch.invalid`` (id -> reason) and ``batch.dropped_ids``.

    The per-episode check builds each episode's call samples alone, which would double the cost of the
    build; it is skipped while the whole build succeeds: an episode whose samples fail alone fails in its
    group too (the same per-episode code, only the advantages' values differ), so a build without failure
    means no episode had such a fault. The first failure starts over along the checked path, which gives
    the same drops, in the same order."""
    with gc_paused():
        return _build_samples(batch, config, decode)


def _build_samples(
    batch: Batch, config: TrainerConfig, decode: Callable[[list[int]], str] | None
) -> tuple[list[Sample], MergeStats]:
    faults = {id(e): reason for e in batch.episodes if (reason := record_fault(e)) is not None}
    groups = [kept for g in batch.groups if (kept := [e for e in g if id(e) not in faults])]
    with contextlib.suppress(Exception):
        built = _build(groups, config, decode)
        for episode in batch.episodes:
            if id(episode) in faults:
                _drop(batch, [episode], faults[id(episode)])
        return built
    return _checked_build(batch, config, decode)


def _checked_build(
    batch: Batch, config: TrainerConfig, decode: Callable[[list[int]], str] | None
) -> tuple[list[Sample], MergeStats]:
    """`build_samples` with every episode checked alone first (`episode_fault`)."""
    faults = [(e, reason) for e in batch.episodes if (reason := episode_fault(e, config)) is not None]
    for episode, reason in faults:
        _drop(batch, [episode], reason)
    while True:  # each round drops at least one episode: it ends
        try:
            return _build(batch.groups, config, decode)
        except _Faulty as fault:
            _drop(batch, fault.episodes, fault.reason)


def episode_fault(episode: EpisodeData, config: TrainerConfig) -> str | None:
    """Why this episode cannot be trained, or None: its rewards, and its own samples."""
    reason = record_fault(episode)
    if reason is not None:
        return reason
    try:  # its samples alone (cheap; merging, the costly part, is blamed per episode in the build)
        call_samples([episode], config.turn_gamma, overlong=config.overlong)
    except Exception as exc:
        return f"its samples cannot be built: {type(exc).__name__}: {exc}"
    return None


def record_fault(episode: EpisodeData) -> str | None:
    """Why this episode's record cannot be trained (no call, rewards that are not finite numbers), or None."""
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
    return None


def _drop(batch: Batch, episodes: list[EpisodeData], reason: str) -> None:
    gone = {id(e) for e in episodes}
    batch.groups = [kept for g in batch.groups if (kept := [e for e in g if id(e) not in gone])]
    for episode in episodes:
        batch.invalid[episode.episode_id] = reason
        batch.dropped_ids.append(episode.episode_id)
        log.warning(
            "episode %s (task %s) dropped from the batch, not trained: %s",
            episode.episode_id,
            episode.task_id,
            reason,
        )


def _build(
    groups: list[list[EpisodeData]], config: TrainerConfig, decode: Callable[[list[int]], str] | None
) -> tuple[list[Sample], MergeStats]:
    per_call = []
    spec = config.spec
    for group in groups:
        with _blame(group, "the task group's advantages"):
            built, finite = _call_samples(group, config.turn_gamma, spec.baseline, config.overlong)
        if not finite:
            raise _Faulty(group, "the task group's advantages are not finite (rewards too large?)")
        per_call.append(built)
    if spec.batch_whiten:
        whiten_batch([s for group in per_call for episode in group for s in episode])
    if config.loss_weighting == "episode":
        weigh_episodes([s for group in per_call for episode in group for s in episode])
    stats = MergeStats()
    samples: list[Sample] = []
    for group, group_samples in zip(groups, per_call, strict=True):
        merged_group: list[Sample] = []
        for episode, calls in zip(group, group_samples, strict=True):
            stats.samples_before += len(calls)
            stats.tokens_before += sum(len(s) for s in calls)
            for timeline in episode.timelines:
                for event in timeline.drift:
                    stats.drift[event.kind] = stats.drift.get(event.kind, 0) + 1
            with _blame([episode], "merging"):
                merged, snaps = merge_episode(episode, calls, config.merge, decode)
            stats.add_snaps(snaps)
            merged_group.extend(merged)
        if config.merge.mode == "tree" and config.merge.tree_scope == "group" and len(merged_group) > 1:
            with _blame(group, "packing the task group's tree"):
                merged_group = [tree_packing.pack_tree(merged_group)]
        samples.extend(merged_group)
    stats.samples_after = len(samples)
    stats.tokens_after = sum(len(s) for s in samples)
    return [as_arrays(s) for s in samples], stats


def call_samples(
    group: list[EpisodeData],
    gamma: float,
    baseline: Baseline = "group_std",
    overlong: OverlongConfig | None = None,
) -> list[list[Sample]]:
    """Per episode of a task group, one sample per call (``calls=[k]``), with its turn's advantages."""
    return _call_samples(group, gamma, baseline, overlong)[0]


def _call_samples(
    group: list[EpisodeData],
    gamma: float,
    baseline: Baseline = "group_std",
    overlong: OverlongConfig | None = None,
) -> tuple[list[list[Sample]], bool]:
    """`call_samples`, and whether every advantage is finite. A sample's advantages are 0.0 and its turn's
    advantage (where its loss mask is 1), so the turn advantages of samples with a trained token are
    checked instead of every token.

    The per-token fields besides the token ids are numpy arrays made from the loss mask's runs of 1s and
    the answer's logprobs: zeros (which cost no pass over a prompt) and slices, where lists cost a Python
    number per token of every prompt, allocated, merged and freed (16M call tokens at a real batch). A
    mask that is not 0/1 keeps lists (`Sample` refuses it, with the same error)."""
    returns = [_episode_returns(episode, gamma, overlong) for episode in group]
    calls = [(e, t) for e, episode in enumerate(group) for t in range(len(episode.timelines))]
    timelines = [timeline for episode in group for timeline in episode.timelines]
    turns = group_turn_advantages(returns, baseline=baseline)  # as episode_token_advantages, by runs
    zeros = _Zeros(sum(len(timeline.loss_mask) for timeline in timelines))
    out: list[list[Sample]] = [[] for _ in group]
    finite = True
    for (e, t), timeline in zip(calls, timelines, strict=True):
        episode = group[e]
        sample = Sample(
            token_ids=timeline.token_ids,
            **_call_fields(timeline, turns[e][t], zeros),
            policy_version=timeline.policy_version,
            episode_id=episode.episode_id,
            task_id=episode.task_id or episode.episode_id,
            calls=[t],
        )
        if finite and not math.isfinite(turns[e][t]) and trained_count(sample.loss_mask):
            finite = False
        out[e].append(sample)
    return out, finite


class _Zeros:
    """Zeroed arrays for a task group's call samples, handed out as consecutive views of one allocation per
    dtype (one allocation instead of three per call)."""

    def __init__(self, size: int) -> None:
        self.masks = np.zeros(size, ARRAY_TYPES["loss_mask"])
        self.floats = np.zeros((2, size), np.float64)
        self.start = 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """A loss mask and two float rows of ``n`` zeros each, not handed out before."""
        start, self.start = self.start, self.start + n
        return (
            self.masks[start : start + n],
            self.floats[0, start : start + n],
            self.floats[1, start : start + n],
        )


def _call_fields(timeline: Timeline, advantage: float, zeros: _Zeros) -> dict:
    """A call sample's loss mask, old logprobs (0.0 on the prompt) and advantages (``advantage`` where the
    mask is 1, else 0.0): arrays (views of ``zeros``) filled from the mask's runs when it is 0/1, else
    lists."""
    mask, prompt = timeline.loss_mask, len(timeline.prompt_ids)
    runs = binary_runs(mask)
    if runs is None:
        return {
            "loss_mask": list(mask),
            "old_logprobs": [0.0] * prompt + list(timeline.response_logprobs),
            "advantages": masked_row(advantage, mask),
        }
    loss_mask, advantages, old_logprobs = zeros.take(len(mask))
    for start, end in runs:
        loss_mask[start:end] = 1
        advantages[start:end] = advantage
    old_logprobs[prompt:] = timeline.response_logprobs
    return {"loss_mask": loss_mask, "old_logprobs": old_logprobs, "advantages": advantages}


def whiten_batch(samples: list[Sample], eps: float = 1e-6) -> None:
    """Standardise the advantages of the batch's trained tokens (REINFORCE++): ``(A - mean) / (std + eps)``
    over all of them, in place. Before merging: merging changes no token, so no statistic."""
    rows = []
    for sample in samples:
        mask = np.asarray(sample.loss_mask) != 0
        if mask.any():
            rows.append((sample, mask, np.array(sample.advantages, np.float64)))
    if not rows:
        return
    mean, std = whiten_stats(np.concatenate([advantages[mask] for _, mask, advantages in rows]))
    for sample, mask, advantages in rows:
        advantages[mask] = (advantages[mask] - mean) / (std + eps)
        sample.advantages = advantages


def weigh_episodes(samples: list[Sample]) -> None:
    """Set each sample's weight so that every episode's trained tokens weigh the same in total.

    Token weight of episode e: ``T / (E * T_e)`` with ``T`` the batch's trained tokens, ``E`` its episodes
    with a trained token and ``T_e`` episode e's; the weights then still sum to ``T`` (the step's token
    normaliser), and each episode to ``T / E``.
    """
    tokens = Counter[str]()
    for sample in samples:
        tokens[sample.episode_id] += trained_count(sample.loss_mask)
    total, episodes = sum(tokens.values()), sum(1 for n in tokens.values() if n)
    for sample in samples:
        n = tokens[sample.episode_id]
        sample.weight = total / (episodes * n) if n else 1.0


def merge_episode(
    episode: EpisodeData, calls: list[Sample], config: MergeConfig, decode: Callable[[list[int]], str] | None
) -> tuple[list[Sample], list[Snap]]:
    """One episode's call samples merged as configured, and the snaps met."""
    if config.mode == "none" or len(calls) < 2:
        return calls, []
    merged, snaps = merge.merge_linear(calls, level=config.level, decode=decode)
    snaps += explain_snaps(episode.episode_id, episode.timelines, merged, decode)
    if config.mode == "tree" and config.tree_scope == "episode" and len(merged) > 1:
        merged = [tree_packing.pack_tree(merged)]
    return merged, snaps


def explain_snaps(
    episode_id: str,
    timelines: list[Timeline],
    merged: list[Sample],
    decode: Callable[[list[int]], str] | None = None,
) -> list[Snap]:
    """Calls that a later call of the episode continues (its messages start with the call's messages and
    reply) but that did not merge into it, each with the likeliest reason."""
    if len(merged) == 1 and set(merged[0].calls) >= set(range(len(timelines))):
        return []  # every call merged into the one sample: none snapped
    absorbed_into = {}
    for sample in merged:
        for call in sample.calls:
            absorbed_into[call] = sample
    snaps = []
    keys = [[_message_key(m) for m in timeline.messages] for timeline in timelines]  # once per call
    for k, earlier in enumerate(timelines):
        later = _continuation(keys[k], keys[k + 1 :])
        if later is None:
            continue
        j = k + 1 + later
        if absorbed_into.get(k) is absorbed_into.get(j):
            continue  # merged (possibly into a call after j)
        if _tools_key(earlier.tools) != _tools_key(timelines[j].tools):
            reason = merge.TOOLS_CHANGED
        elif any(event.kind == TEMPLATE_DROPPED_CONTENT for event in timelines[j].drift):
            reason = merge.TEMPLATE_DROPPED_CONTENT
        elif _text_prefix(earlier, timelines[j], decode):
            reason = merge.TOKENS_DIFFERED
        else:
            reason = merge.TEXT_DIFFERED
        ids, other = earlier.token_ids, timelines[j].token_ids
        parted = merge.common_prefix(ids, other)
        parted = len(ids) if parted == min(len(ids), len(other)) else parted
        snaps.append(Snap(episode_id, k, j, reason, parted))
    return snaps


def _continuation(mine: list[tuple], later: list[list[tuple]]) -> int | None:
    """Index in ``later`` (the message keys of the later calls) of the first call whose request continues
    the conversation whose message keys are ``mine``."""
    n = len(mine)
    for index, keys in enumerate(later):  # a call's last key is its reply: its request is keys[:-1]
        if len(keys) - 1 > n and keys[:n] == mine:
            return index
    return None


def _message_key(message: dict) -> tuple:
    calls = message.get("tool_calls") or []
    return (
        message.get("role"),
        (message.get("content") or "").strip(),
        tuple((c.get("function") or {}).get("name", "") for c in calls if isinstance(c, dict))
        if calls
        else (),
    )


def _tools_key(tools: list[dict] | None) -> tuple:
    return tuple(sorted(str(tool) for tool in tools or ()))


def _text_prefix(earlier: Timeline, later: Timeline, decode: Callable[[list[int]], str] | None) -> bool:
    """Whether the later prompt's text starts with the earlier call's text (then only tokenization parted
    them). Unknown without ``decode``: False."""
    return decode is not None and merge.text_is_prefix(earlier.token_ids, later.prompt_ids, decode)


def _episode_returns(
    episode: EpisodeData, gamma: float, overlong: OverlongConfig | None = None
) -> list[float]:
    """One return per answer of the episode: the episode reward, or per-turn returns when reported. With
    ``overlong`` the reward is shaped first by the episode's longest answer (DAPO)."""
    calls = len(episode.timelines)
    reward = float(episode.reward or 0.0)
    if overlong is not None:
        if overlong.max_tokens is None:
            raise ValueError(
                "trainer.overlong.max_tokens is unset (the server's serving.max_tokens fills it)"
            )
        longest = max(len(timeline.response_ids) for timeline in episode.timelines)
        reward += overlong_penalty(longest, overlong.max_tokens, overlong.buffer_tokens, overlong.penalty)
    if not episode.turn_rewards:
        return [reward] * calls
    return list(turn_returns(episode.turn_rewards, reward, gamma))
