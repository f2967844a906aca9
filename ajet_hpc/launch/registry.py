"""RUN/jobs.json: every job submitted for a run, so that status, logs, cancel and relaunch find them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.storage.rundir import RunDir


@dataclass(frozen=True)
class SubmittedJob:
    name: str  # server-<name>, clients-<group> or het-<...>
    backend: str  # slurm | hetjob | local
    job_id: str  # Slurm job id (array or hetjob leader), or the local controller's pid
    tasks: list[str]  # ids of each task: 12_0, 12_1 (arrays), 12+0, 12+1 (hetjob), or the pid
    log_dir: str  # relative to the run directory
    targets: list[str]  # server / client group names this job runs
    submitted_at: float = field(default_factory=time.time)
    indices: list[int] | None = None  # array indices it runs again (tasks[k] is index indices[k]); None: all
    python: str | None = None  # the python its tasks run with (a client group's runtime)

    @property
    def job_ids(self) -> list[str]:
        """The Slurm jobs its tasks belong to: one, or more once array tasks were resubmitted."""
        if self.backend != "slurm":
            return [self.job_id]
        return list(dict.fromkeys(task.split("_")[0] for task in self.tasks)) or [self.job_id]


def load(run: RunDir) -> list[SubmittedJob]:
    raw = read_json(run.jobs_file) or []
    return [SubmittedJob(**entry) for entry in raw]


def record(run: RunDir, jobs: list[SubmittedJob]) -> None:
    """Append ``jobs`` to the registry (rewritten by rename)."""
    write_json_atomic(run.jobs_file, [asdict(job) for job in [*load(run), *jobs]])


def latest(run: RunDir) -> dict[str, SubmittedJob]:
    """The most recent submission of each job name; array tasks resubmitted since (``indices``) take the
    places of the tasks they replace."""
    newest: dict[str, SubmittedJob] = {}
    for job in load(run):
        base = newest.get(job.name)
        if job.indices is None or base is None:
            newest[job.name] = job
            continue
        tasks = list(base.tasks)
        for index, task in zip(job.indices, job.tasks, strict=True):
            if 0 <= index < len(tasks):
                tasks[index] = task
        newest[job.name] = replace(base, tasks=tasks)
    return newest


def resubmissions(run: RunDir, name: str) -> dict[int, int]:
    """How many times each array index of job ``name`` was resubmitted since its last whole submission."""
    counts: dict[int, int] = {}
    for job in load(run):
        if job.name != name:
            continue
        if job.indices is None:
            counts = {}
            continue
        for index in job.indices:
            counts[index] = counts.get(index, 0) + 1
    return counts
