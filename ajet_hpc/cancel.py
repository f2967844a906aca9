"""``python -m ajet_hpc.cancel RUN``: stop every job of a run (scancel on Slurm, SIGTERM locally)."""

from __future__ import annotations

import argparse
import sys

from ajet_hpc.launch.control import cancel_run
from ajet_hpc.slurm.slurmcli import SlurmError
from ajet_hpc.storage.rundir import RunDir, RunDirError


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.cancel") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        for line in cancel_run(RunDir.at(args.run_dir)):
            print(line)
    except (RunDirError, SlurmError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
