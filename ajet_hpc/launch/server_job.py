"""``python -m ajet_hpc.launch.server_job RUN [--name SERVER]``: a server job's process outside submitit.

Hetjob components and ``sbatch/server.sbatch`` run it: ``python -m ajet_hpc.server`` (the same arguments
and signals) with, on Slurm, the keeper of the server's client arrays beside the server
(``keeper_start.start``), as submitit's ``jobs.ServerJob`` runs it. The keeper's start is here, in the
launch layer, because the keeper submits jobs; the server only calls what it is handed.
"""

from __future__ import annotations

from ajet_hpc.launch import keeper_start
from ajet_hpc.server.__main__ import main as serve_main


def main(argv: list[str] | None = None) -> int:
    return serve_main(
        argv,
        beside=keeper_start.start,
        prog="python -m ajet_hpc.launch.server_job",
        description=__doc__.split("\n\n")[0],
    )


if __name__ == "__main__":
    raise SystemExit(main())
