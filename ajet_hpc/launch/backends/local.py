"""Local processes through submitit's LocalExecutor: the same jobs as on Slurm, on one machine.

Each job (and each task of a client array) is a process started by a submitit controller that survives
the launcher; the controller's pid is the job id. Heterogeneous jobs are a Slurm notion: the plan for this
backend never holds one.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import submitit

from ajet_hpc.config import ClusterConfig
from ajet_hpc.launch.backends.base import BackendError
from ajet_hpc.launch.jobs import ClientJob, ServerJob
from ajet_hpc.launch.plan import HetJobSpec, JobSpec, Planned
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.rundir import RunDir


class LocalBackend:
    name = "local"

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python
        self.handles: dict[str, list[submitit.Job[Any]]] = {}  # job name -> live submitit jobs

    def render(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> str:
        job = _single(job)
        command = shlex.join(job.command(run.root, self.python))
        if job.kind == "clients":
            command += f" --index {{0..{(job.array or 1) - 1}}}"
        return f"# local job {job.name}, logs in {run.job_log_dir(job.name)}\n{command}\n"

    def submit(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> SubmittedJob:
        job = _single(job)
        folder = run.job_log_dir(job.name)
        python = shlex.quote(job.python or self.python)  # a client group with its own runtime runs in it
        executor = submitit.LocalExecutor(folder=folder, python=python, max_num_timeout=100)
        executor.update_parameters(
            timeout_min=job.resources.time_min,
            gpus_per_node=job.resources.gpus_per_node,
            signal_delay_s=cluster.signal_delay_s,
            stderr_to_stdout=True,
            setup=list(cluster.setup),
        )
        submitted: list[submitit.Job[Any]]
        with _controller_output(folder / "controller.log"):
            if job.kind == "server":
                submitted = [executor.submit(ServerJob(str(run.root), job.target))]
            else:
                submitted = executor.map_array(ClientJob(str(run.root), job.target), range(job.array or 1))
        self.handles[job.name] = submitted
        tasks = [j.job_id for j in submitted]
        return SubmittedJob(
            name=job.name,
            backend=self.name,
            job_id=tasks[0],
            tasks=tasks,
            log_dir=str(Path(folder).relative_to(run.root)),
            targets=[job.target],
        )


@contextlib.contextmanager
def _controller_output(path: Path) -> Iterator[None]:
    """Point stdout/stderr at ``path`` while controllers start, so that they inherit it, not ours.

    Controllers outlive the launcher (``--detach``); holding its stdout open would keep a pipe reading
    from the launcher (``| tee``, ``subprocess.run``) waiting until the whole run ends.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


def _single(job: Planned) -> JobSpec:
    if isinstance(job, HetJobSpec):
        raise BackendError(
            "heterogeneous jobs need Slurm; the local backend runs components as separate jobs"
        )
    return job
