"""What a server process does when its job is going down: checkpoint once, then stop, and requeue if it must.

Three things end a server's allocation early, and all take the same save (the hooks registered here: the
trainer checkpoints its current step, the episode store is flushed):

- **USR2**, Slurm's checkpoint signal (``--signal=USR2@signal_delay_s``: the time limit is near, or a
  preemption on a cluster with ``preempt_send_user_signal``). submitit catches it and calls
  `ajet_hpc.launch.jobs.ServerJob.checkpoint` (outside submitit, ``python -m ajet_hpc.server`` does the same
  and ``sbatch/server.sbatch`` requeues); the budget is ``signal_delay_s`` minus a margin for the requeue.
- **SIGTERM**, the only signal many clusters send on preemption (and every cluster on ``scancel`` or at the
  time limit). The save gets two thirds of ``cluster.kill_wait_s`` (the rest is for stopping), then the
  server stops cleanly. It requeues its own job only when Slurm preempted it in this start: with a
  partition ``GraceTime``, a job that ends by itself within the grace time is COMPLETED and never requeued
  (seen on the dev cluster), and a ``scancel`` must stay a cancel.
- **The deadline** (`ajet_hpc.server.deadline`): ``signal_delay_s`` before the job's end time the server
  saves, requeues its job and stops on its own, whether or not a signal comes.

The save runs once per process: a signal that arrives while it runs, or after it (USR2 then SIGTERM,
the deadline then Slurm's signal), only stops the server. Hooks run on the main thread, in the signal
handler, and block the event loop meanwhile, which is what we want while the job is going down: nothing
trains or serves while the ranks save. A save that does not finish in time leaves the previous checkpoint
trusted (the trainer names a checkpoint in ``trainer_state.json`` only once every rank has written it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime

from ajet_hpc.slurm import slurmcli

log = logging.getLogger(__name__)

REQUEUE_MARGIN_S = 20.0
"""Of the user signal's ``signal_delay_s``: kept for the requeue and the stop after the save."""


@dataclass(frozen=True)
class Budgets:
    """How long a save may take, by what started it (seconds)."""

    user_signal_s: float = 100.0  # USR2 or the deadline: signal_delay_s - REQUEUE_MARGIN_S
    term_s: float = 20.0  # SIGTERM: two thirds of cluster.kill_wait_s

    @classmethod
    def of(cls, signal_delay_s: float, kill_wait_s: float) -> Budgets:
        return cls(
            user_signal_s=max(10.0, signal_delay_s - REQUEUE_MARGIN_S),
            term_s=max(1.0, kill_wait_s * 2 / 3),
        )


_hooks: list[Callable[[float], None]] = []
_budgets = Budgets()
_job_id: str | None = os.environ.get("SLURM_JOB_ID")
_saved = False  # a save started in this process (it runs once)
_requeue_by_caller = False  # USR2 came: submitit or the batch script requeues the job
_deadline: str | None = None  # set by the deadline thread just before it signals the main thread
_over: str | None = None  # the server's work is over (training complete, or failed): never requeue


def configure(budgets: Budgets, job_id: str | None) -> None:
    """The server's budgets and its Slurm job id (None outside Slurm: never requeue)."""
    global _budgets, _job_id
    _budgets, _job_id = budgets, job_id


def work_over(why: str) -> None:
    """The server's work is over (training complete, or the watchdog gave up): a SIGTERM from now on (a
    preemption while it shuts down, the time limit) stops it without requeueing its job, which would only
    start again to find nothing to do, or a failure that must not be retried."""
    global _over
    _over = why


def save_budget_s() -> float:
    """How long a save started by the server itself (its deadline, a dead engine) may take."""
    return _budgets.user_signal_s


def on_signal(hook: Callable[[float], None]) -> Callable[[], None]:
    """Run ``hook(budget_s)`` at the save; returns the function that unregisters it."""
    _hooks.append(hook)
    return lambda: _hooks.remove(hook) if hook in _hooks else None


DEFERRED_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
"""Signals that end the job; one that arrives while the save runs is handled once it is over."""


def checkpoint(reason: str, budget_s: float) -> bool:
    """Run the hooks, once per process; returns False (and saves nothing) when a save already started.

    While the hooks run, USR2 and SIGTERM are held back (`_signals_held`): their handlers run once the save
    is over. Otherwise one arriving mid-save runs nested in it, on the same thread: submitit's USR2 handler
    requeues and raises ``SystemExit``, which would cut the save short (seen on the dev cluster when the
    deadline's save met Slurm's preemption signal). Errors are logged, not raised: the stop and the
    requeue must still happen."""
    global _saved
    if _saved:
        log.info("%s: the checkpoint was already taken (or is being taken); not again", reason)
        return False
    _saved = True
    log.info("%s: checkpointing (at most %.0f s)", reason, budget_s)
    with _signals_held():
        for hook in list(_hooks):
            try:
                hook(budget_s)
            except Exception:
                log.exception("checkpoint on %s: %s failed", reason, getattr(hook, "__name__", hook))
    return True


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Record USR2 and SIGTERM instead of handling them while inside; afterwards put their handlers back
    and call them for each one that came, in order. Outside the main thread (where handlers cannot be
    changed) nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: arrived.append(signum)) for sig in DEFERRED_SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(arrived):
            handler = previous[signal.Signals(signum)]
            log.info("%s came during the save: handled now", signal.Signals(signum).name)
            if callable(handler):
                handler(signum, None)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)


def on_user_signal() -> None:
    """USR2 (submitit's ``checkpoint``, or ``python -m ajet_hpc.server``): save; the caller requeues."""
    global _requeue_by_caller
    _requeue_by_caller = True
    checkpoint("USR2", _budgets.user_signal_s)


def on_term() -> None:
    """SIGTERM, from Slurm or from the deadline (`signal_deadline`): save, and requeue when it must (see the
    module doc). The caller stops the server afterwards."""
    global _deadline
    deadline, _deadline = _deadline, None
    if deadline is not None:  # not after another save: the job is going down for another reason
        if checkpoint(deadline, _budgets.user_signal_s):
            _requeue("the time limit is near")
        return
    checkpoint("SIGTERM", _budgets.term_s)
    if _requeue_by_caller or _job_id is None:
        return
    if _over is not None:
        log.info("SIGTERM: %s; not requeueing", _over)
        return
    try:
        record = slurmcli.job_record(_job_id)
    except slurmcli.SlurmError as error:
        log.warning("SIGTERM: cannot tell a preemption from a cancel (%s); not requeueing", error)
        return
    if preempted(record):
        _requeue("Slurm preempted the job")
    else:
        log.info("SIGTERM: not a preemption (job state %s); not requeueing", record.get("JobState"))


def signal_deadline(reason: str) -> None:
    """From the deadline thread: run `on_term`'s deadline path on the main thread (where the hooks must run:
    they block the event loop) by sending SIGTERM to it."""
    global _deadline
    _deadline = reason
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)  # type: ignore[arg-type]


def handle_term_while_starting(signum, frame) -> None:
    """SIGTERM before the server serves (engine loading, ranks starting): nothing to save yet; requeue if
    preempted (see `on_term`), then exit."""
    on_term()
    raise SystemExit(0)


def preempted(record: Mapping[str, str]) -> bool:
    """Whether ``scontrol show job`` says Slurm preempted the job in its current start: a PreemptTime not
    before its StartTime (Slurm may keep the one of an earlier start), and not cancelled meanwhile."""
    preempt, start = _when(record.get("PreemptTime")), _when(record.get("StartTime"))
    if preempt is None or record.get("JobState", "").startswith("CANCELLED"):
        return False
    return start is None or preempt >= start


def _when(text: str | None) -> datetime | None:
    if not text or text in ("None", "Unknown", "N/A"):
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        return None


def _requeue(why: str) -> None:
    global _requeue_by_caller
    if _job_id is None or _requeue_by_caller or _over is not None:
        return
    _requeue_by_caller = True
    try:
        slurmcli.requeue(_job_id)
        log.info("requeued job %s: %s", _job_id, why)
    except slurmcli.SlurmError as error:  # e.g. Slurm requeued it already (no GraceTime)
        log.warning("could not requeue job %s (%s): %s", _job_id, why, error)


def reset() -> None:
    """Forget that a save ran (a new start in the same process: tests)."""
    global _saved, _requeue_by_caller, _deadline, _over
    _saved, _requeue_by_caller, _deadline, _over = False, False, None, None
