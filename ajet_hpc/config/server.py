"""A server job (``servers[]``): its resources, serving limits, its one ``engine`` and the ``models`` it
serves (the first under the job's name), with what is derived from them: where the engine and the ranks run
(``placement_plan``) and the LoRA slots and rank its vLLM engine is built with.

Today's form of a server and the form before it (flat ``model``, ``engine``, ``trainer``, ``adapters``...)
both load: ``config.old_form`` rewrites the old one on load, and errors in it name the paths it was written
with (:meth:`ServerConfig.path`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from ajet_hpc.config import old_form
from ajet_hpc.config.engine import EngineConfig, ServingConfig
from ajet_hpc.config.fields import MODEL_CONFIG, Name
from ajet_hpc.config.lora import VLLM_LORA_RANKS, LoraConfig
from ajet_hpc.config.model import ModelConfig
from ajet_hpc.config.placement import Placement, plan_placement
from ajet_hpc.config.resources import JobResources, Slot
from ajet_hpc.config.trainer import TrainerConfig


class ServerConfig(JobResources):
    """A server job: its resources, one inference engine, and the models that engine serves (a plain server
    is a job with one model, named as the job).

    The same class is the view of one model of a job (``hosted``, ``Topology.server``): the job's fields with
    that model alone in ``models``; ``trainer`` is then that model's."""

    model_config = MODEL_CONFIG
    RESOURCES: ClassVar[dict[str, Slot]] = {
        "partition": Slot("name", "gpu", "Slurm partition of the server job."),
        "cpus": Slot("partition", 4, "CPUs per task (--cpus-per-task)."),
        "mem": Slot(
            "cpus", "16G", "Memory per node: an integer with optional K/M/G/T suffix (MB without one)."
        ),
        "time": Slot(
            "mem", "4:00:00", "Time limit per job: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."
        ),
    }

    name: Name = Field(
        description="Server job name; it is also the name of the job's first model (clients refer to it)."
    )
    nodes: int = Field(default=1, ge=1, description="Nodes of the server job.")
    gpus_per_node: int = Field(
        default=2,
        ge=0,
        description="GPUs per node; 0 runs on CPUs (laptops, CI). The default 2 gives the engine one GPU and "
        "the trainer one (placement split).",
    )
    placement: Literal["split", "colocate"] = Field(
        default="split",
        description="'split': the engine takes the first engine.gpus GPUs of the first node, the trainer one "
        "rank on every other GPU; 'colocate': both share every GPU, the engine sleeping (vLLM sleep mode) "
        "while the ranks train (GPUs only). docs/placement.md.",
    )
    port: int = Field(default=0, ge=0, le=65535, description="HTTP port of the server; 0 picks a free port.")
    serving: ServingConfig = Field(default=ServingConfig(), description="Serving limits, episode settings.")
    engine: EngineConfig = Field(description="The job's inference engine and the base model it runs.")
    models: list[ModelConfig] = Field(
        min_length=1,
        description="The models the engine serves, each with its trainer (or null: frozen) and store; the "
        "first carries the job's name. Several models are LoRA adapters of the base (trainer.lora) or the "
        "bare base; docs/lora.md.",
        json_schema_extra={"default_text": "one model named as the job, with the default trainer"},
    )

    _old_form: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _read_either_form(cls, data: Any, handler: ModelWrapValidatorHandler[ServerConfig]) -> ServerConfig:
        """The old form rewritten to this one (``config.old_form``); a missing ``models`` is the one model
        named as the job."""
        if not isinstance(data, dict):  # an instance: it keeps the form it was read in
            return handler(data)
        old = old_form.is_old_form(data)
        if old:
            data = old_form.to_new_form(data)
        elif "models" not in data and "name" in data:  # {name, engine: {...}}
            data = {**data, "models": [{"name": data["name"]}]}
        server = handler(data)
        server._old_form = old
        return server

    def __eq__(self, other: object) -> bool:
        """Equal fields: the form a server was written in is not part of its config."""
        if not isinstance(other, ServerConfig):
            return NotImplemented
        return type(self) is type(other) and self.__dict__ == other.__dict__

    __hash__ = JobResources.__hash__

    # --- what is read of its models ------------------------------------------------------------------
    @property
    def trainer(self) -> TrainerConfig | None:
        """The trainer of the first model: the model named as the job (in a view of one model, its own)."""
        return self.models[0].trainer

    # --- what is derived ------------------------------------------------------------------------------
    def path(self, index: int, field: str = "") -> str:
        """The path of ``field`` (written in this form: ``engine.gpus``, ``models[1].trainer``) of the server
        at ``servers[index]``, as the user wrote the server (the old form's ``engine_gpus``,
        ``adapters[0].trainer`` for a server written in it)."""
        path = f"servers[{index}]" + (f".{field}" if field else "")
        return old_form.old_path(path) if self._old_form else path

    def written(self, field: str) -> str:
        """``field`` (a path below the server, in this form) as the user wrote the server: ``engine.gpus``,
        or ``engine_gpus`` in the old form."""
        return self.path(0, field).removeprefix("servers[0]").removeprefix(".")

    def hosted(self) -> list[ServerConfig]:
        """The models this server job serves, each as a server: the job itself for its first model, then a
        view of each other (the job's fields with that model alone in ``models``, under its name)."""
        views = [self.model_copy(update={"name": m.name, "models": [m]}) for m in self.models[1:]]
        return [self, *views]

    def lora_models(self) -> list[tuple[str, LoraConfig]]:
        """(name, adapter) of every model of this server that trains a LoRA adapter."""
        return [
            (m.name, m.trainer.lora)
            for m in self.models
            if m.trainer is not None and m.trainer.lora is not None
        ]

    def frozen_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every model of this server served frozen from an adapter folder (``adapter``)."""
        return [(m.name, m.adapter) for m in self.models if m.adapter is not None and m.trainer is None]

    def placement_plan(self) -> Placement:
        """Where the server's engine and trainer ranks run (``PlacementError`` when impossible): those of its
        first trained model; every model's ranks use the same trainer devices (each model's own:
        ``placement_plan`` of its view in ``hosted()``)."""
        trainer = next((m.trainer for m in self.models if m.trainer is not None), None)
        return plan_placement(
            nodes=self.nodes,
            gpus_per_node=self.gpus_per_node,
            mode=self.placement,
            engine_gpus=self.engine.gpus,
            cpu_ranks=trainer.ranks if trainer is not None else 1,
            trains=trainer is not None,
        )

    def lora_rank_limit(self, frozen_ranks: Sequence[int] = ()) -> int | None:
        """The ``max_lora_rank`` the server's vLLM engine is built with: the configured one, else the smallest
        of vLLM's ranks that holds the largest of its adapters' ranks (those it trains, and ``frozen_ranks``,
        read from the folders of its frozen adapters); None when no model of it is an adapter."""
        ranks = [lora.rank for _, lora in self.lora_models()] + list(frozen_ranks)
        if not ranks:
            return None
        if self.engine.vllm.max_lora_rank is not None:
            return self.engine.vllm.max_lora_rank
        return min((r for r in VLLM_LORA_RANKS if r >= max(ranks)), default=VLLM_LORA_RANKS[-1])

    def lora_slots(self) -> int:
        """The ``max_loras`` the server's vLLM engine is built with: the configured one, else one slot per
        LoRA model of the server (trained, or frozen from a folder)."""
        return self.engine.vllm.max_loras or max(1, len(self.lora_models()) + len(self.frozen_adapters()))
