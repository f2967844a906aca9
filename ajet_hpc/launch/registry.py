"""RUN/jobs.json: every job submitted for a run, so that status, logs, cancel and relaunch find them."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

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


def load(run: RunDir) -> list[SubmittedJob]:
    raw = read_json(run.jobs_file) or []
    return [SubmittedJob(**entry) for entry in raw]


def record(run: RunDir, jobs: list[SubmittedJob]) -> None:
    """Append ``jobs`` to the registry (rewritten by rename)."""
    write_json_atomic(run.jobs_file, [asdict(job) for job in [*load(run), *jobs]])


def latest(run: RunDir) -> dict[str, SubmittedJob]:
    """The most recent submission of each job name."""
    newest: dict[str, SubmittedJob] = {}
    for job in load(run):
        newest[job.name] = job
    return newest
