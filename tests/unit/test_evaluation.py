"""Evaluation during training: pass@k against hand-worked values, the eval config and its refusals, the
eval group's jobs, the rounds' schedule and rows, and eval episodes kept out of training."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_collector import config as collector_config
from test_collector import finished

from ajet_hpc.algo.pass_at_k import pass_at_k, score_round
from ajet_hpc.config import ConfigError, Topology
from ajet_hpc.config.evaluation import EvalConfig
from ajet_hpc.launch.plan import JobSpec, build_plan
from ajet_hpc.tracking.episode import EVAL_STEP, round_task_id, split_round_task_id
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.collector import BatchCollector
from ajet_hpc.trainer.coordinator.evaluation import EvalPlan, EvalRounds
from ajet_hpc.trainer.coordinator.recovery import unconsumed


def test_pass_at_k_is_the_unbiased_estimator() -> None:
    # 1 - C(n-c, k) / C(n, k), worked by hand
    assert pass_at_k(4, 1, 1) == pytest.approx(1 / 4)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)=3, C(4,2)=6
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)=1, C(5,3)=10
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # C(7,2)=21, C(10,2)=45
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0  # n - c < k: certain
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_a_round_is_scored_per_task_then_averaged() -> None:
    rewards = {"a": [1.0, 0.5, 0.0, 1.0], "b": [0.0, 0.0, 0.5, 0.0], "c": [1.0, 1.0]}
    score = score_round(rewards, threshold=1.0, samples_per_task=4)
    assert score.episodes == 10
    assert score.reward_mean == pytest.approx(5.0 / 10)
    assert score.pass_at[1] == pytest.approx((2 / 4 + 0 / 4 + 2 / 2) / 3)
    assert score.pass_at[2] == pytest.approx(((1 - 1 / 6) + 0.0 + 1.0) / 3)  # a: 1 - C(2,2)/C(4,2)
    assert score.pass_at[3] == pytest.approx((1.0 + 0.0) / 2)  # c has 2 samples: left out of k >= 3
    assert (score.tasks["a"].samples, score.tasks["a"].passed) == (4, 2)
    assert score.metrics()["eval_pass@1"] == round(score.pass_at[1], 6)


def test_round_task_ids() -> None:
    assert round_task_id(10, "arith-eval-3") == "s10/arith-eval-3"
    assert split_round_task_id("s10/arith-eval-3") == (10, "arith-eval-3")
    assert split_round_task_id("s10/a/b") == (10, "a/b")
    assert split_round_task_id("arith-3") is None and split_round_task_id("sx/3") is None


def topology(eval_block: dict | None, servers: list | None = None, group_servers=None) -> Topology:
    servers = servers or [{"name": "policy", "model": "builtin:tiny", "trainer": {"total_steps": 12}}]
    client: dict[str, Any] = {"name": "math", "agent": "m:f", "tasks": "builtin:arithmetic"}
    client["servers"] = group_servers or ["policy"]
    if eval_block is not None:
        client["eval"] = eval_block
    return Topology.model_validate({"run": {"name": "r"}, "servers": servers, "clients": [client]})


def test_the_eval_group_runs_the_agent_on_the_held_out_tasks() -> None:
    topo = topology({"tasks": "builtin:arithmetic_eval", "samples_per_task": 3, "array": 2, "in_flight": 5})
    (group,) = topo.eval_groups.values()
    assert (group.name, group.tasks, group.repeats, group.array, group.in_flight, group.eval) == (
        "math-eval",
        "builtin:arithmetic_eval",
        3,
        2,
        5,
        None,
    )
    assert group.agent == "m:f" and topo.client("math-eval") == group
    assert topo.evaluated_by("math-eval") is topo.clients[0] and topo.evaluated_by("math") is None
    assert [c.name for c in topo.clients] == ["math"]  # feeds no trainer
    jobs = {job.name: job for job in build_plan(topo, pythons={"math": "/envs/agent/bin/python"})}
    assert set(jobs) == {"server-policy", "clients-math", "clients-math-eval"}
    evaluating = jobs["clients-math-eval"]
    assert isinstance(evaluating, JobSpec)
    assert evaluating.array == 2 and evaluating.python == "/envs/agent/bin/python"  # the group's runtime
    assert evaluating.command(Path("RUN"))[-2:] == ["--group", "math-eval"]


@pytest.mark.parametrize(
    ("block", "servers", "group_servers", "path", "words"),
    [
        ({"tasks": "builtin:a", "model": "other"}, None, None, "clients[0].eval.model", "not one of"),
        (
            {"tasks": "builtin:a"},
            [{"name": "policy", "model": "builtin:tiny", "trainer": None}],
            None,
            "clients[0].eval",
            "none of the group's servers",
        ),
        (
            {"tasks": "builtin:a", "model": "judge"},
            [
                {"name": "policy", "model": "builtin:tiny"},
                {"name": "judge", "model": "builtin:tiny", "trainer": None},
            ],
            ["policy", "judge"],
            "clients[0].eval.model",
            "does not train",
        ),
    ],
)
def test_impossible_eval_blocks_are_refused_by_field(block, servers, group_servers, path, words) -> None:
    with pytest.raises(ConfigError) as caught:
        topology(block, servers, group_servers)
    assert path in str(caught.value) and words in str(caught.value)


def test_an_eval_group_name_taken_by_another_group_is_refused() -> None:
    data = {
        "run": {"name": "r"},
        "servers": [{"name": "policy", "model": "builtin:tiny"}],
        "clients": [
            {
                "name": "math",
                "agent": "m:f",
                "tasks": "builtin:a",
                "servers": ["policy"],
                "eval": {"tasks": "x:y"},
            },
            {"name": "math-eval", "agent": "m:f", "tasks": "builtin:a", "servers": ["policy"]},
        ],
    }
    with pytest.raises(ConfigError, match=r"clients\[0\].eval.*math-eval"):
        Topology.model_validate(data)


def test_eval_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="samples_per_task"):
        EvalConfig.model_validate({"tasks": "builtin:a", "samples_per_task": 0})
    with pytest.raises(ValueError, match="extra"):
        EvalConfig.model_validate({"tasks": "builtin:a", "sample_per_task": 2})


def ended(rewards: dict[tuple[str, int], float]):
    """An ``ended_keys`` of one eval group: (group, task id, repeat) -> an Ended-like record."""
    return lambda group: [((group, t, r), SimpleNamespace(reward=v)) for (t, r), v in rewards.items()]


async def stored() -> bool:
    """A ``written`` whose store holds every ended episode already (these ends are in memory only)."""
    return True


def rounds(tmp_path: Path, rewards: dict, array: int = 1, **eval_fields) -> EvalRounds:
    plan = EvalPlan("math-eval", "math", EvalConfig(tasks="builtin:a", **eval_fields), array)
    return EvalRounds(
        "policy", [plan], 12, tmp_path / "metrics.jsonl", ended_keys=ended(rewards), written=stored
    )


def test_rounds_open_at_the_start_every_n_steps_and_at_the_last(tmp_path: Path) -> None:
    async def scenario() -> list[int]:
        evaluation = rounds(tmp_path, {}, every_steps=5, samples_per_task=1)
        opened = []
        for step in range(13):
            if evaluation.open_due(step):
                opened.append(step)
                assert evaluation.round_for("math-eval", 0) == step
                assert await evaluation.report_done("math-eval", 0, step, 0)
        return opened

    assert asyncio.run(scenario()) == [0, 5, 10, 12]


def test_a_round_closes_when_every_task_reported_and_writes_its_row(tmp_path: Path) -> None:
    rewards = {
        ("s5/a", 0): 1.0,
        ("s5/a", 1): 0.0,
        ("s5/b", 0): 0.5,
        ("s5/b", 1): 0.5,
        ("s0/a", 0): 1.0,  # another round's episode: not counted
    }

    async def scenario() -> EvalRounds:
        evaluation = rounds(tmp_path, rewards, array=2, samples_per_task=2)
        assert evaluation.open_due(5) == ["math-eval"]
        assert not await evaluation.report_done("math-eval", 0, 4, 2)  # not the open round
        assert await evaluation.report_done("math-eval", 0, 5, 2)
        assert evaluation.round_for("math-eval", 0) is None and evaluation.round_for("math-eval", 1) == 5
        assert evaluation.open  # task 1 has not reported yet
        await evaluation.report_done("math-eval", 1, 5, 2)
        assert not evaluation.open
        await evaluation.wait_closed()  # returns at once
        assert evaluation.open_due(5) == []  # complete: never again
        return evaluation

    asyncio.run(scenario())
    (row,) = metrics.read_eval_rows(tmp_path / "metrics.jsonl")
    assert metrics.read_rows(tmp_path / "metrics.jsonl") == []  # not a step row
    assert (row["eval"], row["model"], row["step"], row["eval_episodes"]) == ("math-eval", "policy", 5, 4)
    assert row["eval_reward_mean"] == 0.5 and row["eval_pass@1"] == 0.25 and row["eval_pass@2"] == 0.5
    assert row["eval_tasks"]["a"] == {"n": 2, "passed": 1, "reward_mean": 0.5}
    assert row["eval_complete"] and row["eval_expected"] == 4 and row["eval_best_step"] == 5
    # a new server process reads the completed rounds back; a resume before step 5 forgets it
    assert rounds(tmp_path, rewards, array=2).open_due(5) == []
    metrics.truncate_after(tmp_path / "metrics.jsonl", "policy", 4)
    assert rounds(tmp_path, rewards, array=2).open_due(5) == ["math-eval"]


def test_a_round_past_its_timeout_closes_incomplete(tmp_path: Path) -> None:
    async def scenario() -> None:
        evaluation = rounds(tmp_path, {("s0/a", 0): 1.0}, timeout_s=0.2, samples_per_task=1)
        evaluation.open_due(0)
        await evaluation.wait_closed(poll_s=0.05)
        assert not evaluation.open

    asyncio.run(scenario())
    (row,) = metrics.read_eval_rows(tmp_path / "metrics.jsonl")
    assert row["eval_complete"] is False and row["eval_pass@1"] == 1.0


def test_the_best_step_is_the_highest_pass_at_1(tmp_path: Path) -> None:
    rewards = {("s0/a", 0): 0.0, ("s5/a", 0): 1.0, ("s10/a", 0): 0.0}

    async def scenario() -> None:
        evaluation = rounds(tmp_path, rewards, samples_per_task=1)
        for step in (0, 5, 10):
            evaluation.open_due(step)
            await evaluation.report_done("math-eval", 0, step, 1)

    asyncio.run(scenario())
    best = [(r["step"], r["eval_best_step"]) for r in metrics.read_eval_rows(tmp_path / "metrics.jsonl")]
    assert best == [(0, 0), (5, 5), (10, 5)]


def test_a_long_poll_waits_for_a_round_then_for_the_end(tmp_path: Path) -> None:
    async def scenario() -> tuple:
        evaluation = rounds(tmp_path, {}, samples_per_task=1)
        assert await evaluation.wait_round("math-eval", 0, timeout_s=0.05) is None
        waiting = asyncio.create_task(evaluation.wait_round("math-eval", 0, timeout_s=5))
        await asyncio.sleep(0.05)
        evaluation.open_due(5)
        step = await waiting
        await evaluation.report_done("math-eval", 0, 5, 0)
        ending = asyncio.create_task(evaluation.wait_round("math-eval", 0, timeout_s=5))
        await asyncio.sleep(0.05)
        evaluation.finish()
        return step, await ending, evaluation.finished

    assert asyncio.run(scenario()) == (5, None, True)


def test_eval_episodes_are_never_collected_nor_restored() -> None:
    collector = BatchCollector(collector_config(tasks_per_batch=1, repeats=2))
    for reward in (0.0, 1.0):
        episode = finished("math-eval", "s5/t0", reward)
        episode.metadata[EVAL_STEP] = 5
        collector.announce(episode)
        collector.add(episode)
    assert collector.try_batch(now=0.0) is None and collector.stats.received == 0
    summary = {
        "state": "finished",
        "calls": 1,
        "policy_versions": [5],
        "task_id": "s5/t0",
        "group": "math-eval",
    }
    summaries = [
        {**summary, "episode_id": "e1", "metadata": {"repeat": 0, EVAL_STEP: 5}},
        {**summary, "episode_id": "e2", "metadata": {"repeat": 0}, "group": "math", "task_id": "t0"},
    ]
    assert unconsumed(summaries, set(), 5, 0).fresh == ["e2"]


def test_eval_rows_are_not_step_rows(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    metrics.append_row(path, {"step": 1, "model": "policy"})
    metrics.append_eval_row(path, {"eval": "math-eval", "step": 0, "model": "policy"})
    with pytest.raises(ValueError, match="eval row needs"):
        metrics.append_eval_row(path, {"eval": "math-eval", "model": "policy"})
    assert [r["step"] for r in metrics.read_rows(path)] == [1] and metrics.last_step(path, "policy") == 1
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 0]


def test_offline_eval_refuses_what_it_cannot_evaluate(tmp_path: Path, capsys) -> None:
    from ajet_hpc.offline.evaluate import main
    from ajet_hpc.storage.rundir import RunDir

    assert main([str(tmp_path / "nowhere")]) == 2
    assert "is not a run directory" in capsys.readouterr().err
    without = RunDir(tmp_path / "without")
    without.prepare(topology(None))
    assert main([str(without.root)]) == 2
    assert "0 client groups with an eval block" in capsys.readouterr().err
    untrained = RunDir(tmp_path / "untrained")
    untrained.prepare(topology({"tasks": "builtin:arithmetic_eval"}))
    assert main([str(untrained.root), "--group", "other"]) == 2
    assert "no client group 'other' with an eval block; groups with one: math" in capsys.readouterr().err
    assert main([str(untrained.root), "--step", "5"]) == 2  # the group's model has not saved step 5
    assert "no checkpoint of step 5" in capsys.readouterr().err
