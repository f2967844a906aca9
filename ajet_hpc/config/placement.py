"""Which GPUs of a server allocation run the vLLM engine and which run the trainer's ranks.

A server allocation is ``nodes`` nodes of ``gpus_per_node`` GPUs each (0: CPUs only). One process of it, on
the first node, is the server (HTTP front, engine, coordinator); the trainer's ranks run on every node.

- ``split`` (default): the engine takes the first ``engine.gpus`` GPUs of the first node (tensor parallel
  over them); the ranks take every other GPU of the allocation, one rank per GPU, numbered node by node.
- ``colocate``: engine and ranks share the GPUs: one rank per GPU of the allocation, and the engine on the
  first ``engine.gpus`` GPUs of the first node. vLLM's sleep mode frees the engine's memory while the ranks
  train (CUDA only: refused on CPUs).
- CPUs (``gpus_per_node: 0``): the engine on the first node's CPUs, ``trainer.ranks`` ranks per node.

GPU indices here are positions in what the node's job step sees (``CUDA_VISIBLE_DEVICES`` as Slurm sets it,
else 0..n-1); :func:`visible_devices` turns positions into the values each process exports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Literal

PlacementMode = Literal["split", "colocate"]

RANK_GPUS_VAR = "AJET_RANK_GPUS"
"""JSON list per node of the GPU positions its ranks take, one per rank in local-rank order."""


class PlacementError(ValueError):
    """An impossible placement; ``field`` is the topology field to change (relative to the server)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


@dataclass(frozen=True)
class NodePlacement:
    """One node of the allocation: the engine's GPUs (node 0 only) and its ranks' GPUs."""

    node: int
    engine_gpus: tuple[int, ...]
    rank_gpus: tuple[int, ...]  # one GPU per rank; empty on CPUs
    first_rank: int
    ranks: int

    @property
    def rank_ids(self) -> range:
        return range(self.first_rank, self.first_rank + self.ranks)


@dataclass(frozen=True)
class Placement:
    """The whole allocation's placement (see the module doc)."""

    mode: Literal["split", "colocate", "cpu"]
    gpus_per_node: int
    nodes: tuple[NodePlacement, ...]
    tensor_parallel: int

    @property
    def world_size(self) -> int:
        return sum(node.ranks for node in self.nodes)

    @property
    def on_gpu(self) -> bool:
        return self.gpus_per_node > 0

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        return tuple(node.ranks for node in self.nodes)

    @property
    def engine_gpus(self) -> tuple[int, ...]:
        return self.nodes[0].engine_gpus

    def rank_gpus_json(self) -> str:
        """The value of ``AJET_RANK_GPUS`` (what each node's ranks bind to)."""
        return json.dumps([list(node.rank_gpus) for node in self.nodes])

    def describe(self) -> list[str]:
        """One line per node, for ``--dry-run`` and the server's log."""
        lines = []
        for node in self.nodes:
            if not self.on_gpu:
                engine = "engine (CPU), " if node.node == 0 else ""
                lines.append(f"node {node.node}: {engine}ranks {_ids(node.rank_ids)} on CPUs")
                continue
            parts = []
            if node.engine_gpus:
                tp = f", tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else ""
                parts.append(f"engine on GPU {_ids(node.engine_gpus)}{tp}")
            if node.ranks:
                pairs = ", ".join(f"{r}→GPU {g}" for r, g in zip(node.rank_ids, node.rank_gpus, strict=True))
                parts.append(f"ranks {pairs}")
            shared = " (shared, engine sleeps while ranks train)" if self.mode == "colocate" else ""
            tail = shared if node.node == 0 else ""
            lines.append(f"node {node.node}: " + "; ".join(parts or ["idle"]) + tail)
        return lines


def plan_placement(
    *,
    nodes: int,
    gpus_per_node: int,
    mode: PlacementMode,
    engine_gpus: int,
    cpu_ranks: int,
    trains: bool = True,
) -> Placement:
    """The placement of one server allocation, or :class:`PlacementError` naming the field to change.

    ``cpu_ranks`` is ``trainer.ranks`` (ranks per node on CPUs; on GPUs each trainer GPU runs one rank
    and it is not used); ``trains`` is False for a server that only
    serves (no ranks at all).
    """
    if nodes < 1:
        raise PlacementError("nodes", f"must be >= 1, got {nodes}")
    if nodes > 1 and not trains:
        raise PlacementError(
            "nodes", f"{nodes} nodes for a server without a trainer: the engine runs on the first node only"
        )
    if gpus_per_node == 0:
        return _cpu_placement(nodes, mode, engine_gpus, cpu_ranks if trains else 0)
    if engine_gpus > gpus_per_node:
        raise PlacementError(
            "engine.gpus",
            f"{engine_gpus} is more than the {gpus_per_node} GPUs of a node (gpus_per_node: "
            f"{gpus_per_node}); the engine's tensor parallelism stays inside one node",
        )
    engine = tuple(range(engine_gpus))
    placed: list[NodePlacement] = []
    first = 0
    for node in range(nodes):
        if not trains:
            gpus: tuple[int, ...] = ()
        elif mode == "colocate" or node > 0:
            gpus = tuple(range(gpus_per_node))
        else:
            gpus = tuple(range(engine_gpus, gpus_per_node))
        placed.append(NodePlacement(node, engine if node == 0 else (), gpus, first, len(gpus)))
        first += len(gpus)
    if trains and first == 0:
        raise PlacementError(
            "engine.gpus",
            f"{engine_gpus} leaves no GPU for the trainer on {nodes} node of {gpus_per_node} GPUs; "
            "use placement: colocate or nodes: 2",
        )
    return Placement(mode, gpus_per_node, tuple(placed), engine_gpus)


def cpu_placement(ranks: int, nodes: int = 1) -> Placement:
    """``ranks`` trainer ranks per node on CPUs (tests, benchmarks, laptops)."""
    return _cpu_placement(nodes, "split", 1, ranks)


def _cpu_placement(nodes: int, mode: PlacementMode, engine_gpus: int, ranks: int) -> Placement:
    if mode == "colocate":
        raise PlacementError(
            "placement",
            "colocate needs GPUs (gpus_per_node is 0): it frees the engine's memory with vLLM's sleep mode, "
            "which exists on CUDA only; use placement: split on CPUs",
        )
    if engine_gpus != 1:
        raise PlacementError(
            "engine.gpus", f"{engine_gpus} engine GPUs on a CPU server (gpus_per_node is 0); leave it at 1"
        )
    placed = tuple(NodePlacement(n, (), (), n * ranks, ranks) for n in range(nodes))
    return Placement("cpu", 0, placed, 1)


# ---- the processes' side -------------------------------------------------------------------------------


def visible_devices(environ: Mapping[str, str], gpus_per_node: int) -> list[str]:
    """What this node's job step sees, as ``CUDA_VISIBLE_DEVICES`` values: Slurm's list when it set one,
    else ``0..gpus_per_node-1``."""
    given = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if given:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(gpus_per_node)]


def select_devices(visible: Sequence[str], positions: Sequence[int], who: str) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value for ``positions`` of ``visible``; a clear error when the process
    sees fewer GPUs than the placement expects."""
    missing = [p for p in positions if p >= len(visible)]
    if missing:
        raise RuntimeError(
            f"{who}: the placement gives it GPU {_ids(positions)}, but this node shows only {len(visible)} "
            f"GPU(s) (CUDA_VISIBLE_DEVICES={','.join(visible) or 'unset'}); check --gpus-per-node of the job"
        )
    return ",".join(visible[p] for p in positions)


def bind_rank_gpu(environ: MutableMapping[str, str], node: int, local_rank: int) -> bool:
    """In a trainer rank, before CUDA starts: narrow ``CUDA_VISIBLE_DEVICES`` to the rank's one GPU (which
    it then sees as ``cuda:0``) from ``AJET_RANK_GPUS``. False when the variable is unset (CPU ranks)."""
    table = environ.get(RANK_GPUS_VAR)
    if not table:
        return False
    per_node = json.loads(table)
    if node >= len(per_node) or local_rank >= len(per_node[node]):
        raise RuntimeError(
            f"rank with local id {local_rank} on node {node}: the placement has no GPU for it ({table}); "
            "the ranks were started with another layout than the placement"
        )
    visible = visible_devices(environ, max(len(gpus) for gpus in per_node))
    who = f"trainer rank (node {node}, local rank {local_rank})"
    environ["CUDA_VISIBLE_DEVICES"] = select_devices(visible, [per_node[node][local_rank]], who)
    return True


def node_index(environ: Mapping[str, str] = os.environ) -> int:
    """This process's node in the allocation: ``SLURM_NODEID`` under srun/sbatch, else 0."""
    return int(environ.get("SLURM_NODEID", "0"))


def _ids(values: Sequence[int] | range) -> str:
    values = list(values)
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)
