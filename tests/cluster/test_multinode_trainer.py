"""A server allocation of two nodes: exactly one server (HTTP front, engine, rendezvous, episode store) on the
first node's first task, one trainer rank per node started with srun, DeepSpeed over gloo across the nodes
(the dev cluster's nodes share one host, so the test reads every process of the job from /proc)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import psutil
import pytest
from support import run_module, topology_dict, wait_until, write_topology

from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.lease import read_lease

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
    entries = json.loads((run / "jobs.json").read_text())
    jobs = [entry["job_id"] for entry in entries]
    server_job = next(e["job_id"] for e in entries if e["name"] == "server-policy")
    seen: dict[int, dict] = {}  # every process of the server job, by pid

    def finished() -> bool:
        for pid, now in job_processes(server_job, run).items():
            before = seen.get(pid)
            if before is not None:  # keep what an earlier look saw (the server closes its port and lease)
                now["server"] = now["server"] or before["server"]
                now["listening"] = sorted(set(now["listening"]) | set(before["listening"]))
                now["lease_pid"] = now["lease_pid"] or before["lease_pid"]
            seen[pid] = now
        return all(s.state not in slurmcli.ACTIVE_STATES for s in slurmcli.job_states(jobs))

    try:
        wait_until(finished, 600, "the run to finish", poll_s=1)
    finally:
        subprocess.run(["scancel", *jobs], check=False, capture_output=True)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    work = run / "ckpt" / "policy"
    ready = json.loads((work / "ready.json").read_text())
    assert ready["world_size"] == 2
    ranks_log = (work / "ranks.log").read_text()
    assert "$ srun --nodes=2 --ntasks=2 --distribution=arbitrary" in ranks_log
    assert len(set((work / "hostfile").read_text().split())) == 2  # one rank line per node

    # the processes: one server, ranks on both nodes
    # (a server's own children, forked with its listening socket, belong to it: count process trees)
    server_pids = {p["pid"] for p in seen.values() if p["server"]}
    servers = [p for p in seen.values() if p["server"] and p["ppid"] not in server_pids]
    assert len(servers) == 1, servers
    (server,) = servers
    assert (server["procid"], server["nodeid"]) == ("0", "0")
    rank_nodes = {p["node"] for p in seen.values() if p["rank"]}
    assert len(rank_nodes) == 2, seen
    # one rendezvous writer and one writer of data/policy.h5: the server process
    record = rendezvous.read(run / "servers" / "policy.json")
    assert record is not None and record.pid == server["pid"] and record.node == server["node"]
    assert server["listening"] == [record.port]
    # no other python process of the job listens (srun's own I/O ports are not ours)
    others = [p for p in seen.values() if p["python"] and server["pid"] not in (p["pid"], p["ppid"])]
    assert not any(p["listening"] and not p["rank"] for p in others), others
    assert server["lease_pid"] == server["pid"]


def job_processes(job_id: str, run_dir: Path) -> dict[int, dict]:
    """The live processes of a Slurm job on this host, from their environment: which task and node each is,
    whether it is the server (``ajet_hpc.server`` through submitit) or a trainer rank, its listening ports
    and, for the server, the pid named by the episode store's writer lease."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = proc.environ()
            if env.get("SLURM_JOB_ID") != job_id:
                continue
            cmdline = " ".join(proc.info["cmdline"] or [])
            is_rank = "ajet_hpc.trainer.ranks.worker" in cmdline and "torch.distributed" not in cmdline
            ports = sorted({c.laddr.port for c in proc.net_connections("tcp") if c.status == "LISTEN"})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        is_python = "python" in Path((proc.info["cmdline"] or [""])[0]).name  # not srun's own process
        is_server = is_python and "submitit.core._submit" in cmdline and bool(ports)
        lease = read_lease(run_dir / "data" / "policy.h5") if is_server else None
        found[proc.pid] = {
            "pid": proc.pid,
            "ppid": proc.ppid(),
            "cmd": cmdline[:160],
            "procid": env.get("SLURM_PROCID"),
            "nodeid": env.get("SLURM_NODEID"),
            "node": env.get("SLURMD_NODENAME"),
            "python": is_python,
            "server": is_server,
            "rank": is_rank,
            "listening": ports if not is_rank else [],
            "lease_pid": lease.pid if lease is not None else None,
        }
    return found
