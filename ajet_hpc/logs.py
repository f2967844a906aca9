"""``python -m ajet_hpc.logs RUN [JOB] [-n LINES] [-f]``: print (or follow) the logs of a run's jobs.

JOB selects by job name (server-policy), server or group name (policy), job id, or task id (123_2).
"""

from __future__ import annotations

import argparse
import sys

from ajet_hpc.launch.control import find_logs, follow, tail
from ajet_hpc.storage.rundir import RunDir, RunDirError


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.logs") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("job", nargs="?", help="job name, target name, job id or task id (default: all)")
    parser.add_argument("-n", "--lines", type=int, default=40, help="lines of each log to print (default 40)")
    parser.add_argument("-f", "--follow", action="store_true", help="keep printing what is appended")
    args = parser.parse_args(argv)
    try:
        run = RunDir.at(args.run_dir)
    except RunDirError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    paths = find_logs(run, args.job)
    if not paths:
        what = f"job {args.job!r}" if args.job else "this run"
        print(f"error: no logs for {what} yet (see python -m ajet_hpc.status {run.root})", file=sys.stderr)
        return 2
    for path in paths:
        print(f"==> {path.relative_to(run.root)} <==")
        print(tail(path, args.lines))
    if args.follow:
        try:
            for _ in follow(paths, sys.stdout):
                pass
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
