"""The eval side of a real server over HTTP (transformers engine, the scripted tiny model): the long poll,
the begin checks of eval episodes, the eval sampling settings, the done reports that close a round and
write its row. The whole flow (eval array, coordinator, store) is the quickstart test's."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from server_harness import Harness, RunningServer

from ajet_hpc.config.evaluation import EvalConfig
from ajet_hpc.server.episodes import Episode
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.evaluation import EvalPlan, EvalRounds

pytestmark = pytest.mark.slow


@pytest.fixture
def server(hf_harness: Harness, tmp_path: Path):
    running = hf_harness.serve(name="evaluated")
    config = EvalConfig(tasks="builtin:arithmetic_eval", samples_per_task=2, temperature=0.0, max_tokens=1)
    running.ctx.eval_configs = {"math-eval": config}
    running.ctx.evaluation = EvalRounds(
        "evaluated",
        [EvalPlan("math-eval", "math", config, array=2)],
        total_steps=10,
        metrics_path=tmp_path / "metrics.jsonl",
        ended_keys=running.ctx.episodes.ended_keys,
        written=running.ctx.recorder.written,
    )
    yield running
    running.server.should_exit = True


def _on_loop(harness: Harness, call):
    async def run():
        return call()

    return harness._call(run())


def test_a_round_over_http(server: RunningServer, hf_harness: Harness, tmp_path: Path) -> None:
    http = httpx.Client(base_url=server.url, headers=server.admin, timeout=60)
    rounds = server.ctx.evaluation
    assert rounds is not None
    idle = http.get("/v1/eval/round", params={"group": "math-eval", "index": 0}, timeout=60)
    assert idle.status_code == 200 and idle.json() == {"group": "math-eval", "step": None, "finished": False}
    assert http.get("/v1/eval/round", params={"group": "math", "index": 0}).status_code == 404
    assert http.get("/v1/eval/round", params={"group": "math-eval", "index": 2}).status_code == 400

    body = {"task_id": "s5/t0", "group": "math-eval", "repeat": 0, "metadata": {"eval_step": 5}}
    closed = http.post("/v1/episodes", json=body)
    assert closed.status_code == 409 and closed.json()["error"]["code"] == "eval_round_closed"
    _on_loop(hf_harness, lambda: rounds.open_due(5))
    assert http.get("/v1/eval/round", params={"group": "math-eval", "index": 1}).json()["step"] == 5
    for wrong in (
        {**body, "task_id": "t0"},  # not a round task id
        {**body, "metadata": {"eval_step": 4}},  # another step than its task id
        {**body, "metadata": {}},  # unmarked
        {"task_id": "t0", "group": "math", "repeat": 0, "metadata": {"eval_step": 5}},  # a training group
    ):
        refused = http.post("/v1/episodes", json=wrong)
        assert refused.status_code == 400 and "eval_step" in refused.json()["error"]["param"], wrong

    for task, repeat, reward in (("t0", 0, 1.0), ("t0", 1, 0.0), ("t1", 0, 0.5), ("t1", 1, 1.0)):
        begun = http.post("/v1/episodes", json={**body, "task_id": f"s5/{task}", "repeat": repeat}).json()
        agent = httpx.Client(
            base_url=begun["base_url"], headers={"Authorization": f"Bearer {begun['api_key']}"}
        )
        asked = {"model": "evaluated", "messages": [{"role": "user", "content": "1+1="}], "max_tokens": 8}
        answer = agent.post("/chat/completions", json={**asked, "temperature": 1.5}).json()
        assert answer["usage"]["completion_tokens"] == 1  # eval.max_tokens over what the agent asked
        ended = http.post(f"/v1/episodes/{begun['episode_id']}/end", json={"reward": reward})
        assert ended.status_code == 200
    kept = server.ctx.episodes.lookup(begun["episode_id"])
    assert (
        isinstance(kept, Episode)
        and kept.metadata["eval_step"] == 5
        and kept.sampling
        == {
            "temperature": 0.0,
            "max_tokens": 1,
        }
    )

    done = {"group": "math-eval", "step": 5, "episodes": 2}
    assert http.post("/v1/eval/done", json={**done, "index": 0}).json() == {"accepted": True}
    assert rounds.open  # index 1 has not reported
    assert http.post("/v1/eval/done", json={**done, "index": 1}).json() == {"accepted": True}
    assert http.post("/v1/eval/done", json={**done, "index": 1}).json() == {"accepted": False}  # closed
    (row,) = metrics.read_eval_rows(tmp_path / "metrics.jsonl")
    assert (row["step"], row["eval_episodes"], row["eval_expected"]) == (5, 4, 4)
    assert row["eval_pass@1"] == pytest.approx((1 / 2 + 1 / 2) / 2) and row["eval_reward_mean"] == 0.625
    _on_loop(hf_harness, rounds.finish)
    assert http.get("/v1/eval/round", params={"group": "math-eval", "index": 0}).json()["finished"] is True
