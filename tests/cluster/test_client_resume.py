"""Client arrays resume on their own: on the dev Slurm cluster, an array of 4 runs 60 tasks x 2 repeats;
two array tasks are requeued mid-run, the runner of the third is killed with SIGKILL once (its supervisor
starts it again in the allocation), and every process of the fourth is killed with SIGKILL, supervisor
included (Slurm ends it FAILED by signal 9; the server's keeper submits that index again and the new task
resumes from its store). Every (task, repeat) ends up committed exactly once across the four client
stores, and the server's store shows that nothing committed was run again."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest
from support import run_module, topology_dict, wait_until, write_topology

from ajet_hpc import fault_injection
from ajet_hpc.launch import registry
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.client_store import ClientStore
from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.rundir import RunDir

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TASKS, REPEATS, ARRAY = 60, 2, 4


def finished_by_client(run: Path) -> Counter:
    path = run / "data" / "policy.h5"
    if not path.exists():
        return Counter()
    reader = EpisodeReader(path)
    try:
        return Counter(s["metadata"].get("client") for s in reader.summaries() if s["state"] == "finished")
    finally:
        reader.close()


def task_state(task_id: str) -> str:
    states = [s.state for s in slurmcli.job_states([task_id.split("_")[0]]) if s.job_id == task_id]
    return states[0] if states else "GONE"


def task_processes(array_id: str, index: int) -> list[int]:
    """Every process of one array task: those whose environment names it (the batch script, submitit, the
    task's supervisor, its runner and the runner's children)."""
    wanted = {f"SLURM_ARRAY_JOB_ID={array_id}".encode(), f"SLURM_ARRAY_TASK_ID={index}".encode()}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted <= set(environ.read_bytes().split(b"\0")):
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


def kill_whole_task(array_id: str, index: int) -> None:
    """kill -9 of every process of the task, until none is left (a supervisor may be mid-restart)."""
    while pids := task_processes(array_id, index):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def test_client_array_resumes_after_requeue_and_kill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(fault_injection.KEEPER_POLL_S, "3")  # the keeper's pass (60 s in production)
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm", array=ARRAY)
    data["servers"][0]["trainer"] = None  # serve only: the clients' work is finite
    data["servers"][0]["serving"] = {"episode_timeout_s": 15}
    data["clients"][0].update(
        agent="tests.fixture_agents:slow_arithmetic", max_tasks=TASKS, repeats=REPEATS, in_flight=2
    )
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)))
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    server_id, array_id = jobs["server-policy"]["job_id"], jobs["clients-math"]["job_id"]
    tasks = [f"{array_id}_{i}" for i in range(ARRAY)]
    try:
        wait_until(
            lambda: all(finished_by_client(run)[i] >= 4 for i in range(ARRAY)), 300, "every task to start"
        )
        for task in tasks[:2]:
            subprocess.run(["scontrol", "requeue", task], check=True)

        log_dir = run / "logs" / "clients-math"
        line = wait_until(lambda: _pid_line(log_dir / f"{tasks[2]}_0_log.out"), 60, "the third runner's pid")
        os.kill(int(line), signal.SIGKILL)
        restarted = f"runner of math[2] (pid {line}) died (killed by SIGKILL); restarting it"
        log_text = log_dir / f"{tasks[2]}_0_log.out"
        wait_until(lambda: restarted in log_text.read_text(), 60, "the supervisor to restart the runner")

        kill_whole_task(array_id, 3)
        wait_until(lambda: task_state(tasks[3]) == "FAILED", 60, "Slurm to end the killed task")
        latest = wait_until(
            lambda: (job := registry.latest(RunDir(run))["clients-math"]).tasks[3] != tasks[3] and job,
            60,
            "the keeper to submit the killed task again",
        )
        assert latest.tasks[:3] == tasks[:3] and registry.resubmissions(RunDir(run), "clients-math") == {3: 1}
        tasks = latest.tasks

        time.sleep(5)
        wait_until(
            lambda: all(task_state(t) == "COMPLETED" for t in tasks), 600, "every array task to complete"
        )
        server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
        assert f"client task math[3] (job {array_id}_3) died whole (FAILED, exit 0:9)" in server_log
        resumed = (log_dir / f"{tasks[3]}_0_log.out").read_text()
        assert "client math[3]" in resumed and "resuming:" in resumed  # the same index, from its store
        results = []
        for index in range(ARRAY):
            store = ClientStore.open(
                run / "data" / "clients" / "math" / f"{index}.h5", group="math", index=index
            )
            results += store.results()
            store.close()
        pairs = Counter((r.task_id, r.repeat) for r in results)
        assert len(pairs) == TASKS * REPEATS and set(pairs.values()) == {1}  # exactly once, nothing lost

        reader = EpisodeReader(run / "data" / "policy.h5")
        summaries = reader.summaries()
        reader.close()
        by_id = {s["episode_id"]: s for s in summaries}
        for result in results:
            episode = by_id[result.episode_ids["policy"]]
            assert (episode["state"], episode["task_id"]) == ("finished", result.task_id)
            later = [
                s
                for s in summaries
                if s["task_id"] == result.task_id
                and s["metadata"].get("repeat") == result.repeat
                and s["started_at"] > result.finished_at
            ]
            assert not later, f"{result.task_id} repeat {result.repeat} ran again after its commit"
        finished = [s for s in summaries if s["state"] == "finished"]
        assert len(finished) >= TASKS * REPEATS
        logs = "".join(p.read_text() for p in log_dir.glob("*_log.out"))
        assert "resuming:" in logs and "results already committed" in logs
    finally:
        subprocess.run(
            ["scancel", server_id, array_id, *{t.split("_")[0] for t in tasks}], capture_output=True
        )


def _pid_line(path: Path) -> str | None:
    if not path.exists():
        return None
    found = re.findall(r"client math\[2\] \(job \S+, pid (\d+)\)", path.read_text())
    return found[-1] if found else None
