"""What to submit for a topology, as plain data (no Slurm, no submitit): the launcher's plan.

A server becomes one job; a client group becomes one job array, and so does its eval group when it has an
``eval`` block (``config.evaluation``). With ``cluster.hetjob`` a server and the
client groups that use only that server become one heterogeneous job, one component each, the client
tasks as the ``ntasks`` of their component. A client group with its own runtime (``env:``) carries that
runtime's python, which every backend starts its tasks with.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ajet_hpc.config import ClientGroupConfig, ServerConfig, Topology


@dataclass(frozen=True)
class Resources:
    partition: str
    nodes: int
    ntasks: int  # tasks in total (hetjob client components: the array size)
    cpus_per_task: int
    gpus_per_node: int
    mem: str  # per node, Slurm syntax (4G)
    time_min: int


@dataclass(frozen=True)
class JobSpec:
    """One job of the plan: a server, or a client group (an array of ``array`` tasks)."""

    kind: str  # "server" | "clients"
    target: str  # server name or client group name
    resources: Resources
    array: int | None = None
    python: str | None = None  # the interpreter of the group's own runtime; None: the launcher's

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.target}"

    def command(self, run_dir: Path, python: str = sys.executable) -> list[str]:
        """The entrypoint that runs this job (the sbatch/ scripts and hetjobs call it directly).

        ``python`` is the interpreter for a job that has none of its own (``self.python``).
        """
        python = self.python or python
        if self.kind == "server":
            return [python, "-u", "-m", "ajet_hpc.launch.server_job", str(run_dir), "--name", self.target]
        return [python, "-u", "-m", "ajet_hpc.client", str(run_dir), "--group", self.target]


@dataclass(frozen=True)
class HetJobSpec:
    """Several components started as one Slurm heterogeneous job (``#SBATCH hetjob``)."""

    components: tuple[JobSpec, ...]

    @property
    def name(self) -> str:
        return "het-" + "-".join(component.target for component in self.components)


Planned = JobSpec | HetJobSpec


def server_job(server: ServerConfig) -> JobSpec:
    return JobSpec(
        kind="server",
        target=server.name,
        resources=Resources(
            partition=server.partition,
            nodes=server.nodes,
            ntasks=server.nodes,
            cpus_per_task=server.cpus,
            gpus_per_node=server.gpus_per_node,
            mem=server.mem,
            time_min=server.time_min,
        ),
    )


def client_job(group: ClientGroupConfig, python: str | None = None) -> JobSpec:
    return JobSpec(
        kind="clients",
        target=group.name,
        array=group.array,
        python=python,
        resources=Resources(
            partition=group.partition,
            nodes=1,
            ntasks=1,
            cpus_per_task=group.cpus,
            gpus_per_node=0,
            mem=group.mem,
            time_min=group.time_min,
        ),
    )


def build_plan(
    topology: Topology,
    hetjob: bool | None = None,
    only: set[str] | None = None,
    pythons: Mapping[str, str] | None = None,
) -> list[Planned]:
    """Every job of a topology, servers first.

    ``hetjob`` overrides ``cluster.hetjob`` (the local backend has no heterogeneous jobs); ``only`` keeps
    the jobs whose names it holds (``server-x``, ``clients-y``); ``pythons`` maps a client group to the
    python of its runtime (``launch/runtimes.py``).
    """
    pythons = pythons or {}
    servers = [server_job(server) for server in topology.servers]
    groups = [*topology.clients, *topology.eval_groups.values()]
    clients = {group.name: client_job(group, _python_of(topology, group, pythons)) for group in groups}
    plan: list[Planned] = []
    if topology.cluster.hetjob if hetjob is None else hetjob:
        for server in servers:
            # a group that uses only this server's models (itself, or adapters it serves) rides along
            served = {model.name for model in topology.host_of(server.target).models}
            riders = [clients.pop(g.name) for g in groups if set(g.servers) <= served]
            if riders:
                components = (server, *(_as_component(rider) for rider in riders))
                plan.append(HetJobSpec(components))
            else:
                plan.append(server)
    else:
        plan.extend(servers)
    plan.extend(clients.values())
    if only is not None:
        plan = [job for job in plan if job.name in only]
    return plan


def _python_of(topology: Topology, group: ClientGroupConfig, pythons: Mapping[str, str]) -> str | None:
    """The python of a group's runtime; an eval group runs in the runtime of the group it evaluates."""
    evaluated = topology.evaluated_by(group.name)
    return pythons.get(group.name if evaluated is None else evaluated.name)


def _as_component(job: JobSpec) -> JobSpec:
    """A client array as a hetjob component: its tasks become the component's ntasks."""
    res = job.resources
    tasks = job.array or 1
    as_tasks = Resources(
        partition=res.partition,
        nodes=1,
        ntasks=tasks,
        cpus_per_task=res.cpus_per_task,
        gpus_per_node=0,
        mem=res.mem,
        time_min=res.time_min,
    )
    return JobSpec(kind=job.kind, target=job.target, resources=as_tasks, array=None, python=job.python)
