"""Does the model fit? The launcher's memory estimate for a GPU server, checked before anything is submitted.

Engine: the weights (parameter count from the model's ``config.json`` times the dtype's bytes), split over
``engine.gpus`` by tensor parallelism, must fit in ``gpu_memory_utilization`` of each engine GPU (the rest
of that share is KV cache).

Trainer, per rank, for P parameters on N ranks with bf16 weights and gradients and fp32 Adam (a master copy
and two moments, 12 bytes per parameter), as in the ZeRO paper:

- ZeRO-1: ``2P + 2P + 12P/N`` (optimizer states sharded)
- ZeRO-2: ``2P + (2P + 12P)/N`` (gradients sharded too)
- ZeRO-3: ``(2P + 2P + 12P)/N`` (everything sharded)

plus a frozen reference model when ``kl_coef > 0`` (``2P``, or ``2P/N`` under ZeRO-3). With ``trainer.lora``
the base is frozen: its bf16 weights once per rank (``2P``, ``2P/N`` under ZeRO-3), and the formulas above
apply to the adapter's A parameters alone; the KL term's reference is the base itself, so LoRA saves the
reference copy too (``2P`` or ``2P/N``) on top of the base's gradients and Adam states. Activations come on
top, so the states must leave ``ACTIVATION_HEADROOM`` of the GPU free. With placement ``colocate`` the
trainer's states stay on the GPUs while the engine is awake: they must fit beside the engine's share.
This is an estimate: it refuses what cannot work and lets through what might.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ajet_hpc.config import ConfigIssue, ServerConfig, Topology
from ajet_hpc.engine.adapter import adapter_parameters

log = logging.getLogger(__name__)

GIB = 1024**3
ACTIVATION_HEADROOM = 0.1
"""Share of a trainer GPU left for activations and the allocator's slack."""
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class ModelSize:
    parameters: int
    architecture: str


def model_size(model_dir: Path) -> ModelSize:
    """The parameter count of the model in ``model_dir`` from its ``config.json`` alone: the model is built
    on PyTorch's meta device (no memory, no weights read), so every architecture transformers knows counts
    exactly, tied embeddings once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    architecture = (getattr(config, "architectures", None) or [type(model).__name__])[0]
    return ModelSize(sum(p.numel() for p in model.parameters()), architecture)


def trainer_bytes_per_rank(
    parameters: int, ranks: int, zero_stage: int, reference: bool, adapter: int | None = None
) -> float:
    """The trainer's states on one rank (see the module doc); ``adapter``: the LoRA adapter's parameter
    count, None for full fine-tuning."""
    p, n = float(parameters), max(1, ranks)
    if adapter is not None:  # the frozen base (sharded under ZeRO-3), then the adapter's states
        base = 2 * p / n if zero_stage == 3 else 2 * p
        return base + trainer_bytes_per_rank(adapter, ranks, zero_stage, reference=False)
    states = {1: 2 * p + 2 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[zero_stage]
    if reference:
        states += 2 * p / n if zero_stage == 3 else 2 * p
    return states


def server_fit_issues(
    index: int, server: ServerConfig, size: ModelSize, adapters: Mapping[str, int] | None = None
) -> list[ConfigIssue]:
    """What does not fit on the server's GPUs, each issue naming the field to change (``adapters``: the
    parameter count of each of its models' ``trainer.lora`` adapter, by model name). A server with
    adapters runs one set of trainer ranks per trained model on the same GPUs: their states add up."""
    if server.gpus_per_node == 0:
        return []
    placement = server.placement_plan()
    vllm, gpu = server.engine.vllm, server.engine.gpu_memory_gib * GIB
    dtype = "bfloat16" if vllm.dtype == "auto" else vllm.dtype
    weights = size.parameters * _DTYPE_BYTES[dtype]
    per_engine_gpu = weights / placement.tensor_parallel
    what = f"{size.architecture} with {size.parameters / 1e9:.2f}B parameters"
    issues = []
    engine_budget = vllm.gpu_memory_utilization * gpu
    if per_engine_gpu > engine_budget:
        issues.append(
            ConfigIssue(
                server.path(index, "engine.gpus"),
                f"{what}: its {dtype} weights need {per_engine_gpu / GIB:.1f} GiB per engine GPU over "
                f"{placement.tensor_parallel} GPU(s), more than gpu_memory_utilization "
                f"{vllm.gpu_memory_utilization} x gpu_memory_gib {server.engine.gpu_memory_gib:g} = "
                f"{engine_budget / GIB:.1f} GiB; raise {server.written('engine.gpus')} (tensor parallel) or "
                "vllm.gpu_memory_utilization",
            )
        )
    trainers = [m for m in server.models if m.trainer is not None]
    if not trainers or placement.world_size == 0:
        return issues
    trainer = trainers[0].trainer
    assert trainer is not None
    need = sum(
        trainer_bytes_per_rank(
            size.parameters,
            placement.world_size,
            m.trainer.zero_stage,
            m.trainer.kl_coef > 0,
            (adapters or {}).get(m.name),
        )
        for m in trainers
        if m.trainer is not None
    )
    if len(trainers) > 1:
        what += f", {len(trainers)} trained models"
    colocated = placement.mode == "colocate"
    room = ((1 - vllm.gpu_memory_utilization) if colocated else (1 - ACTIVATION_HEADROOM)) * gpu
    if need > room:
        beside = f"beside the engine's {vllm.gpu_memory_utilization} share " if colocated else ""
        issues.append(
            ConfigIssue(
                server.path(index, "models[0].trainer.zero_stage"),  # the job's first model
                f"{what}: ZeRO-{trainer.zero_stage} on {placement.world_size} rank(s) needs about "
                f"{need / GIB:.1f} GiB per GPU for weights, gradients and Adam states, more than the "
                f"{room / GIB:.1f} GiB {beside}of a {server.engine.gpu_memory_gib:g} GiB GPU; use "
                "zero_stage 3, more GPUs or nodes"
                + (", or a lower vllm.gpu_memory_utilization" if colocated else ""),
            )
        )
    return issues


def fit_issues(topology: Topology) -> list[ConfigIssue]:
    """Fit problems of every GPU server whose model is a local folder (built-in models are tiny)."""
    issues = []
    for index, server in enumerate(topology.servers):
        if server.gpus_per_node == 0 or server.engine.model.startswith("builtin:"):
            continue
        model_dir = Path(server.engine.model).expanduser()
        if not (model_dir / "config.json").is_file():
            continue  # the model field's own check reports it
        try:
            size = model_size(model_dir)
            adapters = {name: adapter_parameters(model_dir, lora) for name, lora in server.lora_models()}
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            issues.append(
                ConfigIssue(
                    server.path(index, "engine.model"), f"cannot read {model_dir / 'config.json'}: {error}"
                )
            )
            continue
        issues += server_fit_issues(index, server, size, adapters)
    return issues
