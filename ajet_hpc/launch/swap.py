"""Hot swap of client groups while the servers keep training.

``python -m ajet_hpc.launch RUN --swap-clients GROUP [--agent module:function] [--array N]`` replaces a
running group's array with one that runs the new agent (or the same agent's new code) at the new size:

1. check everything first (group, agent, array, backend, partitions, the group's runtime); change nothing
   while something is wrong;
2. note where every server is (training step, policy version);
3. cancel the group's array (scancel; locally SIGTERM to the controllers). Each runner then begins no new
   episode, aborts its open ones with a reason (the servers do not wait ``episode_timeout_s`` for them) and
   closes its store; wait until every task is gone;
4. freeze the new group definition into ``RUN/topology.yaml`` (the old file kept as ``topology.<time>.yaml``),
   so that a plain resume (``launch RUN``) sees it;
5. submit the new array and append it to ``jobs.json``; append the swap to ``RUN/swaps.jsonl``.

Nothing committed is lost or run twice: a runner skips every (task, repeat) committed in any store of its
group, whatever the array size was when it was committed. Servers never stop: between the cancel and the
first episode of the new array they simply receive no episodes.

``--add-clients GROUP.yaml`` adds a new group (one client-group block, validated with the whole topology)
to a running run the same way, without step 3.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from ajet_hpc.client.handshake import run_client
from ajet_hpc.config import (
    ClientGroupConfig,
    ConfigError,
    ConfigIssue,
    Topology,
    check_partitions,
    validate_topology,
)
from ajet_hpc.config.yaml_io import parse_yaml
from ajet_hpc.environments.sources import source_issues
from ajet_hpc.launch import control, registry, runtimes
from ajet_hpc.launch.backends import get_backend
from ajet_hpc.launch.plan import build_plan
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.slurm import slurmcli
from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.files import append_jsonl, holder_dead
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.metrics import read_rows

STOP_TIMEOUT_S = 300.0  # how long the old tasks may take to go (Slurm kills them after KillWait anyway)
LOCAL_GRACE_S = 60.0  # a local task that ignores SIGTERM this long (it was still starting) is killed
Say = Callable[[str], None]


class SwapError(Exception):
    """A swap cannot be done as asked; the message says why and what to do instead."""


def requested(args: argparse.Namespace) -> bool:
    """True when the command line asks for a swap or an added group (or gives their options)."""
    return bool(args.swap_clients or args.add_clients or args.agent or args.array is not None)


def main(args: argparse.Namespace, say: Say = print) -> int:
    """The launcher's ``--swap-clients`` / ``--add-clients``; raises ``SwapError`` for a wrong request."""
    if args.swap_clients and args.add_clients:
        raise SwapError("give either --swap-clients GROUP or --add-clients FILE, not both")
    if not (args.swap_clients or args.add_clients):
        raise SwapError("--agent and --array go with --swap-clients GROUP or --add-clients FILE")
    others = [flag for flag, on in _launch_only_flags(args) if on]
    if others:
        raise SwapError(f"{', '.join(others)} cannot be combined with --swap-clients / --add-clients")
    if args.array is not None and args.array < 1:
        raise SwapError(f"--array: give the number of array tasks (at least 1), not {args.array}")
    if args.swap_clients:
        swap_clients(args.config, args.swap_clients, agent=args.agent, array=args.array, say=say)
    else:
        add_clients(args.config, Path(args.add_clients), agent=args.agent, array=args.array, say=say)
    return 0


def _launch_only_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    return [
        ("key=value overrides", bool(args.overrides)),
        ("--dry-run", args.dry_run),
        ("--backend", bool(args.backend)),
        ("--hetjob", args.hetjob),
        ("--no-submit", args.no_submit),
        ("--force", args.force),
    ]


# --- the two operations ---------------------------------------------------------------------------------


def swap_clients(
    run_dir: str | os.PathLike[str],
    group: str,
    *,
    agent: str | None = None,
    array: int | None = None,
    say: Say = print,
    stop_timeout_s: float = STOP_TIMEOUT_S,
) -> dict[str, Any]:
    """Replace running group ``group`` with its new definition; returns the row written to swaps.jsonl."""
    run, topology = _open_run(run_dir)
    old = _known_group(topology, group)
    new_topology = _with_group(topology, old, agent, array)
    new = new_topology.client(group)
    previous = registry.latest(run).get(f"clients-{group}")
    if previous is None:
        raise SwapError(
            f"client group {group!r} was never submitted (no clients-{group} in {run.jobs_file}); "
            f"launch the run first: python -m ajet_hpc.launch {run.root}"
        )
    if previous.backend not in ("slurm", "local"):
        raise SwapError(f"client group {group!r} runs inside {previous.name} ({previous.backend}): {_HETJOB}")
    supervisor = _foreground_supervisor(previous)
    if supervisor is not None:
        raise SwapError(
            f"a launcher in the foreground (pid {supervisor}) supervises this local run and would stop the "
            "servers once the old client tasks end; swap client groups of local runs launched with --detach"
        )
    pythons = _prepare(run, new_topology, new, previous.backend, say)
    with _swap_lock(run, topology):
        say(f"swap of client group {group!r} in {run.root}")
        say(f"  agent  {old.agent} -> {new.agent}" if old.agent != new.agent else f"  agent  {new.agent}")
        say(f"  array  {old.array} -> {new.array}" if old.array != new.array else f"  array  {new.array}")
        at_swap = server_positions(run, topology)
        say(f"  servers now: {_describe(at_swap)}")
        stopped_s, after_stop = _stop(run, topology, previous, stop_timeout_s, say)
        kept = run.replace_topology(new_topology)
        say(f"3. topology.yaml now holds the new group definition (the previous one: {kept.name})")
        entry = _submit(run, new_topology, group, previous.backend, pythons, step="4.", say=say)
        row = {
            "time": time.time(),
            "action": "swap",
            "group": group,
            "old": {"agent": old.agent, "array": old.array, "job_id": previous.job_id},
            "new": {"agent": new.agent, "array": new.array, "job_id": entry.job_id},
            "backend": entry.backend,
            "servers_at_swap": at_swap,
            "servers_after_stop": after_stop,
            "servers_at_start": server_positions(run, new_topology),
            "stopped_after_s": round(stopped_s, 1),
            "previous_topology": kept.name,
        }
        append_jsonl(run.swaps_file, row, sort_keys=True)
    say(f"5. recorded in {run.swaps_file.name} and {run.jobs_file.name}; the servers kept running")
    _say_watch(run, say)
    return row


def add_clients(
    run_dir: str | os.PathLike[str],
    block_file: Path,
    *,
    agent: str | None = None,
    array: int | None = None,
    say: Say = print,
) -> dict[str, Any]:
    """Add the client group in ``block_file`` to a running run; returns the row written to swaps.jsonl."""
    run, topology = _open_run(run_dir)
    block = _read_block(block_file)
    block.update({k: v for k, v in (("agent", agent), ("array", array)) if v is not None})
    new_topology = _with_added(topology, block, block_file)
    new = new_topology.clients[-1]
    backend = _run_backend(run)
    pythons = _prepare(run, new_topology, new, backend, say)
    with _swap_lock(run, topology):
        say(f"adding client group {new.name!r} to {run.root}: agent {new.agent}, array {new.array}")
        at_start = server_positions(run, topology)
        say(f"  servers now: {_describe(at_start)}")
        kept = run.replace_topology(new_topology)
        say(f"1. topology.yaml now holds the new group (the previous one: {kept.name})")
        entry = _submit(run, new_topology, new.name, backend, pythons, step="2.", say=say)
        row = {
            "time": time.time(),
            "action": "add",
            "group": new.name,
            "old": None,
            "new": {"agent": new.agent, "array": new.array, "job_id": entry.job_id},
            "backend": entry.backend,
            "servers_at_swap": at_start,
            "servers_at_start": at_start,
            "previous_topology": kept.name,
        }
        append_jsonl(run.swaps_file, row, sort_keys=True)
    say(f"3. recorded in {run.swaps_file.name} and {run.jobs_file.name}")
    _say_watch(run, say)
    return row


# --- checks before anything changes -----------------------------------------------------------------------

_HETJOB = (
    "a heterogeneous job holds a server and its client groups together, so a group cannot be swapped or "
    "added alone; run with cluster.hetjob: false to swap client groups"
)


def _open_run(run_dir: str | os.PathLike[str]) -> tuple[RunDir, Topology]:
    run = RunDir.at(run_dir)  # RunDirError when it is not a run directory
    if not run.jobs_file.exists():
        raise SwapError(
            f"nothing was submitted for {run.root} (no {run.jobs_file.name}): there is no running group to "
            f"change; launch it first: python -m ajet_hpc.launch {run.root}"
        )
    topology = run.load_topology()
    if topology.cluster.hetjob:
        raise SwapError(f"{run.root} runs with cluster.hetjob: {_HETJOB}")
    return run, topology


def _known_group(topology: Topology, group: str) -> ClientGroupConfig:
    names = [c.name for c in topology.clients]
    if group not in names:
        raise SwapError(
            f"no client group named {group!r} in this run; client groups are: {', '.join(names) or '(none)'}"
            " (add a new group with --add-clients GROUP.yaml)"
        )
    return topology.client(group)


def _with_group(
    topology: Topology, group: ClientGroupConfig, agent: str | None, array: int | None
) -> Topology:
    """The topology with ``group``'s agent and/or array replaced, validated like a launch's."""
    data = topology.model_dump(mode="json")
    index = [c.name for c in topology.clients].index(group.name)
    if agent is not None:
        data["clients"][index]["agent"] = agent
    if array is not None:
        data["clients"][index]["array"] = array
    flags = {f"clients[{index}].agent": "--agent", f"clients[{index}].array": "--array"}
    try:
        return validate_topology(data)
    except ConfigError as exc:
        raise SwapError(_reworded(exc, lambda path: flags.get(path, path))) from None


def _read_block(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SwapError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = parse_yaml(text, source=str(path))
    except ConfigError as exc:
        raise SwapError(f"invalid client group ({path}):\n{exc}") from None
    if not isinstance(data, dict):
        raise SwapError(
            f"{path} must hold one client-group block (a mapping with name, agent, tasks, servers, ...), "
            f"not a {type(data).__name__}"
        )
    return dict(data)


def _with_added(topology: Topology, block: dict[str, Any], source: Path) -> Topology:
    """The topology with the group ``block`` appended, validated with the whole topology (server names,
    duplicates, ratios, env files) and its task source checked as at launch; issues name the block's own
    fields."""
    if block.get("name") in [c.name for c in topology.clients]:
        raise SwapError(
            f"{source}: this run already has a client group named {block['name']!r}; "
            f"to change it, use --swap-clients {block['name']}"
        )
    data = topology.model_dump(mode="json")
    data["clients"].append(block)
    prefix = f"clients[{len(data['clients']) - 1}]"

    def local(path: str) -> str:
        if path == prefix:
            return "(block)"
        return path.removeprefix(prefix + ".") if path.startswith(prefix + ".") else path

    try:
        added = validate_topology(data, envs_dir=Path.cwd() / "envs")
        if bad := source_issues(added):
            raise ConfigError(bad)
        return added
    except ConfigError as exc:
        raise SwapError(f"invalid client group ({source}):\n{_reworded(exc, local)}") from None


def _reworded(exc: ConfigError, rename: Callable[[str], str]) -> str:
    return str(ConfigError([ConfigIssue(rename(issue.path), issue.message) for issue in exc.issues]))


def _run_backend(run: RunDir) -> str:
    """The backend the run's jobs went to (slurm or local)."""
    backends = {job.backend for job in registry.latest(run).values()}
    if "hetjob" in backends:
        raise SwapError(f"{run.root} has heterogeneous jobs: {_HETJOB}")
    if not backends:
        raise SwapError(f"{run.jobs_file} lists no job; launch the run first")
    return "local" if "local" in backends else "slurm"


def _prepare(run: RunDir, topology: Topology, group: ClientGroupConfig, backend: str, say: Say) -> dict:
    """Checks that need the cluster or the agent's code; builds the group's runtime. Returns the pythons."""
    if backend == "slurm":
        if not slurmcli.available():
            raise SwapError("this run's jobs are on Slurm, but no Slurm controller answers here")
        try:
            check_partitions(topology, slurmcli.partitions())
        except ConfigError as exc:
            raise SwapError(f"invalid client group:\n{exc}") from None
    try:
        planned = runtimes.plan_runtimes(topology, run, envs_dir=Path.cwd() / "envs")
    except ConfigError as exc:
        raise SwapError(f"client group {group.name!r}: {exc}") from None
    mine = {name: rt for name, rt in planned.items() if name == group.name}
    try:
        runtimes.ensure_all(mine, progress=say)
    except runtimes.RuntimeBuildError as exc:
        raise SwapError(str(exc)) from None
    pythons = runtimes.pythons(mine)
    check_agent(group.agent, pythons.get(group.name))
    return pythons


def _foreground_supervisor(job: SubmittedJob) -> int | None:
    """The pid of the launcher still supervising a local job (the parent of its controllers), if any."""
    if job.backend != "local":
        return None
    for task in job.tasks:
        with contextlib.suppress(psutil.Error, ValueError):
            parent = psutil.Process(int(task)).parent()
            if parent is not None and "ajet_hpc.launch" in " ".join(parent.cmdline()):
                return parent.pid
    return None


def check_agent(spec: str, python: str | None = None) -> None:
    """``SwapError`` unless ``module:function`` imports and is callable (in ``python``, the group's
    runtime, when it has one; else here)."""
    module, _, attribute = spec.partition(":")
    probe = (
        "import importlib, sys\n"
        f"obj = getattr(importlib.import_module({module!r}), {attribute!r}, None)\n"
        f"sys.exit(0 if callable(obj) else 3)\n"
    )
    done = subprocess.run(
        [python or sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    if done.returncode == 3:
        raise SwapError(f"--agent {spec!r}: {module!r} has no callable {attribute!r}")
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SwapError(f"--agent {spec!r}: cannot import {module!r}: {last}")


@contextlib.contextmanager
def _swap_lock(run: RunDir, topology: Topology) -> Iterator[None]:
    """One swap of a run at a time (RUN/swap.lock, created exclusively; a dead holder's is taken over), on
    the topology the swap was checked against (not one another swap changed meanwhile)."""
    path = run.swap_lock_file
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    for _ in range(2):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            break
        except FileExistsError:
            holder = _lock_holder(path)
            if holder is not None:
                raise SwapError(
                    f"a swap of this run is still in progress (pid {holder['pid']} on {holder['host']}, "
                    f"started {time.time() - holder['since']:.0f}s ago); wait for it to finish"
                ) from None
            path.unlink(missing_ok=True)  # its holder died
    else:
        raise SwapError(f"cannot take {path}: another swap keeps creating it")
    with os.fdopen(fd, "w") as handle:
        handle.write(mine)
    try:
        if run.load_topology() != topology:
            raise SwapError("the run's topology changed meanwhile (another swap?); run this one again")
        yield
    finally:
        path.unlink(missing_ok=True)


def _lock_holder(path: Path) -> dict[str, Any] | None:
    """Who holds the swap lock; None when it is gone or its process is dead (same host only)."""
    try:
        holder = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return None if holder_dead(holder.get("host"), holder.get("pid")) else holder


# --- the swap itself ----------------------------------------------------------------------------------------


def server_positions(run: RunDir, topology: Topology) -> dict[str, dict[str, Any]]:
    """Per server: the last training step in metrics.jsonl and the policy version it serves now (asked
    from the server when it answers, else its rendezvous file, else the metrics row)."""
    last: dict[str, dict[str, Any]] = {}
    for row in read_rows(run.metrics_file):
        last[row.get("model", "")] = row
    secret = run.read_secret()
    positions = {}
    for server in topology.models:
        row = last.get(server.name, {})
        entry: dict[str, Any] = {
            "step": int(row.get("step", 0)),
            "policy_version": int(row.get("policy_version", 0)),
            "source": "metrics",
        }
        live = _live_status(run, server.name, secret)
        if live is not None:
            entry.update(
                policy_version=int(live["policy_version"]),
                episodes_open=live.get("episodes_open"),
                episodes_aborted=live.get("episodes_aborted"),
                source="server",
            )
        positions[server.name] = entry
    return positions


def _live_status(run: RunDir, server: str, secret: str) -> dict[str, Any] | None:
    """The server's ``/v1/status``; None when it is not published or does not answer."""
    try:
        record = rendezvous.read(run.rendezvous_file(server))
    except ValueError:
        return None
    if record is None or record.is_stale():
        return None
    try:  # a server that cannot prove it holds the secret raises ServerNotTrusted: the swap stops there
        with run_client(record.url, secret, timeout_s=5.0) as http:
            reply = http.get("/v1/status")
        reply.raise_for_status()
        return reply.json()
    except (httpx.HTTPError, ValueError):
        return None


def _describe(positions: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, p in positions.items():
        text = f"{name} at step {p['step']} (policy v{p['policy_version']}"
        if p.get("episodes_open") is not None:
            text += f", {p['episodes_open']} episode(s) open, {p['episodes_aborted']} aborted so far"
        parts.append(text + ")" + ("" if p["source"] == "server" else " [not answering]"))
    return "; ".join(parts)


def _stop(
    run: RunDir, topology: Topology, job: SubmittedJob, timeout_s: float, say: Say
) -> tuple[float, dict[str, dict[str, Any]]]:
    """Cancel ``job`` and wait until its tasks are gone; returns how long that took and where the servers
    are then."""
    started = time.monotonic()
    tasks = f"{job.tasks[0]}..{job.tasks[-1]}" if len(job.tasks) > 1 else job.tasks[0]
    say(f"1. cancelling {job.name} ({job.backend} job {job.job_id}, tasks {tasks})")
    say(f"   {control.cancel_job(job)}")
    say("2. waiting for its tasks to end (each aborts its open episodes and closes its store)")
    first_wait = min(timeout_s, LOCAL_GRACE_S) if job.backend == "local" else timeout_s
    left = control.wait_stopped(job, first_wait)
    if left and job.backend == "local":
        say(f"   {len(left)} task(s) ignored SIGTERM for {first_wait:.0f}s (still starting?): killing them")
        control.kill_local(job)
        left = control.wait_stopped(job, 30.0)
    if left:
        states = ", ".join(f"{s.task_id} {s.state}" for s in left)
        raise SwapError(
            f"{job.name}: task(s) still active after {time.monotonic() - started:.0f}s ({states}); nothing "
            "else was changed: run the same swap again once they are gone"
        )
    took, positions = time.monotonic() - started, server_positions(run, topology)
    say(f"   all tasks gone after {took:.1f}s; servers: {_describe(positions)}")
    return took, positions


def _submit(
    run: RunDir, topology: Topology, group: str, backend: str, pythons: dict, step: str, say: Say
) -> SubmittedJob:
    """Submit the group's array with ``backend`` and append it to jobs.json."""
    (job,) = build_plan(topology, hetjob=False, only={f"clients-{group}"}, pythons=pythons)
    entry = get_backend(backend).submit(job, run, topology.cluster)
    registry.record(run, [entry])
    tasks = f" tasks {entry.tasks[0]}..{entry.tasks[-1]}" if len(entry.tasks) > 1 else ""
    say(f"{step} submitted {job.name}: {entry.backend} job {entry.job_id}{tasks} -> {entry.log_dir}/")
    return entry


def read_swaps(run: RunDir) -> list[dict[str, Any]]:
    """The rows of RUN/swaps.jsonl, oldest first (empty when the run was never changed)."""
    return read_rows(run.swaps_file)


def _say_watch(run: RunDir, say: Say) -> None:
    say(f"watch it with: python -m ajet_hpc.status {run.root}")
