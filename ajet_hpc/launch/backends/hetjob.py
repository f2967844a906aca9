"""A small executor of our own for Slurm heterogeneous jobs (``#SBATCH hetjob``), which submitit lacks.

The batch script starts one ``srun --het-group=K`` step per component in the background and waits. On the
checkpoint signal (``--signal=B:USR2@delay`` reaches the batch shell) it passes the signal on to the server
(which checkpoints its trainer and stops), then asks Slurm to requeue the job.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from ajet_hpc.config import ClusterConfig, slurm_memory_mb
from ajet_hpc.launch.backends.base import BackendError
from ajet_hpc.launch.plan import HetJobSpec, JobSpec
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.rundir import RunDir


def _flag(key: str, value: object) -> str:
    return f"#SBATCH --{key}" if value is True else f"#SBATCH --{key}={shlex.quote(str(value))}"


def component_options(component: JobSpec, cluster: ClusterConfig) -> list[tuple[str, object]]:
    """sbatch options of one component.

    Memory is asked per CPU: sbatch refuses --mem in one component beside --mem-per-cpu in another, and a
    client component's tasks may spread over several nodes (the topology's ``mem`` is per task).
    """
    res = component.resources
    options: list[tuple[str, object]] = [("partition", res.partition), ("time", res.time_min)]
    if component.kind == "server":
        options += [("nodes", res.nodes), ("ntasks-per-node", max(1, res.ntasks // res.nodes))]
    else:
        options.append(("ntasks", res.ntasks))
    per_cpu_mb = max(1, slurm_memory_mb(res.mem) // res.cpus_per_task)
    options += [("cpus-per-task", res.cpus_per_task), ("mem-per-cpu", f"{per_cpu_mb}M")]
    if res.gpus_per_node:
        options.append(("gpus-per-node", res.gpus_per_node))
    if cluster.account:
        options.append(("account", cluster.account))
    if cluster.qos:
        options.append(("qos", cluster.qos))
    options += sorted(cluster.sbatch.items())
    return options


def hetjob_script(
    job_name: str,
    log_dir: Path,
    components: Sequence[tuple[JobSpec, list[str]]],
    cluster: ClusterConfig,
) -> str:
    """The sbatch text of a heterogeneous job: a pure function of its arguments (golden-file tested).

    ``components`` pairs each component with the command its tasks run.
    """
    lines = ["#!/bin/bash", "", "# Heterogeneous job written by ajet_hpc (one component per block)"]
    lines += [
        _flag("job-name", job_name),
        _flag("output", str(log_dir / "%j_batch.out")),
        _flag("open-mode", "append"),
        _flag("signal", f"B:USR2@{cluster.signal_delay_s}"),
        _flag("requeue", True),
    ]
    for index, (component, _command) in enumerate(components):
        if index:
            lines.append("#SBATCH hetjob")
        lines += [_flag(key, value) for key, value in component_options(component, cluster)]
    lines += ["", "# setup", *cluster.setup] if cluster.setup else []
    lines += [
        "",
        "# the server (component 0) checkpoints its trainer and stops; then the job goes back in the queue",
        "requeue() {",
        '  echo "checkpoint signal: saving, then requeueing job $SLURM_JOB_ID"',
        '  kill -USR2 "$SERVER_PID" 2>/dev/null || true',
        '  wait "$SERVER_PID" || true',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "}",
        "trap requeue USR2",
        "",
    ]
    for index, (component, command) in enumerate(components):
        out = shlex.quote(str(log_dir)) + f'/"${{SLURM_JOB_ID}}+{index}_%t_log.out"'
        srun = f"srun --het-group={index} --unbuffered --output={out} "
        lines.append(f"# component {index}: {component.name}")
        lines.append(srun + shlex.join(command) + " &")
        if index == 0:
            lines.append("SERVER_PID=$!")
    lines += [
        "",
        "# wait returns early when the trap fires; the second wait keeps the steps",
        "wait",
        "wait",
        "",
    ]
    return "\n".join(lines)


class HetJobExecutor:
    """Renders and submits ``HetJobSpec`` jobs: write the script into the log folder, ``sbatch`` it."""

    name = "hetjob"

    def __init__(self, python: str = sys.executable) -> None:
        self.python = python

    def render(self, job: HetJobSpec, run: RunDir, cluster: ClusterConfig) -> str:
        components = [(c, c.command(run.root, self.python)) for c in job.components]
        return hetjob_script(
            f"ajet-{run.root.name}-{job.name}", run.job_log_dir(job.name), components, cluster
        )

    def submit(self, job: HetJobSpec, run: RunDir, cluster: ClusterConfig) -> SubmittedJob:
        log_dir = run.job_log_dir(job.name)
        log_dir.mkdir(parents=True, exist_ok=True)
        script = log_dir / "hetjob.sbatch"
        script.write_text(self.render(job, run, cluster))
        done = subprocess.run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise BackendError(f"{job.name}: sbatch refused the heterogeneous job: {done.stderr.strip()}")
        job_id = done.stdout.strip().split(";")[0]
        return SubmittedJob(
            name=job.name,
            backend=self.name,
            job_id=job_id,
            tasks=[f"{job_id}+{index}" for index in range(len(job.components))],
            log_dir=str(log_dir.relative_to(run.root)),
            targets=[component.target for component in job.components],
        )
