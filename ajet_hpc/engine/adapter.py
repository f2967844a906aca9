"""LoRA adapters as the engines and the trainer share them: peft's adapter folder is the unit that travels.

A trained adapter leaves the trainer as a ``save_pretrained`` folder of peft (``adapter_config.json`` +
``adapter_model.safetensors``), a few MB, written to node-local storage; the engines load it through their
own LoRA machinery (vLLM's ``add_lora`` with ``load_inplace``, peft's ``set_peft_model_state_dict``).
Before the first step an engine serves the *version-0* adapter, `write_initial_adapter`: every ``B`` is
zero, so it computes exactly the base model, and every request carries an adapter from the start (a
request never switches from the bare base to an adapter when the first trained one arrives).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ajet_hpc.config.lora import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter(folder: Path) -> bool:
    """Whether ``folder`` is a peft adapter folder (not a whole model's)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def peft_config(lora: LoraConfig) -> Any:
    """peft's ``LoraConfig`` for ours (a causal LM, adapters on ``target_modules``)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        task_type="CAUSAL_LM",
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        bias="none",
    )


def _meta_model(model_dir: Path) -> Any:
    """The model of ``model_dir`` built on PyTorch's meta device (no memory, no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def linear_module_names(model_dir: Path) -> set[str]:
    """The last parts of the names of the model's linear layers (what ``target_modules`` may name; GPT-2's
    ``Conv1D`` is a linear layer too)."""
    import torch
    from transformers.pytorch_utils import Conv1D

    model = _meta_model(model_dir)
    linear = (torch.nn.Linear, Conv1D)
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, linear)}


def adapter_parameters(model_dir: Path, lora: LoraConfig) -> int:
    """How many parameters the adapter of ``lora`` has on this model (counted on the meta device)."""
    from peft import get_peft_model

    model = get_peft_model(_meta_model(model_dir), peft_config(lora))
    return sum(p.numel() for name, p in model.named_parameters() if "lora_" in name)


def missing_targets(model_dir: Path, lora: LoraConfig) -> list[str]:
    """The ``target_modules`` the model has no linear layer of."""
    have = linear_module_names(model_dir)
    return [name for name in lora.target_modules if name not in have]


def write_initial_adapter(model_dir: Path, lora: LoraConfig, folder: Path) -> Path:
    """Write the version-0 adapter of the model to ``folder`` (see the module doc) and return it."""
    import torch
    from peft import get_peft_model

    model = get_peft_model(_meta_model(model_dir), peft_config(lora))
    zeros = {
        name: torch.zeros(p.shape, dtype=torch.float32)
        for name, p in model.named_parameters()
        if "lora_" in name
    }
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, state_dict=zeros, safe_serialization=True, save_embedding_layers=False)
    return folder


def kind_mismatch(folder: Path, serves_adapter: bool) -> str | None:
    """Why an engine that serves an adapter (or whole weights) cannot load ``folder``; None when it can."""
    given = is_adapter(folder)
    if given == serves_adapter:
        return None
    what = "an adapter folder" if given else "a whole model's folder"
    served = "a LoRA adapter" if serves_adapter else "whole weights"
    return f"load_weights: {folder} is {what} but the engine serves {served} (trainer.lora decides both)"


def adapter_rank(folder: Path) -> int:
    """The rank ``r`` written in an adapter folder's config."""
    return int(json.loads((Path(folder) / ADAPTER_CONFIG).read_text())["r"])
