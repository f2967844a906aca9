"""``python -m ajet_hpc.status RUN``: the jobs of a run, their states, servers and log paths."""

from __future__ import annotations

import argparse
import sys

from ajet_hpc.launch.control import status_report
from ajet_hpc.slurm.slurmcli import SlurmError
from ajet_hpc.storage.rundir import RunDir, RunDirError


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.status") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        print(status_report(RunDir.at(args.run_dir)))
    except (RunDirError, SlurmError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
