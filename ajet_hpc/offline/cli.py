"""``python -m ajet_hpc.offline RUN <command>``: look into a run offline, also while it is being written.

commands:
  summary    steps, episodes by state, tasks, reward by step, merge ratio, drift, failures
  episodes   a table of episodes, filtered (--step, --task, --group, --state, --min/--max-reward, --limit)
  show       one episode's conversation: messages, tokens by author and loss mask, rewards, timings, drift
  export     episodes or samples (model calls) to JSON Lines or Parquet
  plot       a PNG of reward, episode length, tokens and time per step

Bad input (no such run, model or episode, nothing recorded yet, a store of an older layout) is reported in
one line on stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.offline.conversation import ShowOptions, show_text
from ajet_hpc.offline.export import FORMATS, PER, export
from ajet_hpc.offline.plot import plot
from ajet_hpc.offline.run import InspectError, ModelRun, Run, load_tokenizer
from ajet_hpc.offline.views import EpisodeFilter, check_step, episodes_text, summary_text
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.records import CLOSED_STATES

EXIT_BAD_INPUT = 2


def build_parser(prog: str = "python -m ajet_hpc.offline") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN", help="the run directory (holds topology.yaml)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", help="one model (server name); default: every model with data")
    filters = argparse.ArgumentParser(add_help=False)
    filters.add_argument("--step", type=int, help="only the episodes this training step used")
    filters.add_argument("--task", help="only this task id")
    filters.add_argument("--group", help="only this client group")
    filters.add_argument("--state", choices=CLOSED_STATES, help="only this state")
    filters.add_argument("--min-reward", type=float, help="only episodes with reward >= this")
    filters.add_argument("--max-reward", type=float, help="only episodes with reward <= this")
    filters.add_argument("--limit", type=int, help="only the last N episodes (store order) of each model")

    summary = commands.add_parser("summary", parents=[model], help="a compact report of the run")
    summary.add_argument("--watch", type=float, metavar="SECONDS", help="report again every SECONDS")
    summary.add_argument("--count", type=int, help="with --watch: stop after this many reports")
    commands.add_parser("episodes", parents=[model, filters], help="a table of episodes")

    show = commands.add_parser("show", parents=[model], help="one episode's conversation, token by token")
    show.add_argument("episode", help="episode id, or an unambiguous prefix of one")
    show.add_argument("--tokens", action="store_true", help="also a table of every token shown")
    show.add_argument("--turn", type=int, help="only this model call (1-based)")
    show.add_argument("--full", action="store_true", help="whole prompts, not only what is new in each call")
    show.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="ANSI colours (auto: on a terminal)",
    )

    out = commands.add_parser("export", parents=[model, filters], help="episodes or samples to a file")
    out.add_argument("--format", choices=FORMATS, help="default: from the file name's suffix")
    out.add_argument("--per", choices=PER, default="episode", help="one row per episode or per model call")
    out.add_argument("-o", "--output", type=Path, required=True, help="file to write")

    png = commands.add_parser("plot", parents=[model], help="training curves as a PNG")
    png.add_argument("-o", "--output", type=Path, required=True, help="PNG file to write")
    return parser


def episode_filter(args: argparse.Namespace, models: list[ModelRun]) -> EpisodeFilter:
    check_step(models, args.step)
    return EpisodeFilter(
        step=args.step,
        task=args.task,
        group=args.group,
        state=args.state,
        min_reward=args.min_reward,
        max_reward=args.max_reward,
        limit=args.limit,
    )


def run_command(run: Run, args: argparse.Namespace) -> int:
    models = run.models(args.model)
    if args.command == "summary":
        return _summary(run, args)
    if args.command == "episodes":
        chosen = episode_filter(args, models)
        print(episodes_text([(model, chosen.apply(model)) for model in models]))
    elif args.command == "show":
        model, record = run.find_episode(args.episode, args.model)
        color = args.color == "always" or (
            args.color == "auto" and sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        )
        options = ShowOptions(tokens=args.tokens, turn=args.turn, full=args.full, color=color)
        print(show_text(model.name, record, load_tokenizer(run, model.name), options))
    elif args.command == "export":
        fmt = args.format or args.output.suffix.lstrip(".")
        if fmt not in FORMATS:
            raise InspectError(
                f"cannot tell the format of {args.output}: give --format {' or '.join(FORMATS)}"
            )
        n = export(models, episode_filter(args, models), fmt, args.per, args.output)
        print(f"wrote {n} {args.per} rows to {args.output}")
    elif args.command == "plot":
        plot(models, args.output, f"run {run.name}")
        print(f"wrote {args.output}")
    return 0


def _summary(run: Run, args: argparse.Namespace) -> int:
    reports = 0
    while True:
        print(summary_text(run, run.models(args.model)), flush=True)
        reports += 1
        if args.watch is None or (args.count is not None and reports >= args.count):
            return 0
        time.sleep(args.watch)
        run.refresh()
        print()


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.offline") -> int:
    setup_logging(os.environ.get("AJET_LOG_LEVEL") or "WARNING")
    try:
        args = build_parser(prog).parse_args(argv)
    except SystemExit as exc:  # usage errors (2) and --help (0) as a return value, like every other exit
        return int(exc.code or 0)
    try:
        with Run.open(args.run_dir) as run:
            return run_command(run, args)
    except (InspectError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    except BrokenPipeError:  # piped into head
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silences the flush at exit
        return 0
    except OSError as exc:  # an unreadable store, an unwritable output file
        print(f"error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return EXIT_BAD_INPUT
