"""``ajet-hpc COMMAND ...``: one console command for the tools a user runs by hand.

Each command is one of the ``python -m ajet_hpc.<tool>`` forms, which stay (the sbatch scripts and the
docs use them): ``ajet-hpc launch CONFIG`` is ``python -m ajet_hpc.launch CONFIG``, and so on. A command's
module is imported only when it runs, so ``ajet-hpc status`` starts without loading torch or vLLM.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Command:
    module: str  # holds ``main(argv, prog)``
    summary: str


COMMANDS: dict[str, Command] = {
    "launch": Command(
        "ajet_hpc.launch.cli", "validate a topology, write the run directory, submit (or resume)"
    ),
    "status": Command("ajet_hpc.status", "the jobs of a run, their states, servers and log paths"),
    "logs": Command("ajet_hpc.logs", "print (or follow, -f) the logs of a run's jobs"),
    "cancel": Command("ajet_hpc.cancel", "stop every job of a run"),
    "inspect": Command("ajet_hpc.offline.cli", "read a run offline: steps, episodes, conversations, exports"),
    "export": Command(
        "ajet_hpc.offline.model_export", "a trained model (or LoRA adapter) as a Hugging Face folder"
    ),
    "eval": Command("ajet_hpc.offline.evaluate", "evaluate a saved checkpoint on a group's held-out tasks"),
    "study": Command("ajet_hpc.study.cli", "many runs over a search space, supervised; status and report"),
}
PROG = "ajet-hpc"


def build_parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<9} {command.summary}" for name, command in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.split("\n\n")[0],
        epilog=f"commands:\n{listing}\n\n`{PROG} COMMAND --help` shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument(
        "command", choices=sorted(COMMANDS), metavar="COMMAND", help="one of the commands below"
    )
    parser.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(argv[:1])  # the command alone: its options are its own parser's
    command = COMMANDS[args.command]
    run = importlib.import_module(command.module).main
    try:
        return int(run(argv[1:], prog=f"{PROG} {args.command}") or 0)
    except SystemExit as exc:  # argparse's --help (0) and usage errors (2), as the exit status
        return exc.code if isinstance(exc.code, int) else 1


def _version() -> str:
    try:
        return metadata.version("ajet_hpc")
    except metadata.PackageNotFoundError:
        return "(not installed)"


if __name__ == "__main__":
    raise SystemExit(main())
