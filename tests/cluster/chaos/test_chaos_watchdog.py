"""Chaos tests of the watchdog (docs/reliability.md, "Watchdog") on the dev Slurm cluster: real runs of the
quickstart shape (a trainable tiny model on partition gpu, an array of arithmetic clients on cpu), real
faults by ``kill -9``, and at the end a check of the stores (h5py, through EpisodeReader and the client
stores) and of metrics.jsonl: every step once, the run finishes or fails with its reason, every job ends.

1. A trainer rank and a client runner are killed in one run whose task source (2 epochs) runs out before
   ``total_steps``: the ranks restart from their checkpoint, the runner restarts and resumes from its
   store, and the run ends cleanly "task sources exhausted at step N of M".
2. With ``trainer.max_restarts: 0`` a killed rank fails the server: rendezvous and status say why, the
   clients stop with that message, every job ends (the server's and the clients' FAILED), none requeued.
3. vLLM's engine core process is killed: the server checkpoints, requeues its own job, comes back with a
   fresh engine at the same step and finishes.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections import Counter
from pathlib import Path

import psutil
import pytest
from support import jobs_ended, recorded_steps, run_module, topology_dict, wait_until, write_topology

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.client_store import read_results
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.trainer.coordinator import metrics

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TASKS = 12  # of the source (max_tasks), over 2 array tasks


def chaos_topology(run: Path, **trainer) -> dict:
    data = topology_dict(run, backend="slurm", array=2)
    server = data["servers"][0]
    server.update(cpus=2, mem="3G", time="30:00")
    server["serving"] = {"episode_timeout_s": 15}  # episodes of a killed runner are dropped soon
    server["trainer"] = {
        "ranks": 2,
        "lr": 0.003,
        "tasks_per_batch": 2,
        "repeats": 2,
        "skip_equal_groups": False,  # every finished group trains: the step count is predictable
        "save_every": 1,  # a restart resumes at the last recorded step: no step is trained twice
        **trainer,
    }
    data["clients"][0].update(repeats=None, in_flight=2, mem="500M", time="30:00")
    return data


def launch(tmp_path: Path, data: dict) -> tuple[Path, str, str]:
    run = Path(data["run"]["dir"])
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)))
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    return run, jobs["server-policy"]["job_id"], jobs["clients-math"]["job_id"]


def logs(run: Path, job: str) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs" / job).glob("*_log.out")))


def states(job_id: str) -> list[str]:
    return sorted(s.state for s in slurmcli.job_states([job_id]))


def processes(run: Path, *needles: str) -> list[psutil.Process]:
    """This run's processes whose command line holds every needle (the cluster runs on this machine)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        if str(run) in line and all(n in line for n in needles):
            found.append(proc)
    return found


def kill_a_rank(run: Path) -> int:
    ranks = [
        p
        for p in processes(run, "ajet_hpc.trainer.ranks.worker")
        if "torch.distributed.run" not in p.cmdline()
    ]
    assert ranks, "no trainer rank found"
    os.kill(ranks[-1].pid, signal.SIGKILL)
    return ranks[-1].pid


def store_steps(run: Path) -> list[int]:
    reader = EpisodeReader(run / "data" / "policy.h5")
    try:
        return [s["step"] for s in reader.steps()]
    finally:
        reader.close()


def committed(run: Path, index: int) -> list[tuple[str, int]]:
    path = run / "data" / "clients" / "math" / f"{index}.h5"
    return [r.key for r in read_results(path)] if path.exists() else []


def server_record(run: Path) -> rendezvous.Rendezvous:
    record = rendezvous.read(run / "servers" / "policy.json")
    assert record is not None, "the server left no rendezvous"
    return record


def test_killed_rank_and_runner_recover_and_the_run_ends_when_tasks_run_out(tmp_path: Path) -> None:
    """kill -9 of a trainer rank (restart from the checkpoint), kill -9 of a client runner (restarted in
    its allocation, resumes from its store), and a task source of 2 epochs that runs out before
    total_steps: 2 array tasks x 6 tasks x 2 epochs = 24 groups of 2 repeats, 2 groups a step."""
    data = chaos_topology(tmp_path / "run", total_steps=30, max_restarts=2, max_staleness=100)
    data["clients"][0].update(
        agent="tests.fixture_agents:slow_arithmetic", max_tasks=TASKS, epochs=2, in_flight=1, max_restarts=2
    )
    run, server_id, client_id = launch(tmp_path, data)
    try:
        wait_until(lambda: len(committed(run, 1)) >= 2, 300, "client 1 to commit results")
        (runner,) = processes(run, "ajet_hpc.client", "--index 1", "--once")
        os.kill(runner.pid, signal.SIGKILL)

        wait_until(lambda: len(recorded_steps(run)) >= 2, 300, "step 2")
        kill_a_rank(run)
        wait_until(lambda: metrics.read_events(run / "metrics.jsonl"), 120, "the restart event")

        wait_until(lambda: jobs_ended(server_id, client_id), 600, "every job to end")
        assert states(server_id) == ["COMPLETED"] and states(client_id) == ["COMPLETED", "COMPLETED"]

        record = server_record(run)
        assert record.state == "finished" and record.reason is not None, record
        found = re.fullmatch(
            r"task sources exhausted at step (\d+) of 30 \(2 client task\(s\) .*\)", record.reason
        )
        assert found, record.reason
        last = int(found.group(1))
        assert 2 < last <= TASKS * 2 // 2 and record.step == last
        assert recorded_steps(run) == list(range(1, last + 1))  # every step once in metrics.jsonl ...
        assert store_steps(run) == list(range(1, last + 1))  # ... and in the server's store
        events = metrics.read_events(run / "metrics.jsonl", "policy")
        assert [e["event"] for e in events] == ["trainer_restart", "ended"], events
        assert events[1]["reason"] == record.reason

        for index in (0, 1):  # every (task, repeat) of both epochs committed, once
            keys = Counter(committed(run, index))
            assert len(keys) == TASKS // 2 * 2 * 2 and set(keys.values()) == {1}, keys
            assert sum(task.endswith("@1") for task, _ in keys) == TASKS // 2 * 2
        server_log, client_log = logs(run, "server-policy"), logs(run, "clients-math")
        assert "restarting the ranks from their last checkpoint (restart 1 of 2)" in server_log
        assert "died (killed by SIGKILL); restarting it (restart 1 of 2)" in client_log
        assert "resuming:" in client_log
        status = run_module("ajet_hpc.status", str(run))
        assert "finished" in status.stdout and "task sources exhausted" in status.stdout, status.stdout
    finally:
        subprocess.run(["scancel", server_id, client_id], check=False, capture_output=True)


def test_rank_killed_past_max_restarts_fails_the_server_and_stops_every_job(tmp_path: Path) -> None:
    """``trainer.max_restarts: 0``: the first rank that dies fails the server; the clients stop with the
    server's reason and free their allocations; no job is requeued."""
    data = chaos_topology(tmp_path / "run", total_steps=30, max_restarts=0)
    data["clients"][0].update(max_tasks=None)  # endless work: only the failure ends the clients
    run, server_id, client_id = launch(tmp_path, data)
    try:
        wait_until(lambda: len(recorded_steps(run)) >= 1, 300, "step 1")
        kill_a_rank(run)
        wait_until(lambda: jobs_ended(server_id, client_id), 300, "every job to end")
        assert states(server_id) == ["FAILED"] and states(client_id) == ["FAILED", "FAILED"]

        record = server_record(run)
        assert record.state == "failed" and record.reason is not None, record
        assert "trainer.max_restarts=0" in record.reason, record
        last = record.step
        assert last >= 1 and recorded_steps(run) == list(range(1, last + 1))
        assert store_steps(run) == list(range(1, last + 1))
        (event,) = metrics.read_events(run / "metrics.jsonl", "policy")
        assert (event["event"], event["reason"]) == ("failed", record.reason)

        client_log = logs(run, "clients-math")
        assert client_log.count("server 'policy' failed (job") >= 2, client_log[-3000:]
        assert "restarting it" not in client_log  # a gone server is not a crash to restart from
        status = run_module("ajet_hpc.status", str(run))
        assert "failed" in status.stdout and record.reason in status.stdout, status.stdout
        out = subprocess.run(["scontrol", "show", "job", server_id], capture_output=True, text=True).stdout
        assert "Restarts=0" in out
    finally:
        subprocess.run(["scancel", server_id, client_id], check=False, capture_output=True)


def test_killed_vllm_engine_core_requeues_the_server_which_resumes_and_finishes(tmp_path: Path) -> None:
    """``kill -9`` of vLLM's engine core process: the server checkpoints the step it is at, requeues its
    own job, and resumes there with a fresh engine; the run finishes every step once."""
    total = 6
    data = chaos_topology(tmp_path / "run", total_steps=total, max_restarts=1)
    data["servers"][0].update(engine="vllm", mem="5G")
    data["clients"][0].update(max_tasks=None)
    run, server_id, client_id = launch(tmp_path, data)
    try:
        wait_until(lambda: len(recorded_steps(run)) >= 2, 400, "step 2")
        server_pid = server_record(run).pid
        cores = [
            p
            for p in psutil.Process(server_pid).children(recursive=True)
            if "EngineCor" in p.name() + " ".join(p.cmdline())
        ]
        assert cores, [p.name() for p in psutil.Process(server_pid).children(recursive=True)]
        os.kill(cores[0].pid, signal.SIGKILL)

        wait_until(lambda: jobs_ended(server_id, client_id), 600, "every job to end")
        assert states(server_id) == ["COMPLETED"] and set(states(client_id)) == {"COMPLETED"}
        assert recorded_steps(run) == list(range(1, total + 1))
        assert store_steps(run) == list(range(1, total + 1))
        server_log = logs(run, "server-policy")
        assert "the engine died (vLLM's engine core process died)" in server_log
        assert "job requeued: it comes back with a fresh engine" in server_log
        assert metrics.read_events(run / "metrics.jsonl") == []  # not a failure of the ranks: no restart
        out = subprocess.run(["scontrol", "show", "job", server_id], capture_output=True, text=True).stdout
        assert "Restarts=1" in out
        assert server_record(run).state == "finished"
    finally:
        subprocess.run(["scancel", server_id, client_id], check=False, capture_output=True)
