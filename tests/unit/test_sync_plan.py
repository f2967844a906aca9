"""The weight-sync decision (``trainer/protocol/sync_plan.py``): made once, from the trainer config, the
placement and the engine, and carried to the ranks through their environment without being decided again."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ajet_hpc.config import TrainerConfig
from ajet_hpc.config.lora import LoraConfig
from ajet_hpc.config.placement import PlacementMode, cpu_placement, plan_placement
from ajet_hpc.trainer.protocol.sync_plan import BACKEND_VAR, DISK, WORKERS_VAR, SyncPlan, decide

PACKAGE = Path(__file__).resolve().parents[2] / "ajet_hpc"
MEMORY = TrainerConfig(weight_sync="memory")


def gpus(mode: PlacementMode, engine_gpus: int = 1):
    return plan_placement(nodes=1, gpus_per_node=4, mode=mode, engine_gpus=engine_gpus, cpu_ranks=1)


def test_memory_on_vllm_takes_the_backend_of_the_placement_and_the_engine_s_tensor_parallelism() -> None:
    assert decide(MEMORY, cpu_placement(2), "vllm") == SyncPlan("ajet_gloo", 1)
    assert decide(MEMORY, gpus("split", engine_gpus=2), "vllm") == SyncPlan("nccl", 2)
    assert decide(MEMORY, gpus("colocate"), "vllm") == SyncPlan("ipc", 1)


def test_disk_when_asked_when_nothing_trains_and_when_the_engine_cannot_receive(caplog) -> None:
    assert decide(TrainerConfig(weight_sync="disk"), cpu_placement(1), "vllm") == DISK
    assert decide(None, cpu_placement(1), "vllm") == DISK
    with caplog.at_level("INFO", logger="ajet_hpc.trainer.protocol.sync_plan"):
        assert decide(MEMORY, cpu_placement(1), "transformers") == DISK
    assert "weight_sync memory needs the vLLM engine" in caplog.text
    assert not DISK.in_memory and DISK.rank_env() == {}


def test_a_lora_adapter_goes_to_the_engine_as_a_folder_whatever_the_placement(caplog) -> None:
    lora = TrainerConfig(weight_sync="memory", lora=LoraConfig(rank=8))
    with caplog.at_level("INFO", logger="ajet_hpc.trainer.protocol.sync_plan"):
        for placement in (cpu_placement(1), gpus("split"), gpus("colocate")):
            assert decide(lora, placement, "vllm") == DISK
    assert "adapter reaches the engine as a node-local adapter folder" in caplog.text


def test_the_ranks_read_back_the_plan_the_server_put_in_their_environment() -> None:
    for plan in (SyncPlan("nccl", 4), SyncPlan("ajet_gloo", 1), SyncPlan("ipc", 2), DISK):
        assert SyncPlan.from_env({"PATH": "/bin", **plan.rank_env()}) == plan


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (
            {BACKEND_VAR: "rdma"},
            "AJET_WEIGHT_SYNC='rdma' is not a weight-transfer backend (nccl, ipc, ajet_gloo)",
        ),
        (
            {BACKEND_VAR: "nccl", WORKERS_VAR: "0"},
            "AJET_ENGINE_WORKERS='0' is not a number of engine workers",
        ),
        ({BACKEND_VAR: "nccl", WORKERS_VAR: "two"}, "AJET_ENGINE_WORKERS='two'"),
    ],
)
def test_a_mangled_environment_is_refused_with_the_variable_named(environ, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SyncPlan.from_env(environ)


def test_no_other_module_reads_or_decides_the_backend() -> None:
    """Only sync_plan.py spells the ranks' variables and reads ``trainer.weight_sync`` (the config field);
    the rest of the package is handed a `SyncPlan`."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "sync_plan.py" or path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            spelled = isinstance(node, ast.Constant) and node.value in (BACKEND_VAR, WORKERS_VAR)
            if spelled or (isinstance(node, ast.Attribute) and node.attr == "weight_sync"):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}")
    assert found == []
