"""End to end on the real Slurm dev cluster (tools/slurm-dev-cluster): submit, find, watch, cancel."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support import REPO, jobs_ended, run_module, topology_dict, wait_until, write_topology

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm")]

START_S = 90  # submit -> every client has reached the server; a few seconds on an idle dev cluster


def launch(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = run_module("ajet_hpc.launch", str(config), *args)
    assert done.returncode == 0, done.stderr + done.stdout
    return done


def jobs(run: Path) -> dict[str, dict]:
    return {entry["name"]: entry for entry in json.loads((run / "jobs.json").read_text())}


def logs_containing(folder: Path, text: str) -> list[Path]:
    return [p for p in sorted(folder.glob("*.out")) if text in p.read_text(errors="replace")]


def states(job_id: str) -> dict[str, slurmcli.JobState]:
    return {s.job_id: s for s in slurmcli.job_states([job_id])}


@pytest.fixture
def cleanup(tmp_path: Path):
    """Job ids to scancel whatever happens in the test, besides every job recorded in tmp_path/run."""
    ids: list[str] = []
    yield ids
    registry = tmp_path / "run" / "jobs.json"
    if registry.exists():
        ids += [entry["job_id"] for entry in json.loads(registry.read_text())]
    if ids:
        subprocess.run(["scancel", *ids], check=False, capture_output=True)


def test_server_and_client_array_on_dev_cluster(tmp_path: Path, cleanup: list[str]) -> None:
    run = tmp_path / "run"
    config = write_topology(tmp_path, topology_dict(run, backend="slurm"))
    out = launch(config).stdout
    submitted = jobs(run)
    server_id, client_id = submitted["server-policy"]["job_id"], submitted["clients-math"]["job_id"]
    cleanup += [server_id, client_id]
    assert server_id in out and client_id in out and "python -m ajet_hpc.status" in out
    assert submitted["clients-math"]["tasks"] == [f"{client_id}_{i}" for i in range(3)]  # one sbatch call

    client_logs = run / submitted["clients-math"]["log_dir"]
    wait_until(lambda: len(logs_containing(client_logs, "reached server policy")) == 3, START_S, "3 clients")

    server = states(server_id)[server_id]
    assert (server.state, server.partition, server.nodes) == ("RUNNING", "gpu", "g1")
    tasks = states(client_id)
    assert set(tasks) == {f"{client_id}_{i}" for i in range(3)}
    assert {t.partition for t in tasks.values()} == {"cpu"}
    assert all(t.nodes in {"c1", "c2", "c3"} for t in tasks.values()), tasks
    record = rendezvous.read(run / "servers" / "policy.json")
    assert record is not None and record.job_id == server_id and record.node == "g1"
    for log in logs_containing(client_logs, "reached server policy"):
        assert record.url in log.read_text()

    status = run_module("ajet_hpc.status", str(run))
    assert status.returncode == 0, status.stderr
    assert f"server-policy          {server_id}" in status.stdout
    assert "RUNNING" in status.stdout and "g1" in status.stdout
    assert (
        f"policy           serving  step 0, no step yet, policy v0; {record.url} job {server_id} on g1"
        in (status.stdout)
    )

    again = launch(run)  # relaunch on the run directory: the live server is left alone
    assert f"still active as job {server_id}" in again.stdout
    assert jobs(run)["server-policy"]["job_id"] == server_id

    logs = run_module("ajet_hpc.logs", str(run), "policy", "-n", "5")
    assert logs.returncode == 0 and "ready at" in logs.stdout

    cancel = run_module("ajet_hpc.cancel", str(run))
    assert cancel.returncode == 0 and f"scancel {server_id}" in cancel.stdout
    every_job = [entry["job_id"] for entry in json.loads((run / "jobs.json").read_text())]
    wait_until(lambda: jobs_ended(*every_job), 60, "every job of the run to end after cancel")
    wait_until(lambda: not (run / "servers" / "policy.json").exists(), 30, "the rendezvous to be withdrawn")


def test_hetjob_runs_server_and_clients_as_one_job(tmp_path: Path, cleanup: list[str]) -> None:
    run = tmp_path / "run"
    config = write_topology(tmp_path, topology_dict(run, backend="slurm", array=2))
    launch(config, "--hetjob")
    (entry,) = jobs(run).values()
    job_id = entry["job_id"]
    cleanup.append(job_id)
    assert entry["name"] == "het-policy-math" and entry["tasks"] == [f"{job_id}+0", f"{job_id}+1"]

    log_dir = run / entry["log_dir"]
    wait_until(lambda: len(logs_containing(log_dir, "reached server policy")) == 2, START_S, "2 het clients")
    components = states(job_id)
    assert components[f"{job_id}+0"].partition == "gpu" and components[f"{job_id}+0"].nodes == "g1"
    assert components[f"{job_id}+1"].partition == "cpu"
    assert components[f"{job_id}+1"].nodes.startswith("c")
    assert all(c.state == "RUNNING" for c in components.values()), components
    indexes = sorted(
        line.split("[")[1].split("]")[0]
        for p in logs_containing(log_dir, "reached")
        for line in p.read_text().splitlines()
        if "reached server" in line
    )
    assert indexes == ["0", "1"]  # SLURM_PROCID gives each hetjob client its own index

    assert run_module("ajet_hpc.cancel", str(run)).returncode == 0
    wait_until(lambda: jobs_ended(*[job_id]), 60, "the hetjob to end after cancel")


def test_hand_written_sbatch_scripts(tmp_path: Path, cleanup: list[str]) -> None:
    """The commands ``--no-submit`` prints start the run with sbatch/*.sbatch, carrying what submitit would
    give the jobs: account and extra sbatch options (seen in ``scontrol show job``; the dev cluster keeps no
    QOS without accounting, the unit test sees --qos in the commands) and the setup lines (run by the
    scripts: seen in the logs)."""
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm", array=2)
    data["cluster"] |= {"account": "proj42", "qos": "high", "sbatch": {"comment": "by-hand"}}
    data["cluster"]["setup"] = ["export AJET_HAND_SETUP=yes", 'echo "setup lines ran: $AJET_HAND_SETUP"']
    config = write_topology(tmp_path, data)
    out = launch(config, "--no-submit").stdout
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("sbatch ")]
    assert len(commands) == 2
    ids = []
    for command in commands:
        done = subprocess.run(
            command.replace("sbatch ", "sbatch --parsable ", 1).split(),
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        )
        ids.append(done.stdout.strip())
    cleanup.extend(ids)
    wait_until(lambda: len(logs_containing(run / "logs", "reached server policy")) == 2, START_S, "2 clients")
    assert len(logs_containing(run / "logs", "setup lines ran: yes")) == 3  # the server and both clients
    for job_id in ids:
        record = slurmcli.job_record(job_id.split("_")[0])
        assert (record["Account"], record["Comment"]) == ("proj42", "by-hand")  # (no QOS without accounting)
    subprocess.run(["scancel", ids[0]], check=True)
    wait_until(
        lambda: not (run / "servers" / "policy.json").exists(), 60, "the server to withdraw on scancel"
    )


def test_unknown_partition_on_live_cluster_exits_2(tmp_path: Path) -> None:
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm")
    data["clients"][0]["partition"] = "nosuchpartition"
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)))
    assert done.returncode == 2
    assert "clients[0].partition: unknown partition 'nosuchpartition'" in done.stderr
    assert not run.exists()


def test_an_array_larger_than_the_cluster_allows_exits_2(tmp_path: Path) -> None:
    """The dev cluster keeps Slurm's default MaxArraySize (1001): a group of 1,002 tasks is refused by name
    before anything is submitted or written (Slurm would refuse that sbatch after the servers were
    submitted), with the limit read from ``scontrol show config``."""
    assert slurmcli.array_limit() == 1001
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm")
    data["clients"][0]["array"] = 1002
    done = run_module("ajet_hpc.launch", str(write_topology(tmp_path, data)))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "clients[0].array: 1002 array tasks, but a job array here may have at most 1001" in done.stderr
    assert not run.exists()


def test_preempted_server_is_requeued_by_submitits_signal(tmp_path: Path, cleanup: list[str]) -> None:
    """A job on the higher-tier partition 'urgent' preempts the server on g1: Slurm sends USR2
    (preempt_send_user_signal), submitit checkpoints and requeues, and the server comes back with a
    fresh rendezvous file."""
    run = tmp_path / "run"
    data = topology_dict(run, backend="slurm")
    data["clients"] = []
    data["servers"][0]["time"] = "30:00"  # submitit counts any signal in the last 10 minutes as a timeout
    launch(write_topology(tmp_path, data))
    server_id = jobs(run)["server-policy"]["job_id"]
    path = run / "servers" / "policy.json"
    first = wait_until(lambda: rendezvous.read(path), START_S, "the server's rendezvous")

    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-p",
            "urgent",
            "-w",
            "g1",
            "-c",
            "2",
            "--mem=100M",
            f"--output={tmp_path}/urgent-%j.out",
            "--wrap",
            "sleep 2",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    cleanup.append(urgent)

    def restarted():
        record = rendezvous.read(path)
        return record if record is not None and record.started_at != first.started_at else None

    second = wait_until(restarted, 120, "the requeued server to publish again")
    assert second.job_id == server_id  # same job, requeued
    out = subprocess.run(["scontrol", "show", "job", server_id], capture_output=True, text=True).stdout
    assert "Restarts=1" in out
    log = (run / "logs" / "server-policy" / f"{server_id}_0_log.out").read_text()
    assert "this job is preempted" in log and "Calling checkpoint method" in log
    # submitit logs "Requeued job N" once `scontrol requeue` returns; but slurmctld may requeue the job
    # and SIGTERM its processes, the scontrol child among them, before that child exits (seen in CI).
    # Then Slurm's own line of the step's cancellation is the record that the requeue went through.
    assert f"Requeued job {server_id}" in log or (
        f"JOB {server_id} ON g1 CANCELLED" in log and "DUE TO JOB REQUEUE" in log
    )
