"""vLLM's own processes and the job's signals: they must outlive Slurm's signals until the server stops them.

Slurm signals every process of a job. `shield_from_job_signals` runs in vLLM's engine core and worker
processes (through our vLLM plugin, ``weight_transfer.register``); `VllmEngine` (``vllm_engine``) names the
file that lets SIGTERM through (``STOPPING_VAR``) and creates it when it stops the engine.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading

log = logging.getLogger(__name__)

STOPPING_VAR = "AJET_ENGINE_STOPPING_FILE"
"""A file that exists once the server stops its engine: until then vLLM's processes ignore SIGTERM."""


def shield_from_job_signals() -> None:
    """In vLLM's engine core and worker processes (our vLLM plugin calls it there): survive the job's signals.

    Slurm signals every process of a job: USR2 (its checkpoint signal, whose default action kills) and
    SIGTERM (preemption, cancel, time limit), on which vLLM's processes shut down at once: requests in
    flight would fail while the server saves its checkpoint. The server stops its engine itself
    (`VllmEngine.stop`). So USR2 is ignored, and SIGTERM reaches vLLM's own handler only once the server
    has created its ``STOPPING_VAR`` file, just before vLLM's shutdown sends its SIGTERM. vLLM installs
    its handlers before it loads plugins, so this wraps them. Does nothing in any other process."""
    stopping = os.environ.get(STOPPING_VAR)
    if stopping is None or multiprocessing.parent_process() is None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum, frame) -> None:
        if not os.path.exists(stopping):
            log.info("vLLM process %d: ignoring SIGTERM (the server stops its engine itself)", os.getpid())
            return
        if callable(previous):
            previous(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_term)
