"""The GPU path in one short run (by hand on a GPU machine; CI has none): engine and DeepSpeed ZeRO-3
trainer colocated on one GPU, a Qwen2.5-0.5B-shaped model with random weights built from a config written
here (tied embeddings, bf16; no download), GRPO steps with the weight sync of the real server, and the
engine's logprobs after each sync against a transformers forward of the trained weights.

The engine is vLLM (CUDA build) with sleep mode when it imports, as a colocated server runs it; where vLLM
is missing (a machine that cannot install its CUDA wheel) the transformers engine takes its place and the
RESULT line says ``engine=transformers`` (then ``wake_s`` is 0: nothing sleeps). The trainer's ranks are
started by the server's own launcher code with the colocate placement (one rank bound to the GPU through
``AJET_RANK_GPUS``), and talk to this process through the same file protocol.

    make install && .venv/bin/python tools/gpu_check.py        # ends with RESULT gpu_ok=1 ...
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

import torch

from ajet_hpc.algo.samples import Sample
from ajet_hpc.config.topology import TrainerConfig
from ajet_hpc.engine.base import SamplingParams, generate_all
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.select import vllm_available
from ajet_hpc.launch.placement import cpu_placement, plan_placement
from ajet_hpc.trainer.launch import start_ranks
from ajet_hpc.trainer.protocol import TrainerChannel

QWEN25_05B = {
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


def make_engine(model: Path, use_vllm: bool):
    if use_vllm:
        from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings

        on_gpu = torch.cuda.is_available()
        settings = VllmSettings(
            dtype="bfloat16" if on_gpu else "float32",
            max_model_len=512,
            gpu_memory_utilization=0.3,
            enable_sleep_mode=on_gpu,
        )
        return VllmEngine(model, settings)
    from ajet_hpc.engine.transformers_engine import TransformersEngine, TransformersSettings

    return TransformersEngine(model, TransformersSettings(max_model_len=512))


def score(folder: Path, prompt: list[int], response: list[int], device: str) -> list[float]:
    """Each response token's logprob under a fresh transformers load of ``folder`` (bf16 on CUDA)."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response], device=device)).logits[0].float()
    table = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return table.gather(1, torch.tensor(response, device=device)[:, None])[:, 0].tolist()


async def rollouts(engine, prompt: list[int], group: int, version: int) -> list[Sample]:
    params = SamplingParams(max_tokens=24, temperature=1.0)
    outs = [await generate_all(engine, prompt, params, f"v{version}-{i}") for i in range(group)]
    rewards = [random.random() for _ in outs]
    mean, std = statistics.fmean(rewards), statistics.pstdev(rewards) or 1.0
    samples = []
    for i, (out, reward) in enumerate(zip(outs, rewards, strict=True)):
        n = len(prompt) + len(out.token_ids)
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
        assert len(samples[-1].token_ids) == n
    return samples


async def check(args: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="ajet-gpu-check-"))
    model = build_model(work / "model", args.layers)
    use_vllm, why = vllm_available()
    print(f"engine: {'vllm' if use_vllm else 'transformers'} ({why})")
    engine = make_engine(model, use_vllm)
    started = time.monotonic()
    await engine.start()
    print(f"engine up in {time.monotonic() - started:.1f} s")
    config = TrainerConfig(zero_stage=3, ranks=1, lr=1e-4, total_steps=args.steps, save_every=10**6)
    if args.cpu:  # a smoke test of this script where there is no GPU
        placement = cpu_placement(1)
    else:
        placement = plan_placement(nodes=1, gpus_per_node=1, mode="colocate", engine_gpus=1, cpu_ranks=1)
    log_path = work / "ranks.log"
    process = start_ranks(
        work / "trainer", model, config, on_slurm=False, placement=placement, log_path=log_path
    )
    channel = TrainerChannel(work / "trainer", alive=lambda: process.poll() is None, log_path=log_path)
    figures: dict[str, list[float]] = {"step_s": [], "sync_s": [], "wake_s": [], "sleep_s": [], "maxdiff": []}
    try:
        ready = await channel.wait_ready(timeout_s=600)
        print(f"trainer ready: {json.dumps(ready)}")
        prompt = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": "2+3="}], add_generation_prompt=True, return_dict=False
        )
        for step in range(1, args.steps + 1):
            samples = await rollouts(engine, prompt, args.group, step - 1)
            figures["sleep_s"].append(await engine.sleep())
            began = time.monotonic()
            channel.submit(step, samples)
            result = await channel.wait_result(step, timeout_s=600)
            figures["step_s"].append(time.monotonic() - began)
            began = time.monotonic()
            figures["wake_s"].append(await engine.wake_up())
            await engine.load_weights(Path(result["weights_dir"]), step)
            figures["sync_s"].append(time.monotonic() - began)
            out = await generate_all(
                engine, prompt, SamplingParams(max_tokens=16, temperature=0.0), f"g{step}"
            )
            reference = score(
                Path(result["weights_dir"]), prompt, out.token_ids, "cpu" if args.cpu else "cuda"
            )
            diff = max(abs(a - b) for a, b in zip(out.logprobs, reference, strict=True))
            figures["maxdiff"].append(diff)
            print(
                f"step {step}: loss {result['loss']:.4f}, trainer {figures['step_s'][-1]:.2f} s "
                f"(export {result.get('export_time_s')} s), sync {figures['sync_s'][-1]:.2f} s, "
                f"wake {figures['wake_s'][-1]:.2f} s, engine-vs-trained logprob maxdiff {diff:.4f}"
            )
        channel.request_stop()
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
        await engine.stop()
    return {
        "engine": "vllm" if use_vllm else "transformers",
        "step_s": statistics.median(figures["step_s"]),
        "sync_s": statistics.median(figures["sync_s"]),
        "wake_s": statistics.median(figures["wake_s"]),
        "logprob_maxdiff": max(figures["maxdiff"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--group", type=int, default=8, help="rollouts per step")
    parser.add_argument("--layers", type=int, default=24, help="decoder layers (Qwen2.5-0.5B has 24)")
    parser.add_argument("--tolerance", type=float, default=0.1, help="bf16 logprob agreement bound")
    parser.add_argument("--cpu", action="store_true", help="smoke-test this script on the CPU")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU", file=sys.stderr)
        return 2
    print("device:", "cpu" if args.cpu else torch.cuda.get_device_name(0), "torch", torch.__version__)
    random.seed(0)
    result = asyncio.run(check(args))
    ok = result["logprob_maxdiff"] <= args.tolerance
    print(
        f"RESULT gpu_ok={int(ok)} engine={result['engine']} step_s={result['step_s']:.3f} "
        f"sync_s={result['sync_s']:.3f} wake_s={result['wake_s']:.3f} "
        f"logprob_maxdiff={result['logprob_maxdiff']:.4f}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
