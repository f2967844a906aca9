"""``python -m ajet_hpc.launch CONFIG [key=value ...]``: validate, write the run directory, submit.

CONFIG is a topology YAML file, or an existing run directory (launching again resumes that run: jobs that
are still queued or running are left alone, the others are submitted again).

On a running run directory, --swap-clients GROUP [--agent M:F] [--array N] replaces a client group's array
while the servers keep training, and --add-clients GROUP.yaml adds a group (see launch/swap.py).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path

from ajet_hpc.config import (
    ClusterConfig,
    ConfigError,
    ConfigIssue,
    Topology,
    check_array_sizes,
    check_partitions,
    dump_topology,
    load_topology,
)
from ajet_hpc.environments.sources import source_issues
from ajet_hpc.launch import registry, runtimes, swap
from ajet_hpc.launch.backends import Backend, BackendError, get_backend
from ajet_hpc.launch.control import TaskState, task_states
from ajet_hpc.launch.fit import fit_issues
from ajet_hpc.launch.foreground import supervise
from ajet_hpc.launch.lora_check import lora_issues
from ajet_hpc.launch.plan import Planned, build_plan
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.logging_setup import setup_logging
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage.rundir import RunDir, RunDirError
from ajet_hpc.trainer.coordinator import experiment_trackers

log = logging.getLogger("ajet_hpc.launch")
EXIT_BAD_INPUT = 2


def build_parser(prog: str = "python -m ajet_hpc.launch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="topology YAML, or a run directory to resume")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted-path overrides, e.g. servers.policy.nodes=2 cluster.backend=slurm",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print every script it would submit; submit nothing"
    )
    parser.add_argument(
        "--backend", choices=["auto", "slurm", "local"], help="same as the override cluster.backend=..."
    )
    parser.add_argument("--hetjob", action="store_true", help="same as the override cluster.hetjob=true")
    parser.add_argument(
        "--no-submit",
        action="store_true",
        help="write the run directory and print the sbatch commands for sbatch/; submit nothing",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace the frozen topology of an existing run directory with this one",
    )
    parser.add_argument(
        "--detach",
        action="store_true",
        help="local backend: return once the jobs started instead of supervising them",
    )
    hot = parser.add_argument_group("hot swap (CONFIG is a running run directory; the servers keep training)")
    hot.add_argument(
        "--swap-clients",
        metavar="GROUP",
        help="cancel GROUP's array, let its open episodes end, and submit it again with --agent / --array "
        "(or the agent's new code); recorded in RUN/swaps.jsonl",
    )
    hot.add_argument(
        "--add-clients",
        metavar="GROUP.yaml",
        help="add the client group in this file (one block of the topology's clients list) to the run",
    )
    hot.add_argument("--agent", metavar="MODULE:FUNCTION", help="the group's new agent")
    hot.add_argument("--array", type=int, metavar="N", help="the group's new number of array tasks")
    return parser


def read_topology(args: argparse.Namespace) -> tuple[Topology, RunDir]:
    overrides = list(args.overrides)
    if args.backend:
        overrides.append(f"cluster.backend={args.backend}")
    if args.hetjob:
        overrides.append("cluster.hetjob=true")
    source = Path(args.config)
    if source.is_dir():
        run = RunDir.at(source)
        return load_topology(run.topology_file, overrides), run
    if not source.exists():
        raise ConfigError.at("(file)", f"{source} does not exist")
    topology = load_topology(source, overrides, envs_dir=Path.cwd() / "envs")
    return topology, RunDir.for_topology(topology)


def resolve_backend(topology: Topology) -> str:
    wanted = topology.cluster.backend
    if wanted == "auto":
        return "slurm" if slurmcli.available() else "local"
    if wanted == "slurm" and not slurmcli.available():
        raise BackendError("cluster.backend is slurm but no Slurm controller answers here (sbatch/sinfo)")
    return wanted


def still_active(run: RunDir, job: Planned) -> str | None:
    """The job id of a live earlier submission of ``job`` (so a relaunch does not start it twice).

    Fails closed: ``BackendError`` when the scheduler cannot tell (never "gone, submit again")."""
    previous = registry.latest(run).get(job.name)
    if previous is None:
        return None
    if any(state.active for state in _states(run, previous)):
        return previous.job_id
    return None


def live_jobs(run: RunDir) -> list[tuple[str, str]]:
    """(job name, job id) of every earlier submission of this run that still runs or waits."""
    return [
        (name, job.job_id)
        for name, job in registry.latest(run).items()
        if any(state.active for state in _states(run, job))
    ]


def _states(run: RunDir, job: SubmittedJob) -> list[TaskState]:
    try:
        return task_states(job)
    except slurmcli.SlurmError as exc:
        raise BackendError(
            f"cannot tell whether job {job.job_id} ({job.name}) of {run.root} still runs, so nothing was "
            f"submitted (it could run twice): {exc}. Launch again once Slurm answers (squeue, scontrol)"
        ) from exc


def refuse_force_over_live_jobs(run: RunDir, topology: Topology, force: bool) -> None:
    """--force replaces a run's topology: not while jobs of the old one still run (they would keep the old
    topology, and the new submissions would run beside them)."""
    if not (force and run.exists()) or run.holds(dump_topology(topology)):
        return
    live = live_jobs(run)
    if live:
        jobs = ", ".join(f"{name} (job {job_id})" for name, job_id in live)
        raise BackendError(
            f"--force would replace the topology of {run.root} while its jobs still run: {jobs}. Cancel "
            f"them first (python -m ajet_hpc.cancel {run.root}), then launch with --force again"
        )


def launch(args: argparse.Namespace) -> int:
    topology, run = read_topology(args)
    bad = source_issues(topology) + fit_issues(topology) + lora_issues(topology)
    if bad:
        raise ConfigError(bad)
    absent = experiment_trackers.missing(topology.run.trackers)  # before anything is written or submitted
    if absent:
        raise ConfigError(ConfigIssue("run.trackers", message) for message in absent)
    backend_name = resolve_backend(topology) if not args.dry_run else _dry_run_backend(topology)
    if backend_name == "slurm" and slurmcli.available():
        check_partitions(topology, slurmcli.partitions())
        check_array_sizes(topology, slurmcli.array_limit())
    backend: Backend = get_backend(backend_name)
    client_runtimes = runtimes.plan_runtimes(topology, run, envs_dir=Path.cwd() / "envs")  # builds nothing
    pythons = runtimes.pythons(client_runtimes)
    plan = build_plan(topology, hetjob=topology.cluster.hetjob and backend_name == "slurm", pythons=pythons)
    scripts = [(job, backend.render(job, run, topology.cluster)) for job in plan]  # fails before writing

    if args.dry_run:
        for job, text in scripts:
            print(f"### {job.name} ({backend_name}) ###")
            print(text)
        for line in runtimes.describe(client_runtimes):
            print(line)
        for server in topology.servers:
            size = f"{server.nodes} node(s) x {server.gpus_per_node} GPU(s)"
            print(f"placement of server {server.name} ({size}, {server.placement}):")
            for line in server.placement_plan().describe():
                print(f"  {line}")
        print(f"dry run: {len(plan)} job(s) for run directory {run.root}; nothing submitted or written")
        return 0

    refuse_force_over_live_jobs(run, topology, args.force)
    state = run.prepare(topology, force=args.force)
    print(f"run directory: {run.root} ({state})")
    try:
        runtimes.ensure_all(client_runtimes)  # once, here on the login node, before any job starts
    except runtimes.RuntimeBuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.no_submit:
        print("submit by hand with the scripts in sbatch/:")
        for line in hand_commands(topology, run, pythons):
            print(f"  {line}")
        return 0
    # every job asked before any is submitted: a scheduler that cannot answer stops the launch here
    alive = {job.name: still_active(run, job) for job in plan} if state == "resumed" else {}
    submitted = []
    for job in plan:
        live = alive.get(job.name)
        if live:
            print(f"  {job.name:<24} still active as job {live}: left alone")
            continue
        entry = backend.submit(job, run, topology.cluster)
        submitted.append(entry)
        tasks = f" tasks {entry.tasks[0]}..{entry.tasks[-1]}" if len(entry.tasks) > 1 else ""
        print(f"  {job.name:<24} {entry.backend} job {entry.job_id}{tasks} -> {run.root / entry.log_dir}")
    registry.record(run, submitted)
    print("watch it with:")
    print(f"  python -m ajet_hpc.status {run.root}")
    print(f"  python -m ajet_hpc.logs {run.root} [JOB] -f")
    print(f"  python -m ajet_hpc.cancel {run.root}")
    if backend_name == "local" and not args.detach:
        return supervise(run, backend, submitted)
    return 0


def hand_commands(topology: Topology, run: RunDir, pythons: Mapping[str, str] | None = None) -> list[str]:
    """The sbatch command lines that start this run's jobs with the hand-written sbatch/ scripts.

    ``pythons`` maps a client group to its runtime's python, which reaches the script as ``AJET_PYTHON``.
    """
    logs = run.logs_dir
    common = " ".join(cluster_sbatch_options(topology.cluster))
    lines = []
    for server in topology.servers:
        gpus = f" --gpus-per-node={server.gpus_per_node}" if server.gpus_per_node else ""
        lines.append(
            f"sbatch {common} -p {server.partition} --nodes={server.nodes}{gpus} "
            f"--cpus-per-task={server.cpus} --mem={server.mem} --time={server.time} "
            f"--output={logs}/%x-%j.out sbatch/server.sbatch {run.root} {server.name}"
        )
    for group in [*topology.clients, *topology.eval_groups.values()]:
        evaluated = topology.evaluated_by(group.name)  # an eval group runs in its group's runtime
        python = (pythons or {}).get(group.name if evaluated is None else evaluated.name)
        export = f"--export={shlex.quote(f'ALL,AJET_PYTHON={python}')} " if python else ""
        lines.append(
            f"sbatch {export}{common} -p {group.partition} --array=0-{group.array - 1} "
            f"--cpus-per-task={group.cpus} "
            f"--mem={group.mem} --time={group.time} --output={logs}/%x-%A_%a.out "
            f"sbatch/clients.sbatch {run.root} {group.name}"
        )
    return lines


def cluster_sbatch_options(cluster: ClusterConfig) -> list[str]:
    """The options every hand-written job gets from ``cluster``, as submitit gives them to its jobs: the
    checkpoint signal ``signal_delay_s`` ahead (over the scripts' default), account, qos and the extra
    ``cluster.sbatch`` options. (``cluster.setup`` reaches the scripts as ``RUN/setup.sh``.)"""
    options = [f"--signal=B:USR2@{cluster.signal_delay_s}"]
    options += [
        f"--{name}={value}" for name, value in (("account", cluster.account), ("qos", cluster.qos)) if value
    ]
    options += [f"--{key}={shlex.quote(str(value))}" for key, value in cluster.sbatch.items()]
    return options


def _dry_run_backend(topology: Topology) -> str:
    """A dry run renders for the asked backend without needing it; auto means slurm when present."""
    if topology.cluster.backend == "auto":
        return "slurm" if slurmcli.available() else "local"
    return topology.cluster.backend


def main(argv: list[str] | None = None, prog: str = "python -m ajet_hpc.launch") -> int:
    setup_logging()
    args = build_parser(prog).parse_args(argv)
    try:
        if swap.requested(args):
            return swap.main(args)
        return launch(args)
    except ConfigError as exc:
        print(f"error: invalid topology ({args.config}):\n{exc}", file=sys.stderr)
    except (RunDirError, BackendError, slurmcli.SlurmError, swap.SwapError) as exc:
        print(f"error: {exc}", file=sys.stderr)
    return EXIT_BAD_INPUT
