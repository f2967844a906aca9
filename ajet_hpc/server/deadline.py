"""The server's own alarm before its job's time limit: save, requeue and stop without waiting for a signal.

Slurm's checkpoint signal before the time limit (``--signal``) is not sent everywhere: some clusters
strip it, some preempt with SIGTERM only, a job started by hand may lack it. So the server reads its job's
end time and, ``signal_delay_s`` before it, takes the same save as on the signal
(`ajet_hpc.server.preemption`), requeues its job and stops. It reads the end time from ``scontrol show job``
(an administrator may extend the limit; a preemption with ``GraceTime`` moves it earlier) and falls back on
``SLURM_JOB_END_TIME`` (set once per start). Once per start, and not once training is complete.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

from ajet_hpc.slurm import slurmcli

log = logging.getLogger(__name__)

POLL_S = 60.0
"""Longest time between two reads of the end time: at most one ``scontrol show job`` a minute per server
(docs/scaling.md), however long the server takes to serve."""


def save_at(end_time: float | None, signal_delay_s: float) -> float | None:
    """When to start the time-limit save (epoch seconds): ``signal_delay_s`` before the end; None without a
    time limit."""
    if end_time is None:
        return None
    return end_time - signal_delay_s


def next_wait(save_time: float | None, now: float, poll_s: float = POLL_S) -> float | None:
    """Seconds to sleep before looking again; 0: save now; None: no time limit, stop watching."""
    if save_time is None:
        return None
    return max(0.0, min(poll_s, save_time - now))


def end_time_from(record: Mapping[str, str], environ: Mapping[str, str]) -> float | None:
    """The job's end time (epoch seconds) from its ``scontrol show job`` record, else SLURM_JOB_END_TIME;
    None for a job without a time limit."""
    text = record.get("EndTime")
    if text and text not in ("Unknown", "None", "N/A") and record.get("TimeLimit") != "UNLIMITED":
        try:
            return datetime.fromisoformat(text).timestamp()
        except ValueError:
            pass
    raw = environ.get("SLURM_JOB_END_TIME", "")
    return float(raw) if raw.isdigit() and int(raw) > 0 else None


def job_end_time(job_id: str, environ: Mapping[str, str] = os.environ) -> float | None:
    try:
        record = slurmcli.job_record(job_id)
    except slurmcli.SlurmError as error:
        log.warning("deadline: scontrol show job %s failed (%s); using SLURM_JOB_END_TIME", job_id, error)
        record = {}
    return end_time_from(record, environ)


class DeadlineWatch(threading.Thread):
    """Calls ``fire(reason)`` once, ``signal_delay_s`` before the job's end time, when ``ready()`` (the
    server serves) and not ``finished()`` (training complete)."""

    def __init__(
        self,
        signal_delay_s: float,
        end_time: Callable[[], float | None],
        fire: Callable[[str], None],
        ready: Callable[[], bool],
        finished: Callable[[], bool],
        poll_s: float = POLL_S,
    ) -> None:
        super().__init__(name="time-limit-deadline", daemon=True)
        self.signal_delay_s, self.poll_s = signal_delay_s, poll_s
        self.end_time, self.fire, self.ready, self.finished = end_time, fire, ready, finished
        self.stopped = threading.Event()

    def run(self) -> None:
        end, read_at = None, -float("inf")
        while not self.stopped.is_set():
            if time.monotonic() - read_at >= self.poll_s:  # not on every wake-up: a Slurm RPC each
                end, read_at = self.end_time(), time.monotonic()
            wait = next_wait(save_at(end, self.signal_delay_s), time.time(), self.poll_s)
            if wait is None:
                log.info("deadline: the job has no time limit; no time-limit save")
                return
            if wait > 0 or not self.ready():
                self.stopped.wait(wait or 0.5)
                continue
            if self.finished():
                return
            left = end - time.time() if end is not None else 0.0
            log.info("deadline: the job ends in %.0f s; saving, requeueing and stopping", left)
            self.fire(f"time limit in {left:.0f} s")
            return

    def stop(self) -> None:
        self.stopped.set()
