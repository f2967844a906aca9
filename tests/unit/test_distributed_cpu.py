"""A CPU rank's process group: gloo through DeepSpeed's comm, without DeepSpeed compiling its shared-memory
all-reduce kernel (a C++ build of minutes at the first run of an installation, used only by its inference
path). A real one-rank group in a fresh process, whose DeepSpeed backend must come up without the op."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support import REPO

from ajet_hpc.trainer.protocol.rank_env import free_port

CHILD = textwrap.dedent(
    """
    import torch.distributed as dist
    import deepspeed.comm.comm as ds_comm
    from ajet_hpc.trainer.ranks.distributed import RankEnv, init_process_group

    env = RankEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port={port})
    init_process_group(env, on_gpu=False)
    assert dist.get_backend() == "gloo", dist.get_backend()
    assert ds_comm.cdb is not None and ds_comm.cdb.shm_comm_op is None, ds_comm.cdb.shm_comm_op
    import torch
    x = torch.ones(3)
    ds_comm.all_reduce(x)
    assert x.tolist() == [1.0, 1.0, 1.0]
    print("ok")
    """
)


def test_a_cpu_rank_starts_gloo_without_building_the_shm_kernel() -> None:
    code = CHILD.replace("{port}", str(free_port()))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    assert "deepspeed_shm_comm_op built" not in done.stdout + done.stderr


MLFLOW_CHILD = textwrap.dedent(
    """
    import sys
    from ajet_hpc.trainer.ranks.distributed import import_deepspeed

    deepspeed = import_deepspeed()
    from deepspeed.autotuning import autotuner

    assert "mlflow" not in sys.modules and not autotuner.has_mlflow  # DeepSpeed came up without MLflow
    assert import_deepspeed() is deepspeed
    import mlflow  # our tracker's import is untouched

    print("ok", mlflow.__name__)
    """
)


def test_deepspeed_is_imported_without_mlflow_which_stays_importable() -> None:
    """The rank's DeepSpeed import skips the MLflow import of DeepSpeed's autotuner (0.9 CPU-s a rank
    start); MLflow (the ``mlflow`` extra, installed here) still imports for our tracker afterwards."""
    done = subprocess.run(
        [sys.executable, "-c", MLFLOW_CHILD],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok mlflow"), done.stdout + done.stderr
