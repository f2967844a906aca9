"""The keeper's decisions (``launch/keeper.py``), the registry's view of resubmitted array tasks, and who
starts the keeper (the launch layer's server job entries, through ``serve``'s ``beside``); the keeper on the
dev cluster is in ``tests/cluster/test_client_resume.py``."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from support import topology_dict, write_topology

from ajet_hpc.config import load_topology
from ajet_hpc.launch import keeper_start, registry, server_job
from ajet_hpc.launch.jobs import ServerJob
from ajet_hpc.launch.keeper import died_whole, kept_groups
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.server import __main__ as server_main
from ajet_hpc.server import process
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


def _run(tmp_path: Path) -> RunDir:
    """A prepared run: server ``policy``, client group ``math`` with resubmits (the default)."""
    topology = load_topology(write_topology(tmp_path, topology_dict(tmp_path / "run")))
    run = RunDir(tmp_path / "run")
    run.prepare(topology)
    return run


def test_the_keeper_starts_on_slurm_only_for_a_server_that_keeps_a_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _run(tmp_path)
    topology = run.load_topology()
    started: list[list[str]] = []

    def popen(argv: list[str]) -> str:
        started.append(argv)
        return "child"

    monkeypatch.setattr(keeper_start.subprocess, "Popen", popen)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert keeper_start.start(run, topology, "policy") is None  # not on Slurm
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    assert keeper_start.start(run, topology, "other") is None  # keeps no group
    assert keeper_start.start(run, topology, "policy") == "child"
    assert started == [[sys.executable, "-m", "ajet_hpc.launch.keeper", str(run.root), "policy"]]


def test_the_server_job_entries_hand_the_keeper_down(monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's ``ServerJob`` and ``python -m ajet_hpc.launch.server_job`` (hetjobs, sbatch/) both serve
    with ``keeper_start.start`` beside the server; ``python -m ajet_hpc.server`` serves alone."""
    calls: list[tuple[str, str | None, object]] = []

    def fake_serve(run_dir: str, name: str | None = None, beside: object = None) -> int:
        calls.append((str(run_dir), name, beside))
        return 0

    monkeypatch.setattr(process, "serve", fake_serve)  # ServerJob imports it when called
    monkeypatch.setattr(server_main, "serve", fake_serve)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        assert ServerJob("/r", "policy")() == 0
        assert server_job.main(["/r", "--name", "policy"]) == 0
        assert server_main.main(["/r", "--name", "policy"]) == 0
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert calls == [
        ("/r", "policy", keeper_start.start),
        ("/r", "policy", keeper_start.start),
        ("/r", "policy", None),
    ]


def test_the_server_starts_what_it_is_handed_once_assembled_and_ends_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``serve(..., beside=start)``: ``start`` runs in the serving process after the assembly, right before
    uvicorn serves; its process is terminated first when serving ends, also when serving raises."""
    run = _run(tmp_path)
    events: list[str] = []
    ctx = SimpleNamespace(
        name="policy", public_url="http://127.0.0.1:1", job=SimpleNamespace(started_at=0.0), failed=False,
        over=False, coordinator=None,
    )  # fmt: skip

    class Server:
        started, should_exit = False, False
        handle_exit = staticmethod(lambda sig, frame: None)

        def run(self, sockets: object) -> None:
            events.append("serve")
            raise RuntimeError("uvicorn died")

    class Companion:
        def terminate(self) -> None:
            events.append("terminate")

    def start(run_arg: RunDir, topology: object, server: str) -> Companion:
        events.append(f"start {server} {run_arg.root == run.root}")
        return Companion()

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)

    def assemble(*args: object) -> tuple[object, list[SimpleNamespace]]:
        events.append("assemble")
        return object(), [ctx]

    monkeypatch.setattr(process, "assemble", assemble)
    monkeypatch.setattr(process, "create_app", lambda *args, **kwargs: object())
    monkeypatch.setattr(process, "uvicorn_server", lambda app, config: Server())
    monkeypatch.setattr(process, "_leave", lambda *args: events.append("leave"))
    with pytest.raises(RuntimeError, match="uvicorn died"):
        process.serve(run.root, "policy", beside=start)
    assert events == ["assemble", "start policy True", "serve", "terminate", "leave"]
