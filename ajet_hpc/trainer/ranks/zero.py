"""DeepSpeed for the trainer: the engine from ``TrainerConfig``, the frozen reference model, weight export
in the model's dtype, and checkpoints that only count once ``ds/trainer_state.json`` names them. With
``trainer.lora`` the model is a peft adapter on the frozen base (`ajet_hpc.trainer.ranks.lora`): the reference
is the base itself, exports are adapter folders and checkpoints leave the base out.

Gradient accumulation is the caller's (``managed_gradient_accumulation: false``): ``engine.backward`` only
accumulates, and each ``engine.step()`` is one optimizer step over everything accumulated since the last
one, however many micro-batches that was. ZeRO-2/3 still communicate inside each backward, so all ranks
must run the same number of forward/backward passes (the worker pads with zero-weight micro-batches).
"""

from __future__ import annotations

import io
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ajet_hpc import fault_injection
from ajet_hpc.algo.sample_tensors import tree_attention
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.storage.files import write_bytes_atomic
from ajet_hpc.trainer.protocol.checkpoints import (
    TrainerState,
    commit_checkpoint,
    next_trainer_state,
    read_trainer_state,
    resume_point,
    uncommit_checkpoint,
)
from ajet_hpc.trainer.protocol.weight_handoff import copy_model_extras, publish_weights, staging_dir
from ajet_hpc.trainer.protocol.work_dir import WorkDir, step_name
from ajet_hpc.trainer.ranks import lora
from ajet_hpc.trainer.ranks.distributed import import_deepspeed

log = logging.getLogger(__name__)

WEIGHT_DECAY = 0.0
"""AdamW weight decay (TrainerConfig has no field for it yet; torch's default 0.01 would pull the policy
towards zero, not towards the initial model)."""
GRADIENT_CLIPPING = 0.0
"""Global gradient-norm clipping; 0 is off (TrainerConfig has no field for it yet)."""
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def ds_config(config: TrainerConfig, on_gpu: bool) -> dict[str, Any]:
    """The DeepSpeed config of the policy model (pure; see the module doc for the accumulation mode)."""
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter sharded, also the small ones
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": GRADIENT_CLIPPING,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": config.lr,
                "betas": list(ADAM_BETAS),
                "eps": ADAM_EPS,
                "weight_decay": WEIGHT_DECAY,
                "torch_adam": True,
            },
        },
        "zero_optimization": zero,
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def reference_ds_config(config: TrainerConfig, on_gpu: bool) -> dict[str, Any]:
    """The frozen reference model's config: sharded like the policy under ZeRO-3, no optimizer."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "bf16": {"enabled": on_gpu},
        "steps_per_print": 2**31 - 1,
    }


def model_dtype(on_gpu: bool) -> torch.dtype:
    """The dtype the trainer holds (and exports) the model in: bf16 on GPUs, float32 on the CPU."""
    return torch.bfloat16 if on_gpu else torch.float32


def load_model(model_dir: Path, on_gpu: bool, attention: str | None = None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    extra = {"attn_implementation": attention} if attention else {}  # tree batches: samples.tree_attention
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=model_dtype(on_gpu), local_files_only=True, **extra
    )
    model.config.use_cache = False
    model.eval()  # no dropout: the policy's logprobs are those the engine samples with
    return model


@dataclass
class Models:
    """The policy engine and, with ``kl_coef > 0``, the frozen reference (a module or a ZeRO-3 engine);
    ``adapter``: the policy is a LoRA adapter, and with ``kl_coef > 0`` its reference is the base
    (``reference`` stays None: `reference_is_base`)."""

    engine: Any
    reference: torch.nn.Module | None
    device: torch.device
    dtype: torch.dtype
    adapter: bool = False
    kl: bool = False

    @property
    def reference_is_base(self) -> bool:
        return self.adapter and self.kl


def build(model_dir: Path, config: TrainerConfig, on_gpu: bool, local_rank: int) -> Models:
    deepspeed = import_deepspeed()

    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    started = time.monotonic()
    attention = tree_attention(on_gpu, config.merge.tree_attention) if config.merge.mode == "tree" else None
    model = load_model(model_dir, on_gpu, attention)
    if config.lora is not None:
        model = lora.wrap(model, config.lora)
    loaded = time.monotonic()
    trained = lora.trainable(model)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config(config, on_gpu))
    log.info(
        "model loaded in %.1f s, DeepSpeed engine (ZeRO-%d) built in %.1f s%s",
        loaded - started,
        config.zero_stage,
        time.monotonic() - loaded,
        ""
        if config.lora is None
        else f"; LoRA rank {config.lora.rank}: {sum(p.numel() for p in trained):,} trained parameters",
    )
    reference = None
    if config.kl_coef > 0 and config.lora is None:
        ref = load_model(model_dir, on_gpu, attention).requires_grad_(False)
        if config.zero_stage == 3:
            ref_engine, *_ = deepspeed.initialize(model=ref, config=reference_ds_config(config, on_gpu))
            reference = ref_engine.module
        else:
            reference = ref.to(device)
        reference.eval()
    return Models(
        engine=engine,
        reference=reference,
        device=device,
        dtype=model_dtype(on_gpu),
        adapter=config.lora is not None,
        kl=config.kl_coef > 0,
    )


# ---- weights -------------------------------------------------------------------------------------------


def full_state_dict(models: Models, rank: int) -> dict[str, torch.Tensor] | None:
    """The whole model's weights on the CPU in the model's dtype, on rank 0 (None elsewhere). A collective
    under ZeRO-3 (parameters are gathered one module at a time): every rank must call it."""
    engine = models.engine
    if engine.zero_optimization_partition_weights():
        state = engine._zero3_consolidated_16bit_state_dict()
    elif rank == 0:
        state = engine.module.state_dict()
    else:
        state = None
    if state is None:
        return None
    return {
        k: v.detach().to("cpu", models.dtype if v.is_floating_point() else v.dtype) for k, v in state.items()
    }


def export_weights(models: Models, work: WorkDir, step: int, model_dir: Path, rank: int) -> Path:
    """Write ``weights/step-N`` (save_pretrained + the initial model's tokenizer files) on rank 0.
    A collective under ZeRO-3. Returns the folder (written only by rank 0). A LoRA policy writes its
    adapter folder only (`ajet_hpc.engine.adapter`), its tensors alone gathered."""
    module = models.engine.module
    if models.adapter:
        zero3 = models.engine.zero_optimization_partition_weights()
        adapter = lora.adapter_state(module, zero3, models.dtype)
        final = work.weights_dir(step)
        if rank != 0:
            return final
        staged = staging_dir(work, step)
        lora.save_adapter(module, adapter, staged)
        return publish_weights(work, step, staged)
    state = full_state_dict(models, rank)
    final = work.weights_dir(step)
    if rank != 0:
        return final
    staged = staging_dir(work, step)
    module.save_pretrained(staged, state_dict=state, safe_serialization=True)
    copy_model_extras(model_dir, staged)
    return publish_weights(work, step, staged)


# ---- checkpoints ---------------------------------------------------------------------------------------


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(models: Models, work: WorkDir, step: int, rank: int, world_size: int, stage: int) -> None:
    """DeepSpeed checkpoint ``ds/step-N`` plus each rank's RNG state; then rank 0 names it in
    ``trainer_state.json``. All ranks call it. A crash before the last write leaves the previous one."""
    import torch.distributed as dist

    tag = step_name(step)
    tag_dir = work.ds / tag
    if rank == 0 and tag_dir.exists():  # left by an abandoned run that got past this step
        shutil.rmtree(tag_dir)
    dist.barrier()
    models.engine.save_checkpoint(
        str(work.ds), tag=tag, client_state={"ajet_step": step}, exclude_frozen_parameters=models.adapter
    )
    rng = tag_dir / _rng_file(rank)
    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    write_bytes_atomic(rng, buffer.getvalue())
    dist.barrier()
    if rank == 0:
        files = [_rng_file(r) for r in range(world_size)]
        state = TrainerState(step=step, tag=tag, world_size=world_size, zero_stage=stage, rng_files=files)
        commit_checkpoint(work, next_trainer_state(read_trainer_state(work), state))
        _test_exit_after_commit(work, step)
    dist.barrier()


def _test_exit_after_commit(work: WorkDir, step: int) -> None:
    """The hook `fault_injection.EXIT_AFTER_COMMIT` (tests only)."""
    if fault_injection.armed(fault_injection.EXIT_AFTER_COMMIT) != str(step):
        return
    marker = work.root / f".test-exit-after-commit-{step}"
    if not marker.exists():
        marker.touch()
        log.warning(
            "test hook %s: exiting after the commit of step %d", fault_injection.EXIT_AFTER_COMMIT, step
        )
        logging.shutdown()
        os._exit(137)


def resume(
    models: Models, work: WorkDir, rank: int, world_size: int, stage: int, recorded: int | None = None
) -> int:
    """Load the checkpoint ``trainer_state.json`` names, if any; the step it was taken after (0: fresh).
    ``recorded``: the last step the coordinator recorded; a checkpoint past it is gone back from
    (`checkpoints.resume_point`), and rank 0 names the one resumed from the trusted one. All ranks call it."""
    import torch.distributed as dist

    trusted = read_trainer_state(work)
    if trusted is None:
        return 0
    state, why = resume_point(trusted, recorded)
    if why is not None and rank == 0:
        log.warning("%s", why)
    if state is not trusted:
        dist.barrier()  # every rank has read the trusted state
        if rank == 0:
            uncommit_checkpoint(work, state)
    if state is None:
        return 0
    if (state.world_size, state.zero_stage) != (world_size, stage):
        raise RuntimeError(
            f"checkpoint {work.ds / state.tag} was written by {state.world_size} ranks with ZeRO stage "
            f"{state.zero_stage}; these are {world_size} ranks with stage {stage}: use the same "
            f"trainer.ranks (x nodes) and trainer.zero_stage, or start afresh in another work dir"
        )
    started = time.monotonic()
    # a LoRA checkpoint holds the adapter only (`save_checkpoint`): the base comes from the model folder
    path, client = models.engine.load_checkpoint(
        str(work.ds), tag=state.tag, load_module_strict=not models.adapter
    )
    if path is None:
        raise RuntimeError(f"DeepSpeed found no checkpoint {state.tag} in {work.ds}")
    if client.get("ajet_step") != state.step:
        raise RuntimeError(f"checkpoint {state.tag} holds step {client.get('ajet_step')}, not {state.step}")
    _set_rng_state(torch.load(work.ds / state.tag / state.rng_files[rank], weights_only=True))
    log.info("resumed from %s (step %d) in %.1f s", path, state.step, time.monotonic() - started)
    return state.step
