"""``python -m ajet_hpc.inspect RUN <command> ...``"""

from ajet_hpc.inspect.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
