"""``python -m ajet_hpc.client RUN --group GROUP [--index I]``: run one client task of a run.

Without --index the task index comes from SLURM_ARRAY_TASK_ID (array jobs) or SLURM_PROCID (hetjobs).
The runner runs in a child process that is started again when it dies (``supervisor``); ``--once`` runs it
in this process, without restarts.
"""

from __future__ import annotations

import argparse

from ajet_hpc.client.task_supervisor import run_supervised


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ajet_hpc.client", description=__doc__)
    parser.add_argument("run_dir", help="the run directory (written by python -m ajet_hpc.launch)")
    parser.add_argument("--group", required=True, help="client group name from the topology")
    parser.add_argument("--index", type=int, default=None, help="task index within the group")
    parser.add_argument(
        "--once", action="store_true", help="run the runner in this process, not restarted when it dies"
    )
    args = parser.parse_args(argv)
    if args.once:  # the runner's imports (HDF5, numpy, HTTP) where it runs, not in its supervisor
        from ajet_hpc.client.eval_runner import make_worker
        from ajet_hpc.client.runner_process import run_client

        return run_client(args.run_dir, args.group, args.index, make_worker)
    return run_supervised(args.run_dir, args.group, args.index)


if __name__ == "__main__":
    raise SystemExit(main())
