"""``python -m ajet_hpc.study STUDY.yaml`` creates a study directory (or resumes it) and supervises it;
``... STUDY status`` prints one screen about it; ``... STUDY report`` writes its Markdown report and plots.

STUDY is a study file or a study directory (running again on either resumes the study). The supervisor
runs in the foreground, or with --slurm as a small CPU Slurm job that requeues itself before its time
limit. Exit status: 0 done, 1 the supervisor stopped early, 2 bad study file or missing Optuna (nothing
submitted), 3 another supervisor already runs for this study.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ajet_hpc.config import ConfigError
from ajet_hpc.config.load import _read_mapping
from ajet_hpc.config.yaml_io import to_yaml
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.files import write_bytes_atomic
from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.schema import StudySpec, load_study
from ajet_hpc.study.search import OptunaMissing, require_optuna

EXIT_BAD_INPUT = 2
EXIT_SUPERVISED = 3


class StudyDirError(Exception):
    pass


def build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("study", help="a study file (STUDY.yaml) or a study directory")
    parser.add_argument(
        "action", nargs="?", default="run", choices=["run", "status", "report"], help="default: run"
    )
    parser.add_argument("--slurm", action="store_true", help="run the supervisor as a CPU Slurm job")
    parser.add_argument("--passes", type=int, metavar="N", help="stop the supervisor after N passes")
    parser.add_argument("--colour-by", metavar="PATH", help="report: the parameter that colours the curves")
    return parser


def frozen_spec(study_dir: StudyDir) -> StudySpec:
    return load_study(study_dir.spec_file)[0]


def open_study_dir(target: Path) -> tuple[StudySpec, StudyDir]:
    """The study of a directory, or the one a study file describes (created on first use: the study file
    and its base topology are frozen into it; a changed study file is refused)."""
    if target.is_dir():
        study_dir = StudyDir(target.resolve())
        if not study_dir.exists():
            raise StudyDirError(f"{target} is not a study directory (no study.yaml in it)")
        return frozen_spec(study_dir), study_dir
    if not target.exists():
        raise ConfigError.at("(file)", f"{target} does not exist")
    spec, base = load_study(target)
    study_dir = StudyDir((Path(spec.dir) if spec.dir else Path("studies") / spec.name).resolve())
    frozen = to_yaml({**_read_mapping(target), "base": "base.yaml", "dir": str(study_dir.root)})
    base_text = base.read_text()
    if study_dir.exists():
        if study_dir.spec_file.read_text() != frozen or study_dir.base_file.read_text() != base_text:
            raise StudyDirError(
                f"{study_dir.root} already holds a different study (or base topology); resume it with "
                f"`python -m ajet_hpc.study {study_dir.root}`, or give this study another name or dir"
            )
    else:
        write_bytes_atomic(study_dir.base_file, base_text.encode())
        write_bytes_atomic(study_dir.spec_file, frozen.encode())
        study_dir.event("study_created", source=str(target.resolve()), budget=spec.trial_budget())
    return frozen_spec(study_dir), study_dir


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.study") -> int:
    setup_logging()
    args = build_parser(prog).parse_args(argv)
    try:
        require_optuna()
        spec, study_dir = open_study_dir(Path(args.study))
        if args.action == "status":
            from ajet_hpc.study.state import status_table

            print(status_table(spec, study_dir))
            return 0
        if args.action == "report":
            from ajet_hpc.study.report import write_report

            print(f"report: {write_report(spec, study_dir, args.colour_by)}")
            return 0
        if args.slurm:
            from ajet_hpc.study import slurm_job

            print(slurm_job.submit(spec, study_dir))
            return 0
        from ajet_hpc.study.trial_supervisor import Supervisor, SupervisorRunning

        print(f"study directory: {study_dir.root}; `python -m ajet_hpc.study {study_dir.root} status`")
        try:
            return Supervisor(spec, study_dir).run(max_passes=args.passes)
        except SupervisorRunning as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_SUPERVISED
    except ConfigError as exc:
        print(f"error: invalid study ({args.study}):\n{exc}", file=sys.stderr)
    except (OptunaMissing, StudyDirError, slurmcli.SlurmError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
