"""What the episode registry holds per closed episode (issue 14, item 9): past the last ``keep_whole``
closed episodes only their summary, measured with tracemalloc on real trackers (tiny tokenizer)."""

from __future__ import annotations

import gc
import tracemalloc

import pytest

from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.server.episodes import ClosedEpisode, EpisodeRegistry, Gone
from ajet_hpc.server.errors import Conflict

TURNS = 8


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def run_episode(registry: EpisodeRegistry, tokenizer, index: int) -> str:
    """An 8-turn episode as the server records it: prompt, sampled ids, record; then its end."""
    episode = registry.begin(f"task-{index}", "g", {"seed": index}, repeat=0)
    tracker = episode.tracker
    assert tracker is not None  # a live episode tracks its context
    messages = [{"role": "system", "content": "You are a careful assistant. " * 4}]
    for turn in range(TURNS):
        messages.append(
            {"role": "user", "content": f"turn {turn} of episode {index}: " + "question text " * 20}
        )
        plan = tracker.build_prompt(messages)
        reply = {"role": "assistant", "content": f"answer {turn}: " + "answer text " * 25}
        ids = tokenizer.encode(reply["content"], add_special_tokens=False)
        tracker.record(plan, ids, [-0.25] * len(ids), reply, "stop", policy_version=1)
        messages.append(reply)
    registry.end(episode.episode_id, 1.0, None, None, {})
    return episode.episode_id


def bytes_per_closed_episode(tokenizer, keep_whole: int, episodes: int = 24) -> float:
    registry = EpisodeRegistry("m", lambda: tokenizer, 600.0, keep_whole=keep_whole)
    run_episode(registry, tokenizer, -1)  # warm the tokenizer's own caches outside the measure
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for index in range(episodes):
            run_episode(registry, tokenizer, index)
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - base) / episodes
    finally:
        tracemalloc.stop()


def test_a_closed_episode_past_the_whole_window_keeps_only_its_summary(tokenizer) -> None:
    whole = bytes_per_closed_episode(tokenizer, keep_whole=10**9)  # what the registry held before
    compact = bytes_per_closed_episode(tokenizer, keep_whole=0)
    print(f"bytes per closed {TURNS}-turn episode: whole {whole:,.0f}, summary only {compact:,.0f}")
    assert compact < 8 * 1024, compact
    assert compact * 20 < whole, (compact, whole)


def test_a_compacted_episode_still_answers_the_episode_api(tokenizer) -> None:
    registry = EpisodeRegistry("m", lambda: tokenizer, 600.0, keep_whole=1)
    first = run_episode(registry, tokenizer, 0)
    whole = registry.lookup(first).summary()
    assert len(registry.lookup(first).timelines) == TURNS  # the most recent one is held whole
    run_episode(registry, tokenizer, 1)
    kept = registry.lookup(first)
    assert isinstance(kept, ClosedEpisode) and kept.summary() == whole
    with pytest.raises(Gone, match="no longer held"):
        kept.timelines  # noqa: B018
    repeated = registry.end(first, 1.0, None, None, {})  # a retried end: the recorded result again
    assert repeated.duplicate and repeated.episode_id == first and repeated.calls == TURNS
    with pytest.raises(Conflict, match="already finished"):
        registry.end(first, 0.5, None, None, {})
    with pytest.raises(Conflict):
        registry.get_open(first)
    with pytest.raises(Conflict, match="already ended"):  # its key stays ended: exactly once
        registry.begin("task-0", "g", {}, repeat=0)
