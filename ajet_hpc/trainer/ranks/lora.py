"""LoRA under DeepSpeed: the base frozen, only the adapter trained, moved and checkpointed.

The model is wrapped by peft (`wrap`) before ``deepspeed.initialize``, which gets only the adapter's
parameters: the optimizer holds no state and the backward makes no gradient for the base (its
parameters have ``requires_grad=False``). Under ZeRO-3 the base is still partitioned over the ranks; the
export gathers the adapter's parameters only (`adapter_state`), a few MB whatever the base's size.

The reference policy of the KL term is the base itself: the same module with the adapter disabled
(``disable_adapter()``), so no reference copy is loaded. Checkpoints leave the frozen base out
(``exclude_frozen_parameters``): it is the initial model's folder, read again at every start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.engine.adapter import peft_config


def wrap(model: torch.nn.Module, lora: LoraConfig) -> Any:
    """``model`` with an adapter on ``lora.target_modules`` (peft), the rest frozen. The model stays in
    eval mode (no dropout: the trainer's logprobs are the engine's), except the adapter's own dropout when
    ``lora.dropout > 0``."""
    from peft import get_peft_model

    wrapped = get_peft_model(model, peft_config(lora))
    wrapped.eval()
    if lora.dropout > 0:
        for name, module in wrapped.named_modules():
            if name.endswith("lora_dropout") or ".lora_dropout." in name:
                module.train()
    return wrapped


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def is_adapter_key(name: str) -> bool:
    return "lora_" in name


def adapter_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for name, p in module.named_parameters() if is_adapter_key(name)]


def adapter_state(module: torch.nn.Module, zero3: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter's tensors on the CPU in ``dtype``, in the names of ``module.state_dict()``. A collective
    under ZeRO-3 (the adapter's parameters are gathered, nothing else): every rank must call it."""
    with _gathered(adapter_parameters(module), zero3):
        return {
            name: tensor.detach().to("cpu", dtype).clone()
            for name, tensor in module.state_dict().items()
            if is_adapter_key(name)
        }


def adapter_bytes(module: torch.nn.Module) -> int:
    """Bytes of the adapter in the parameters' dtype (its full size also where ZeRO-3 partitions it)."""
    return sum(int(getattr(p, "ds_numel", p.numel())) * p.element_size() for p in adapter_parameters(module))


def save_adapter(module: Any, state: dict[str, torch.Tensor], folder: Path) -> None:
    """Write the adapter folder (peft's ``save_pretrained``: config + safetensors) from ``state``: the
    adapter's tensors only, also with ``lm_head`` in ``target_modules`` (the frozen head stays out)."""
    module.save_pretrained(folder, state_dict=state, safe_serialization=True, save_embedding_layers=False)


def base_only(module: Any) -> AbstractContextManager[None]:
    """A context in which the wrapped model computes the base model (the adapter disabled)."""
    return module.disable_adapter()


@contextmanager
def _gathered(params: list[torch.nn.Parameter], zero3: bool) -> Iterator[None]:
    if not zero3:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        yield
