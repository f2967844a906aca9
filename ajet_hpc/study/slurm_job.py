"""The supervisor as a small CPU Slurm job (``--slurm``), so that a study outlives any allocation.

It is submitted with submitit, as the launcher submits servers, and it is ``Checkpointable``: Slurm's
USR2 ``signal_delay_s`` before the time limit makes submitit requeue the same job, which runs the
supervisor again. The requeued job takes over the study's lease at once (the lease knows a holder that is
this Slurm job before its requeue is gone), and the supervisor resumes from the study directory.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import submitit

from ajet_hpc.config import slurm_time_minutes
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.schema import StudySpec


class SupervisorJob(submitit.helpers.Checkpointable):
    """What the Slurm job runs: the supervisor loop on the study directory, from the submitting folder."""

    def __init__(self, study_root: str, cwd: str) -> None:
        self.study_root, self.cwd = study_root, cwd

    def __call__(self) -> int:
        from ajet_hpc.logging_setup import setup_logging
        from ajet_hpc.study.schema import load_study
        from ajet_hpc.study.trial_supervisor import LEASE_TIMING, Supervisor

        setup_logging()
        os.chdir(self.cwd)
        signal.signal(signal.SIGTERM, _interrupt)  # scancel: release the lease on the way out
        study_dir = StudyDir(Path(self.study_root))
        supervisor = Supervisor(load_study(study_dir.spec_file)[0], study_dir, cwd=Path(self.cwd))
        # a requeued or resubmitted job may start before the killed one's lease has gone stale
        code = supervisor.run(wait_for_lease_s=2 * LEASE_TIMING.timeout_s)
        if code:
            raise RuntimeError(f"the study supervisor stopped (code {code}): see {study_dir.events_file}")
        return code


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def parameters(spec: StudySpec, study_dir: StudyDir) -> dict[str, Any]:
    job = spec.supervisor
    return {
        "job_name": f"ajet-study-{spec.name}",
        "partition": job.partition,
        "time": slurm_time_minutes(job.time),
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": job.cpus,
        "signal_delay_s": job.signal_delay_s,
        "stderr_to_stdout": True,
        "additional_parameters": {"mem": job.mem},
    }


def submit(spec: StudySpec, study_dir: StudyDir, python: str = sys.executable) -> str:
    """Submit the supervisor job, unless the one recorded in ``supervisor.json`` still waits or runs;
    returns a line saying which."""
    recorded = read_json(study_dir.supervisor_job_file) or {}
    job_id = recorded.get("job_id")
    if job_id and any(s.state in slurmcli.ACTIVE_STATES for s in slurmcli.job_states([job_id])):
        return f"the supervisor already runs as Slurm job {job_id}: nothing submitted"
    folder = study_dir.root / "supervisor-logs"
    executor = submitit.SlurmExecutor(folder=folder, python=python, max_num_timeout=1000)
    executor.update_parameters(**parameters(spec, study_dir))
    job = executor.submit(SupervisorJob(str(study_dir.root), str(Path.cwd())))
    write_json_atomic(study_dir.supervisor_job_file, {"job_id": job.job_id, "logs": str(folder)})
    study_dir.event("supervisor_submitted", job=job.job_id)
    return f"the supervisor runs as Slurm job {job.job_id} (logs in {folder})"
