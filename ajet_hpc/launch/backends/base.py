"""The interface every backend fills: render a job (dry run) and submit it."""

from __future__ import annotations

from typing import Protocol

from ajet_hpc.config import ClusterConfig
from ajet_hpc.launch.plan import Planned
from ajet_hpc.launch.registry import SubmittedJob
from ajet_hpc.storage.rundir import RunDir


class BackendError(RuntimeError):
    """A job could not be rendered or submitted; the message says which and why."""


class Backend(Protocol):
    name: str

    def render(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> str:
        """What would be submitted for ``job`` (sbatch text, or the local command), without side effects."""
        ...

    def submit(self, job: Planned, run: RunDir, cluster: ClusterConfig) -> SubmittedJob:
        """Submit ``job`` and return its registry entry."""
        ...
