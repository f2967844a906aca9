"""Foreground supervision of a local run: progress while it runs, a clean stop when it is done.

The run is done when every client task has finished; the servers are then asked to stop (SIGTERM, which
the server handles like a Slurm cancel). Ctrl-C stops everything. A run without clients is supervised
until Ctrl-C.
"""

from __future__ import annotations

import logging
import time

from ajet_hpc.launch.backends import Backend, LocalBackend
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)


def supervise(run: RunDir, backend: Backend, submitted: list[SubmittedJob], poll_s: float = 1.0) -> int:
    if not isinstance(backend, LocalBackend):
        return 0
    handles = backend.handles
    servers = [h for job in submitted if job.name.startswith("server-") for h in handles.get(job.name, [])]
    clients = [h for job in submitted if job.name.startswith("clients-") for h in handles.get(job.name, [])]
    print(f"supervising {len(servers)} server(s) and {len(clients)} client task(s); Ctrl-C stops the run")
    reported = -1
    try:
        while True:
            finished = sum(1 for h in clients if h.done())
            if finished != reported:
                print(f"  clients finished: {finished}/{len(clients)}", flush=True)
                reported = finished
            if clients and finished == len(clients):
                break
            if servers and all(h.done() for h in servers):
                print("  every server has stopped")
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping every job of the run")
    _stop(servers + clients)
    failed = [h.job_id for h in clients + servers if _exit_failed(h)]
    if failed:
        print(f"some jobs failed ({', '.join(failed)}); see python -m ajet_hpc.logs {run.root}")
        return 1
    print(f"run finished; everything is in {run.root}")
    return 0


def _stop(handles: list, grace_s: float = 20.0) -> None:
    for handle in handles:
        if not handle.done():
            handle._process.terminate()  # the submitit controller forwards SIGTERM to its task
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(h.done() for h in handles):
        time.sleep(0.2)
    for handle in handles:
        if not handle.done():
            log.warning("job %s did not stop within %.0fs: killing it", handle.job_id, grace_s)
            handle._process.kill()


def _exit_failed(handle) -> bool:
    try:
        handle.result()
    except Exception:  # submitit re-raises the job's exception, or reports a failed or killed job
        return True
    return False
