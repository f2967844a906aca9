"""Start the trainer's ranks next to the coordinator: torchrun on one node, srun across nodes.

How many ranks run on each node, and on which GPUs, is the server's placement (``config/placement.py``).

One node (Slurm or not): ``python -m torch.distributed.run --standalone --nproc_per_node=<ranks> -m
ajet_hpc.trainer.ranks.worker ...`` (``--standalone`` makes torchrun pick a free rendezvous port itself).

Several nodes (inside the server job's allocation, from the server process on the first node):
``srun --nodes=<nodes> --ntasks=<world> --distribution=arbitrary --overlap --kill-on-bad-exit=1 python -m
ajet_hpc.trainer.ranks.worker ...`` with ``SLURM_HOSTFILE`` naming each rank's node in rank order, so nodes
may hold different numbers of ranks (the first node gives GPUs to the engine). Each task is one rank; the
worker maps SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID / SLURM_NODEID to its rank, and takes MASTER_ADDR from
the first node of the step's node list; MASTER_PORT is a port found free here (this process runs on the
allocation's first node). ``--overlap`` lets the step share the nodes with the server's own step.

On GPUs each rank binds to its one GPU (``AJET_RANK_GPUS``, read by the worker before CUDA starts), which
it sees as ``cuda:0``. Without CUDA the ranks run DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) with
one OpenMP thread each. The ranks stop by themselves when the process that started them is gone (rank 0
checks it on the same host).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ajet_hpc.config.placement import RANK_GPUS_VAR, Placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.slurm import slurmcli
from ajet_hpc.trainer.protocol.rank_env import PARENT_HOST_VAR, PARENT_PID_VAR, free_port
from ajet_hpc.trainer.protocol.sync_plan import BACKEND_VAR, DISK, WORKERS_VAR, SyncPlan
from ajet_hpc.trainer.protocol.work_dir import prepare_for_ranks


def worker_args(work_dir: Path, model_dir: Path, config: TrainerConfig) -> list[str]:
    return [
        "-m",
        "ajet_hpc.trainer.ranks.worker",
        "--work-dir",
        str(work_dir),
        "--model",
        str(model_dir),
        "--config",
        config.model_dump_json(),
    ]


def rank_command(
    work_dir: Path,
    model_dir: Path,
    config: TrainerConfig,
    *,
    on_slurm: bool,
    ranks_per_node: Sequence[int],
    python: str,
) -> list[str]:
    """The command line that starts all ranks (pure; see the module doc)."""
    nodes = len(ranks_per_node)
    if nodes < 1 or min(ranks_per_node) < 0 or sum(ranks_per_node) < 1:
        raise ValueError(f"no ranks to start: ranks per node {list(ranks_per_node)}")
    if nodes > 1 and not on_slurm:
        raise ValueError(f"{nodes} nodes need Slurm: outside Slurm the trainer runs on one node")
    worker = worker_args(work_dir, model_dir, config)
    if nodes == 1:
        per_node = f"--nproc_per_node={ranks_per_node[0]}"
        torchrun = [python, "-m", "torch.distributed.run", "--standalone", per_node]
        return [*torchrun, "--module", *worker[1:]]
    return [
        "srun",
        f"--nodes={sum(1 for n in ranks_per_node if n)}",
        f"--ntasks={sum(ranks_per_node)}",
        "--distribution=arbitrary",
        "--overlap",
        "--kill-on-bad-exit=1",
        python,
        *worker,
    ]


def hostfile_lines(hostnames: Sequence[str], ranks_per_node: Sequence[int]) -> list[str]:
    """``SLURM_HOSTFILE`` for ``--distribution=arbitrary``: one line per rank, its node, in rank order."""
    if len(hostnames) < len(ranks_per_node):
        raise ValueError(
            f"the allocation has {len(hostnames)} node(s) ({', '.join(hostnames)}), the placement "
            f"{len(ranks_per_node)}"
        )
    return [host for host, count in zip(hostnames, ranks_per_node, strict=False) for _ in range(count)]


def rank_environment(
    base: Mapping[str, str], *, on_gpu: bool, nodes: int, rank_gpus: str | None = None
) -> dict[str, str]:
    """The ranks' environment: ``base`` plus the accelerator's settings, the GPU table and, across nodes,
    MASTER_PORT."""
    env = dict(base)
    env[PARENT_PID_VAR] = str(os.getpid())
    env[PARENT_HOST_VAR] = socket.gethostname()
    env.pop(RANK_GPUS_VAR, None)
    if on_gpu and rank_gpus is not None:
        env[RANK_GPUS_VAR] = rank_gpus
    if not on_gpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["OMP_NUM_THREADS"] = "1"
    if nodes > 1:
        env.pop("MASTER_ADDR", None)  # the worker takes the first node of the step
        env["MASTER_PORT"] = str(free_port())
    return env


def _ignore_checkpoint_signal() -> None:
    """In the child, before exec: ignore SIGUSR2 (inherited through exec by torchrun/srun and the ranks).

    Slurm sends its pre-timeout/preemption signal to every process of the job. The server handles it by
    asking the ranks to checkpoint (``ajet_hpc.server.preemption``); USR2's default action would kill them
    first."""
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)


def start_ranks(
    work_dir: Path,
    model_dir: Path,
    config: TrainerConfig,
    *,
    on_slurm: bool,
    placement: Placement,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    sync: SyncPlan = DISK,
) -> subprocess.Popen:
    """Start the ranks (in a new process group) with their output appended to ``log_path``; the caller
    watches the returned process (``poll()``) and ends it with ``terminate()``. Clears the ``stop`` and
    ``ready.json`` files of an earlier run first. ``env``: the environment of the server's job step
    (default ``os.environ``), before the engine narrowed its own ``CUDA_VISIBLE_DEVICES``; ``sync``: how
    the ranks hand their weights to the engine (the server's `sync_plan.decide`)."""
    work = prepare_for_ranks(work_dir)
    ranks_per_node = placement.ranks_per_node
    command = rank_command(
        work.root,
        Path(model_dir).absolute(),
        config,
        on_slurm=on_slurm,
        ranks_per_node=ranks_per_node,
        python=sys.executable,
    )
    base = os.environ if env is None else env
    environment = rank_environment(
        base, on_gpu=placement.on_gpu, nodes=len(ranks_per_node), rank_gpus=placement.rank_gpus_json()
    )
    for var in (BACKEND_VAR, WORKERS_VAR):  # the plan alone says how weights travel, not the job's env
        environment.pop(var, None)
    environment.update(sync.rank_env())
    if len(ranks_per_node) > 1:
        nodelist = base.get("SLURM_JOB_NODELIST") or base.get("SLURM_NODELIST") or ""
        hosts = hostfile_lines(slurmcli.hostnames(nodelist), ranks_per_node)
        hostfile = work.root / "hostfile"
        hostfile.write_text("\n".join(hosts) + "\n")
        environment["SLURM_HOSTFILE"] = str(hostfile)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"$ {shlex.join(command)}\n".encode())
        log.flush()
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
            start_new_session=True,
            preexec_fn=_ignore_checkpoint_signal,
        )
