"""A gloo backend for vLLM's weight-transfer API, so that CPU runs (CI, laptops) take the very path GPUs take.

vLLM 0.32 moves trainer weights into a running engine through ``vllm.distributed.weight_transfer``: a worker
side (``WeightTransferEngine``: init, start, receive chunks, finish) created in each vLLM worker from the
engine's ``weight_transfer_config``, and a trainer side (``TrainerWeightTransferEngine``) that drives the
same four calls through a ``VLLMWeightSyncClient`` while it sends. Its built-in transports are NCCL and CUDA
IPC. This module adds ``ajet_gloo``: the trainer's rank 0 and the engine's workers form their own gloo
group (not the default group of either side) and the weights travel as broadcasts of flat buckets of
``bucket_bytes``, received into the model with vLLM's layerwise reload, as the NCCL backend does.

Both sides are registered with vLLM's factories by :func:`register`, which vLLM runs in every process
through our ``vllm.general_plugins`` entry point (pyproject.toml), and which the trainer calls itself.
"""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ajet_hpc import fault_injection
from ajet_hpc.engine.vllm_signals import shield_from_job_signals

log = logging.getLogger(__name__)

BACKEND = "ajet_gloo"


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Worker side: where the trainer's rank 0 listens, and this worker's place in the transfer group."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float
    bucket_bytes: int


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One update: every parameter's name, dtype and shape, in the order they are sent."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: the group's address (rank 0 listens there; port 0: any free one), its size (1 +
    engine workers)."""

    backend: ClassVar[str] = BACKEND
    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 300.0
    bucket_bytes: int = 256 * 2**20


ALIGN = 64
"""Byte alignment of each tensor inside a bucket, so any dtype can be viewed in place."""


@dataclass(frozen=True)
class Piece:
    index: int  # position in the metadata
    offset: int  # byte offset in its bucket
    nbytes: int


def buckets(
    names: list[str], shapes: list, dtypes: list[torch.dtype], bucket_bytes: int
) -> list[list[Piece]]:
    """The transfer plan, computed alike on both sides from the same metadata: whole decoder layers (vLLM's
    ``layerwise_groups``) packed into buckets of about ``bucket_bytes`` (a bigger layer travels alone).

    A bucket never ends inside a layer, so each layer the engine receives is complete, processed and copied
    into the model before the bucket's buffer is reused: both sides keep two buffers and reuse them for
    every bucket of every sync (no new memory per sync, and the next bucket travels while one is loaded).
    Tensors travel as raw bytes, so one bucket may hold several dtypes."""
    from vllm.distributed.weight_transfer.base import layerwise_groups

    index = {name: i for i, name in enumerate(names)}
    plan: list[list[Piece]] = []
    size = 0
    for group in layerwise_groups(names):
        pieces = []
        for name in group:
            i = index[name]
            nbytes = _numel(shapes[i]) * torch.empty((), dtype=dtypes[i]).element_size()
            pieces.append((i, nbytes))
        group_bytes = sum(-(-n // ALIGN) * ALIGN for _, n in pieces)
        if not plan or size + group_bytes > bucket_bytes:
            plan.append([])
            size = 0
        for i, nbytes in pieces:
            plan[-1].append(Piece(i, size, nbytes))
            size += -(-nbytes // ALIGN) * ALIGN
    return plan


def bucket_size(bucket: list[Piece]) -> int:
    last = bucket[-1]
    return last.offset + last.nbytes


class Buffers:
    """Two reusable byte buffers, grown to the largest bucket (see `buckets`)."""

    def __init__(self) -> None:
        self._pair = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]

    def get(self, which: int, nbytes: int) -> torch.Tensor:
        if self._pair[which].numel() < nbytes:
            self._pair[which] = torch.empty(nbytes, dtype=torch.uint8)
        return self._pair[which][:nbytes]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _broadcast(group, tensor: torch.Tensor):
    """Start broadcasting ``tensor`` from the group's rank 0; the returned work is waited on later."""
    from torch.distributed import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def _open_group(address: str, port: int, rank: int, world_size: int, timeout_s: float, listen=None):
    """The transfer group, apart from either side's default process group. Rank 0 (the trainer) hosts its
    store on the socket it bound (``listen``): under torchrun a plain tcp:// rendezvous would look for
    torchrun's own agent store instead."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        address,
        port,
        rank,
        world_size,
        "gloo",
        timeout=datetime.timedelta(seconds=timeout_s),
        listen_socket=listen,
    )


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("", port))
    sock.listen(64)
    return sock


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """The vLLM worker's side (see the module doc)."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.bucket_bytes = 256 * 2**20
        self.buffers = Buffers()

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        self.bucket_bytes = init_info.bucket_bytes
        rank = init_info.rank_offset + self.parallel_config.rank
        self.group = _open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)  # the engine re-ties a tied head after

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer: init_weight_transfer_engine was not called")
        shapes = [tuple(s) for s in update_info.shapes]
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        plan = buckets(update_info.names, shapes, dtypes, self.bucket_bytes)
        pending = _broadcast(self.group, self.buffers.get(0, bucket_size(plan[0])))
        for k, bucket in enumerate(plan):
            pending.wait()
            buffer = self.buffers.get(k % 2, bucket_size(bucket))
            if k + 1 < len(plan):  # the next bucket travels while this one is loaded
                pending = _broadcast(self.group, self.buffers.get((k + 1) % 2, bucket_size(plan[k + 1])))
            self.model.load_weights(
                (
                    update_info.names[p.index],
                    buffer[p.offset : p.offset + p.nbytes].view(dtypes[p.index]).view(shapes[p.index]),
                )
                for p in bucket
            )

    def update_weights(self, update_info: dict) -> None:  # no device to synchronise on the CPU
        self.receive_weights(self.parse_update_info(update_info))

    def shutdown(self) -> None:
        self.group = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer's side: rank 0 sends, every rank iterates the source (a gather under ZeRO-3)."""

    init_info_cls = GlooTrainerInitInfo
    source: WeightSource  # vLLM's base allows none (payload-only backends); this one always iterates one

    def __init__(self, *, client, source: WeightSource, is_sender: bool, bucket_bytes: int) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes = bucket_bytes
        self.group = None
        self.buffers = Buffers()

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client, source=None):
        if source is None:
            raise ValueError("the gloo weight transfer needs a WeightSource")
        engine = cls(
            client=client, source=source, is_sender=init_info.is_sender, bucket_bytes=init_info.bucket_bytes
        )
        if not engine.is_sender:
            return engine
        listen = _listen(init_info.master_port)
        worker_info = GlooInitInfo(
            master_address=init_info.master_address,
            master_port=listen.getsockname()[1],
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            bucket_bytes=init_info.bucket_bytes,
        )
        # the workers wait inside init_weight_transfer_engine for the rendezvous: both sides at once
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(engine.client.init_weight_transfer_engine, asdict(worker_info))
            engine.group = _open_group(
                init_info.master_address,
                worker_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
                listen=listen,
            )
            joined.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:  # stay in the trainer's gather collectives
                pass
            return
        info = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            received = pool.submit(self.client.update_weights, asdict(info))
            self._send(meta)
            received.result()
        finally:
            pool.shutdown(wait=False)  # a failed send leaves the receiver blocked until its timeout
        self.client.finish_weight_update()

    def _send(self, meta) -> None:
        tensors = self._checked(meta)
        names = [m.name for m in meta]
        plan = buckets(names, [tuple(m.shape) for m in meta], [m.dtype for m in meta], self.bucket_bytes)
        if [p.index for bucket in plan for p in bucket] != list(range(len(meta))):
            raise ValueError("the weight source's metadata is not in decoder-layer order (layerwise_groups)")
        stall = int(fault_injection.armed(fault_injection.SYNC_STALL_BUCKET) or "-1")  # tests only
        pending = None
        for k, bucket in enumerate(plan):
            if k == stall:  # tests: a sender that stops midway (killed while it waits here)
                log.warning("%s=%d: stalling before bucket %d", fault_injection.SYNC_STALL_BUCKET, stall, k)
                time.sleep(3600)
            buffer = self.buffers.get(k % 2, bucket_size(bucket))  # free: the bucket before the last is sent
            for p in bucket:
                tensor = next(tensors)
                flat = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
                buffer[p.offset : p.offset + p.nbytes].copy_(flat)
            if pending is not None:
                pending.wait()
            pending = _broadcast(self.group, buffer)
        if pending is not None:
            pending.wait()

    def _checked(self, meta) -> Iterator[torch.Tensor]:
        for i, (name, tensor) in enumerate(self.source):
            expected = meta[i]
            if name != expected.name or tuple(tensor.shape) != tuple(expected.shape):
                raise ValueError(
                    f"weight source yielded {name} {tuple(tensor.shape)} at {i}, metadata says "
                    f"{expected.name} {tuple(expected.shape)}"
                )
            yield tensor

    def shutdown(self) -> None:
        self.group = None


def register() -> None:
    """Register ``ajet_gloo`` with vLLM's worker and trainer factories (idempotent); in vLLM's own
    processes, also ignore the job's signals (`vllm_signals.shield_from_job_signals`)."""
    shield_from_job_signals()
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, GlooWeightTransferEngine)
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, GlooTrainerWeightTransferEngine)
