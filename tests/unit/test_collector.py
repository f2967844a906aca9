"""The batch collector's task-group policy with client-group ratios (mixed-task training)."""

from __future__ import annotations

from ajet_hpc.config import TrainerConfig
from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.server.episodes import ABORTED, FINISHED, Episode
from ajet_hpc.tracking import ContextTracker
from ajet_hpc.trainer.coordinator.collector import BatchCollector, quotas

TOKENIZER = build_tokenizer()


def finished(group: str, task: str, reward: float) -> Episode:
    """A closed episode of one recorded call."""
    tracker = ContextTracker(TOKENIZER)
    plan = tracker.build_prompt([{"role": "user", "content": task}])
    ids = TOKENIZER("ok<|im_end|>", add_special_tokens=False)["input_ids"]
    tracker.record(plan, ids, [-0.5] * len(ids), {"role": "assistant", "content": "ok"}, "stop", 0)
    episode = Episode(episode_id=f"{group}-{task}-{reward}", model="policy", tracker=tracker)
    episode.task_id, episode.group, episode.state, episode.reward = task, group, FINISHED, reward
    return episode


def add_tasks(collector: BatchCollector, group: str, count: int, start: int = 0) -> None:
    for k in range(start, start + count):
        for reward in (0.0, 1.0):  # repeats=2, unequal rewards: never skipped
            collector.add(finished(group, f"t{k}", reward))


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"tasks_per_batch": 10, "repeats": 2, "mix_wait_s": 60.0, **overrides})


def test_quotas_split_by_largest_remainder() -> None:
    assert quotas(10, {"math": 0.7, "tools": 0.3}) == {"math": 7, "tools": 3}
    assert quotas(4, {"a": 0.5, "b": 0.5}) == {"a": 2, "b": 2}
    assert quotas(3, {"a": 0.5, "b": 0.5}) == {"a": 2, "b": 1}
    assert quotas(8, {"a": 0.7, "b": 0.3}) == {"a": 6, "b": 2}  # 5.6 / 2.4


def test_every_batch_holds_the_ratio() -> None:
    collector = BatchCollector(config(), mix={"math": 0.7, "tools": 0.3})
    add_tasks(collector, "math", 12)
    add_tasks(collector, "tools", 5)
    batch = collector.try_batch(now=0.0)
    assert batch is not None and batch.tasks_per_client_group() == {"math": 7, "tools": 3}
    assert batch.shortfall == {}
    assert collector.try_batch(now=0.0) is None  # 5 math and 2 tools left: not a batch
    add_tasks(collector, "math", 2, start=12)
    add_tasks(collector, "tools", 1, start=5)
    second = collector.try_batch(now=0.0)
    assert second is not None and second.tasks_per_client_group() == {"math": 7, "tools": 3}


def test_a_slow_group_is_waited_for_then_reported_not_filled() -> None:
    collector = BatchCollector(config(), mix={"math": 0.7, "tools": 0.3})
    add_tasks(collector, "math", 9)
    add_tasks(collector, "tools", 1)
    assert collector.try_batch(now=100.0) is None  # math is complete, tools short: the wait starts
    assert collector.try_batch(now=130.0) is None
    batch = collector.try_batch(now=161.0)
    assert batch is not None
    assert batch.tasks_per_client_group() == {"math": 7, "tools": 1}  # not filled with math tasks
    assert batch.shortfall == {"tools": 2}


def test_without_any_group_at_its_share_nothing_waits() -> None:
    collector = BatchCollector(config(), mix={"math": 0.7, "tools": 0.3})
    add_tasks(collector, "math", 3)
    add_tasks(collector, "tools", 1)
    assert collector.try_batch(now=0.0) is None
    assert collector.try_batch(now=10_000.0) is None


def test_the_same_task_id_in_two_groups_is_two_tasks() -> None:
    collector = BatchCollector(config(tasks_per_batch=2))
    collector.add(finished("a", "t0", 0.0))
    collector.add(finished("b", "t0", 1.0))
    assert collector.try_batch() is None  # two episodes, but of two tasks, each one short
    collector.add(finished("a", "t0", 1.0))
    collector.add(finished("b", "t0", 0.0))
    batch = collector.try_batch()
    assert batch is not None
    assert sorted(group[0].group or "" for group in batch.groups) == ["a", "b"]
    for group in batch.groups:
        assert len({e.group for e in group}) == 1


def test_without_a_mix_a_batch_is_any_complete_tasks() -> None:
    collector = BatchCollector(config(tasks_per_batch=3))
    add_tasks(collector, "math", 2)
    assert collector.try_batch() is None
    add_tasks(collector, "tools", 1)
    batch = collector.try_batch()
    assert batch is not None and batch.tasks_per_client_group() == {"math": 2, "tools": 1}


def test_a_group_that_can_no_longer_complete_is_dropped_and_reported() -> None:
    """Repeats 0 and 1 of t0 ended; repeat 0 went stale (dropped), so repeat 1 waits for a repeat that no
    client runs again: the collector drops it and the next batch reports it with its id."""
    ended = {("math", "t0"): 2, ("math", "t1"): 1}
    collector = BatchCollector(config(tasks_per_batch=1), repeats_of={"math": 2})
    collector.ended_count = lambda group, task: ended.get((group, task), 0)
    collector.add(finished("math", "t0", 1.0))  # its partner ended and is gone
    collector.add(finished("math", "t1", 0.0))  # its partner has not run yet: it waits
    assert collector.try_batch() is None
    assert collector.stats.dropped_incomplete == 1
    ended[("math", "t1")] = 2
    collector.add(finished("math", "t1", 1.0))
    batch = collector.try_batch()
    assert batch is not None and [e.task_id for e in batch.episodes] == ["t1", "t1"]
    assert batch.dropped_incomplete == 1 and batch.dropped_ids == ["math-t0-1.0"]


def test_repeats_that_ended_but_are_not_yet_stored_still_count_as_coming() -> None:
    """The server hands the collector an episode once the store holds it, but counts a repeat as ended at
    its end: between the two the repeat is announced (in transit). A group whose repeats all ended, one of
    them stored, waits for the others instead of being dropped as one that can no longer complete (which
    broke every group while the coordinator collected during a step)."""
    ended: dict[tuple[str, str], int] = {}
    collector = BatchCollector(config(tasks_per_batch=1), repeats_of={"math": 2})
    collector.ended_count = lambda group, task: ended.get((group, task), 0)
    first, second = finished("math", "t0", 0.0), finished("math", "t0", 1.0)
    for episode in (first, second):  # both end: counted, announced, queued for the store
        ended[("math", "t0")] = ended.get(("math", "t0"), 0) + 1
        collector.announce(episode)
    collector.add(first)  # the first is written
    assert collector.try_batch() is None and collector.stats.dropped_incomplete == 0
    collector.add(second)
    batch = collector.try_batch()
    assert batch is not None and batch.episodes == [first, second]
    assert batch.dropped_incomplete == 0 and batch.dropped_ids == []
    collector.add(finished("math", "t1", 0.0))  # never announced (restored, or no store): nothing in transit
    ended[("math", "t1")] = 2
    assert collector.try_batch() is None and collector.stats.dropped_incomplete == 1


def test_an_aborted_repeat_does_not_take_a_finished_ones_place_in_transit() -> None:
    """A repeat whose call failed on the client's side is run again: the server closes the first attempt
    as aborted (superseded). Its store write reached `add`, which took one off the task's count in transit,
    though only finished episodes are announced: a finished repeat on its way to the store then no longer
    counted as coming, and the group was dropped as unable to complete (found by tools/bench/scale.py at
    4,096 open episodes, where clients retried under load)."""
    ended: dict[tuple[str, str], int] = {}
    collector = BatchCollector(config(tasks_per_batch=1), repeats_of={"math": 2})
    collector.ended_count = lambda group, task: ended.get((group, task), 0)
    first, second = finished("math", "t0", 0.0), finished("math", "t0", 1.0)
    superseded = finished("math", "t0", 0.5)
    superseded.state = ABORTED
    for episode in (first, second):  # both end: counted, announced, on their way to the store
        ended[("math", "t0")] = ended.get(("math", "t0"), 0) + 1
        collector.announce(episode)
    collector.announce(superseded)  # closed as aborted: not announced
    collector.add(superseded)  # written to the store (aborted episodes are kept there too)
    collector.add(first)
    assert collector.try_batch() is None and collector.stats.dropped_incomplete == 0  # second is coming
    collector.add(second)
    batch = collector.try_batch()
    assert batch is not None and batch.episodes == [first, second]


def test_restored_and_stale_episodes_are_counted_in_the_next_batch() -> None:
    collector = BatchCollector(config(tasks_per_batch=1, max_staleness=1))
    collector.set_policy_version(1)
    collector.note_dropped_stale(["old-1", "old-2"])  # too stale to restore after a restart
    collector.restore([finished("math", "t0", 0.0), finished("math", "t0", 1.0)])
    batch = collector.try_batch()
    assert batch is not None and batch.recovered == 2 and batch.dropped_stale == 2
    assert batch.dropped_ids == ["old-1", "old-2"]
    add_tasks(collector, "math", 1, start=1)
    second = collector.try_batch()
    assert second is not None and (second.recovered, second.dropped_stale, second.dropped_ids) == (0, 0, [])


def test_an_arrival_scans_no_waiting_episode_until_a_batch_can_form(monkeypatch) -> None:
    """Thousands of open episodes mean thousands waiting in the pool: each arrival used to check every one
    of them for staleness and re-slice every task's list. Now the pool counts its complete task groups as
    it changes; below a batch's worth nothing is scanned, and the count always equals a recount."""
    collector = BatchCollector(config(tasks_per_batch=4, repeats=2, skip_equal_groups=False))
    checked: list[str] = []
    real = collector._is_stale

    def counted(episode, version: int) -> bool:
        checked.append(episode.episode_id)  # which episodes a try looked at: the real check follows
        return real(episode, version)

    monkeypatch.setattr(collector, "_is_stale", counted)

    def recount() -> int:
        return sum(len(episodes) // 2 for episodes in collector._pending.values())

    for task in range(200):  # 200 tasks, one repeat each: no complete group
        collector.add(finished("math", f"t{task}", 0.0))
        assert collector.try_batch() is None and collector._pending.complete == recount() == 0
    assert checked == []
    for task in range(3):  # three complete groups: still short of a batch
        collector.add(finished("math", f"t{task}", 1.0))
        assert collector.try_batch() is None and collector._pending.complete == recount() == task + 1
    assert checked == []
    collector.add(finished("math", "t3", 1.0))  # the fourth: a batch, after one scan
    batch = collector.try_batch()
    assert batch is not None and sorted({str(e.task_id) for e in batch.episodes}) == ["t0", "t1", "t2", "t3"]
    assert len(checked) == 204 and collector._pending.complete == recount() == 0
    collector.put_back(batch)
    assert collector._pending.complete == recount() == 4


def test_equal_groups_are_skipped_until_they_would_hold_the_trainer() -> None:
    """A policy that answers every task alike makes every group equal: the collector skips them up to
    ``EQUAL_GROUPS_PER_TASK`` per task of a batch since the last batch, then keeps them, so the run trains
    on instead of waiting for groups that no longer come; after that batch it skips again."""
    from ajet_hpc.trainer.coordinator.collector import EQUAL_GROUPS_PER_TASK

    collector = BatchCollector(config(tasks_per_batch=2, repeats=2))
    limit = EQUAL_GROUPS_PER_TASK * 2

    def equal_tasks(count: int, start: int) -> None:
        for k in range(start, start + count):
            for repeat in range(2):
                episode = finished("math", f"t{k}", 1.0)
                episode.episode_id = f"t{k}-{repeat}"
                collector.add(episode)

    equal_tasks(limit, 0)
    assert collector.try_batch(now=0.0) is None  # every one skipped: the limit reached, not passed
    equal_tasks(2, limit)
    batch = collector.try_batch(now=0.0)
    assert batch is not None and batch.skipped_equal == limit
    assert {e.task_id for e in batch.episodes} == {f"t{limit}", f"t{limit + 1}"}  # kept, equal as they are
    equal_tasks(2, limit + 2)
    assert collector.try_batch(now=0.0) is None  # a new batch: skipped again
    assert collector.stats.skipped_equal == limit + 2
