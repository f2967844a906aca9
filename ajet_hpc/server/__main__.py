"""``python -m ajet_hpc.server RUN --name SERVER``: run one server of a run, alone.

A server job runs ``python -m ajet_hpc.launch.server_job`` (hetjobs, ``sbatch/server.sbatch``) or submitit's
``ServerJob``: the same ``main``, with the keeper of the server's client arrays beside it on Slurm.
"""

from __future__ import annotations

import argparse
import signal

from ajet_hpc.server import preemption
from ajet_hpc.server.process import StartBeside, serve


def _checkpoint_then_stop(signum, frame) -> None:
    """SIGUSR2 outside submitit (sbatch/server.sbatch forwards Slurm's checkpoint signal): save the
    trainer's state (``preemption``), then stop as on SIGTERM (which saves no second time); the batch
    script requeues the job."""
    preemption.on_user_signal()
    signal.raise_signal(signal.SIGTERM)


def main(
    argv: list[str] | None = None,
    beside: StartBeside | None = None,
    prog: str = "python -m ajet_hpc.server",
    description: str = __doc__.split("\n\n")[0],
) -> int:
    """Parse ``RUN [--name SERVER]``, take Slurm's signals, serve; ``beside``: see ``process.StartBeside``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("run_dir", help="the run directory (written by python -m ajet_hpc.launch)")
    parser.add_argument("--name", help="server name from the topology (default: the only server)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGUSR2, _checkpoint_then_stop)
    signal.signal(signal.SIGTERM, preemption.handle_term_while_starting)  # uvicorn's while it serves
    return serve(args.run_dir, args.name, beside)


if __name__ == "__main__":
    raise SystemExit(main())
