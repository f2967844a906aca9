"""Shared fixtures: the repository root, the Slurm dev cluster, and small topologies in tmp folders."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from ajet_hpc.launch import slurmcli

sys.path.insert(0, str(Path(__file__).parent))  # tests/support.py

REPO = Path(__file__).resolve().parents[1]


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
