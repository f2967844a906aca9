"""Hot swap of a client group on the dev Slurm cluster, while the server trains.

The quickstart trains with an array of 2 running the built-in agent; after a few steps the group is
swapped to another agent and an array of 1 (so the sharding changes). The server is never touched:
training goes on to its last step, every step once. The server store shows which agent ran each episode:
the old one only up to the policy version at which the new array started, the new one only from the
version at which the swap began; no (task, repeat) is committed twice across the group's stores, and the
old runners aborted their open episodes instead of leaving them to time out.
"""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from support import REPO, jobs_ended, recorded_steps, run_module, wait_until

from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TOTAL = 10
OLD_AGENT, NEW_AGENT = (
    "ajet_hpc.environments.arithmetic.agent:solve",
    "tests.fixture_agents:arithmetic_swapped",
)
AGENTS = (OLD_AGENT, NEW_AGENT)


def jobs(run: Path) -> list[dict]:
    return json.loads((run / "jobs.json").read_text())


def test_swap_client_group_mid_training(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [
        f"run.dir={run}",
        "cluster.backend=slurm",
        "servers.policy.time=30:00",
        "clients.math.time=30:00",
        "clients.math.array=2",
        "clients.math.eval=null",  # the swap of the training array is what is tested
        f"servers.policy.trainer.total_steps={TOTAL}",
        "servers.policy.trainer.tasks_per_batch=4",
        "servers.policy.trainer.repeats=4",
        "servers.policy.engine=transformers",  # the clients are the subject: an engine that loads in seconds
    ]
    done = run_module("ajet_hpc.launch", str(REPO / "configs" / "quickstart.yaml"), *overrides)
    assert done.returncode == 0, done.stderr + done.stdout
    first = {entry["name"]: entry["job_id"] for entry in jobs(run)}
    every = [first["server-policy"], first["clients-math"]]
    try:
        wait_until(lambda: len(recorded_steps(run)) >= 2, 600, "step 2")
        swapped = run_module(
            "ajet_hpc.launch", str(run), "--swap-clients", "math", "--agent", NEW_AGENT, "--array", "1"
        )
        print(swapped.stdout)
        assert swapped.returncode == 0, swapped.stderr + swapped.stdout
        assert "all tasks gone" in swapped.stdout
        (row,) = [json.loads(line) for line in (run / "swaps.jsonl").read_text().splitlines()]
        assert (row["action"], row["group"]) == ("swap", "math")
        assert (row["old"]["agent"], row["old"]["array"], row["old"]["job_id"]) == (
            OLD_AGENT,
            2,
            first["clients-math"],
        )
        assert (row["new"]["agent"], row["new"]["array"]) == (NEW_AGENT, 1)
        at_swap, stopped = row["servers_at_swap"]["policy"], row["servers_after_stop"]["policy"]
        at_start = row["servers_at_start"]["policy"]
        assert at_swap["source"] == stopped["source"] == "server"  # asked the running server
        assert stopped["episodes_open"] == 0  # the old runners aborted theirs before they went
        assert at_start["step"] < TOTAL, "training ended before the swap was over: raise TOTAL"
        newest = {entry["name"]: entry["job_id"] for entry in jobs(run)}
        assert newest["clients-math"] == row["new"]["job_id"] != first["clients-math"]
        every.append(newest["clients-math"])

        wait_until(
            lambda: jobs_ended(*every),
            600,
            "the run to finish after the swap",
        )
        assert recorded_steps(run) == list(range(1, TOTAL + 1))  # training never stopped nor repeated a step

        reader = EpisodeReader(run / "data" / "policy.h5")
        try:
            episodes, trained = reader.summaries(), reader.steps()
        finally:
            reader.close()
        by_agent = {a: [e for e in episodes if e["metadata"].get("agent") == a] for a in AGENTS}
        assert len(by_agent[OLD_AGENT]) + len(by_agent[NEW_AGENT]) == len(episodes)
        assert by_agent[OLD_AGENT] and by_agent[NEW_AGENT]
        assert max(v for e in by_agent[OLD_AGENT] for v in e["policy_versions"]) <= at_start["policy_version"]
        assert min(v for e in by_agent[NEW_AGENT] for v in e["policy_versions"]) >= at_swap["policy_version"]
        assert not [e for e in by_agent[OLD_AGENT] if e["state"] == "dropped"]  # none left to time out
        cut = [e for e in by_agent[OLD_AGENT] if e["state"] == "aborted"]
        assert all("stopped by SIGTERM" in e["reason"] for e in cut), [e["reason"] for e in cut]
        new_ids = {e["episode_id"] for e in by_agent[NEW_AGENT]}
        assert any(new_ids & set(s["episode_ids"]) for s in trained if s["step"] > at_start["step"])

        stores = sorted((run / "data" / "clients" / "math").glob("*.h5"))
        assert [p.name for p in stores] == ["0.h5", "1.h5"]  # index 1 of the old array is kept
        committed = Counter(r.key for p in stores for r in read_results(p))
        assert committed and max(committed.values()) == 1, committed.most_common(3)
        logs = run / "logs" / "clients-math"
        old_out = "".join(p.read_text() for p in logs.glob(f"{first['clients-math']}_*_log.out"))
        new_out = "".join(p.read_text() for p in logs.glob(f"{newest['clients-math']}_*_log.out"))
        assert "stopped by SIGTERM;" in old_out and "open episode(s) aborted" in old_out
        assert "by other tasks of group math" in new_out
    finally:
        subprocess.run(["scancel", *every], check=False, capture_output=True)
