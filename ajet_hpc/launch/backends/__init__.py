"""Launcher backends: each renders and submits the jobs of a plan its own way."""

from __future__ import annotations

from ajet_hpc.launch.backends.base import Backend, BackendError
from ajet_hpc.launch.backends.local import LocalBackend
from ajet_hpc.launch.backends.slurm import SlurmBackend

__all__ = ["Backend", "BackendError", "LocalBackend", "SlurmBackend", "get_backend"]


def get_backend(name: str) -> Backend:
    if name == "slurm":
        return SlurmBackend()
    if name == "local":
        return LocalBackend()
    raise BackendError(f"unknown backend {name!r}; use slurm or local")
