"""``python -m ajet_hpc.server RUN --name SERVER``: run one server of a run (sbatch/ scripts call this)."""

from __future__ import annotations

import argparse
import signal

from ajet_hpc.server import preemption
from ajet_hpc.server.process import serve


def _checkpoint_then_stop(signum, frame) -> None:
    """SIGUSR2 outside submitit (sbatch/server.sbatch forwards Slurm's checkpoint signal): save the
    trainer's state (``preemption``), then stop as on SIGTERM (which saves no second time); the batch
    script requeues the job."""
    preemption.on_user_signal()
    signal.raise_signal(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ajet_hpc.server", description=__doc__)
    parser.add_argument("run_dir", help="the run directory (written by python -m ajet_hpc.launch)")
    parser.add_argument("--name", help="server name from the topology (default: the only server)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGUSR2, _checkpoint_then_stop)
    signal.signal(signal.SIGTERM, preemption.handle_term_while_starting)  # uvicorn's while it serves
    return serve(args.run_dir, args.name)


if __name__ == "__main__":
    raise SystemExit(main())
