"""``python -m ajet_hpc.launch``: see ajet_hpc.launch.cli."""

from ajet_hpc.launch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
