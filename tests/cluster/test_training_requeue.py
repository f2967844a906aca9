"""Training on the dev Slurm cluster: server on partition gpu, clients as an array on partition cpu.

The server job is first preempted (a job on the higher-tier partition ``urgent`` takes its node: Slurm
sends USR2, the server checkpoints the step it is at, submitit requeues it) and resumes exactly at that
step. Later ``scontrol requeue`` (Slurm's SIGTERM only) makes it save the step it is at again and resume
there. The clients find the server again by themselves both times, and every step appears exactly
once in metrics.jsonl.

The server runs the transformers engine (it loads in seconds; a vLLM load is about 45 s, and this run
starts the server three times): the signals, checkpoints and requeues are the subject, not the engine. Its
weights reach the engine by a reload from disk after each step. vLLM on Slurm through a requeue is
``chaos/test_chaos_watchdog.py``'s killed engine core (in-memory sync) and ``test_swarm.py``'s two adapters
of one server; a signal during an in-memory weight sync (docs/reliability.md) is
``component/test_weight_sync.py::test_a_signal_during_a_sync_saves_the_step_without_waiting_for_the_blocked_loop``.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from support import (
    REPO,
    SIGNAL_SAVED,
    jobs_ended,
    ranks_trained_steps,
    recorded_steps,
    run_module,
    wait_until,
)

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.trainer.coordinator import metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TOTAL, SAVE_EVERY = 16, 5
EVAL_EPISODES = 16 * 2  # the quickstart's 16 held-out tasks, 2 samples each (it takes 4)


def server_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs" / "server-policy").glob("*_log.out")))


def resumes(run: Path) -> list[int]:
    return [int(m) for m in re.findall(r"resumed policy at step (\d+)", server_log(run))]


def preempt(node: str, out: Path) -> str:
    command = ["sbatch", "--parsable", "-p", "urgent", "-w", node, "-c", "2", "--mem=100M"]
    return subprocess.run(
        [*command, f"--output={out}/urgent-%j.out", "--wrap", "sleep 2"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_quickstart_on_slurm_survives_preemption_and_requeue(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = [
        f"run.dir={run}",
        "cluster.backend=slurm",
        "servers.policy.time=30:00",  # submitit counts any signal in the last 10 minutes as a timeout
        "clients.math.time=30:00",
        "clients.math.array=2",
        f"servers.policy.trainer.total_steps={TOTAL}",
        f"servers.policy.trainer.save_every={SAVE_EVERY}",
        "servers.policy.trainer.tasks_per_batch=4",  # a quarter of the quickstart's batch: the
        "servers.policy.trainer.repeats=4",  # signals and requeues are what is tested, not learning
        "clients.math.eval.samples_per_task=2",
        "servers.policy.engine=transformers",  # three server starts: no vLLM load in any (module docstring)
    ]
    done = run_module("ajet_hpc.launch", str(REPO / "configs" / "quickstart.yaml"), *overrides)
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    server_id, client_id = jobs["server-policy"]["job_id"], jobs["clients-math"]["job_id"]
    eval_id = jobs["clients-math-eval"]["job_id"]  # the quickstart's eval group
    urgent = None
    try:
        tasks = {s.job_id: s for s in slurmcli.job_states([client_id])}
        assert len(tasks) == 2 and {s.partition for s in tasks.values()} == {"cpu"}
        wait_until(lambda: len(recorded_steps(run)) >= 2, 600, "step 2")
        server = slurmcli.job_states([server_id])[0]
        assert (server.partition, server.nodes) == ("gpu", "g1")

        # 1. preemption: USR2 → checkpoint of the current step → requeue → resume at that very step
        urgent = preempt("g1", tmp_path)
        saved = wait_until(
            lambda: re.findall(SIGNAL_SAVED, server_log(run)),
            180,
            "the server to checkpoint on the preemption signal",
        )
        saved_at = int(saved[0])
        assert saved_at < TOTAL, "the run finished before the preemption: raise TOTAL"
        assert recorded_steps(run) == list(
            range(1, saved_at + 1)
        )  # recorded up to the saved step, nothing lost
        first = wait_until(lambda: resumes(run), 300, "the preempted server to resume")
        assert first == [saved_at]

        # 2. scontrol requeue: Slurm's SIGTERM only; the server saves the step it is at within
        #    cluster.kill_wait_s and resumes there
        wait_until(
            lambda: len(recorded_steps(run)) > max(saved_at, SAVE_EVERY) + 1, 600, "steps after the resume"
        )
        before = recorded_steps(run)
        assert before[-1] < TOTAL, "the run finished before the requeue could happen: raise TOTAL"
        subprocess.run(["scontrol", "requeue", server_id], check=True)

        every = [server_id, client_id, eval_id]
        wait_until(
            lambda: jobs_ended(*every),
            900,
            "the run to finish after the requeue",
        )
        assert recorded_steps(run) == list(range(1, TOTAL + 1))  # every step exactly once
        second = resumes(run)[1]
        saves = [int(s) for s in re.findall(SIGNAL_SAVED, server_log(run))]
        assert saves[:2] == [saved_at, second] and second >= before[-1]  # saved on SIGTERM, resumed there
        trained = ranks_trained_steps(run)
        assert sorted(trained) == list(range(1, TOTAL + 1))
        assert set(trained.values()) == {1}, trained  # nothing trained twice: both stops saved their step
        out = subprocess.run(["scontrol", "show", "job", server_id], capture_output=True, text=True).stdout
        assert "Restarts=2" in out
        assert "this job is preempted" in server_log(run) or "this job is timed-out" in server_log(run)
        client_logs = "".join(p.read_text() for p in (run / "logs" / "clients-math").glob("*_log.out"))
        assert "is back at" in client_logs or "reached server policy" in client_logs
        assert "stopping: " in client_logs  # the clients ended because training finished
        assert_eval_rounds_once(run)
    finally:
        subprocess.run(
            ["scancel", server_id, client_id, eval_id, *([urgent] if urgent else [])],
            check=False,
            capture_output=True,
        )


def assert_eval_rounds_once(run: Path) -> None:
    """Through the preemption and the requeue, every eval round ran once and completely: one row per due
    step, and one finished episode per (round task, sample) in the server store, all of each."""
    rows = metrics.read_eval_rows(run / "metrics.jsonl", "policy")
    shown = [(row["step"], row["eval_complete"], row["eval_episodes"]) for row in rows]
    assert shown == [(step, True, EVAL_EPISODES) for step in (0, 5, 10, 15, TOTAL)], shown
    with EpisodeReader(run / "data" / "policy.h5") as reader:
        finished = [s for s in reader.summaries() if s["group"] == "math-eval" and s["state"] == "finished"]
    keys = Counter((s["task_id"], s["metadata"]["repeat"]) for s in finished)
    assert len(keys) == 5 * EVAL_EPISODES and set(keys.values()) == {1}
