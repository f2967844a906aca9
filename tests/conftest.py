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
