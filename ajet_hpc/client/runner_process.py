"""The process of one client array task's runner: it builds the task's worker (a training group's
``runner.GroupTask``, an eval group's ``eval_runner.EvalGroupTask``), runs it to its end, and says how it
ended by its exit code (``array_task.EXIT_*``), which the task's supervisor reads.

On SIGTERM (a cancel, or a hot swap of the group) the worker begins no new episode, aborts its open ones
with a reason, closes its store and the process exits; before the first episode it leaves at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

from ajet_hpc.client.array_task import EXIT_SERVER_GONE, EXIT_STORE_FAILED, pick_group, resolve_index
from ajet_hpc.client.runner import GroupTask, group_task
from ajet_hpc.client.session import ClientStopping
from ajet_hpc.config import ClientGroupConfig, Topology
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.slurm import environment
from ajet_hpc.storage import task_ends
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)

WorkerFactory = Callable[[RunDir, Topology, ClientGroupConfig, int], GroupTask]


def _stop_on_sigterm(worker: GroupTask) -> Callable[[], None]:
    """SIGTERM drains the worker (in a thread: the handler must not block); before the first episode it
    leaves at once. Returns what puts the previous handler back. (submitit's own handler ignores SIGTERM.)"""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handle(signum: int, frame: object) -> None:
        reason = f"client task {worker.group.name}[{worker.index}] stopped by {signal.Signals(signum).name}"
        if worker.stopping.is_set():
            return
        worker.stopping.set()
        if not worker.started.is_set():
            raise ClientStopping(reason)
        threading.Thread(target=worker.stop, args=(reason,), name="drain", daemon=True).start()

    previous = signal.signal(signal.SIGTERM, handle)

    def restore() -> None:
        signal.signal(signal.SIGTERM, previous)

    return restore


def run_client(
    run_dir: str | os.PathLike[str],
    group_name: str,
    index: int | None = None,
    make_worker: WorkerFactory = group_task,
) -> int:
    """Run array task ``index`` of a group to its end; ``make_worker`` builds its worker (an eval group's
    is ``client.eval_runner.EvalGroupTask``)."""
    setup_logging()
    run = RunDir.at(run_dir)
    topology = run.load_topology()
    group = pick_group(topology, group_name)
    index = resolve_index(index)
    if not 0 <= index < group.array:
        raise SystemExit(f"client index {index} is outside group {group.name!r} (array of {group.array})")
    job = environment.current()
    log.info(
        "client %s[%d] (job %s, pid %d) on node %s", group.name, index, job.job_id, os.getpid(), job.node
    )
    try:
        worker = make_worker(run, topology, group, index)
    except (OSError, StoreError) as exc:  # a full disk or quota, a live writer elsewhere: nothing ran yet
        log.error(
            "client %s[%d] stops (exit %d) before any episode: its store cannot be opened: %s. Free space "
            "(or stop the other writer); a restart or requeue resumes from the last commit",
            group.name,
            index,
            EXIT_STORE_FAILED,
            exc,
        )
        return EXIT_STORE_FAILED
    restore_handler = _stop_on_sigterm(worker)
    try:
        tally = worker.run()
    except ClientStopping as exc:
        log.info("stopping before any episode: %s", exc)
        tally = worker.tally
    finally:
        restore_handler()
        worker.store.close()
    if worker.store_failed is not None:
        log.error(
            "client %s[%d] stops (exit %d): its store could not record a result: %s. Free space (or stop the "
            "other writer); a restart or requeue resumes from the last commit",
            group.name,
            index,
            EXIT_STORE_FAILED,
            worker.store_failed,
        )
        return EXIT_STORE_FAILED
    if worker.gone is not None:
        log.error("client %s[%d] stops: %s", group.name, index, worker.gone)
        return EXIT_SERVER_GONE
    if not (worker.finished.is_set() or worker.stopping.is_set()):  # its tasks are used up
        task_ends.mark_end(run, group, index, task_ends.EXHAUSTED, f"{tally.finished} episodes finished")
    mean = sum(tally.rewards) / len(tally.rewards) if tally.rewards else float("nan")
    log.info(
        "client %s[%d] done: %d episodes finished (mean reward %.3f), %d aborted, %d committed from the "
        "servers' records",
        group.name,
        index,
        tally.finished,
        mean,
        tally.aborted,
        tally.recovered,
    )
    return 0
