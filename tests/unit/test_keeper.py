"""The keeper's decisions (``launch/keeper.py``) and the registry's view of resubmitted array tasks; the
keeper on the dev cluster is in ``tests/cluster/test_client_resume.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from ajet_hpc.config import load_topology
from ajet_hpc.launch import registry
from ajet_hpc.launch.keeper import died_whole, kept_groups
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.slurm.slurmcli import JobState
from ajet_hpc.storage.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("state", "exit_code", "dead"),
    [
        ("FAILED", "0:9", True),  # kill -9 of every process of the task
        ("FAILED", "0:15", True),
        ("NODE_FAIL", "0:0", True),
        ("OUT_OF_MEMORY", "0:125", True),
        ("BOOT_FAIL", "", True),
        ("FAILED", "1:0", False),  # it ended itself (ClientJob raised: servers failed, store full...)
        ("FAILED", "3:0", False),
        ("CANCELLED", "0:15", False),  # someone's scancel
        ("COMPLETED", "0:0", False),
        ("RUNNING", "0:0", False),
        ("TIMEOUT", "0:0", False),
    ],
)
def test_what_died_whole(state: str, exit_code: str, dead: bool) -> None:
    assert died_whole(JobState("7_1", state, "cpu", "c1", "", exit_code)) is dead


def job(name: str, tasks: list[str], indices: list[int] | None = None) -> SubmittedJob:
    return SubmittedJob(name, "slurm", tasks[0].split("_")[0], tasks, "logs/x", ["math"], indices=indices)


def test_resubmitted_tasks_take_their_index_place_until_the_next_whole_submission(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    registry.record(run, [job("clients-math", ["10_0", "10_1", "10_2"])])
    registry.record(run, [job("clients-math", ["12"], indices=[1])])
    registry.record(run, [job("clients-math", ["13_0", "13_1"], indices=[1, 2])])
    merged = registry.latest(run)["clients-math"]
    assert merged.tasks == ["10_0", "13_0", "13_1"] and merged.job_ids == ["10", "13"]
    assert merged.job_id == "10" and merged.indices is None
    assert registry.resubmissions(run, "clients-math") == {1: 2, 2: 1}
    registry.record(run, [job("clients-math", ["20_0", "20_1"])])  # a hot swap: a new whole array
    assert registry.latest(run)["clients-math"].tasks == ["20_0", "20_1"]
    assert registry.resubmissions(run, "clients-math") == {}


def test_each_group_is_kept_by_the_server_of_its_first_model() -> None:
    """configs/two_models.yaml: group ``pairs`` uses proposer then solver; proposer's job keeps it, alone."""
    topology = load_topology(REPO / "configs" / "two_models.yaml")
    assert {s.name: [g.name for g in kept_groups(topology, s.name)] for s in topology.servers} == {
        "proposer": ["pairs"],
        "solver": [],
    }
    adapters = load_topology(REPO / "configs" / "propose_solve_lora.yaml")  # adapters: their server job keeps
    assert [g.name for g in kept_groups(adapters, "base")] == ["pairs"]
