"""The watchdog of a server job: what the server does when a part of it dies.

- **Trainer ranks** that fail a step are restarted from their last checkpoint by the coordinator, up to
  ``trainer.max_restarts`` times in a row; then the coordinator calls ``ModelContext.fail``.
- **The engine** (vLLM's engine core process, killed or crashed) cannot be restarted inside the running
  process without losing the weights the trainer sent it. The watchdog notices the dead engine, checkpoints
  the trainer at its current step and flushes the episode store (the hooks a preemption runs), then
  requeues its own Slurm job: the job comes back with a fresh engine and resumes exactly there, like after
  a preemption; clients wait for it as for any requeue. Off Slurm (no requeue) the server fails instead.
- **Failed** (``ModelContext.fail``): the rendezvous says ``failed`` with the reason, the server stops
  serving within seconds and the job exits non-zero without requeueing.

docs/reliability.md, "Watchdog", says the same for users.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ajet_hpc.server import preemption
from ajet_hpc.slurm import environment, slurmcli

log = logging.getLogger(__name__)

POLL_S = 2.0


def engine_failure(engine: Any) -> str | None:
    """Why the engine cannot serve any more (its process died), or None while it is fine. Engines without
    a separate process (transformers) never fail this way."""
    return getattr(engine, "failure", None)


def requeue_own_job() -> str | None:
    """Put this Slurm job back in the queue (``scontrol requeue``); returns why that was not possible, or
    None when it was done (Slurm then stops this job like on a preemption)."""
    job = environment.current()
    if not job.on_slurm:
        return "not a Slurm job: nothing can requeue it"
    try:
        slurmcli.requeue(job.job_id)
    except slurmcli.SlurmError as exc:
        return f"scontrol requeue {job.job_id}: {exc}"
    return None


def engine_died(ctx: Any, why: str) -> None:
    """Save what the dead engine would lose, then requeue this job (once; later calls do nothing).

    ``ctx`` is a `ModelContext` (``server.context``). Runs on the event loop's thread and blocks it, like
    the preemption hooks it runs: the trainer's ranks are other processes and save meanwhile. A job with
    several models has one engine for all of them: the first model to notice saves every model (the
    preemption hooks) and requeues; the others only stop."""
    if ctx.engine_lost is not None or ctx.failed:
        return
    ctx.engine_lost = why
    if ctx.job.engine_lost is not None:  # another model of the job saved and requeued
        return
    ctx.job.engine_lost = why
    log.error("the engine died (%s): checkpointing the trainer, then requeueing the job", why)
    if not preemption.checkpoint(f"the engine died ({why})", preemption.save_budget_s()):
        log.warning("a save was already taken in this job: the requeued job resumes from it")
    error = requeue_own_job()
    if error is not None:
        ctx.fail(f"the engine died ({why}) and the job could not requeue itself ({error})")
        return
    log.info("job requeued: it comes back with a fresh engine and resumes from the checkpoint")


async def watch(ctx: Any, training: asyncio.Task | None, poll_s: float = POLL_S) -> None:
    """Check the engine every ``poll_s``; on its death stop training, save and requeue (``engine_died``)."""
    while not ctx.failed and ctx.engine_lost is None:
        await asyncio.sleep(poll_s)
        why = engine_failure(ctx.engine)
        if why is None:
            continue
        engine_died(ctx, why)
        if training is not None:  # the ranks were asked to stop: no restart of them on the way down
            training.cancel()
        return
