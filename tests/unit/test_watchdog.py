"""The watchdog's parts without a cluster: metrics events, rendezvous states, epochs, end markers, client
discovery of failed or absent servers, the client supervisor (real child processes) and the status lines."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
from support import topology_dict

from ajet_hpc.client import array_task, discovery, task_supervisor
from ajet_hpc.client.task_sources import assigned_tasks, epochs
from ajet_hpc.config import ServingConfig, load_topology
from ajet_hpc.config.errors import ConfigError
from ajet_hpc.engine.transformers_engine import TransformersEngine
from ajet_hpc.environments.episode import Task
from ajet_hpc.launch.control import describe_servers
from ajet_hpc.server import preemption
from ajet_hpc.server.context import JobContext, ModelContext
from ajet_hpc.server.recorder import EpisodeRecorder
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous, task_ends
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator import metrics


def make_run(tmp_path: Path, **client) -> RunDir:
    data = topology_dict(tmp_path / "run", array=2)
    data["servers"][0]["trainer"] = {"total_steps": 20}
    data["clients"][0].update(client)
    run = RunDir(tmp_path / "run")
    run.prepare(load_topology(data))
    return run


def test_event_rows_are_kept_apart_from_step_rows_and_survive_a_resume(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        metrics.append_row(path, {"step": step, "model": "policy"})
    metrics.append_event(path, "policy", "trainer_restart", "rank 1 died", at_step=4, restart=1)
    assert [row["step"] for row in metrics.read_rows(path)] == [1, 2, 3]
    (event,) = metrics.read_events(path, "policy")
    assert (event["event"], event["reason"], event["at_step"]) == ("trainer_restart", "rank 1 died", 4)
    metrics.append_row(path, {"step": 9, "model": "other"})
    assert metrics.last_step(path, "policy") == 3 and metrics.last_step(path, "third") == 0
    assert metrics.truncate_after(path, "policy", 2) == 1  # step 3 runs again; the event stays
    assert [row["step"] for row in metrics.read_rows(path) if row["model"] == "policy"] == [1, 2]
    assert (
        metrics.last_step(path, "policy") == 2 and metrics.last_step(tmp_path / "none.jsonl", "policy") == 0
    )
    assert len(metrics.read_events(path)) == 1 and metrics.read_events(path, "other") == []
    with pytest.raises(ValueError, match="at_step"):
        metrics.append_event(path, "policy", "x", "y", step=3)
    with pytest.raises(ValueError, match="append_event"):
        metrics.append_row(path, {"step": 5, "model": "policy", "event": "x"})


def test_rendezvous_without_the_new_fields_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    old = {"name": "policy", "url": "http://h:1", "host": "h", "port": 1, "pid": 2, "job_id": "3"}
    path.write_text(json.dumps({**old, "node": "g1", "state": "training", "format": 1}))
    record = rendezvous.read(path)
    assert record is not None
    assert (record.step, record.last_step_at, record.reason, record.final) == (0, None, None, False)
    assert dataclasses.replace(record, state="failed").final


def test_epochs_rename_later_passes_and_read_the_source_afresh() -> None:
    opened = []

    def open_shard():
        opened.append(1)
        return iter([Task("a", {"x": 1}), Task("b", {})])

    assert [t.id for t in epochs(open_shard, 3)] == ["a", "b", "a@1", "b@1", "a@2", "b@2"]
    assert len(opened) == 3


def test_assigned_tasks_shard_then_repeat(tmp_path: Path) -> None:
    group = make_run(tmp_path, max_tasks=4, epochs=2).load_topology().clients[0]
    ids = [t.id for t in assigned_tasks(group, 1)]
    assert len(ids) == 4 and ids[2:] == [f"{i}@1" for i in ids[:2]]


def test_new_fields_are_checked_with_their_names(tmp_path: Path) -> None:
    data = topology_dict(tmp_path / "run")
    data["clients"][0]["epochs"] = 0
    with pytest.raises(ConfigError, match=r"clients\[0\].epochs"):
        load_topology(data)
    data["clients"][0].update(epochs=1, server_wait_s=-1)
    with pytest.raises(ConfigError, match=r"clients\[0\].server_wait_s"):
        load_topology(data)
    data["clients"][0].update(server_wait_s=None, max_restarts=0)
    data["servers"][0]["trainer"] = {"max_restarts": -1}
    with pytest.raises(ConfigError, match=r"servers\[0\].trainer.max_restarts"):
        load_topology(data)


def test_end_markers_count_only_for_the_current_group_settings(tmp_path: Path) -> None:
    run = make_run(tmp_path, epochs=2)
    topology = run.load_topology()
    group = topology.clients[0]
    assert not task_ends.feeding(run, topology, "policy").all_ended
    task_ends.mark_end(run, group, 0, task_ends.EXHAUSTED)
    assert task_ends.feeding(run, topology, "policy") == task_ends.Feeding(1, 1, 0)
    task_ends.mark_end(run, group, 1, task_ends.FAILED, "kept dying")
    ended = task_ends.feeding(run, topology, "policy")
    assert ended.all_ended and ended.describe() == "1 client task(s) used up their tasks, 1 failed"
    more = topology.model_copy(update={"clients": [group.model_copy(update={"epochs": 3})]})
    assert task_ends.feeding(run, more, "policy").working == 2  # markers of 2 epochs do not end 3


def test_clients_stop_on_a_failed_server_and_after_server_wait_s(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    started = time.monotonic()
    with pytest.raises(discovery.ServerUnavailable, match="server_wait_s"):
        discovery.wait_for_server(run, "policy", timeout_s=0.5, poll_s=0.1)
    assert time.monotonic() - started < 30
    record = rendezvous.Rendezvous(
        name="policy", url="http://127.0.0.1:9", host="127.0.0.1", port=9, pid=1, job_id="77", node="g1"
    )
    rendezvous.publish(
        run.rendezvous_file("policy"), dataclasses.replace(record, state="failed", reason="boom")
    )
    with pytest.raises(discovery.ServerFailed, match=r"failed \(job 77\): boom"):
        discovery.wait_for_server(run, "policy")  # at once, although no timeout is set


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "runner.py"
    path.write_text(body)
    return [sys.executable, str(path), str(tmp_path)]


def test_supervisor_restarts_a_killed_runner_until_it_finishes(tmp_path: Path) -> None:
    run = make_run(tmp_path, max_restarts=2)
    group = run.load_topology().clients[0]
    command = _script(
        tmp_path,
        "import os, signal, sys, pathlib\n"
        "starts = pathlib.Path(sys.argv[1]) / 'starts'\n"
        "n = len(starts.read_text()) if starts.exists() else 0\n"
        "starts.write_text('x' * (n + 1))\n"
        "if n < 2: os.kill(os.getpid(), signal.SIGKILL)\n",
    )
    assert task_supervisor.supervise(run, group, 0, command, delay_s=0) == 0
    assert (tmp_path / "starts").read_text() == "xxx"
    assert task_ends.end_state(run, group, 0) is None


def test_supervisor_gives_up_after_max_restarts_and_marks_the_task_failed(tmp_path: Path) -> None:
    run = make_run(tmp_path, max_restarts=1)
    group = run.load_topology().clients[0]
    command = _script(tmp_path, "raise SystemExit(1)\n")
    assert task_supervisor.supervise(run, group, 1, command, delay_s=0) == task_supervisor.EXIT_GAVE_UP
    assert task_ends.end_state(run, group, 1) == task_ends.FAILED


def test_supervisor_does_not_restart_a_runner_whose_server_is_gone(tmp_path: Path) -> None:
    run = make_run(tmp_path, max_restarts=3)
    group = run.load_topology().clients[0]
    command = _script(tmp_path, f"raise SystemExit({array_task.EXIT_SERVER_GONE})\n")
    assert task_supervisor.supervise(run, group, 0, command, delay_s=0) == array_task.EXIT_SERVER_GONE


def test_status_shows_state_step_last_step_and_reason(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    record = rendezvous.Rendezvous(
        name="policy", url="http://10.0.0.1:80", host="h", port=80, pid=1, job_id="12", node="g1"
    )
    failed = dataclasses.replace(
        record, state="failed", step=7, last_step_at=1000.0, reason="trainer ranks failed 4 time(s)"
    )
    rendezvous.publish(run.rendezvous_file("policy"), failed)
    line, reason = describe_servers(run, now=1030.0)
    assert "failed" in line and "step 7/20" in line and "(30s ago)" in line and "job 12 on g1" in line
    assert reason.split() == ["reason:", "trainer", "ranks", "failed", "4", "time(s)"]


@pytest.mark.parametrize("on_slurm", [True, False])
def test_the_server_context_saves_once_and_requeues_its_job_when_the_engine_died(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_slurm: bool
) -> None:
    """What the coordinator calls when a step fails with the engine dead (``ctx.engine_died``): the save
    hooks run once, then the job requeues itself; where it cannot (off Slurm) the server fails instead."""
    requeued: list[str] = []
    monkeypatch.setattr(slurmcli, "requeue", requeued.append)  # scontrol is the cluster's
    for name in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    if on_slurm:
        monkeypatch.setenv("SLURM_JOB_ID", "42")
    engine = TransformersEngine(tmp_path / "model")  # not started: it is only asked whether it died
    recorder = EpisodeRecorder(tmp_path / "policy.h5")
    ctx = ModelContext(
        name="policy", job=JobContext(engine, "s" * 32), settings=ServingConfig(), recorder=recorder
    )
    saves: list[float] = []
    preemption.reset()
    unregister = preemption.on_signal(saves.append)
    try:
        assert ctx.engine_failure() is None  # transformers runs in the server's process: it never dies apart
        ctx.engine_died("vLLM's engine core process died")
        ctx.engine_died("again")  # once: later calls do nothing
    finally:
        unregister()
        preemption.reset()
        recorder.close()
    assert ctx.engine_lost == ctx.job.engine_lost == "vLLM's engine core process died" and len(saves) == 1
    if on_slurm:
        assert requeued == ["42"] and not ctx.failed
    else:
        assert requeued == [] and ctx.failed and ctx.state == "failed"
        assert ctx.reason is not None and "could not requeue itself (not a Slurm job" in ctx.reason


def test_the_supervisor_loads_none_of_the_runners_stack() -> None:
    """An array task's supervisor (submitit's process, ``ClientJob``) outlives its runner: it imports neither
    HDF5, numpy nor an HTTP client, which cost each array task about 0.4 s of CPU more at its start."""
    import subprocess

    wanted = ("h5py", "numpy", "httpx", "openai", "ajet_hpc.client.runner", "ajet_hpc.client.runner_process")
    probe = (
        "import sys, ajet_hpc.client.task_supervisor, ajet_hpc.launch.jobs\n"
        f"print(sorted(m for m in {wanted!r} if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
