"""Chaos test on the dev Slurm cluster: a server preempted with SIGTERM only (docs/reliability.md,
"Preemption and time limits").

The dev cluster sends the user signal at preemption (``preempt_send_user_signal``) to jobs with
``--signal``. To see what a cluster without the user signal does, the run is started by hand with the
``sbatch/`` scripts (``launch --no-submit`` writes the run directory) and the server job gets
``--signal=TERM@30`` on the sbatch command line (over the script's ``B:USR2``): SIGTERM at the preemption
(then, after the partition's GraceTime, SIGTERM again and SIGKILL after KillWait), never USR2. A job on the
higher-tier partition ``urgent`` takes the server's node; the server saves the step it is at, requeues its
own job (with GraceTime a job that stops by itself would end COMPLETED, never requeued), resumes at that
step and the run finishes: every step once in metrics.jsonl, in the server's store and in the ranks' log.
The client array is suspended from step 2 until the save, so that the run cannot finish before Slurm gets
round to the preemption.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import (
    REPO,
    SIGNAL_SAVED,
    jobs_ended,
    ranks_trained_steps,
    recorded_steps,
    run_module,
    topology_dict,
    wait_until,
    write_topology,
)

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TOTAL = 6


def server_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("server-*.out")))


def sbatch(*args: str) -> str:
    env = {**os.environ, "AJET_PYTHON": sys.executable}  # and PYTHONPATH: the jobs run this checkout
    done = subprocess.run(
        ["sbatch", "--parsable", *args], capture_output=True, text=True, check=True, env=env
    )
    return done.stdout.strip().split(";")[0]


def test_sigterm_only_preemption_checkpoints_requeues_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm", array=2, kill_wait_s=30)
    data["servers"][0].update(cpus=2, mem="3G", time="30:00")
    data["servers"][0]["trainer"] = {
        "ranks": 2,
        "lr": 0.003,
        "tasks_per_batch": 2,
        "repeats": 2,
        "skip_equal_groups": False,  # every finished group trains: the step count is predictable
        "total_steps": TOTAL,
        "save_every": 100,  # no periodic checkpoint: only the signal's (and the last step's)
    }
    data["clients"][0].update(repeats=None, max_tasks=None, in_flight=2, mem="500M", time="30:00")
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)), "--no-submit")
    assert done.returncode == 0, done.stderr + done.stdout
    logs = run / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server_id = sbatch(
        *("-p", "gpu", "-c", "2", "--mem=3G", "--time=30:00", "--signal=TERM@30", f"--chdir={REPO}"),
        *(f"--output={logs}/server-%j.out", str(REPO / "sbatch" / "server.sbatch"), str(run), "policy"),
    )
    client_id = sbatch(
        *("-p", "cpu", "--array=0-1", "--mem=500M", "--time=30:00", f"--chdir={REPO}"),
        *(f"--output={logs}/clients-%A_%a.out", str(REPO / "sbatch" / "clients.sbatch"), str(run), "math"),
    )
    urgent = None
    try:
        wait_until(lambda: len(recorded_steps(run)) >= 2, 300, "step 2")
        # Hold the clients while the preemption takes its time (the scheduler's pass, a loaded machine): no
        # new episode, so with max_staleness 1 the trainer stops within two steps, well before TOTAL.
        subprocess.run(["scontrol", "suspend", client_id], check=True)
        command = ["sbatch", "--parsable", "-p", "urgent", "-w", "g1", "-c", "2", "--mem=100M"]
        urgent = subprocess.run(
            [*command, f"--output={tmp_path}/urgent-%j.out", "--wrap", "sleep 2"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        saved = wait_until(
            lambda: re.findall(SIGNAL_SAVED, server_log(run)),
            120,
            "the server to checkpoint on SIGTERM",
        )
        subprocess.run(["scontrol", "resume", client_id], check=True)
        saved_at = int(saved[0])
        assert saved_at < TOTAL, "the run finished before the preemption: raise TOTAL"
        assert recorded_steps(run) == list(
            range(1, saved_at + 1)
        )  # recorded up to the saved step, nothing lost
        wait_until(lambda: jobs_ended(server_id, client_id), 600, "the run to finish after the preemption")

        log = server_log(run)
        assert "SIGTERM: checkpointing" in log
        assert f"requeued job {server_id}: Slurm preempted the job" in log
        assert "checkpoint signal" not in log and "USR2" not in log  # SIGTERM only
        assert [int(m) for m in re.findall(r"resumed policy at step (\d+)", log)] == [saved_at]
        assert recorded_steps(run) == list(range(1, TOTAL + 1))  # every step exactly once
        trained = ranks_trained_steps(run)
        assert all(trained[s] == 1 for s in range(1, saved_at + 1)), trained  # nothing trained twice
        assert sorted(trained) == list(range(1, TOTAL + 1))
        reader = EpisodeReader(run / "data" / "policy.h5")
        try:
            assert [s["step"] for s in reader.steps()] == list(range(1, TOTAL + 1))
            finished = [s for s in reader.summaries() if s["state"] == "finished"]
            assert len({s["episode_id"] for s in finished}) == len(finished) >= TOTAL * 2 * 2
        finally:
            reader.close()
        record = slurmcli.job_record(server_id)
        assert record["Restarts"] == "1" and record["JobState"] == "COMPLETED"
    finally:
        subprocess.run(
            ["scontrol", "resume", client_id], check=False, capture_output=True
        )  # if the test failed while they were held
        subprocess.run(
            ["scancel", server_id, client_id, *([urgent] if urgent else [])], check=False, capture_output=True
        )
