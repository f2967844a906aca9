"""What a server process does on Slurm's pre-timeout or preemption signal, before submitit requeues it.

submitit catches the signal (USR2) in the job's main thread and calls the job's ``checkpoint``
(`ajet_hpc.launch.jobs.ServerJob`), which runs the hooks registered here: the trainer saves a checkpoint of
its current step and the episode store is flushed. Then submitit requeues the job and exits; the requeued
job resumes from the run directory. Hooks run one after the other and may block: the event loop of the
process is suspended meanwhile, which is what we want while the job is going down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

_hooks: list[Callable[[], None]] = []


def on_signal(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` on the checkpoint signal; returns the function that unregisters it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook) if hook in _hooks else None


def run_hooks() -> int:
    """Run every registered hook (errors are logged, not raised: the requeue must still happen).
    Returns how many failed."""
    failed = 0
    for hook in list(_hooks):
        try:
            hook()
        except Exception:
            failed += 1
            log.exception("checkpoint on signal: %s failed", getattr(hook, "__name__", hook))
    return failed
