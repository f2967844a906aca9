"""The GPU path in one short run (by hand on a GPU machine; CI has none): engine and DeepSpeed ZeRO-3
trainer colocated on one GPU, a Qwen2.5-0.5B-shaped model with random weights built from a config written
here (tied embeddings, bf16; no download), GRPO steps, and the engine's logprobs after each weight sync.

With vLLM (CUDA build) the engine sleeps while the rank trains (sleep mode) and the weights reach it in
memory (``weight_sync: memory``: CUDA IPC, the rank shares the engine's GPU); a second pass reloads them
from disk instead, and the engine's logprobs after the two must agree, and agree with a transformers
forward of the trained weights. Where vLLM is missing (a machine that cannot install its CUDA wheel) the
transformers engine takes its place with the disk pass only, and the RESULT line says so
(``engine=transformers+disk``, ``wake_s`` 0). The ranks are started by the server's own launcher code with
the colocate placement (one rank bound to the GPU through ``AJET_RANK_GPUS``).

    make install && .venv/bin/python tools/gpu_check.py        # ends with RESULT gpu_ok=1 ...
    .venv/bin/python tools/gpu_check.py --cpu --layers 2       # smoke test of the script on a CPU machine
    .venv/bin/python tools/gpu_check.py --flex-only            # only the tree mask check (below)

Then LoRA (``trainer.lora``): the same rank trains a rank-16 adapter under ZeRO-3 in bf16 (the base frozen
and partitioned, the adapter gathered alone for its export, the KL term against the base with the adapter
disabled), and a transformers engine serving the adapter through peft loads each step's adapter folder; its
logprobs must agree with a fresh peft forward of that folder (``lora_maxdiff``, within the bf16 bound).

First, a tree-packed micro-batch (``merge.mode: tree``) through FlexAttention's block mask against SDPA's
dense mask, forward and backward (``flex_tree_check``: the training path of ``merge.tree_attention: flex``,
which the CPU tests cannot run); ``flex_tree_diff`` in the RESULT line, at most 1e-3 to pass. And every
algorithm and off-policy correction of ``trainer.algorithm`` / ``trainer.off_policy`` in bf16 against
float32 (``algorithm_bf16_check``; ``algo_bf16_diff``, at most ``ALGORITHM_BF16_BOUND``;
``algo_bf16_seqw_diff`` for sequence-level importance weights, reported only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.config.placement import cpu_placement, plan_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.base import SamplingParams, generate_all
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import vllm_available
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.protocol.sync_channel import SyncServer, clear
from ajet_hpc.trainer.protocol.sync_plan import SyncBackend, SyncPlan
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights, MemoryWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

# a config.json's fields, passed as keyword arguments to transformers' config classes
QWEN25_05B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def build_model(dest: Path, layers: int) -> Path:
    """A random Qwen2.5-0.5B-shaped model (``layers`` of its 24) with the built-in tiny tokenizer's files
    (token ids below 104, inside the vocabulary), saved in bf16."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**QWEN25_05B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(dest)
    tiny = resolve_model("builtin:tiny", dest.parent / "builtin")
    for extra in [*tiny.glob("tokenizer*"), tiny / "chat_template.jinja"]:
        (dest / extra.name).write_bytes(extra.read_bytes())
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen2-shaped, {layers} layers, {params / 1e6:.0f}M parameters, tied embeddings, bf16")
    return dest


def make_engine(model: Path, use_vllm: bool, backend: SyncBackend | None):
    if use_vllm:
        from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

        on_gpu = torch.cuda.is_available()
        settings = VllmSettings(
            dtype="bfloat16" if on_gpu else "float32",
            max_model_len=512,
            gpu_memory_utilization=0.3,
            enable_sleep_mode=on_gpu,
            weight_transfer_backend=backend,
        )
        return VllmEngine(model, settings)
    from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings

    return TransformersEngine(model, TransformersSettings(max_model_len=512))


def score(folder: Path, prompt: list[int], response: list[int], device: str) -> list[float]:
    """Each response token's logprob under a fresh transformers load of ``folder`` (bf16 on CUDA)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    # transformers declares PreTrainedModel.to through functools.wraps, which mypy does not bind as a method
    model = cast(torch.nn.Module, loaded).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device=device)).logits[0].float()
    table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return table.gather(1, torch.tensor(response, device=device)[:, None])[:, 0].tolist()


async def rollouts(engine, prompt: list[int], group: int, version: int) -> list[Sample]:
    """``group`` sampled answers (seeded: both passes draw the same ones from the same weights), rewards
    from a seeded random stream, group-normalised advantages on the answer tokens."""
    rewards_rng = random.Random(version)
    samples = []
    outs = []
    for i in range(group):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=1000 * version + i)
        outs.append(await generate_all(engine, prompt, params, f"v{version}-{i}-{time.monotonic_ns()}"))
    rewards = [rewards_rng.random() for _ in outs]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
    for i, (out, reward) in enumerate(zip(outs, rewards, strict=True)):
        mask = [0] * len(prompt) + [1] * len(out.token_ids)
        advantage = (reward - mean) / std
        samples.append(
            Sample(
                token_ids=prompt + out.token_ids,
                loss_mask=mask,
                old_logprobs=[0.0] * len(prompt) + list(out.logprobs),
                advantages=[advantage * m for m in mask],
                policy_version=version,
                episode_id=f"e{version}-{i}",
                task_id="t",
            )
        )
    return samples


async def train_pass(
    engine, model: Path, work: Path, args, backend: SyncBackend | None, lora: LoraConfig | None = None
) -> list[dict]:
    """``args.steps`` GRPO steps with the weights reaching the engine in memory (``backend``) or from disk
    (None); after each, the engine's greedy answer with its logprobs, and the timings. With ``lora`` the
    ranks train an adapter (and a KL term to the base) and the engine gets adapter folders."""
    config = TrainerConfig(
        zero_stage=3,
        ranks=1,
        lr=1e-4 if lora is None else 1e-3,
        total_steps=args.steps,
        save_every=10**6,
        lora=lora,
        kl_coef=0.0 if lora is None else 0.05,
    ).resolved(ServingConfig())
    if args.cpu:  # a smoke test of this script where there is no GPU
        placement = cpu_placement(1)
    else:
        placement = plan_placement(nodes=1, gpus_per_node=1, mode="colocate", engine_gpus=1, cpu_ranks=1)
    sync_server = None
    if backend is not None:
        clear(WorkDir(work).sync)
        sync_server = asyncio.get_running_loop().create_task(
            SyncServer(WorkDir(work).sync, engine.weight_transfer).serve()
        )
    log_path = work / "ranks.log"
    process = start_ranks(
        work, model, config, on_slurm=False, placement=placement, log_path=log_path, sync=SyncPlan(backend, 1)
    )
    channel = TrainerChannel(work, alive=lambda: process.poll() is None, log_path=log_path)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+3="}], add_generation_prompt=True, return_dict=False
    )
    steps = []
    try:
        ready = await channel.wait_ready(timeout_s=600)
        print(f"trainer ready ({'memory ' + backend if backend else 'disk'}): {json.dumps(ready)}")
        for step in range(1, args.steps + 1):
            samples = await rollouts(engine, prompt, args.group, step - 1)
            sleep_s = await engine.sleep()
            began = time.monotonic()
            channel.submit(step, samples)
            result = await channel.wait_result(step, timeout_s=600)
            step_s = time.monotonic() - began
            began = time.monotonic()
            wake_s = await engine.wake_up()
            if isinstance(result.weights, MemoryWeights):  # sent before the result was written
                sync_s = result.weights.send_s
            else:
                assert isinstance(result.weights, DiskWeights), (
                    f"{result.weights.kind} weights: only a server whose job ends gets those"
                )
                await engine.load_weights(result.weights.folder, step)
                sync_s = time.monotonic() - began
            greedy = SamplingParams(max_tokens=16, temperature=0.0)
            out = await generate_all(engine, prompt, greedy, f"g{step}-{backend}")
            steps.append(
                dict(
                    result=result,
                    step_s=step_s,
                    sync_s=sync_s,
                    wake_s=wake_s,
                    sleep_s=sleep_s,
                    prompt=prompt,
                    tokens=out.token_ids,
                    logprobs=out.logprobs,
                )
            )
            print(
                f"step {step}: loss {result.loss:.4f}, trainer {step_s:.2f} s, weights "
                f"{result.weights.kind} {sync_s:.3f} s, wake {wake_s:.2f} s, sleep {sleep_s:.2f} s"
            )
        channel.request_stop()
        await asyncio.to_thread(process.wait, 120)
    finally:
        if process.poll() is None:
            process.kill()
        if sync_server is not None:
            sync_server.cancel()
    return steps


def tree_samples(seed: int, branches: int = 6, prefix: int = 200, answer: int = 40) -> list[Sample]:
    """Forked calls of one episode: a shared prefix, then each call its own answer (trained), some calls
    continuing an earlier one; packed into one tree by ``pack_tree``, as ``merge.mode: tree`` does."""
    rng = random.Random(seed)
    stem = [rng.randrange(1, 1000) for _ in range(prefix)]
    calls: list[list[int]] = []
    out = []
    for k in range(branches):
        base = rng.choice(calls) if calls and rng.random() < 0.5 else stem
        body = [rng.randrange(1, 1000) for _ in range(answer)]
        calls.append(base + body)
        n = len(calls[-1])
        out.append(
            Sample(
                token_ids=calls[-1],
                loss_mask=[0] * len(base) + [1] * answer,
                old_logprobs=[0.0] * n,
                advantages=[0.0] * len(base) + [1.0] * answer,
                policy_version=0,
                episode_id="e",
                task_id="t",
                calls=[k],
            )
        )
    return out


def flex_tree_check(device: str) -> float:
    """A tree-packed micro-batch through FlexAttention's block mask against SDPA's dense mask: the trained
    tokens' logprobs, and on a GPU the gradients of their sum (what ``merge.tree_attention: flex`` trains
    with; the CPU tests compare the attention forward only, FlexAttention has no backward there). A small
    Qwen2 with random weights, float32, the trainer's own ``collate``, ``model_inputs`` and
    ``model_logprobs``. Returns the largest difference relative to the largest value compared."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet_hpc.algo.output_layer import model_logprobs
    from ajet_hpc.algo.sample_tensors import collate
    from ajet_hpc.algo.tree_packing import pack_tree
    from ajet_hpc.trainer.ranks.step import model_inputs

    shape = dict(QWEN25_05B, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
    shape.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, torch_dtype="float32")
    config = Qwen2Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    tree = pack_tree(tree_samples(0))
    assert tree.parents is not None, "the forked calls packed into one chain"
    weights = None
    found: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}
    backward = device != "cpu"
    for attention in ("sdpa", "flex_attention"):
        model = Qwen2ForCausalLM._from_config(config, attn_implementation=attention)
        if weights is None:
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(weights)
        model.to(device)
        batch = collate([tree], 0, dense_tree_mask=attention != "flex_attention")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.set_grad_enabled(backward):
            inputs = model_inputs(batch, attention, torch.float32)
            logprobs, _ = model_logprobs(
                model, inputs, batch["loss_mask"], batch.get("parents"), chunk_tokens=2**62
            )
            if backward:
                logprobs.sum().backward()
        grads = [p.grad.detach().float().cpu() for p in model.parameters() if p.grad is not None]
        found[attention] = (logprobs.detach().float().cpu(), grads)
    (dense, dense_grads), (flex, flex_grads) = found["sdpa"], found["flex_attention"]
    diff = float((dense - flex).abs().max() / dense.abs().max().clamp_min(1e-12))
    for a, b in zip(dense_grads, flex_grads, strict=True):
        diff = max(diff, float((a - b).abs().max() / a.abs().max().clamp_min(1e-12)))
    print(
        f"tree mask, {len(tree)} packed tokens of {len(tree.calls)} calls: flex_attention vs sdpa "
        f"({'forward and backward' if backward else 'forward only'}): largest relative difference {diff:.2e}"
    )
    return diff


ALGORITHM_BF16_BOUND = 0.05  # bf16 keeps 8 bits of mantissa: ~0.4% per value, a few % over a backward
ALGORITHM_CHECKS: dict[str, dict[str, Any]] = {
    "grpo": {},
    "dr_grpo": {"algorithm": "dr_grpo"},
    "dapo": {"algorithm": "dapo"},
    "gspo": {"algorithm": "gspo", "clip_eps": 0.2, "clip_eps_high": 0.28},  # wide: no clip flips
    "rloo": {"algorithm": "rloo"},
    "reinforce_pp": {"algorithm": "reinforce_pp"},
    "tis/token": {"recompute_logprobs": True, "off_policy": {"mode": "tis", "cap": 1.02}},
    "mis/sequence": {
        "algorithm": "gspo",
        "recompute_logprobs": True,
        "off_policy": {"mode": "mis", "level": "sequence", "low": 0.5, "high": 2.0},
    },
}


def algorithm_bf16_check(device: str) -> tuple[float, float]:
    """Every algorithm's loss and off-policy correction in bf16 against float32 (``ALGORITHM_CHECKS``):
    the same small Qwen2 in both dtypes, forked calls with advantages of both signs, engine log-
    probabilities a little off the model's, the trainer's own objective (``ajet_hpc.algo.objective``).
    Returns the largest relative difference of a gradient (its norm) or a loss, over the objectives with
    token-level weights, and the same for sequence-level weights: these multiply the bf16 forward's error
    over every token of an answer (a product of ratios), so they differ from float32 by far more (about
    0.2 for 24-token answers on the CPU); that is the engine/trainer mismatch itself, reported, not bounded.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ajet_hpc.algo.objective import Objective
    from ajet_hpc.algo.output_layer import model_logprobs
    from ajet_hpc.algo.sample_tensors import collate
    from ajet_hpc.config.engine import ServingConfig
    from ajet_hpc.trainer.ranks.step import model_inputs

    shape = dict(QWEN25_05B, num_hidden_layers=2, hidden_size=256, intermediate_size=512)
    shape.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, torch_dtype="float32")
    config = Qwen2Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    models = {torch.float32: Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")}
    models[torch.bfloat16] = Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")
    models[torch.bfloat16].load_state_dict(models[torch.float32].state_dict())
    models[torch.bfloat16].to(torch.bfloat16)
    samples = tree_samples(1, answer=24)
    for k, sample in enumerate(samples):
        sign = 1.0 if k % 2 else -1.0
        sample.advantages = [a * sign * (1 + k / 4) for a in sample.advantages]
    batch = {key: value.to(device) for key, value in collate(samples, 0).items()}

    def logprobs_of(dtype: torch.dtype) -> torch.Tensor:
        model = models[dtype]
        inputs = model_inputs(batch, "sdpa", dtype)
        lp, _ = model_logprobs(model, inputs, batch["loss_mask"], None, chunk_tokens=2**62)
        return lp

    for model in models.values():
        model.to(device)
    with torch.no_grad():  # the engine: float32 logprobs, a little off
        noise = (
            torch.rand(batch["loss_mask"].shape, generator=torch.Generator().manual_seed(1)) - 0.5
        ) * 0.02
        engine = logprobs_of(torch.float32) + noise.to(device)
        batch["old_logprobs"] = torch.where(batch["loss_mask"] != 0, engine, 0.0)
    worst = {"token": (0.0, ""), "sequence": (0.0, "")}
    for name, settings in ALGORITHM_CHECKS.items():
        trainer = TrainerConfig.model_validate(settings).resolved(ServingConfig(max_tokens=64))
        objective = Objective.of(trainer)
        divisor = float(objective.divisor(samples))
        found = {}
        for dtype, model in models.items():
            model.zero_grad()
            part = objective.micro_loss(logprobs_of(dtype), batch, divisor)
            part.loss.backward()
            grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
            found[dtype] = (float(part.loss.detach()), grads)
        (loss32, grads32), (loss16, grads16) = found[torch.float32], found[torch.bfloat16]
        if not (torch.isfinite(grads16).all() and abs(loss16) < float("inf")):
            return float("inf"), float("inf")
        diff = max(
            float((grads16 - grads32).norm() / grads32.norm().clamp_min(1e-12)),
            abs(loss16 - loss32) / max(abs(loss32), 1e-3),
        )
        level = trainer.off_policy.level if trainer.off_policy.mode != "none" else "token"
        print(f"  {name}: {diff:.2e} (tokens truncated or masked: {int(part.hit.sum())})")
        worst[level] = max(worst[level], (diff, name))
    (token, token_name), (sequence, sequence_name) = worst["token"], worst["sequence"]
    print(
        f"algorithms in bf16 against float32: largest relative difference {token:.2e} ({token_name}); "
        f"with sequence-level weights {sequence:.2e} ({sequence_name})"
    )
    return token, sequence


def score_adapter(
    model: Path, adapter: Path, prompt: list[int], response: list[int], device: str
) -> list[float]:
    """Each response token's logprob under a fresh peft load of ``adapter`` on the base (bf16 on CUDA)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    base = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    net = cast(torch.nn.Module, PeftModel.from_pretrained(base, adapter)).to(device).eval()
    with torch.no_grad():
        logits = net(torch.tensor([prompt + response], device=device)).logits[0].float()
    table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    del net
    if device == "cuda":
        torch.cuda.empty_cache()
    return table.gather(1, torch.tensor(response, device=device)[:, None])[:, 0].tolist()


async def lora_check(model: Path, work: Path, args: argparse.Namespace) -> float:
    """LoRA under ZeRO-3 (module doc): the largest engine-vs-peft logprob difference over the steps."""
    from ajet_hpc.engine.adapter import write_initial_adapter
    from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings

    lora = LoraConfig(rank=16, alpha=32)
    v0 = write_initial_adapter(model, lora, work / "lora-v0")
    engine = TransformersEngine(model, TransformersSettings(max_model_len=512, lora_adapter=str(v0)))
    await engine.start()
    try:
        steps = await train_pass(engine, model, work / "lora", args, None, lora)
    finally:
        await engine.stop()
    device = "cpu" if args.cpu else "cuda"
    worst = 0.0
    for step in steps:
        folder = step["result"].weights.folder
        reference = score_adapter(model, folder, step["prompt"], step["tokens"], device)
        worst = max(worst, *(abs(a - b) for a, b in zip(step["logprobs"], reference, strict=True)))
    print(f"LoRA under ZeRO-3: engine (peft) vs a fresh peft forward of each step's adapter: {worst:.4f}")
    return worst


async def check(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ajet-gpu-check-"))
    model = build_model(work / "model", args.layers)
    use_vllm, why = vllm_available()
    # vLLM: weights in memory (CUDA IPC: the rank shares the engine's GPU), and a disk pass to compare with;
    # the transformers engine: from disk only
    backend: SyncBackend | None = ("ajet_gloo" if args.cpu else "ipc") if use_vllm else None
    print(f"engine: {'vllm' if use_vllm else 'transformers'} ({why})")
    engine = make_engine(model, use_vllm, backend)
    started = time.monotonic()
    await engine.start()
    print(f"engine up in {time.monotonic() - started:.1f} s")
    try:
        memory = await train_pass(engine, model, work / "memory", args, backend) if backend else []
        if memory:
            await engine.load_weights(model, 0)  # back to the initial weights for the disk pass
        disk = await train_pass(engine, model, work / "disk", args, None)
    finally:
        await engine.stop()
    device = "cpu" if args.cpu else "cuda"
    last = disk[-1]
    reference = score(last["result"].weights.folder, last["prompt"], last["tokens"], device)
    engine_vs_trained = max(abs(a - b) for a, b in zip(last["logprobs"], reference, strict=True))
    print(f"engine (disk reload) vs a transformers forward of the trained weights: {engine_vs_trained:.4f}")
    memory_vs_disk = 0.0
    if memory:
        for mem, dsk in zip(memory, disk, strict=True):
            if mem["tokens"] == dsk["tokens"]:
                diffs = [abs(a - b) for a, b in zip(mem["logprobs"], dsk["logprobs"], strict=True)]
                memory_vs_disk = max(memory_vs_disk, *diffs)
            else:
                memory_vs_disk = float("inf")
        print(f"engine after memory sync vs after disk reload: maxdiff {memory_vs_disk:.4f}")
    lora_maxdiff = await lora_check(model, work, args)
    timed = memory or disk
    return {
        "lora_maxdiff": lora_maxdiff,
        "engine": f"vllm+{backend}" if backend else "transformers+disk",
        "step_s": statistics.median(s["step_s"] for s in timed),
        "sync_s": statistics.median(s["sync_s"] for s in timed),
        "wake_s": statistics.median(s["wake_s"] for s in timed),
        "logprob_maxdiff": max(engine_vs_trained, memory_vs_disk),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group", type=int, default=8, help="rollouts per step")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="bf16 logprob agreement bound")
    parser.add_argument("--cpu", action="store_true", help="smoke-test this script on the CPU")
    parser.add_argument(
        "--flex-only", action="store_true", help="only the tree mask check (FlexAttention against SDPA)"
    )
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    print("device:", "cpu" if args.cpu else torch.cuda.get_device_name(0), "torch", torch.__version__)
    random.seed(0)
    flex_diff = flex_tree_check("cpu" if args.cpu else "cuda")
    algo_diff, algo_seq_diff = algorithm_bf16_check("cpu" if args.cpu else "cuda")
    result = asyncio.run(check(args)) if not args.flex_only else {}
    ok = (
        flex_diff <= 1e-3
        and algo_diff <= ALGORITHM_BF16_BOUND
        and result.get("logprob_maxdiff", 0.0) <= args.tolerance
        and result.get("lora_maxdiff", 0.0) <= args.tolerance
    )
    engine = (
        f"engine={result['engine']} step_s={result['step_s']:.3f} sync_s={result['sync_s']:.3f} "
        f"wake_s={result['wake_s']:.3f} logprob_maxdiff={result['logprob_maxdiff']:.4f} "
        f"lora_maxdiff={result['lora_maxdiff']:.4f} "
        if result
        else ""
    )
    print(
        f"RESULT gpu_ok={int(ok)} {engine}flex_tree_diff={flex_diff:.2e} algo_bf16_diff={algo_diff:.2e} "
        f"algo_bf16_seqw_diff={algo_seq_diff:.2e}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
