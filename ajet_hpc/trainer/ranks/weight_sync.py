"""The ranks' side of ``trainer.weight_sync: memory``: send the trained weights straight into the engine.

The server decides which of vLLM's transfer backends the ranks use and how many engine workers receive
(`sync_plan.SyncPlan`: ``nccl`` between GPUs, ``ipc`` when colocated on the same GPUs, ``ajet_gloo`` on
CPUs). Every rank builds the sender; rank 0 sends, the others only take part in the
gathers. vLLM's trainer engine for the backend does the handshake and the transfer; its control calls go to
the server through ``sync_channel``.

:class:`ZeroSource` is the ``WeightSource`` over a DeepSpeed engine: parameters in the model's own names
(those of its checkpoint, which vLLM's ``load_weights`` takes), one decoder layer at a time. Under ZeRO-3 a
layer's parameters are gathered together (``GatheredParameters``), copied out and released before the next
layer is gathered, so no rank ever holds more than one layer beyond its shard. A tied output head is the
embedding's parameter and is sent once, as the embedding.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ajet_hpc.config import TrainerConfig
from ajet_hpc.trainer.protocol.sync_plan import SyncPlan

log = logging.getLogger(__name__)

RENDEZVOUS = ("nccl", "ajet_gloo")
"""Backends whose engine receives inside ``update_weights`` while rank 0 sends, in the same collectives:
rank 0 sends only once the server took that call (`sync_channel.Expected`). IPC hands the engine buffers
in the call itself and needs no gate."""


def zero_source(module: torch.nn.Module, zero3: bool):
    """A vLLM ``WeightSource`` over a DeepSpeed-wrapped module (see the module doc)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, layerwise_groups

    class ZeroSource(WeightSource):
        def __init__(self) -> None:
            self.params = dict(module.named_parameters())  # deduplicated: a tied head is not repeated
            shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in self.params.items()}
            self.meta = [ParamMeta(n, p.dtype, shapes[n]) for n, p in self.params.items()]
            self.layer_groups = layerwise_groups([m.name for m in self.meta])
            order = [n for group in self.layer_groups for n in group]
            self.meta = sorted(self.meta, key=lambda m: order.index(m.name))
            self.gathered = 0  # groups of the current pass gathered so far (see `drain`)
            self.gate: Callable[[], None] | None = None  # rank 0: waits until the engine receives

        def metadata(self):
            return self.meta

        def new_pass(self) -> None:
            """A send begins: none of its gathers is done yet."""
            self.gathered = 0

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            self.new_pass()
            if self.gate is not None:  # before the first gather: on SyncInterrupted, `drain` does them all
                self.gate()
            for group in self.layer_groups:
                copies = self._gather(group)
                self.gathered += 1
                yield from zip(group, copies, strict=True)

        def drain(self) -> None:
            """Take part in the gathers of the pass that are left (a send stopped before its end): under
            ZeRO-3 every rank must join each layer's gather, or the others wait in it for ever."""
            if zero3:
                for group in self.layer_groups[self.gathered :]:
                    self._gather(group)
            self.gathered = len(self.layer_groups)

        def _gather(self, group: list[str]) -> list[torch.Tensor]:
            params = [self.params[n] for n in group]
            if not zero3:
                return [p.data.detach() for p in params]
            import deepspeed

            with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
                return [p.data.detach().clone() for p in params]

    return ZeroSource()


def _address(engine_host: str | None) -> str:
    """Where the engine's workers reach this rank: loopback when they run on this host."""
    if engine_host == socket.gethostname():
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.getfqdn()


@dataclass
class SyncStats:
    seconds: float
    bytes: int
    withheld: bool = False  # the server's job was ending: the weights did not reach the engine


class WeightSender:
    """Builds vLLM's trainer-side transfer engine for the backend the server chose and sends each step."""

    def __init__(
        self,
        module: torch.nn.Module,
        zero3: bool,
        config: TrainerConfig,
        folder: Path,
        rank: int,
        plan: SyncPlan,
    ) -> None:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from ajet_hpc.engine.weight_transfer import register
        from ajet_hpc.trainer.protocol.sync_channel import FileSyncClient

        register()
        if plan.backend is None:
            raise ValueError("a weight sender needs an in-memory sync plan; a disk plan exports the weights")
        self.backend, self.workers = plan.backend, plan.engine_workers
        self.rank = rank
        self.source = zero_source(module, zero3)
        self.bytes = sum(
            _numel(m.shape) * torch.empty((), dtype=m.dtype).element_size() for m in self.source.meta
        )
        self.client = FileSyncClient(folder, config.weight_sync_timeout_s)
        init_info = self._init_info(config, rank)
        started = time.monotonic()
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=self.source
        )
        log.info(
            "weight sync: %s backend up in %.2f s (%d parameters, %.1f MB per sync)",
            self.backend,
            time.monotonic() - started,
            len(self.source.meta),
            self.bytes / 1e6,
        )

    def _init_info(self, config: TrainerConfig, rank: int):
        from ajet_hpc.trainer.protocol.rank_env import PARENT_HOST_VAR, free_port

        workers = self.workers
        bucket = config.weight_sync_bucket_mb * 2**20
        if self.backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            return IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=bucket)
        address = _address(os.environ.get(PARENT_HOST_VAR))
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            return NCCLTrainerInitInfo(
                rank=rank,
                master_address=address,
                master_port=free_port() if rank == 0 else 0,
                world_size=1 + workers,
                packed=True,
                packed_buffer_size_bytes=bucket,
            )
        from ajet_hpc.engine.weight_transfer import GlooTrainerInitInfo

        return GlooTrainerInitInfo(
            rank=rank,
            master_address=address,
            master_port=0,  # rank 0 binds a free port itself
            world_size=1 + workers,
            timeout_s=config.weight_sync_timeout_s,
            bucket_bytes=bucket,
        )

    def send(self, version: int) -> SyncStats:
        """Send the current weights, tagged as policy ``version``; every rank calls it. When the server's
        job is ending (``sync_channel.SyncInterrupted``, only rank 0 talks to the server) the send stops,
        rank 0 still joins the gathers the other ranks are in, and the weights are reported withheld."""
        from ajet_hpc.trainer.protocol.sync_channel import SyncInterrupted

        started = time.monotonic()
        self.client.version = version
        self.source.new_pass()
        if self.rank == 0 and self.backend in RENDEZVOUS:
            receiving = self.client.expect("update_weights")
            self.source.gate = lambda: receiving.wait_taken(self.client.timeout_s)
        try:
            self.engine.send_weights()
        except SyncInterrupted as stopped:
            log.warning(
                "%s: step %d's weights stay with the trainer (its checkpoint carries them)", stopped, version
            )
            self.source.drain()
            return SyncStats(time.monotonic() - started, 0, withheld=True)
        finally:
            self.source.gate = None
        return SyncStats(time.monotonic() - started, self.bytes if self.rank == 0 else 0)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
