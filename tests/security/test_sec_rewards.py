"""Rewards an episode ends with (issue 14, item 6): finite and within ``±serving.max_abs_reward``, else a 400
that names the value and the limit before anything is recorded; and a batch that still holds a bad episode
drops that episode, reports it, and trains the rest."""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import cast

import httpx
import openai
import pytest
from server_harness import Harness
from support import topology_dict

from ajet_hpc.config import TrainerConfig, load_topology
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.tiny import build_tokenizer
from ajet_hpc.server.episodes import FINISHED, Episode
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.tracking import ContextTracker
from ajet_hpc.tracking.episode import EpisodeData
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.collector import Batch, BatchCollector
from ajet_hpc.trainer.coordinator.episodes_to_samples import build_samples
from ajet_hpc.trainer.coordinator.host import TrainerSetup
from ajet_hpc.trainer.coordinator.loop import Coordinator
from ajet_hpc.trainer.protocol.sync_plan import DISK

LIMIT = 10.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    harness = Harness("transformers", resolve_model("builtin:tiny", tmp_path_factory.mktemp("models")))
    yield harness.serve(max_abs_reward=LIMIT)
    harness.close()


def _one_call(server) -> str:
    begun = server.begin(task_id="t0", group="g", repeat=0)
    client = openai.OpenAI(base_url=begun["base_url"], api_key=begun["api_key"], max_retries=0)
    client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "1+1"}], max_tokens=4
    )
    return begun["episode_id"]


def _end_raw(server, episode_id: str, body: str) -> httpx.Response:
    headers = {**server.admin, "Content-Type": "application/json"}
    return httpx.post(f"{server.url}/v1/episodes/{episode_id}/end", content=body, headers=headers)


@pytest.mark.slow
def test_bad_rewards_are_refused_before_anything_is_recorded_and_a_corrected_end_follows(server) -> None:
    episode_id = _one_call(server)
    refused = [
        ('{"reward": NaN}', "reward", "reward is nan"),
        ('{"reward": Infinity}', "reward", "reward is inf"),
        ('{"reward": 1.0, "turn_rewards": [-Infinity]}', "turn_rewards", "turn_rewards[0] is -inf"),
        ('{"reward": 1.0, "turn_rewards": [NaN]}', "turn_rewards", "turn_rewards[0] is nan"),
        ('{"reward": 1e300}', "reward", "reward is 1e+300, beyond this server's limit of ±10"),
        ('{"reward": -10.5}', "reward", "reward is -10.5, beyond this server's limit of ±10"),
        ('{"reward": 1.0, "turn_rewards": [11]}', "turn_rewards[0]", "turn_rewards[0] is 11, beyond"),
    ]
    for body, param, message in refused:
        reply = _end_raw(server, episode_id, body)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()["error"]
        assert message in error["message"] and error["param"] == param, (body, error)
        if "beyond" in message:
            assert "max_abs_reward" in error["message"] and error["code"] == "reward_out_of_range"
        shown = server.episode(episode_id)
        assert shown["state"] == "open" and shown["reward"] is None, body  # nothing recorded
    assert server.status()["episodes_finished"] == 0
    corrected = server.end(episode_id, -LIMIT, turn_rewards=[LIMIT])  # the limit itself is allowed
    assert corrected.status_code == 200, corrected.text
    assert server.episode(episode_id)["reward"] == -LIMIT
    assert server.status()["episodes_finished"] == 1


# The drop path of a batch. The server refuses the bad rewards above, so a bad episode cannot come through
# its API: it is built here directly, as it could come from an older server's store restored after a
# restart, or from a bug elsewhere (a turn_rewards list that no longer matches the calls).

TOKENIZER = build_tokenizer()


def finished(task: str, episode_id: str, reward: float, turn_rewards: list[float] | None = None) -> Episode:
    tracker = ContextTracker(TOKENIZER)
    plan = tracker.build_prompt([{"role": "user", "content": task}])
    ids = TOKENIZER("ok<|im_end|>", add_special_tokens=False)["input_ids"]
    tracker.record(plan, ids, [-0.5] * len(ids), {"role": "assistant", "content": "ok"}, "stop", 0)
    episode = Episode(episode_id=episode_id, model="policy", tracker=tracker)
    episode.task_id, episode.group, episode.state = task, "g", FINISHED
    episode.reward, episode.turn_rewards = reward, turn_rewards
    return episode


def test_a_batch_drops_the_episodes_at_fault_reports_them_and_trains_the_rest(caplog) -> None:
    good = [finished("t0", "a0", 0.0), finished("t0", "a1", 1.0), finished("t0", "a2", 0.5)]
    bad_reward = finished("t0", "nan-reward", math.nan)
    bad_turns = finished("t1", "short-turns", 1.0, turn_rewards=[0.5, 0.5])  # two values for one call
    other = finished("t1", "b0", 0.0)
    alone: list[EpisodeData] = [finished("t2", "c0", math.inf), finished("t2", "c1", -math.inf)]
    batch = Batch(groups=[[*good[:2], bad_reward, good[2]], [bad_turns, other], alone], dropped_ids=["x"])
    with caplog.at_level(logging.WARNING):
        samples, stats = build_samples(batch, TrainerConfig(tasks_per_batch=3, repeats=2))
    assert sorted(batch.invalid) == ["c0", "c1", "nan-reward", "short-turns"]
    assert "reward is nan" in batch.invalid["nan-reward"] and "inf" in batch.invalid["c0"]
    assert "turn_rewards" in batch.invalid["short-turns"]
    assert batch.dropped_invalid == 4 and batch.dropped_ids == ["x", *batch.invalid]  # the journal's list
    assert [[e.episode_id for e in group] for group in batch.groups] == [["a0", "a1", "a2"], ["b0"]]
    assert {s.episode_id for s in samples} == {"a0", "a1", "a2", "b0"}
    assert all(math.isfinite(a) for s in samples for a in s.advantages)
    assert any(a != 0.0 for s in samples for a in s.advantages)  # the good group still learns
    assert stats.samples_after == len(samples)
    assert "nan-reward" in caplog.text and "short-turns" in caplog.text
    again, _ = build_samples(batch, TrainerConfig(tasks_per_batch=3, repeats=2))  # a retried step
    assert len(again) == len(samples) and batch.dropped_invalid == 4


def test_a_batch_with_no_valid_episode_builds_nothing_and_the_collector_reports_it_next() -> None:
    collector = BatchCollector(TrainerConfig(tasks_per_batch=1, repeats=2, skip_equal_groups=False))
    batch = Batch(groups=[[finished("t0", "n0", math.nan), finished("t0", "n1", math.nan)]])
    samples, _ = build_samples(batch, collector.config)
    assert samples == [] and batch.episodes == [] and batch.dropped_invalid == 2
    collector.carry_over(batch)  # what the coordinator does with a batch that built no sample
    collector.add(finished("t1", "d0", 0.0))
    collector.add(finished("t1", "d1", 1.0))
    following = collector.try_batch()
    assert following is not None and following.dropped_invalid == 2
    assert following.dropped_ids == ["n0", "n1"] and sorted(following.invalid) == ["n0", "n1"]


@pytest.mark.slow
def test_the_coordinator_skips_a_batch_it_cannot_build_and_reports_it_with_the_next(server, tmp_path) -> None:
    data = topology_dict(tmp_path / "run")
    data["servers"][0]["trainer"] = {"total_steps": 2, "tasks_per_batch": 1, "repeats": 2}
    config = load_topology(data).servers[0]
    setup = TrainerSetup(
        server=config,
        model_path=Path("unused"),
        run=RunDir(tmp_path / "run"),
        on_slurm=False,
        placement=config.placement_plan(),
        sync=DISK,
    )
    coordinator = Coordinator(server.ctx, setup)
    batch = Batch(groups=[[finished("t0", "n0", math.nan), finished("t0", "n1", 1.0, turn_rewards=[1, 2])]])
    no_ranks = cast(TrainerChannel, None)  # a batch that builds nothing never reaches the ranks
    trained = asyncio.run(coordinator._train_step(channel=no_ranks, batch=batch))
    assert trained is False and coordinator.step == 0  # no step, no error: the coordinator goes on
    assert not (tmp_path / "run" / "ckpt" / "policy" / "consumed.jsonl").exists()
    coordinator.collector.add(finished("t1", "d0", 0.0))
    coordinator.collector.add(finished("t1", "d1", 1.0))
    following = coordinator.collector.try_batch()
    assert following is not None and following.dropped_ids == ["n0", "n1"]
    assert following.dropped_invalid == 2 and "turn_rewards has 2 values" in following.invalid["n1"]
