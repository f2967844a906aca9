"""Acceptance (issue 44, "what users import stays put"): an agent module written against last week's public
imports (tests/fixtures/old_paths_agent.py) still loads through the client runner's loader and runs, and
each old path it imports warns with a FutureWarning that names the new one. In a fresh interpreter: an
import is cached once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, warnings
from types import SimpleNamespace as Obj
from ajet_hpc.client.api import EpisodeContext, Task
from ajet_hpc.environments.sources import import_entry  # what the runner loads `agent: module:function` with

class Completions:
    def create(self, **request):
        assert request["model"] == "policy" and "3+4=" in request["messages"][0]["content"], request
        return Obj(choices=[Obj(message=Obj(content="7"))])

class Model:  # stands for the episode's ModelHandle: an OpenAI client without a server
    name = "policy"
    def client(self):
        return Obj(chat=Obj(completions=Completions()))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    solve = import_entry("tests.fixtures.old_paths_agent:solve")
task = Task(id="t", data={"question": "3+4=", "answer": "7"})
ctx = EpisodeContext(task=task, models={"policy": Model()}, repeat=0)
outcome = solve(ctx)
print(json.dumps({
    "warnings": [str(w.message) for w in caught if issubclass(w.category, FutureWarning)],
    "reward": outcome.reward,
    "metadata": outcome.metadata,
    "module": solve.__module__,
}))
"""


def test_an_agent_written_against_the_old_paths_still_runs_and_is_told_the_new_ones() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["module"] == "tests.fixtures.old_paths_agent"
    assert result["reward"] == 1.0 and result["metadata"]["echoed"] == "7", result  # run, sandbox included
    moved = {message.split(" moved to ")[0]: message for message in result["warnings"]}
    expected = {
        "ajet_hpc.agents": "ajet_hpc.environments",
        "ajet_hpc.agents.single_call": "ajet_hpc.environments.single_call",
        "ajet_hpc.agents.mcp_tools": "ajet_hpc.environments.mcp_tools",
        "ajet_hpc.rewards": "ajet_hpc.environments.rewards",
        "ajet_hpc.rewards.math_answer": "ajet_hpc.environments.rewards.math_answer",
        "ajet_hpc.sandbox": "ajet_hpc.environments.sandbox",
        "ajet_hpc.tasks": "ajet_hpc.environments",
        "ajet_hpc.tasks.arithmetic": "ajet_hpc.environments.arithmetic.tasks",
    }
    assert set(moved) == set(expected), result["warnings"]
    for old, new in expected.items():
        assert moved[old] == f"{old} moved to {new}: import {new} (the old path will be removed)"
