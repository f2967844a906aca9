"""One model a server job serves (``servers[].models[]``): its name, its trainer (or none: a frozen model),
the LoRA adapter folder it is served from, and its store."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ajet_hpc.config.fields import MODEL_CONFIG, Name
from ajet_hpc.config.store import StoreConfig
from ajet_hpc.config.trainer import TrainerConfig


class ModelConfig(BaseModel):
    """A model of the run, served by its server job's engine: the base model itself, or a LoRA adapter of it.
    It has its own name, trainer, store, checkpoints and metrics; clients name it. docs/lora.md, "Several
    models on one server"."""

    model_config = MODEL_CONFIG

    name: Name = Field(
        description="The model's name: clients refer to it, and it names its files in the run. The first "
        "model of a server job carries the job's name."
    )
    trainer: TrainerConfig | None = Field(
        default=TrainerConfig(),
        description="The model's trainer; null serves it without training (a judge or an opponent that does "
        "not learn): the bare base, or `adapter`. Where a job serves several models, each one that trains "
        "has trainer.lora (an adapter of the base they share).",
    )
    adapter: str | None = Field(
        default=None,
        min_length=1,
        description="With trainer: null, on a job with several models, a peft adapter folder of the base "
        "(adapter_config.json and adapter_model.safetensors, e.g. from `ajet-hpc export --adapter`) served "
        "frozen as this model; a relative path is taken from where the server runs, like engine.model.",
    )
    store: StoreConfig = Field(
        default=StoreConfig(), description="Group commit of this model's store (RUN/data/<name>.h5)."
    )
