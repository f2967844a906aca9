"""Which task of which client group this process is, and how its runner ends: what both the array task's
supervisor and its runner need, kept apart from the runner so that the supervisor, which outlives it in
every array task, loads neither HDF5, numpy nor an HTTP stack."""

from __future__ import annotations

import os

from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.slurm import environment

EXIT_SERVER_GONE = 3
"""The runner stopped because a server failed or stayed away longer than ``clients[].server_wait_s``; its
supervisor does not start it again."""
EXIT_STORE_FAILED = 5
"""The runner stopped because its store could not record a result (disk full, quota, lease taken over): it
runs no episode it cannot record; a restart or requeue of the task resumes from the store's last commit."""


def pick_group(topology: Topology, name: str) -> ClientGroupConfig:
    """The client group (or eval group) called ``name``; exits naming the groups otherwise."""
    try:
        return topology.client(name)
    except KeyError as exc:
        raise SystemExit(f"{exc.args[0]} (in this run)") from None


def resolve_index(explicit: int | None) -> int:
    """This task's index in its group: explicit, else the array task id, else the hetjob rank."""
    if explicit is not None:
        return explicit
    job = environment.current()
    if job.array_index is not None:
        return job.array_index
    return int(os.environ.get("SLURM_PROCID", "0"))
