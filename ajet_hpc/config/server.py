"""A server job (``servers[]``): its resources, engine, serving limits, store and trainer, and the models it
serves (itself, then its ``adapters``), with what is derived from them: where the engine and the ranks run
(``placement_plan``) and the LoRA slots and rank its vLLM engine is built with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from ajet_hpc.config.engine import ServingConfig, VllmConfig
from ajet_hpc.config.fields import MODEL_CONFIG, ModelSource, Name
from ajet_hpc.config.lora import VLLM_LORA_RANKS, LoraConfig
from ajet_hpc.config.placement import Placement, plan_placement
from ajet_hpc.config.resources import JobResources, Slot
from ajet_hpc.config.store import StoreConfig
from ajet_hpc.config.trainer import TrainerConfig


class AdapterConfig(BaseModel):
    """One more model on a server's engine: a LoRA adapter of the server's base model with its own trainer,
    store, checkpoints and metrics, or (``trainer: null``) the bare base under this name. Clients name it
    as they name a server. docs/lora.md, "Several models on one server"."""

    model_config = MODEL_CONFIG

    name: Name = Field(
        description="The model's name: clients refer to it, and it names its files in the run."
    )
    trainer: TrainerConfig | None = Field(
        default=TrainerConfig(lora=LoraConfig()),
        description="The adapter's trainer, with trainer.lora (default: a rank-16 adapter); null serves the "
        "model without training (a judge or an opponent that does not learn): the bare base, or `adapter`.",
    )
    adapter: str | None = Field(
        default=None,
        min_length=1,
        description="With trainer: null, a peft adapter folder of the base (adapter_config.json and "
        "adapter_model.safetensors, e.g. from `ajet-hpc export --adapter`) served frozen as this model; a "
        "relative path is taken from where the server runs, like `model`.",
    )
    store: StoreConfig = Field(
        default=StoreConfig(), description="Group commit of this model's store (RUN/data/<name>.h5)."
    )


class ServerConfig(JobResources):
    """One trainable model: an inference engine and its trainer in one GPU allocation."""

    model_config = MODEL_CONFIG
    RESOURCES: ClassVar[dict[str, Slot]] = {
        "partition": Slot("engine", "gpu", "Slurm partition of the server job."),
        "cpus": Slot("vllm", 4, "CPUs per task (--cpus-per-task)."),
        "mem": Slot(
            "cpus", "16G", "Memory per node: an integer with optional K/M/G/T suffix (MB without one)."
        ),
        "time": Slot(
            "mem", "4:00:00", "Time limit per job: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."
        ),
    }

    name: Name = Field(
        description="Server name; clients refer to it, and it names the model's files in the run."
    )
    model: ModelSource = Field(description="Model weights: 'builtin:tiny' or a local path.")
    engine: Literal["auto", "vllm", "transformers"] = Field(
        default="auto", description="Inference engine; 'auto' picks vLLM when it is installed."
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
        description="'split': the engine takes the first engine_gpus GPUs of the first node, the trainer one "
        "rank on every other GPU; 'colocate': both share every GPU, the engine sleeping (vLLM sleep mode) "
        "while the ranks train (GPUs only). docs/placement.md.",
    )
    engine_gpus: int = Field(
        default=1, ge=1, description="GPUs of the vLLM engine on the first node (its tensor parallel size)."
    )
    gpu_memory_gib: float = Field(
        default=80.0,
        gt=0,
        allow_inf_nan=False,
        description="Memory of one GPU of the partition in GiB, for the launcher's check that the model "
        "fits.",
    )
    vllm: VllmConfig = Field(default=VllmConfig(), description="vLLM engine settings.")
    port: int = Field(default=0, ge=0, le=65535, description="HTTP port of the server; 0 picks a free port.")
    serving: ServingConfig = Field(default=ServingConfig(), description="Serving limits, episode settings.")
    store: StoreConfig = Field(
        default=StoreConfig(), description="Group commit of the server store (docs/storage.md)."
    )
    trainer: TrainerConfig | None = Field(
        default=TrainerConfig(),
        description="Trainer settings of this model; null serves it without training.",
    )
    adapters: list[AdapterConfig] = Field(
        default_factory=list,
        description="More models served by this server's one engine, each a LoRA adapter of its base model "
        "(or the bare base) with its own trainer; the server itself stays a model too (give it trainer.lora "
        "or trainer: null). docs/lora.md.",
    )

    def models(self) -> list[ServerConfig]:
        """The models this server job serves: itself, then each adapter as a model of its own (the server's
        fields with the adapter's name, trainer and store)."""
        hosted = [
            self.model_copy(update={"name": a.name, "trainer": a.trainer, "store": a.store, "adapters": []})
            for a in self.adapters
        ]
        return [self, *hosted]

    def lora_models(self) -> list[tuple[str, LoraConfig]]:
        """(name, adapter) of every model of this server that trains a LoRA adapter."""
        return [
            (m.name, m.trainer.lora)
            for m in self.models()
            if m.trainer is not None and m.trainer.lora is not None
        ]

    def frozen_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every adapter of this server served frozen from a folder (``adapter``)."""
        return [(a.name, a.adapter) for a in self.adapters if a.adapter is not None and a.trainer is None]

    def placement_plan(self) -> Placement:
        """Where the server's engine and trainer ranks run (``PlacementError`` when impossible). For a server
        with adapters, that of its first trained model: every model's ranks use the same trainer devices
        (each model's own: ``placement_plan`` of ``models()``'s entry)."""
        server = self
        if server.adapters and server.trainer is None:
            server = next((m for m in server.models() if m.trainer is not None), server)
        return plan_placement(
            nodes=server.nodes,
            gpus_per_node=server.gpus_per_node,
            mode=server.placement,
            engine_gpus=server.engine_gpus,
            cpu_ranks=server.trainer.ranks if server.trainer is not None else 1,
            trains=server.trainer is not None,
        )

    def lora_rank_limit(self, frozen_ranks: Sequence[int] = ()) -> int | None:
        """The ``max_lora_rank`` the server's vLLM engine is built with: the configured one, else the smallest
        of vLLM's ranks that holds the largest of its adapters' ranks (those it trains, and ``frozen_ranks``,
        read from the folders of its frozen adapters); None when no model of it is an adapter."""
        ranks = [lora.rank for _, lora in self.lora_models()] + list(frozen_ranks)
        if not ranks:
            return None
        if self.vllm.max_lora_rank is not None:
            return self.vllm.max_lora_rank
        return min((r for r in VLLM_LORA_RANKS if r >= max(ranks)), default=VLLM_LORA_RANKS[-1])

    def lora_slots(self) -> int:
        """The ``max_loras`` the server's vLLM engine is built with: the configured one, else one slot per
        LoRA model of the server (trained, or frozen from a folder)."""
        return self.vllm.max_loras or max(1, len(self.lora_models()) + len(self.frozen_adapters()))
