"""Training on the dev Slurm cluster: server on partition gpu, clients as an array on partition cpu;
``scontrol requeue`` of the server mid-run → it resumes at its last checkpoint, the clients find it again,
and every step appears exactly once in metrics.jsonl."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import REPO, run_module, wait_until

from ajet_hpc.launch import slurmcli

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TOTAL, SAVE_EVERY = 16, 4


def steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def test_quickstart_on_slurm_survives_a_server_requeue(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [
        f"run.dir={run}",
        "cluster.backend=slurm",
        "servers.policy.time=30:00",
        "clients.math.time=30:00",
        "clients.math.array=2",
        f"servers.policy.trainer.total_steps={TOTAL}",
        f"servers.policy.trainer.save_every={SAVE_EVERY}",
    ]
    done = run_module("ajet_hpc.launch", str(REPO / "configs" / "quickstart.yaml"), *overrides)
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    server_id, client_id = jobs["server-policy"]["job_id"], jobs["clients-math"]["job_id"]
    try:
        tasks = {s.job_id: s for s in slurmcli.job_states([client_id])}
        assert len(tasks) == 2 and {s.partition for s in tasks.values()} == {"cpu"}
        wait_until(lambda: len(steps(run)) > SAVE_EVERY, 600, f"step {SAVE_EVERY + 1}")
        server = slurmcli.job_states([server_id])[0]
        assert (server.partition, server.nodes) == ("gpu", "g1")
        before = steps(run)
        assert before[-1] < TOTAL, "the run finished before the requeue could happen: raise TOTAL"
        subprocess.run(["scontrol", "requeue", server_id], check=True)

        every = [server_id, client_id]
        wait_until(
            lambda: all(
                s.state not in slurmcli.ACTIVE_STATES for j in every for s in slurmcli.job_states([j])
            ),
            900,
            "the run to finish after the requeue",
        )
        assert steps(run) == list(range(1, TOTAL + 1))  # every step exactly once
        log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
        resumed = [line for line in log.splitlines() if "resumed policy at step" in line]
        assert resumed, "the requeued server did not resume from a checkpoint"
        resumed_at = int(resumed[-1].split("resumed policy at step ")[1].split()[0])
        assert resumed_at % SAVE_EVERY == 0 and 0 < resumed_at <= before[-1]
        out = subprocess.run(["scontrol", "show", "job", server_id], capture_output=True, text=True).stdout
        assert "Restarts=1" in out
        client_logs = "".join(p.read_text() for p in (run / "logs" / "clients-math").glob("*_log.out"))
        assert "is back at" in client_logs or "reached server policy" in client_logs
        assert "stopping: " in client_logs  # the clients ended because training finished
    finally:
        subprocess.run(["scancel", server_id, client_id], check=False, capture_output=True)
