"""One client array task: find the group's servers and run its share of the work."""

from __future__ import annotations

import logging
import os

from ajet_hpc.client.discovery import wait_for_server
from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.launch import environment
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)


def pick_group(topology: Topology, name: str) -> ClientGroupConfig:
    for group in topology.clients:
        if group.name == name:
            return group
    names = ", ".join(g.name for g in topology.clients) or "(none)"
    raise SystemExit(f"no client group named {name!r} in this run; groups are: {names}")


def resolve_index(explicit: int | None) -> int:
    """This task's index in its group: explicit, else the array task id, else the hetjob rank."""
    if explicit is not None:
        return explicit
    job = environment.current()
    if job.array_index is not None:
        return job.array_index
    return int(os.environ.get("SLURM_PROCID", "0"))


def run_client(run_dir: str | os.PathLike[str], group_name: str, index: int | None = None) -> int:
    setup_logging()
    run = RunDir.at(run_dir)
    group = pick_group(run.load_topology(), group_name)
    index = resolve_index(index)
    if not 0 <= index < group.array:
        raise SystemExit(f"client index {index} is outside group {group.name!r} (array of {group.array})")
    job = environment.current()
    log.info("client %s[%d] (job %s) on node %s", group.name, index, job.job_id, job.node)
    for server_name in group.servers:
        found = wait_for_server(run, server_name)
        log.info(
            "client %s[%d] reached server %s at %s (job %s on %s): %s",
            group.name,
            index,
            server_name,
            found.url,
            found.rendezvous.job_id,
            found.rendezvous.node,
            found.health,
        )
    return 0
