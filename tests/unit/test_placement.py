"""Placement of a server allocation's engine and trainer ranks: 1/2/4 nodes x 1/4/8 GPUs x split/colocate,
the refusals with the field to change, and the per-process CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json

import pytest
from support import REPO

from ajet_hpc.config.placement import (
    RANK_GPUS_VAR,
    PlacementError,
    PlacementMode,
    bind_rank_gpu,
    cpu_placement,
    plan_placement,
    select_devices,
    visible_devices,
)
from ajet_hpc.launch.cli import main


def place(
    nodes: int, gpus: int, mode: PlacementMode = "split", engine: int = 1, ranks: int = 1, trains: bool = True
):
    return plan_placement(
        nodes=nodes, gpus_per_node=gpus, mode=mode, engine_gpus=engine, cpu_ranks=ranks, trains=trains
    )


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("gpus", [1, 4, 8])
@pytest.mark.parametrize("mode", ["split", "colocate"])
def test_every_gpu_runs_one_rank_and_the_engine_sits_on_node_0(
    nodes: int, gpus: int, mode: PlacementMode
) -> None:
    if mode == "split" and nodes == 1 and gpus == 1:
        with pytest.raises(PlacementError) as refused:
            place(nodes, gpus, mode)
        assert refused.value.field == "engine.gpus"
        assert "leaves no GPU for the trainer on 1 node of 1 GPUs" in refused.value.message
        return
    placement = place(nodes, gpus, mode)
    assert placement.engine_gpus == (0,)
    assert [n.engine_gpus for n in placement.nodes[1:]] == [()] * (nodes - 1)
    expected_ranks = nodes * gpus - (1 if mode == "split" else 0)
    assert placement.world_size == expected_ranks
    ids = [r for n in placement.nodes for r in n.rank_ids]
    assert ids == list(range(expected_ranks))  # numbered node by node
    for node in placement.nodes:
        assert len(node.rank_gpus) == node.ranks == len(set(node.rank_gpus))
        if mode == "split" and node.node == 0:
            assert 0 not in node.rank_gpus  # never the engine's GPU
        else:
            assert node.rank_gpus == tuple(range(gpus))


def test_split_with_tensor_parallel_engine() -> None:
    placement = place(2, 8, "split", engine=2)
    assert placement.engine_gpus == (0, 1) and placement.tensor_parallel == 2
    assert placement.ranks_per_node == (6, 8)
    assert placement.nodes[0].rank_gpus == (2, 3, 4, 5, 6, 7)
    assert placement.nodes[1].first_rank == 6
    assert json.loads(placement.rank_gpus_json()) == [[2, 3, 4, 5, 6, 7], list(range(8))]
    lines = placement.describe()
    assert lines[0].startswith("node 0: engine on GPU 0,1, tensor parallel 2; ranks 0→GPU 2, 1→GPU 3")
    assert lines[1].startswith("node 1: ranks 6→GPU 0, 7→GPU 1")


def test_colocate_shares_the_engine_gpus() -> None:
    placement = place(1, 4, "colocate", engine=4)
    assert placement.engine_gpus == (0, 1, 2, 3) and placement.nodes[0].rank_gpus == (0, 1, 2, 3)
    assert "engine sleeps while ranks train" in placement.describe()[0]


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        (
            {"nodes": 1, "gpus": 8, "engine": 8},
            "engine.gpus",
            "8 leaves no GPU for the trainer on 1 node of 8",
        ),
        ({"nodes": 2, "gpus": 4, "engine": 8}, "engine.gpus", "more than the 4 GPUs of a node"),
        ({"nodes": 1, "gpus": 0, "mode": "colocate"}, "placement", "colocate needs GPUs"),
        ({"nodes": 1, "gpus": 0, "engine": 2}, "engine.gpus", "on a CPU server"),
        ({"nodes": 2, "gpus": 4, "trains": False}, "nodes", "without a trainer"),
    ],
)
def test_impossible_placements_name_the_field(kwargs: dict, field: str, words: str) -> None:
    with pytest.raises(PlacementError) as refused:
        place(**kwargs)
    assert refused.value.field == field and words in refused.value.message


def test_cpu_and_serving_only() -> None:
    cpu = place(2, 0, ranks=2)
    assert (cpu.mode, cpu.on_gpu, cpu.ranks_per_node, cpu.world_size) == ("cpu", False, (2, 2), 4)
    assert cpu.describe() == ["node 0: engine (CPU), ranks 0,1 on CPUs", "node 1: ranks 2,3 on CPUs"]
    assert cpu_placement(3).ranks_per_node == (3,)
    serving = place(1, 1, trains=False)
    assert serving.world_size == 0 and serving.engine_gpus == (0,)


def test_each_process_sees_its_own_gpus() -> None:
    # Slurm gave this node's step GPUs 4-7 of the machine; positions index into that list
    slurm = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_devices(slurm, 4) == ["4", "5", "6", "7"]
    assert visible_devices({}, 3) == ["0", "1", "2"]
    placement = place(1, 4, "split", engine=2)
    assert select_devices(visible_devices(slurm, 4), placement.engine_gpus, "engine") == "4,5"
    env = {**slurm, RANK_GPUS_VAR: placement.rank_gpus_json()}
    assert bind_rank_gpu(env, node=0, local_rank=1) and env["CUDA_VISIBLE_DEVICES"] == "7"
    assert not bind_rank_gpu({}, node=0, local_rank=0)  # CPU ranks: nothing to bind
    with pytest.raises(RuntimeError, match="shows only 2 GPU"):
        select_devices(["0", "1"], [2], "trainer rank")
    with pytest.raises(RuntimeError, match="no GPU for it"):
        bind_rank_gpu({RANK_GPUS_VAR: placement.rank_gpus_json()}, node=1, local_rank=0)


def test_the_dry_run_prints_the_placement_and_refuses_impossible_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(REPO / "configs" / "quickstart.yaml")
    assert main([config, "servers.policy.gpus_per_node=8", "servers.policy.engine_gpus=2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "placement of server policy (1 node(s) x 8 GPU(s), split):" in out
    assert "  node 0: engine on GPU 0,1, tensor parallel 2; ranks 0→GPU 2, 1→GPU 3" in out
    assert main([config, "servers.policy.gpus_per_node=8", "servers.policy.engine.gpus=8", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "servers[0].engine.gpus: 8 leaves no GPU for the trainer on 1 node of 8 GPUs" in err
    assert main([config, "servers.policy.placement=colocate", "--dry-run"]) == 2  # quickstart: CPUs only
    assert "servers[0].placement: colocate needs GPUs" in capsys.readouterr().err
