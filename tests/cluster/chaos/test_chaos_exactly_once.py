"""Chaos on the dev Slurm cluster: exactly once through client and server faults in one training run.

The quickstart's shape (a trainable server on partition gpu, an array of three client tasks on cpu), with
scripted faults while it trains:

- every client task exits like a ``kill -9`` right between the server's answer to ``end`` and its own
  commit (once each; a test hook, because a real kill cannot be timed to that window), and resumes;
- ``scontrol requeue`` of a third of the client array, twice;
- ``scontrol requeue`` of the server (no signal: it resumes from its last checkpoint) while task groups are
  half committed by the clients.

Then, read from the stores with h5py: every step once in metrics.jsonl, no (group, task, repeat) finished
twice in the server store or committed twice in the client stores, no episode in two training steps, and
every committed result names the episode the server kept for its key.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from support import REPO, jobs_ended, recorded_steps, topology_dict, wait_until, write_topology

from ajet_hpc import fault_injection
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.client_store import ClientStore
from ajet_hpc.storage.episode_store_reader import EpisodeReader

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

TOTAL, SAVE_EVERY, ARRAY = 12, 3, 3


def client_log(run: Path, task: str) -> str:
    return "".join(p.read_text() for p in (run / "logs" / "clients-math").glob(f"{task}_*log.out"))


def starts(run: Path, task: str) -> int:
    return len(re.findall(r"client math\[\d\] \(job", client_log(run, task)))


def state(task: str) -> str:
    states = [s.state for s in slurmcli.job_states([task.split("_")[0]]) if s.job_id == task]
    return states[0] if states else "GONE"


def active(task: str) -> bool:
    return state(task) in slurmcli.ACTIVE_STATES


def requeue_running(task: str) -> None:
    wait_until(lambda: state(task) == "RUNNING", 180, f"{task} to run")
    subprocess.run(["scontrol", "requeue", task], check=True)


def resume_after_crash(run: Path, task: str) -> None:
    """A crashed client task comes back: by itself (a restart in its allocation) or by our requeue."""
    wait_until(lambda: "exiting between end and commit" in client_log(run, task), 300, f"{task} to crash")
    wait_until(lambda: starts(run, task) >= 2 or not active(task), 120, f"{task} to restart or end")
    if starts(run, task) < 2:
        subprocess.run(["scontrol", "requeue", task], check=True)
    wait_until(lambda: starts(run, task) >= 2, 180, f"{task} to start again")


def test_exactly_once_through_client_crashes_and_requeues(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm", array=ARRAY)
    data["servers"][0].update(mem="3G", cpus=2, time="30:00")
    data["servers"][0]["trainer"] = {
        "ranks": 1,
        "zero_stage": 2,
        "tasks_per_batch": 3,
        "repeats": 2,
        "total_steps": TOTAL,
        "save_every": SAVE_EVERY,
        "max_staleness": 2,
    }
    data["clients"][0].update(max_tasks=None, repeats=None, in_flight=2, time="30:00")
    env = {**os.environ, fault_injection.EXIT_AFTER_END: "3"}
    done = subprocess.run(
        [sys.executable, "-m", "ajet_hpc.launch", str(write_topology(tmp_path, data))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr + done.stdout
    jobs = {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}
    server_id, array_id = jobs["server-policy"]["job_id"], jobs["clients-math"]["job_id"]
    tasks = [f"{array_id}_{i}" for i in range(ARRAY)]
    try:
        wait_until(lambda: state(server_id) == "RUNNING", 900, "the server job to start")
        for task in tasks:
            resume_after_crash(run, task)
        wait_until(lambda: recorded_steps(run), 600, "step 1")
        requeue_running(tasks[0])  # a third of the array, once
        wait_until(lambda: len(recorded_steps(run)) >= 2, 600, "step 2")
        subprocess.run(["scontrol", "requeue", server_id], check=True)  # groups are half committed now
        assert len(recorded_steps(run)) < TOTAL, "the run finished before the server requeue: raise TOTAL"
        requeue_running(tasks[0])  # and the third again
        every = [server_id, array_id]
        wait_until(
            lambda: jobs_ended(*every),
            900,
            "the run to finish",
        )
    finally:
        subprocess.run(["scancel", server_id, array_id], check=False, capture_output=True)

    assert recorded_steps(run) == list(range(1, TOTAL + 1))  # every step once
    server_log = "".join(p.read_text() for p in (run / "logs" / "server-policy").glob("*_log.out"))
    assert "episode keys ended before this start" in server_log  # the requeued server knew its keys

    with EpisodeReader(run / "data" / "policy.h5") as reader:
        summaries = reader.summaries()
        step_records = reader.steps()
    finished = [s for s in summaries if s["state"] == "finished"]
    keys = Counter((s["group"], s["task_id"], s["metadata"]["repeat"]) for s in finished)
    assert keys and max(keys.values()) == 1, [k for k, n in keys.items() if n > 1]  # one per key
    kept = {(s["task_id"], s["metadata"]["repeat"]): s["episode_id"] for s in finished}
    in_steps = Counter(e for record in step_records for e in record["episode_ids"])
    assert in_steps and max(in_steps.values()) == 1  # no episode in two steps, also across the requeue
    by_id = {s["episode_id"]: s for s in summaries}
    assert all(by_id[e]["state"] == "finished" for e in in_steps)

    results = []
    for index in range(ARRAY):
        store = ClientStore.open(run / "data" / "clients" / "math" / f"{index}.h5", group="math", index=index)
        results += store.results()
        store.close()
    committed = Counter(r.key for r in results)
    assert committed and max(committed.values()) == 1  # committed once across the array
    for result in results:
        assert result.episode_ids["policy"] == kept[result.key]  # the episode the server trains
    recovered = [r for r in results if r.metadata.get("recovered")]
    assert len(recovered) >= ARRAY  # each crash between end and commit: committed from the server's record
    logs = "".join(client_log(run, t) for t in tasks)
    assert "committed, not run again" in logs
