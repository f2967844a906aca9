"""Foreground supervision of a local run: progress while it runs, a clean stop when it is done.

The run is done when every client task has finished; the servers are then asked to stop (SIGTERM, which
the server handles like a Slurm cancel). Ctrl-C stops everything. A run without clients is supervised
until Ctrl-C.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ajet_hpc.launch.backends import Backend, LocalBackend
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.metrics import read_eval_rows, read_rows

log = logging.getLogger(__name__)


def supervise(run: RunDir, backend: Backend, submitted: list[SubmittedJob], poll_s: float = 1.0) -> int:
    if not isinstance(backend, LocalBackend):
        return 0
    handles = backend.handles
    servers = [h for job in submitted if job.name.startswith("server-") for h in handles.get(job.name, [])]
    clients = [h for job in submitted if job.name.startswith("clients-") for h in handles.get(job.name, [])]
    print(f"supervising {len(servers)} server(s) and {len(clients)} client task(s); Ctrl-C stops the run")
    reported = -1
    progress = MetricsTail(run.metrics_file)
    try:
        while True:
            for row in progress.new_rows():
                print(format_row(row), flush=True)
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
    table = reward_table(read_rows(run.metrics_file))
    if table:
        print(table)
    evals = eval_table(read_eval_rows(run.metrics_file))
    if evals:
        print(evals)
    print(f"run finished; everything is in {run.root}")
    return 0


class MetricsTail:
    """The metrics rows appended since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, 0

    def new_rows(self) -> list[dict]:
        rows = read_rows(self.path)
        fresh, self.seen = rows[self.seen :], len(rows)
        return fresh


def format_row(row: dict) -> str:
    return (
        f"  [{row.get('model')}] step {row.get('step'):>4}  reward {row.get('reward_mean', 0):.3f}"
        f" ± {row.get('reward_std', 0):.3f}  loss {row.get('loss') or 0:+.4f}"
        f"  {row.get('step_time_s', 0):.1f}s"
    )


def reward_table(rows: list[dict]) -> str:
    """Reward per step, one line each, with a bar: the curve a run drew."""
    if not rows:
        return ""
    lines = ["", "model       step  reward_mean  reward_std", "-" * 60]
    for row in sorted(rows, key=lambda r: (str(r.get("model", "")), r["step"])):  # one block per model
        mean = row.get("reward_mean") or 0.0
        bar = "#" * round(max(0.0, min(1.0, mean)) * 30)
        lines.append(
            f"{row.get('model', ''):<10} {row['step']:>5}  {mean:11.3f}  {row.get('reward_std', 0):10.3f}"
            f"  {bar}"
        )
    return "\n".join(lines)


def eval_table(rows: list[dict]) -> str:
    """The eval rounds: mean reward and pass@1 at each evaluated step, per model and eval group."""
    if not rows:
        return ""
    lines = ["", "model      eval group        step  reward  pass@1", "-" * 60]
    for row in sorted(rows, key=lambda r: (str(r.get("model")), str(r.get("eval")), r["step"])):
        mean, p1 = row.get("eval_reward_mean"), row.get("eval_pass@1")
        lines.append(
            f"{row.get('model', ''):<10} {row['eval']:<16} {row['step']:>5}  "
            f"{'-' if mean is None else f'{mean:6.3f}'}  {'-' if p1 is None else f'{p1:6.3f}'}"
            f"{'' if row.get('eval_complete', True) else '  (incomplete)'}"
        )
    best = {(r.get("model"), r["eval"]): r.get("eval_best_step") for r in rows}
    lines += [f"best eval step of {m} / {g}: {step}" for (m, g), step in best.items()]
    return "\n".join(lines)


def _stop(handles: list, grace_s: float = 45.0) -> None:
    """SIGTERM each job (its controller forwards it to the task), then kill what is left, children too."""
    for handle in handles:
        if not handle.done():
            handle._process.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not all(h.done() for h in handles):
        time.sleep(0.2)
    for handle in handles:
        if not handle.done():
            log.warning(
                "job %s did not stop within %.0fs: killing it and its children", handle.job_id, grace_s
            )
            kill_tree(handle._process.pid)


def _exit_failed(handle) -> bool:
    try:
        handle.result()
    except Exception:  # submitit re-raises the job's exception, or reports a failed or killed job
        return True
    return False
