"""Who this rank is (torchrun or srun), the process group, and how the batch is split over the ranks."""

from __future__ import annotations

import datetime
import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from types import ModuleType

from ajet_hpc.slurm import slurmcli

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankEnv:
    """The ranks' layout as torch.distributed's env:// rendezvous reads it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    node: int = 0
    """The rank's node in the allocation (SLURM_NODEID under srun; 0 under torchrun)."""
    gpu_bound: bool = False
    """True once the rank's ``CUDA_VISIBLE_DEVICES`` shows it its one GPU (then ``cuda:0``)."""

    @property
    def device_index(self) -> int:
        """The CUDA device this rank uses: 0 when bound to one GPU, else its local rank."""
        return 0 if self.gpu_bound else self.local_rank

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write the variables env:// reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

        LOCAL_RANK is the device index: DeepSpeed sets the device from it, and a bound rank sees one GPU."""
        environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(self.device_index),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
        )


def rank_env(
    environ: Mapping[str, str], hostnames: Callable[[str], list[str]] = slurmcli.hostnames
) -> RankEnv:
    """The rank's layout: torchrun's variables when RANK is set, else srun's (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID) with MASTER_ADDR from the first node of the step's (or job's) node list, unless
    MASTER_ADDR is set. MASTER_PORT must be set under srun (the launcher sets it)."""
    if "RANK" in environ:
        keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in keys if k not in environ]
        if missing:
            raise RuntimeError(f"RANK is set but not {', '.join(missing)}: start the ranks with torchrun")
        return RankEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ["LOCAL_RANK"]),
            master_addr=environ["MASTER_ADDR"],
            master_port=int(environ["MASTER_PORT"]),
        )
    if "SLURM_PROCID" in environ:
        if "MASTER_PORT" not in environ:
            raise RuntimeError(
                "under srun the launcher must set MASTER_PORT "
                "(see ajet_hpc.trainer.coordinator.rank_launcher)"
            )
        addr = environ.get("MASTER_ADDR")
        if not addr:
            nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise RuntimeError("under srun neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set")
            addr = hostnames(nodelist)[0]
        return RankEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", "0")),
            master_addr=addr,
            master_port=int(environ["MASTER_PORT"]),
            node=int(environ.get("SLURM_NODEID", "0")),
        )
    raise RuntimeError(
        "neither RANK (torchrun) nor SLURM_PROCID (srun) is set: "
        "use ajet_hpc.trainer.coordinator.rank_launcher"
    )


def import_deepspeed() -> ModuleType:
    """``deepspeed``, imported without MLflow.

    DeepSpeed's autotuner imports MLflow at DeepSpeed's own import when it is installed (it is, with our
    ``mlflow`` tracker extra): 0.9 of the 3.2 CPU-seconds that importing DeepSpeed costs, paid by every
    rank at every start and requeue, for an autotuner we never run. MLflow is hidden during that one
    import (the autotuner then finds it missing, as it handles); our tracker imports it as usual later."""
    if "deepspeed" in sys.modules:
        return sys.modules["deepspeed"]
    hide = "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import machinery: "not importable"
    try:
        import deepspeed
    finally:
        if hide and sys.modules.get("mlflow", 0) is None:
            del sys.modules["mlflow"]
    return deepspeed


def init_process_group(env: RankEnv, on_gpu: bool) -> None:
    """NCCL on GPUs (one per local rank), gloo on the CPU; DeepSpeed's comm wraps the same group."""
    import torch

    deepspeed = import_deepspeed()

    env.export(os.environ)
    if on_gpu:
        torch.cuda.set_device(env.device_index)
    backend = "nccl" if on_gpu else "gloo"
    if not on_gpu:
        skip_shm_comm_build()
    # Ranks wait for batches in short collective polls (see worker), so no call waits long.
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(minutes=30))
    log.info("process group up: %s, rank %d of %d", backend, env.rank, env.world_size)


def close_process_group() -> None:
    """The clean end of a rank, once every rank has been told to stop: a barrier, then the group destroyed.

    A rank that leaves with its group alive lets the interpreter's finalisation destroy gloo's work objects,
    which take the GIL while it is torn down and abort the process now and then (SIGABRT, and torchrun exits
    1 on a run that ended well; see pytorch/pytorch#179291). The barrier keeps a rank from closing its
    connections while another still talks on them."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


SHM_COMM_OP = "deepspeed_shm_comm"


def skip_shm_comm_build() -> None:
    """Keep DeepSpeed's comm backend from compiling its shared-memory all-reduce kernel on the CPU.

    On the CPU accelerator, DeepSpeed's torch backend JIT-compiles ``deepspeed_shm_comm`` when it starts: a
    C++ build of minutes (5 min on two cores) at the first run of every installation, for a kernel that only
    its inference all-reduce uses. Training over gloo never calls it, so it is marked incompatible in
    DeepSpeed's table of usable ops (``deepspeed.ops.__compatible_ops__``, a dict DeepSpeed keeps for such
    edits) and the backend starts without it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def shard_by_tokens(lengths: list[int], world_size: int) -> list[list[int]]:
    """Split sample indices over ranks with balanced token counts: longest first, each to the rank with the
    fewest tokens so far (lowest rank on ties). Deterministic; indices ascending within a shard; a rank may
    get none when there are fewer samples than ranks."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shards: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return [sorted(s) for s in shards]
