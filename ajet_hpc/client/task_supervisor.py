"""The client array task's watchdog: runs the runner in a child process and starts it again when it dies.

A runner that ends by itself is done: it finished its tasks, its servers finished, or they failed or stayed
away (``EXIT_SERVER_GONE``; not restarted: the array task ends with that message and frees its allocation).
A runner that dies any other way (SIGKILL, the OOM killer, a crash in native code, an uncaught error) is
started again in the same allocation, up to ``clients[].max_restarts`` times per start of the array task; it
resumes from its store like after a preemption (committed results are not run again). After that the
array task writes its end marker as ``failed`` (so that a server does not wait for its episodes) and fails.

Signals: SIGTERM (a cancel, a requeue, the end of a hot swap) is passed on to the runner, which drains and
exits; the supervisor then does not restart it. The runner ignores Slurm's checkpoint signal (USR2): the
supervisor's process handles it (submitit requeues the job), and SIGTERM follows.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ajet_hpc.client.array_task import EXIT_SERVER_GONE, pick_group, resolve_index
from ajet_hpc.config import ClientGroupConfig
from ajet_hpc.storage import task_ends
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)

EXIT_GAVE_UP = 4
"""The supervisor gave up after ``clients[].max_restarts`` restarts of a runner that kept dying."""
RESTART_DELAY_S = 2.0


def describe_exit(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def runner_command(run: RunDir, group: str, index: int, python: str = sys.executable) -> list[str]:
    """The runner alone, in a process of its own (``--once``: no supervisor in it)."""
    module = [python, "-u", "-m", "ajet_hpc.client", str(run.root)]
    return [*module, "--group", group, "--index", str(index), "--once"]


def _ignore_checkpoint_signal() -> None:
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def supervise(
    run: RunDir,
    group: ClientGroupConfig,
    index: int,
    command: list[str] | None = None,
    delay_s: float = RESTART_DELAY_S,
) -> int:
    """Run array task ``index`` of ``group`` to its end, restarting its runner when it dies; returns the
    exit code for the array task (0: done; ``EXIT_SERVER_GONE``; ``EXIT_GAVE_UP``)."""
    command = command or runner_command(run, group.name, index)
    stopping = threading.Event()
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    restore = _handle(signal.SIGTERM, forward)
    restarts = 0
    try:
        while True:
            child = subprocess.Popen(command, preexec_fn=_ignore_checkpoint_signal)
            code = child.wait()
            if code in (0, EXIT_SERVER_GONE):
                return code
            if stopping.is_set():  # stopped on purpose (cancel, requeue): not a death to restart from
                log.info("runner of %s[%d] stopped by a signal (%s)", group.name, index, describe_exit(code))
                return 0
            why = describe_exit(code)
            if restarts >= group.max_restarts:
                detail = (
                    f"runner of {group.name}[{index}] died {restarts + 1} time(s) "
                    f"(clients[].max_restarts={group.max_restarts}); last: {why}"
                )
                log.error("giving up: %s", detail)
                task_ends.mark_end(run, group, index, task_ends.FAILED, detail)
                return EXIT_GAVE_UP
            restarts += 1
            log.warning(
                "runner of %s[%d] (pid %d) died (%s); restarting it (restart %d of %d): it resumes from "
                "its store",
                group.name,
                index,
                child.pid,
                why,
                restarts,
                group.max_restarts,
            )
            if stopping.wait(delay_s):
                return 0
    finally:
        restore()


def _handle(signum: int, handler: Callable[[int, object], None]) -> Callable[[], None]:
    """Install ``handler`` for ``signum`` (main thread only); returns what puts the previous one back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signum, handler)

    def restore() -> None:
        signal.signal(signum, previous)

    return restore


def run_supervised(run_dir: str | os.PathLike[str], group_name: str, index: int | None = None) -> int:
    """Entry point of a client array task (``ClientJob``, ``python -m ajet_hpc.client``)."""
    from ajet_hpc.logging_setup import setup_logging

    setup_logging()
    run = RunDir.at(run_dir)
    group = pick_group(run.load_topology(), group_name)
    index = resolve_index(index)
    if not 0 <= index < group.array:
        raise SystemExit(f"client index {index} is outside group {group.name!r} (array of {group.array})")
    started = time.monotonic()
    code = supervise(run, group, index)
    log.info(
        "client task %s[%d] ends after %.0f s: %s",
        group.name,
        index,
        time.monotonic() - started,
        _meaning(code),
    )
    return code


def _meaning(code: int) -> str:
    return {
        0: "done",
        EXIT_SERVER_GONE: "a server failed or stayed away (see the runner's message above)",
        EXIT_GAVE_UP: "its runner kept dying (clients[].max_restarts)",
    }.get(code, describe_exit(code))
