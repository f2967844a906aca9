"""The seam between a trainer and the server that hosts it: what a `Coordinator` needs from its host
(`TrainerHost`), and everything else it is given once, at construction (`TrainerSetup`).

The host is the model's context in the server process (``ajet_hpc.server.context.ModelContext``): it
owns the engine, the episode store and the admission of new episodes, and it decides what a failure means
for the job (requeue, fail, finish). The coordinator trains; it never reaches into the server beyond these
members, and the server sets nothing on a coordinator after building it (``ajet_hpc.server.assembly``
builds both).

Several trainers behind one server (one per trainable adapter of a base model) each get a `TrainerHost` of
their own: a view over the one server that routes the trainer's episodes, steps and end to that trainer's
store and state, with the engine shared. A coordinator does not know whether it is alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol

from ajet_hpc.config import ServerConfig, TrainerConfig
from ajet_hpc.config.placement import Placement
from ajet_hpc.engine.base import Engine
from ajet_hpc.storage.records import StepRecord
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.evaluation import EvalRounds
from ajet_hpc.trainer.coordinator.experiment_trackers import Trackers
from ajet_hpc.trainer.protocol.sync_plan import SyncPlan


class StepStore(Protocol):
    """The server store, as a trainer uses it: where it is (to read back unconsumed episodes on a resume)
    and where each recorded step goes."""

    @property
    def path(self) -> Path: ...

    def submit_step(self, record: StepRecord) -> None: ...


class WeightReceiver(Protocol):
    """An engine that takes weights sent in memory (``weight_sync: memory``; the vLLM engine)."""

    last_pause_s: float  # how long generation paused for the last sync

    async def weight_transfer(self, method: str, argument: object) -> None: ...

    async def abandon_weight_update(self) -> None: ...


class TrainerHost(Protocol):
    """What a coordinator needs from the server that hosts it."""

    @property
    def engine(self) -> Engine:
        """The engine serving the policy: it gets each step's weights and sleeps while colocated ranks
        train."""
        ...

    @property
    def recorder(self) -> StepStore:
        """The server store."""
        ...

    @property
    def admission(self) -> asyncio.Event:
        """Set while new episodes may start; cleared while a strictly on-policy step changes the weights."""
        ...

    def engine_failure(self) -> str | None:
        """Why the engine cannot serve any more, or None; asked when a step fails."""
        ...

    def engine_died(self, why: str) -> None:
        """A step failed with the engine dead: checkpoint and requeue the job (the host's watchdog)."""
        ...

    def fail(self, reason: str) -> None:
        """Training cannot go on (the ranks gave up): the server fails, its job is not requeued."""
        ...

    def finish_training(self, reason: str | None = None) -> None:
        """Training is over (``reason``: why before ``total_steps``)."""
        ...


def _no_end() -> str | None:
    return None


@dataclass(frozen=True)
class TrainerSetup:
    """What a coordinator is built with, besides its host; built by the server's assembly
    (``ajet_hpc.server.assembly``) or by a test."""

    server: ServerConfig  # with a trainer
    model_path: Path  # the base model folder the ranks start from
    run: RunDir
    on_slurm: bool
    placement: Placement  # where the ranks run (``ServerConfig.placement_plan``)
    sync: SyncPlan  # how weights reach the engine (``sync_plan.decide``)
    receiver: WeightReceiver | None = None  # the engine, when ``sync`` is in memory
    mix: dict[str, float] | None = None  # client group -> share of each batch's tasks
    repeats_of: dict[str, int] | None = None  # client group -> episodes per task (``BatchCollector``)
    ended_count: Callable[[str, str], int] | None = None  # (group, task) -> repeats ended so far
    sources_ended: Callable[[], str | None] = _no_end
    """A description once every client task feeding the server has used up its tasks, else None."""
    rank_env: Mapping[str, str] | None = None  # the job step's environment for the ranks (None: this one)
    stored: list[dict[str, object]] | None = None  # the store's summaries, read once at the server's start
    trackers: Trackers | None = None  # run.trackers beyond metrics.jsonl (TensorBoard, W&B, MLflow)
    evaluation: EvalRounds | None = None  # the eval rounds that follow this model's steps

    def __post_init__(self) -> None:
        if self.server.trainer is None:
            raise ValueError(f"server {self.server.name} has no trainer")
        if self.sync.in_memory and self.receiver is None:
            raise ValueError(
                f"server {self.server.name}: weight sync {self.sync.backend} in memory needs an engine that "
                "receives weights (the vLLM engine)"
            )

    @cached_property
    def trainer(self) -> TrainerConfig:
        """The server's trainer settings, with its algorithm's and serving's defaults filled in
        (``TrainerConfig.resolved``)."""
        assert self.server.trainer is not None  # checked in __post_init__
        return self.server.trainer.resolved(self.server.serving)
