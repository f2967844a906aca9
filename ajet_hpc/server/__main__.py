"""``python -m ajet_hpc.server RUN --name SERVER``: run one server of a run (sbatch/ scripts call this)."""

from __future__ import annotations

import argparse

from ajet_hpc.server.process import serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ajet_hpc.server", description=__doc__)
    parser.add_argument("run_dir", help="the run directory (written by python -m ajet_hpc.launch)")
    parser.add_argument("--name", help="server name from the topology (default: the only server)")
    args = parser.parse_args(argv)
    return serve(args.run_dir, args.name)


if __name__ == "__main__":
    raise SystemExit(main())
