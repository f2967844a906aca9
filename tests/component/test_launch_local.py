"""The local backend end to end: real processes, real HTTP, the same jobs as on Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import run_module, run_processes, topology_dict, wait_until, write_topology, zombie

from ajet_hpc.storage import rendezvous

pytestmark = pytest.mark.slow


def test_local_run_in_the_foreground(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, topology_dict(run))), timeout_s=120)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "clients finished: 3/3" in done.stdout and "run finished" in done.stdout
    logs = sorted((run / "logs" / "clients-math").glob("*_log.out"))
    assert len(logs) == 3
    reached = [line for p in logs for line in p.read_text().splitlines() if "reached server policy" in line]
    assert sorted(line.split("math[")[1][0] for line in reached) == ["0", "1", "2"]
    assert not (run / "servers" / "policy.json").exists()  # the server withdrew it on its way out
    status = run_module("ajet_hpc.status", str(run))
    assert status.returncode == 0 and status.stdout.count("FINISHED") == 4


def test_detached_local_run_can_be_cancelled(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run)
    data["clients"] = []
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)), "--detach")
    assert done.returncode == 0, done.stderr
    server_pid = json.loads((run / "jobs.json").read_text())[0]["job_id"]
    record = wait_until(lambda: rendezvous.read(run / "servers" / "policy.json"), 60, "the local server")
    assert record.url.startswith("http://127.0.0.1:")
    status = run_module("ajet_hpc.status", str(run))
    assert f"server-policy          {server_pid}" in status.stdout and "RUNNING" in status.stdout
    cancel = run_module("ajet_hpc.cancel", str(run))
    assert cancel.returncode == 0 and server_pid in cancel.stdout
    wait_until(lambda: not (run / "servers" / "policy.json").exists(), 30, "the server to stop")
    wait_until(
        lambda: not Path(f"/proc/{server_pid}").exists() or zombie(server_pid), 30, "the process to exit"
    )


def test_cancel_of_a_detached_run_leaves_no_process_of_it(tmp_path: Path) -> None:
    """Tried as a new user would (issue 31): a detached local run with a server and three client tasks,
    cancelled while the clients work: every process of the run is gone, none left waiting for its server."""
    run = tmp_path / "run"
    data = topology_dict(run)
    data["clients"][0].update(max_tasks=None, agent="tests.fixture_agents:slow_arithmetic")
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)), "--detach")
    assert done.returncode == 0, done.stderr
    logs = run / "logs" / "clients-math"
    wait_until(
        lambda: sum("reached server policy" in p.read_text() for p in logs.glob("*_log.out")) == 3,
        90,
        "the three client tasks to reach the server",
    )
    assert len(run_processes(run)) >= 4
    cancel = run_module("ajet_hpc.cancel", str(run))
    assert cancel.returncode == 0, cancel.stderr
    wait_until(lambda: not run_processes(run), 60, "every process of the run to stop")
