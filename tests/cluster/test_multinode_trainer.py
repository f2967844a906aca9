"""A server allocation of two nodes: the HTTP front and engine on the first, one trainer rank per node
started with srun, DeepSpeed over gloo across the nodes (the dev cluster's nodes share one host)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import run_module, topology_dict, wait_until, write_topology

from ajet_hpc.launch import slurmcli

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]


def test_trainer_ranks_span_the_nodes_of_the_server_allocation(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm", array=1)
    server = data["servers"][0]
    server.update(partition="cpu", nodes=2, mem="2500M", time="20:00")
    server["trainer"] = {
        "zero_stage": 2,
        "ranks": 1,
        "lr": 0.003,
        "tasks_per_batch": 2,
        "repeats": 2,
        "skip_equal_groups": False,
        "total_steps": 2,
        "save_every": 2,
    }
    client = data["clients"][0]
    client.update(max_tasks=None, repeats=None, time="20:00", in_flight=2)
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)))
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = [entry["job_id"] for entry in json.loads((run / "jobs.json").read_text())]
    try:
        wait_until(
            lambda: all(s.state not in slurmcli.ACTIVE_STATES for s in slurmcli.job_states(jobs)),
            600,
            "the run to finish",
            poll_s=2,
        )
    finally:
        subprocess.run(["scancel", *jobs], check=False, capture_output=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    work = run / "ckpt" / "policy"
    ready = json.loads((work / "ready.json").read_text())
    assert ready["world_size"] == 2
    ranks_log = (work / "ranks.log").read_text()
    assert "$ srun --nodes=2 --ntasks=2 --ntasks-per-node=1" in ranks_log
    nodes = {line.split("on node ")[1].split()[0] for line in ranks_log.splitlines() if "on node " in line}
    assert len(nodes) == 2, ranks_log[-3000:]
