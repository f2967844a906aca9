"""How trained weights reach the engine: decided once per server start, by `decide`, and nowhere else.

``trainer.weight_sync: memory`` sends the weights from the ranks straight into a vLLM engine through one of
vLLM's weight-transfer backends: NCCL from the trainer's GPUs to the engine's (placement ``split``), CUDA IPC
when they share the GPUs (``colocate``), our gloo backend on CPUs (``cpu``). The transformers engine has no
such receiver: it reloads the exported weights from disk, and so does ``weight_sync: disk``. A LoRA
trainer (``trainer.lora``) always hands over its adapter folder, a few MB on node-local storage, which the
engine loads through its own LoRA API (``add_lora``): no transfer group is needed for so little.

The server builds its engine with `SyncPlan.backend` (``VllmSettings.weight_transfer_backend``), hands the
plan to its coordinator (`TrainerSetup.sync`), and the coordinator hands it to the ranks it starts through
their environment (`SyncPlan.rank_env`; the ranks read it back once with `SyncPlan.from_env`). Nothing
else looks at the trainer config, the placement or the engine to find out how weights travel.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast, get_args

from ajet_hpc.config import TrainerConfig
from ajet_hpc.config.placement import Placement

log = logging.getLogger(__name__)

SyncBackend = Literal["nccl", "ipc", "ajet_gloo"]
BACKEND_VAR = "AJET_WEIGHT_SYNC"
WORKERS_VAR = "AJET_ENGINE_WORKERS"
_BACKEND_OF_PLACEMENT: dict[str, SyncBackend] = {"cpu": "ajet_gloo", "split": "nccl", "colocate": "ipc"}


@dataclass(frozen=True)
class SyncPlan:
    """``backend``: vLLM's transfer backend for in-memory syncs, None to reload from disk;
    ``engine_workers``: how many engine workers receive each sync (its tensor-parallel size)."""

    backend: SyncBackend | None = None
    engine_workers: int = 1

    @property
    def in_memory(self) -> bool:
        return self.backend is not None

    def rank_env(self) -> dict[str, str]:
        """The variables that carry the plan to the ranks (none for disk: their absence means disk)."""
        if self.backend is None:
            return {}
        return {BACKEND_VAR: self.backend, WORKERS_VAR: str(self.engine_workers)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> SyncPlan:
        """The plan the server put in a rank's environment (`rank_env`), with a clear error if mangled."""
        backend = environ.get(BACKEND_VAR, "")
        if not backend:
            return cls()
        if backend not in get_args(SyncBackend):
            known = ", ".join(get_args(SyncBackend))
            raise ValueError(f"{BACKEND_VAR}={backend!r} is not a weight-transfer backend ({known})")
        workers = environ.get(WORKERS_VAR, "1")
        if not workers.isdigit() or int(workers) < 1:
            raise ValueError(f"{WORKERS_VAR}={workers!r} is not a number of engine workers")
        return cls(cast(SyncBackend, backend), int(workers))


DISK = SyncPlan()
"""Reload the exported weights from disk after each step."""


def decide(
    trainer: TrainerConfig | None, placement: Placement, engine: Literal["vllm", "transformers"]
) -> SyncPlan:
    """The one decision: in memory when the trainer asks for it and the engine is vLLM (the backend from
    the placement), else from disk (logged when memory was asked for but the engine cannot receive)."""
    if trainer is None or trainer.weight_sync != "memory":
        return DISK
    if trainer.lora is not None:
        log.info("trainer.lora: the adapter reaches the engine as a node-local adapter folder (add_lora)")
        return DISK
    if engine != "vllm":
        log.info("weight_sync memory needs the vLLM engine; the %s engine reloads from disk", engine)
        return DISK
    return SyncPlan(_BACKEND_OF_PLACEMENT[placement.mode], placement.tensor_parallel)
