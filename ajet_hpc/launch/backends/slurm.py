"""Slurm through submitit: one job per server, one job array per client group (one sbatch call each).

Heterogeneous jobs, which submitit cannot express, go to the small executor in ``hetjob.py``.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import submitit
from submitit.slurm.slurm import _make_sbatch_string

from ajet_hpc.config import ClusterConfig
from ajet_hpc.launch.backends.base import BackendError
from ajet_hpc.launch.backends.hetjob import HetJobExecutor
from ajet_hpc.launch.jobs import ClientJob, ServerJob
from ajet_hpc.launch.plan import HetJobSpec, JobSpec, Planned
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.rundir import RunDir


def job_name(run: RunDir, job: Planned) -> str:
    return f"ajet-{run.root.name}-{job.name}"


def slurm_parameters(job: JobSpec, run: RunDir, cluster: ClusterConfig) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for one job; the same dict renders the dry run and submits."""
    res = job.resources
    params: dict[str, Any] = {
        "job_name": job_name(run, job),
        "partition": res.partition,
        "time": res.time_min,
        "nodes": res.nodes,
        "ntasks_per_node": max(1, res.ntasks // res.nodes),
        "cpus_per_task": res.cpus_per_task,
        "signal_delay_s": cluster.signal_delay_s,
        "stderr_to_stdout": True,
        "additional_parameters": {"mem": res.mem, **cluster.sbatch},
    }
    if res.gpus_per_node:
        params["gpus_per_node"] = res.gpus_per_node
    if cluster.account:
        params["account"] = cluster.account
    if cluster.qos:
        params["qos"] = cluster.qos
    if cluster.setup:
        params["setup"] = list(cluster.setup)
    if job.array and job.array > 1:
        params["array_parallelism"] = job.array
    return params


class SlurmBackend:
    name = "slurm"

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.hetjobs = HetJobExecutor(python=python)

    def render(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> str:
        if isinstance(job, HetJobSpec):
            return self.hetjobs.render(job, run, cluster)
        folder = run.job_log_dir(job.name)
        python = job.python or self.python  # a client group with its own runtime runs in it
        command = " ".join([shlex.quote(python), "-u -m submitit.core._submit", shlex.quote(str(folder))])
        map_count = job.array if job.array and job.array > 1 else None
        try:
            return _make_sbatch_string(
                command=command, folder=folder, map_count=map_count, **slurm_parameters(job, run, cluster)
            )
        except (TypeError, ValueError) as exc:
            raise BackendError(f"{job.name}: cannot build its sbatch script: {exc}") from exc

    def submit(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> SubmittedJob:
        if isinstance(job, HetJobSpec):
            return self.hetjobs.submit(job, run, cluster)
        return self._submit(job, run, cluster, None)

    def resubmit(self, job: JobSpec, run: RunDir, cluster: ClusterConfig, indices: list[int]) -> SubmittedJob:
        """Submit the array tasks ``indices`` of client job ``job`` again (one sbatch: an array of them, its
        k-th task running index ``indices[k]``); the entry's ``indices`` say which ones they replace."""
        return self._submit(job, run, cluster, list(indices))

    def _submit(
        self, job: JobSpec, run: RunDir, cluster: ClusterConfig, indices: list[int] | None
    ) -> SubmittedJob:
        folder = run.job_log_dir(job.name)
        python = job.python or self.python
        executor = submitit.SlurmExecutor(folder=folder, python=shlex.quote(python), max_num_timeout=100)
        params = slurm_parameters(job, run, cluster)
        if indices is not None:  # an array of the resubmitted indices only
            params.pop("array_parallelism", None)
            if len(indices) > 1:
                params["array_parallelism"] = len(indices)
        executor.update_parameters(**params)
        try:
            if job.kind == "server":
                submitted = [executor.submit(ServerJob(str(run.root), job.target))]
            else:
                arguments = range(job.array or 1) if indices is None else indices
                submitted = executor.map_array(ClientJob(str(run.root), job.target), arguments)
        except submitit.core.utils.FailedJobError as exc:
            raise BackendError(f"{job.name}: sbatch refused the job: {exc}") from exc
        tasks = [j.job_id for j in submitted]
        return SubmittedJob(
            name=job.name,
            backend=self.name,
            job_id=tasks[0].split("_")[0],
            tasks=tasks,
            log_dir=str(Path(folder).relative_to(run.root)),
            targets=[job.target],
            indices=indices,
            python=python,
        )
