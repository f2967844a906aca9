"""The callables that submitit pickles and runs in each job.

They are checkpointable: on Slurm's pre-timeout or preemption signal (USR2), submitit calls
``checkpoint`` and requeues the job, which then calls the same callable again; the server and client
resume from the run directory. A server also saves on SIGTERM and before its time limit
(`ajet_hpc.server.preemption`). A job that ends for good without success (a server whose watchdog gave up,
a client task whose servers failed) raises, so that Slurm marks it FAILED and nothing requeues it.
"""

from __future__ import annotations

from typing import Any

import submitit


class JobFailed(RuntimeError):
    """A job that ended for good without success; the message says where to look."""


class ServerJob(submitit.helpers.Checkpointable):
    def __init__(self, run_dir: str, name: str) -> None:
        self.run_dir, self.name = run_dir, name

    def __call__(self) -> int:
        import signal

        from ajet_hpc.launch import keeper_start
        from ajet_hpc.server import preemption
        from ajet_hpc.server.process import serve

        # submitit's own handler ignores SIGTERM, the only signal of a preemption on many clusters: ours
        # saves (``preemption``) and stops; uvicorn's, which saves first, replaces it while the server serves
        signal.signal(signal.SIGTERM, preemption.handle_term_while_starting)
        code = serve(self.run_dir, self.name, beside=keeper_start.start)  # the keeper of its client arrays
        if code:
            raise JobFailed(f"server {self.name} failed (exit code {code}): see its rendezvous and log")
        return code

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """USR2: save the trainer's state and flush the episode store (once), then let submitit requeue us."""
        from ajet_hpc.server import preemption

        preemption.on_user_signal()
        return super().checkpoint(*args, **kwargs)


class ClientJob(submitit.helpers.Checkpointable):
    def __init__(self, run_dir: str, group: str) -> None:
        self.run_dir, self.group = run_dir, group

    def __call__(self, index: int) -> int:
        """Run the array task's runner under its supervisor, which restarts it when it dies."""
        from ajet_hpc.client.task_supervisor import describe_exit, run_supervised

        code = run_supervised(self.run_dir, self.group, index)
        if code:
            raise JobFailed(f"client task {self.group}[{index}] stopped: {describe_exit(code)} (see its log)")
        return code
