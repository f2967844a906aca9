"""``python -m ajet_hpc.offline RUN <command> ...``"""

from ajet_hpc.offline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
