"""Exactly once per episode key (client group, task, repeat): the server registry's side."""

from __future__ import annotations

from typing import Any, TypedDict

import pytest

from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.server.episodes import ABORTED, FINISHED, OPEN, EpisodeRegistry
from ajet_hpc.server.errors import Conflict

TOKENIZER = build_tokenizer()


class KeyParts(TypedDict, total=False):
    """Parts of an episode key, as an end names them."""

    task_id: str
    group: str
    repeat: int


def registry() -> tuple[EpisodeRegistry, list]:
    closed: list = []
    episodes = EpisodeRegistry("policy", lambda: TOKENIZER, timeout_s=60)
    episodes.on_closed(closed.append)
    return episodes, closed


def test_a_key_ends_once_and_a_retried_end_answers_the_recorded_result() -> None:
    episodes, closed = registry()
    first = episodes.begin("t1", "math", {}, repeat=0)
    assert first.key == ("math", "t1", 0) and first.metadata["repeat"] == 0
    summary = episodes.end(first.episode_id, 1.0, None, None, {})
    assert (summary.episode_id, summary.state, summary.duplicate) == (first.episode_id, FINISHED, False)
    again = episodes.end(first.episode_id, 1.0, None, None, {})  # the answer was lost: the client retries
    assert again.duplicate and again.episode_id == first.episode_id and again.reward == 1.0
    with pytest.raises(Conflict, match="already finished") as refused:
        episodes.end(first.episode_id, 0.0, None, None, {})  # a different result for the same episode
    assert refused.value.code == "episode_finished"
    assert [e.episode_id for e in closed] == [first.episode_id]  # one close, one sink call
    with pytest.raises(Conflict, match="already ended as episode") as ended:
        episodes.begin("t1", "math", {}, repeat=0)
    assert ended.value.code == "episode_key_ended"
    assert episodes.begin("t1", "math", {}, repeat=1).key == ("math", "t1", 1)  # another repeat runs
    assert episodes.begin("t1", "other", {}, repeat=0).key == ("other", "t1", 0)  # another group too


def test_a_new_begin_of_an_open_key_aborts_the_old_episode() -> None:
    episodes, closed = registry()
    old = episodes.begin("t1", "math", {"repeat": 0})  # the repeat as clients sent it in metadata
    new = episodes.begin("t1", "math", {"repeat": 0})  # its runner died; the restarted one runs it again
    assert old.state == ABORTED and new.episode_id in (old.reason or "") and new.state == OPEN
    assert [e.episode_id for e in closed] == [old.episode_id]
    with pytest.raises(Conflict, match="aborted"):
        episodes.end(old.episode_id, 1.0, None, None, {})  # the old agent comes back late: refused
    assert episodes.end(new.episode_id, 1.0, None, None, {}).episode_id == new.episode_id


def test_a_second_run_of_an_ended_key_is_not_trained() -> None:
    episodes, closed = registry()
    a = episodes.begin("t1", "math", {"repeat": 0})
    b = episodes.begin("t1", "math", {"repeat": 1})
    b.repeat = 0  # two episodes of one key open at once cannot be begun; made so to reach the end path
    episodes.end(a.episode_id, 1.0, None, None, {})
    answer = episodes.end(b.episode_id, 0.0, None, None, {})
    assert answer.duplicate and answer.episode_id == a.episode_id and answer.reward == 1.0
    assert b.state == ABORTED and a.episode_id in (b.reason or "")
    assert [(e.episode_id, e.state) for e in closed] == [(a.episode_id, FINISHED), (b.episode_id, ABORTED)]
    assert episodes.ended_count("math", "t1") == 1


def test_an_end_naming_another_key_changes_nothing() -> None:
    episodes, closed = registry()
    episode = episodes.begin("t1", "math", {}, repeat=0)
    wrongs: list[KeyParts] = [{"group": "tools"}, {"repeat": 3}, {"task_id": "t2"}]
    for wrong in wrongs:
        task_id = wrong.get("task_id")
        with pytest.raises(Conflict) as refused:
            episodes.end(
                episode.episode_id,
                1.0,
                task_id,
                None,
                {},
                group=wrong.get("group"),
                repeat=wrong.get("repeat"),
            )
        assert refused.value.code == "episode_key_mismatch" or "differs" in str(refused.value)
    assert episode.state == OPEN and not closed and episodes.ended_count("math", "t1") == 0


def test_ended_keys_come_back_from_the_store_summaries() -> None:
    episodes, _ = registry()
    summaries: list[dict[str, Any]] = [
        {"episode_id": "ep-a", "task_id": "t1", "group": "math", "state": "finished", "reward": 0.5,
         "metadata": {"repeat": 0}, "calls": 2, "policy_versions": [3], "started_at": 1.0, "ended_at": 2.0},
        {"episode_id": "ep-b", "task_id": "t1", "group": "math", "state": "aborted", "reward": None,
         "metadata": {"repeat": 1}, "calls": 1, "policy_versions": [3], "started_at": 1.0, "ended_at": 2.0},
        {"episode_id": "ep-c", "task_id": "t2", "group": None, "state": "finished", "reward": 1.0,
         "metadata": {}, "calls": 1, "policy_versions": [3], "started_at": 1.0, "ended_at": 2.0},
    ]  # fmt: skip
    assert episodes.restore_ended(summaries) == 1  # only the finished episode with a whole key
    assert [(key, e.episode_id) for key, e in episodes.ended_keys("math")] == [(("math", "t1", 0), "ep-a")]
    with pytest.raises(Conflict, match="ep-a"):
        episodes.begin("t1", "math", {}, repeat=0)
    assert episodes.begin("t1", "math", {}, repeat=1).state == OPEN  # the aborted repeat runs again
