"""A LoRA adapter trained on a frozen base (``trainer.lora``), and the adapter ranks vLLM serves."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from ajet_hpc.config.fields import MODEL_CONFIG

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The adapter ranks vLLM's ``max_lora_rank`` takes (its LoRA kernels are built for these)."""

DEFAULT_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(BaseModel):
    """A LoRA adapter trained on a frozen base model (peft); docs/lora.md."""

    model_config = MODEL_CONFIG

    rank: int = Field(default=16, ge=1, le=512, description="Rank r of the adapter's A and B matrices.")
    alpha: int = Field(default=32, gt=0, description="Scaling: the update is scaled by alpha / rank.")
    dropout: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapter's input while training. 0 (the default) keeps the trainer's "
        "log-probabilities those the engine samples with; above 0 the ratio of new to old policy is noisy.",
    )
    target_modules: tuple[str, ...] = Field(
        default=DEFAULT_LORA_MODULES,
        min_length=1,
        description="Names of the linear layers that get an adapter (the last part of the module name); "
        "each must exist in the model, checked before submitting.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _listed(cls, value: object) -> object:
        return tuple(value) if isinstance(value, list) else value
