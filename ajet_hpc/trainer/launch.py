"""Start the trainer's ranks next to the coordinator: torchrun on one node, srun across nodes.

One node (Slurm or not): ``python -m torch.distributed.run --standalone --nproc_per_node=<ranks> -m
ajet_hpc.trainer.worker ...`` (``--standalone`` makes torchrun pick a free rendezvous port itself).

Several nodes (inside the server job's allocation, from its batch script's process on the first node):
``srun --nodes=<nodes> --ntasks=<nodes*ranks> --ntasks-per-node=<ranks> --overlap --kill-on-bad-exit=1
python -m ajet_hpc.trainer.worker ...``. Each task is one rank; the worker maps SLURM_PROCID / SLURM_NTASKS
/ SLURM_LOCALID to RANK / WORLD_SIZE / LOCAL_RANK and takes MASTER_ADDR from the first node of the step's
node list; MASTER_PORT is a port found free here (this process runs on the allocation's first node).
``--overlap`` lets the step share the nodes with the coordinator's own step, if it runs as one.

Without CUDA the ranks run DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) with one OpenMP thread each.
Which GPUs the ranks see (apart from the engine's) is the caller's choice, through ``env``. The ranks
stop by themselves when the process that started them is gone (rank 0 checks it on the same host).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from ajet_hpc.config.topology import TrainerConfig
from ajet_hpc.trainer.protocol import WorkDir

PARENT_PID_VAR = "AJET_TRAINER_PARENT_PID"
PARENT_HOST_VAR = "AJET_TRAINER_PARENT_HOST"
"""The starting process (the coordinator) and its host: rank 0 exits when that process is gone."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def worker_args(work_dir: Path, model_dir: Path, config: TrainerConfig) -> list[str]:
    return [
        "-m",
        "ajet_hpc.trainer.worker",
        "--work-dir",
        str(work_dir),
        "--model",
        str(model_dir),
        "--config",
        config.model_dump_json(),
    ]


def rank_command(
    work_dir: Path, model_dir: Path, config: TrainerConfig, *, on_slurm: bool, nodes: int, python: str
) -> list[str]:
    """The command line that starts all ranks (pure; see the module doc)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if nodes > 1 and not on_slurm:
        raise ValueError(f"{nodes} nodes need Slurm: outside Slurm the trainer runs on one node")
    worker = worker_args(work_dir, model_dir, config)
    if nodes == 1:
        torchrun = [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.ranks}"]
        return [*torchrun, "--module", *worker[1:]]
    return [
        "srun",
        f"--nodes={nodes}",
        f"--ntasks={nodes * config.ranks}",
        f"--ntasks-per-node={config.ranks}",
        "--overlap",
        "--kill-on-bad-exit=1",
        python,
        *worker,
    ]


def rank_environment(base: Mapping[str, str], *, on_gpu: bool, nodes: int) -> dict[str, str]:
    """The ranks' environment: ``base`` plus the accelerator's settings and, across nodes, MASTER_PORT."""
    env = dict(base)
    env[PARENT_PID_VAR] = str(os.getpid())
    env[PARENT_HOST_VAR] = socket.gethostname()
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
    nodes: int,
    log_path: Path,
    on_gpu: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen:
    """Start the ranks (in a new process group) with their output appended to ``log_path``; the caller
    watches the returned process (``poll()``) and ends it with ``terminate()``. Clears the ``stop`` and
    ``ready.json`` files of an earlier run first. ``on_gpu`` defaults to ``torch.cuda.is_available()``."""
    work = WorkDir(Path(work_dir).absolute())
    work.root.mkdir(parents=True, exist_ok=True)
    for stale in (work.stop, work.save_request, work.save_refused):  # left by the previous job
        stale.unlink(missing_ok=True)
    work.ready.unlink(missing_ok=True)
    if on_gpu is None:
        import torch

        on_gpu = torch.cuda.is_available()
    command = rank_command(
        work.root, Path(model_dir).absolute(), config, on_slurm=on_slurm, nodes=nodes, python=sys.executable
    )
    environment = rank_environment(os.environ if env is None else env, on_gpu=on_gpu, nodes=nodes)
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
