"""Ending a process together with everything it started.

Some of our children start processes in sessions of their own (torchrun puts each rank in one), and the
ranks ignore SIGTERM until the server asks them to stop (``trainer.ranks.worker``): a signal to the child's
process group alone can leave them running. ``kill_tree`` finds the descendants first, then SIGKILLs
them all."""

from __future__ import annotations

import contextlib

import psutil


def kill_tree(pid: int, wait_s: float = 10.0) -> None:
    """SIGKILL a process and all its descendants, then wait up to ``wait_s`` for them to be gone."""
    try:
        root = psutil.Process(pid)
        family = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(family, timeout=wait_s)
