"""Environments users bring, through the front door: the real package from the registry in the group's own
client runtime (``env:``), a short training run on the local backend, rewards from the library's scorer."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from support import REPO, run_module

from ajet_hpc.config import load_topology
from ajet_hpc.config.fields import parse_reasoning_gym
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.trainer import metrics

pytestmark = pytest.mark.slow

RESCORE = """
import json, sys
import reasoning_gym
out = []
for name, config, index, answer in json.load(sys.stdin):
    dataset = reasoning_gym.create_dataset(name, **config)
    out.append(dataset.score_answer(answer, dataset[index]))
print(json.dumps(out))
"""


def test_a_reasoning_gym_mix_of_three_datasets_trains_with_rewards_per_dataset(tmp_path: Path) -> None:
    """configs/reasoning_gym.yaml for 3 steps: chain_sum, gcd and count_bits as three groups in one
    runtime; every step trains all three (rewards per dataset in its row), every episode is stored with the
    answer it was scored on, and reasoning-gym itself, run apart from our code, gives the same rewards."""
    run = tmp_path / "rg"
    config = REPO / "configs" / "reasoning_gym.yaml"
    steps = "servers.policy.trainer.total_steps=3"
    done = run_module("ajet_hpc.launch", str(config), f"run.dir={run}", steps, timeout_s=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    groups = {"chain_sum", "gcd", "count_bits"}
    rows = metrics.read_rows(run / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert set(row["reward_by_group"]) == groups and row["client_groups"] == dict.fromkeys(groups, 2)
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        finished = [s for s in reader.summaries() if s["state"] == "finished"]
    assert {s["group"] for s in finished} == groups
    assert all(s["metadata"]["dataset"] == s["group"] for s in finished)
    sources = {g.name: parse_reasoning_gym(g.tasks) for g in load_topology(config).clients}
    asked = []
    for s in finished[:60]:
        name, params = sources[s["group"]]
        index = int(re.fullmatch(rf"{name}-1-(\d+)", s["task_id"])[1])  # type: ignore[index]
        asked.append([name, {"size": 200, "seed": 1, **params}, index, s["metadata"]["answer"]])
    (python,) = (run / "envs").glob("reasoning-gym-*/bin/python")  # the group's runtime, built at launch
    rescored = subprocess.run(
        [str(python), "-c", RESCORE], input=json.dumps(asked), capture_output=True, text=True, check=True
    )
    assert json.loads(rescored.stdout) == pytest.approx([s["reward"] for s in finished[:60]])
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    assert "unexpected error on" not in server_log and "Traceback" not in server_log  # no 5xx answered
