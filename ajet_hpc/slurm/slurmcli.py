"""Small wrappers over Slurm's command-line tools (sinfo, squeue, scontrol, scancel).

Job states come from ``squeue`` and, for jobs that left the queue, from ``scontrol show job``: many
clusters (and the dev cluster) run without accounting, where ``sacct`` does not answer.

``job_states`` fails closed: only Slurm's own "invalid job id" answer means that a job is gone; any other
failure (controller down, timeout, no scontrol) raises ``SlurmError``, so that a relaunch never mistakes
live jobs for ended ones and submits them twice.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass

TIMEOUT_S = 30
QUERY_TRIES = 3  # a read-only query is asked again when the command did not get an answer (below)
QUERY_BACKOFF_S = 1.0

# What Slurm's tools print when they did not reach slurmctld or lost the connection mid-answer; with a tool
# killed by a signal (SIGPIPE when the controller closes the socket while the tool writes to it), the only
# failures a read-only query is asked again for. Anything else (a bad job id, a wrong option) is final.
_TRANSIENT = (
    "unable to contact slurm controller",
    "socket timed out",
    "zero bytes were transmitted",
    "connection refused",
    "connection reset",
    "broken pipe",
)


class SlurmError(RuntimeError):
    """A Slurm command failed; the message holds the command and what it printed."""


def available() -> bool:
    """True when ``sbatch`` is on PATH and the controller answers."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        _run(["sinfo", "-h", "-o", "%P"])  # a probe: not asked again
    except SlurmError:
        return False
    return True


def array_limit() -> int | None:
    """The most tasks one job array (indices from 0) may have on this cluster: ``MaxArraySize`` (the highest
    index is one less) and ``max_array_tasks`` of ``SchedulerParameters``, from ``scontrol show config``;
    None when Slurm does not say (arrays off: ``MaxArraySize=0`` gives 0)."""
    limits = []
    for line in _run(["scontrol", "show", "config"], check=False, query=True).splitlines():
        key, _, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if key == "MaxArraySize" and value.isdigit():
            limits.append(int(value))
        elif key == "SchedulerParameters":
            for item in value.split(","):
                name, _, number = item.partition("=")
                if name.strip() == "max_array_tasks" and number.strip().isdigit():
                    limits.append(int(number))
    return min(limits) if limits else None


def _run(cmd: list[str], check: bool = True, query: bool = False) -> str:
    """Run a Slurm command and return its stdout; ``query`` marks a read-only one, asked again on a
    transient failure (``_query``)."""
    if query:
        done = _query(cmd)
    else:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SlurmError(f"{' '.join(cmd)}: {exc}") from exc
    if check and done.returncode != 0:
        raise SlurmError(
            f"{' '.join(cmd)} exited {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
        )
    return done.stdout


def partitions() -> set[str]:
    """Partition names of the live cluster (the default one is printed with a '*', removed here)."""
    return {
        line.strip().rstrip("*")
        for line in _run(["sinfo", "-h", "-o", "%P"], query=True).splitlines()
        if line.strip()
    }


@dataclass(frozen=True)
class JobState:
    job_id: str  # as Slurm prints it: 123, 123_4 (array task) or 123+0 (hetjob component)
    state: str  # PENDING, RUNNING, COMPLETED, CANCELLED, ...
    partition: str
    nodes: str  # node list, '' while pending
    reason: str
    exit_code: str = ""  # "code:signal" once it ended, as scontrol prints it (0:9: killed by SIGKILL)


def _parse_scontrol_record(text: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for token in text.split():
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value
    return fields


_UNKNOWN_JOB = "invalid job id"  # scontrol's answer for a job that left slurmctld's memory (MinJobAge)


def _transient(returncode: int, said: str) -> bool:
    """True when a query's failure says the controller was not reached or the answer was cut, not that the
    question was wrong: worth asking again."""
    return returncode < 0 or any(marker in said.lower() for marker in _TRANSIENT)


def _query(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a read-only Slurm query, asked again (``QUERY_TRIES`` in all, growing pauses) while it fails in
    a transient way; the last answer is returned whatever it is. Never used for a command that changes
    anything (sbatch, scancel, requeue): those are not safe to repeat."""
    for attempt in range(1, QUERY_TRIES + 1):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired as exc:
            if attempt == QUERY_TRIES:
                raise SlurmError(f"{' '.join(cmd)}: {exc}") from exc
        except OSError as exc:
            raise SlurmError(f"{' '.join(cmd)}: {exc}") from exc
        else:
            said = done.stderr.strip() or done.stdout.strip()
            if done.returncode == 0 or attempt == QUERY_TRIES or not _transient(done.returncode, said):
                return done
        time.sleep(QUERY_BACKOFF_S * attempt)
    raise AssertionError("unreachable")  # the loop returns or raises on its last attempt


def _show_job(job_id: str) -> str:
    """``scontrol show job -o`` of one job; '' when Slurm says it does not know it, ``SlurmError`` when
    Slurm did not answer (after ``_query``'s tries)."""
    cmd = ["scontrol", "show", "job", "-o", str(job_id)]
    done = _query(cmd)
    if done.returncode == 0:
        return done.stdout
    said = (done.stderr.strip() or done.stdout.strip())[-2000:]
    if _UNKNOWN_JOB in said.lower():
        return ""
    raise SlurmError(f"{' '.join(cmd)} exited {done.returncode}: {said or '(no output)'}")


def job_states(job_ids: Iterable[str]) -> list[JobState]:
    """States of every task of the given jobs (array tasks and hetjob components expanded); a job Slurm no
    longer knows has none. ``SlurmError`` when Slurm cannot answer (never read as "gone")."""
    states: list[JobState] = []
    for job_id in job_ids:
        out = _show_job(str(job_id))
        for line in out.splitlines():
            rec = _parse_scontrol_record(line)
            if "JobId" not in rec:
                continue
            nodes = rec.get("NodeList", "")
            for shown in _task_ids(rec):
                states.append(
                    JobState(
                        job_id=shown,
                        state=rec.get("JobState", "UNKNOWN"),
                        partition=rec.get("Partition", ""),
                        nodes="" if nodes == "(null)" else nodes,
                        reason=rec.get("Reason", ""),
                        exit_code=rec.get("ExitCode", ""),
                    )
                )
    return states


def _task_ids(rec: dict[str, str]) -> list[str]:
    """The task ids one scontrol record stands for: pending array tasks share one record whose
    ArrayTaskId is a range list (``0-2``, ``1,3-5``, ``0-9%3``)."""
    task = rec.get("ArrayTaskId")
    if task not in (None, "", "(null)"):
        base = rec.get("ArrayJobId", rec["JobId"])
        return [f"{base}_{index}" for index in expand_ranges(task.split("%")[0])]
    if rec.get("HetJobOffset") not in (None, ""):
        return [f"{rec.get('HetJobId', rec['JobId'])}+{rec['HetJobOffset']}"]
    return [rec["JobId"]]


def expand_ranges(text: str) -> list[int]:
    """``1,3-5`` -> [1, 3, 4, 5]."""
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        out.extend(range(int(low), int(high or low) + 1))
    return out


ACTIVE_STATES = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def job_record(job_id: str) -> dict[str, str]:
    """``scontrol show job`` of one job as field -> value ({} when Slurm does not know it)."""
    out = _run(["scontrol", "show", "job", "-o", str(job_id)], check=False, query=True)
    for line in out.splitlines():
        rec = _parse_scontrol_record(line)
        if "JobId" in rec:
            return rec
    return {}


def requeue(job_id: str) -> None:
    """Put a job back in the queue (``scontrol requeue``); a running one is stopped first (SIGTERM, then
    SIGKILL after KillWait) and starts again later with SLURM_RESTART_COUNT + 1."""
    _run(["scontrol", "requeue", str(job_id)])


def cancel(job_ids: Iterable[str]) -> None:
    ids = [str(job_id) for job_id in job_ids]
    if ids:
        _run(["scancel", *ids])


def node_address(node: str) -> str | None:
    """The address Slurm reaches ``node`` at (its NodeAddr); None when unknown."""
    try:
        rec = _parse_scontrol_record(_run(["scontrol", "show", "node", "-o", node], query=True))
    except SlurmError:
        return None
    return rec.get("NodeAddr") or None


def hostnames(nodelist: str) -> list[str]:
    """Expand a Slurm node list (``g[1-3],c1``) with ``scontrol show hostnames``."""
    out = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True, text=True
    ).stdout
    return out.split()
