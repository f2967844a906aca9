"""Watching and stopping a run's jobs: status, logs and cancel, for every backend."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ajet_hpc.launch import registry
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.metrics import read_rows


@dataclass(frozen=True)
class TaskState:
    job: str  # registry name (server-x, clients-y, het-...)
    task_id: str
    state: str
    where: str  # node list (Slurm) or "local"
    reason: str = ""

    @property
    def active(self) -> bool:
        return self.state in slurmcli.ACTIVE_STATES


def _pid_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            code = handle.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "FINISHED"
    return "FINISHED" if code in ("Z", "X") else "RUNNING"


def task_states(job: SubmittedJob) -> list[TaskState]:
    if job.backend == "local":
        return [TaskState(job.name, task, _pid_state(int(task)), "local") for task in job.tasks]
    found = {s.job_id: s for s in slurmcli.job_states(job.job_ids)}
    states = []
    for task in job.tasks:
        s = found.get(task)
        if s is None:  # left scontrol's memory (MinJobAge): finished long ago
            states.append(TaskState(job.name, task, "GONE", "", "no longer known to slurmctld"))
        else:
            states.append(
                TaskState(job.name, task, s.state, s.nodes, s.reason if s.state == "PENDING" else "")
            )
    return states


def describe_servers(run: RunDir, now: float | None = None) -> list[str]:
    """One line per server (state, step of total, last step time, address, heartbeat), and the reason of
    a server that finished early or failed on the next line."""
    now = time.time() if now is None else now
    lines = []
    for server in run.load_topology().models:
        try:
            record = rendezvous.read(run.rendezvous_file(server.name))
        except ValueError as exc:
            lines.append(f"  {server.name:<16} unreadable rendezvous: {exc}")
            continue
        if record is None:
            lines.append(f"  {server.name:<16} not published (starting, queued or stopped)")
            continue
        total = f"/{server.trainer.total_steps}" if server.trainer is not None else ""
        last = "no step yet"
        if record.last_step_at:
            clock = time.strftime("%H:%M:%S", time.localtime(record.last_step_at))
            last = f"last step {clock} ({now - record.last_step_at:.0f}s ago)"
        freshness = "STALE" if record.is_stale() and not record.final else "ok"
        lines.append(
            f"  {server.name:<16} {record.state:<8} step {record.step}{total}, {last}, policy "
            f"v{record.policy_version}; {record.url} job {record.job_id} on {record.node}, heartbeat "
            f"{record.age_s(now):.0f}s ago ({freshness})"
        )
        if record.reason:
            lines.append(f"  {'':<16} {'reason:':<8} {record.reason}")
    return lines


def status_report(run: RunDir) -> str:
    jobs = registry.latest(run)
    lines = [f"run {run.root}"]
    if not jobs:
        lines.append("  no jobs submitted yet")
    lines.append("jobs:")
    lines.append(f"  {'job':<22} {'task':<14} {'state':<12} {'where':<12} log")
    for job in jobs.values():
        for state in task_states(job):
            log = log_files(run, job, state.task_id)
            shown_log = str(log[0].relative_to(run.root)) if log else job.log_dir + "/"
            where = state.where or state.reason
            lines.append(f"  {job.name:<22} {state.task_id:<14} {state.state:<12} {where:<12} {shown_log}")
    lines.append("servers:")
    lines.extend(describe_servers(run))
    swaps = describe_swaps(run)
    if swaps:
        lines.append(f"client groups changed while running ({run.swaps_file.name}):")
        lines.extend(swaps)
    return "\n".join(lines)


def describe_swaps(run: RunDir) -> list[str]:
    """One line per hot swap or added group: what changed, when, and where the servers were."""
    lines = []
    for row in read_rows(run.swaps_file):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.get("time", 0)))
        old, new = row.get("old") or {}, row.get("new") or {}
        change = f"agent {new.get('agent')}, array {new.get('array')}"
        if old:
            change = (
                f"agent {old.get('agent')} -> {new.get('agent')}, "
                f"array {old.get('array')} -> {new.get('array')}"
            )
        at = ", ".join(
            f"{name} step {p.get('step')}" for name, p in (row.get("servers_at_swap") or {}).items()
        )
        lines.append(
            f"  {when} {row.get('action')} {row.get('group')}: {change} (job {new.get('job_id')}; {at})"
        )
    return lines


def log_files(run: RunDir, job: SubmittedJob, task_id: str | None = None) -> list[Path]:
    """The log files of a job (or of one of its tasks), newest last."""
    folder = run.root / job.log_dir
    pattern = f"{task_id}_*.out" if task_id else "*.out"
    return sorted(folder.glob(pattern), key=lambda path: path.stat().st_mtime)


def find_logs(run: RunDir, selector: str | None) -> list[Path]:
    """Logs selected by job name (server-x), target (x), job id or task id; all logs when None."""
    jobs = registry.latest(run)
    chosen: list[Path] = []
    for job in jobs.values():
        if selector is None or selector in (job.name, job.job_id, *job.targets):
            chosen.extend(log_files(run, job))
        elif selector in job.tasks:
            chosen.extend(log_files(run, job, selector))
    return chosen


def tail(path: Path, lines: int) -> str:
    with path.open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        size = handle.tell()
        handle.seek(max(0, size - 64 * 1024 * max(1, lines // 100)))
        text = handle.read().decode(errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def follow(paths: list[Path], out: TextIO, poll_s: float = 0.5) -> Iterator[None]:
    """Print what is appended to ``paths``; yields after each poll so callers can stop it."""
    offsets = {path: path.stat().st_size if path.exists() else 0 for path in paths}
    while True:
        for path in paths:
            if not path.exists():
                continue
            with path.open("rb") as handle:
                handle.seek(offsets[path])
                chunk = handle.read()
                offsets[path] = handle.tell()
            if chunk:
                prefix = f"[{path.name}] " if len(paths) > 1 else ""
                for line in chunk.decode(errors="replace").splitlines():
                    out.write(prefix + line + "\n")
                out.flush()
        yield
        time.sleep(poll_s)


def cancel_run(run: RunDir) -> list[str]:
    """Stop every active job of the run; returns a line per job saying what was done."""
    return [cancel_job(job) for job in registry.latest(run).values()]


def cancel_job(job: SubmittedJob) -> str:
    """Stop one job's active tasks (scancel, or SIGTERM to local controllers, which pass it on to their
    task); returns a line saying what was done."""
    active = [s for s in task_states(job) if s.active]
    if not active:
        return f"{job.name}: nothing to cancel (already finished)"
    if job.backend == "local":
        for state in active:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(state.task_id), signal.SIGTERM)
        return f"{job.name}: sent SIGTERM to local process(es) {', '.join(s.task_id for s in active)}"
    slurmcli.cancel(job.job_ids)
    return f"{job.name}: scancel {' '.join(job.job_ids)}"


def wait_stopped(job: SubmittedJob, timeout_s: float, poll_s: float = 1.0) -> list[TaskState]:
    """Wait until no task of ``job`` is active (Slurm: not even COMPLETING); the tasks still active after
    ``timeout_s`` (empty when all are gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        active = [s for s in task_states(job) if s.active]
        if not active or time.monotonic() > deadline:
            return active
        time.sleep(poll_s)


def kill_local(job: SubmittedJob) -> None:
    """SIGKILL a local job's controllers and everything under them (a task that ignored SIGTERM)."""
    if job.backend != "local":
        raise ValueError(f"{job.name} is a {job.backend} job; only local jobs are killed by pid")
    for task in job.tasks:
        kill_tree(int(task))
