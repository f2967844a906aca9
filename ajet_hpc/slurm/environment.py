"""What a running job knows about itself: its job id, its node, and the address others reach it at."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from ajet_hpc.slurm import slurmcli


@dataclass(frozen=True)
class JobEnvironment:
    job_id: str  # Slurm: 123, 123_4 (array task); local: the submitit controller's pid, or "local"
    node: str
    on_slurm: bool
    array_index: int | None  # SLURM_ARRAY_TASK_ID when in an array

    def advertise_host(self) -> str:
        """The address other nodes use to reach a port opened by this job."""
        if not self.on_slurm:
            return "127.0.0.1"
        return slurmcli.node_address(self.node) or socket.getfqdn()

    def bind_host(self) -> str:
        """Listen on every interface on a cluster node; only on loopback on a laptop."""
        return "0.0.0.0" if self.on_slurm else "127.0.0.1"


def current() -> JobEnvironment:
    env = os.environ
    if "SLURM_JOB_ID" in env:
        array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
        job_id = f"{array_job}_{array_task}" if array_job and array_task else env["SLURM_JOB_ID"]
        return JobEnvironment(
            job_id=job_id,
            node=env.get("SLURMD_NODENAME") or socket.gethostname(),
            on_slurm=True,
            array_index=int(array_task) if array_task else None,
        )
    return JobEnvironment(
        job_id=env.get("SUBMITIT_LOCAL_JOB_ID", "local"),
        node=socket.gethostname(),
        on_slurm=False,
        array_index=None,
    )
