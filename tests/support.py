"""Helpers shared by the test modules (not fixtures): topologies on disk, waiting, running the CLIs."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


def topology_dict(run_dir: Path, *, array: int = 3, backend: str = "local", **cluster: Any) -> dict[str, Any]:
    """A small topology: one server on partition gpu, one client group (array) on partition cpu."""
    return {
        "run": {"name": run_dir.name, "dir": str(run_dir)},
        "cluster": {"backend": backend, "signal_delay_s": 30, **cluster},
        "servers": [
            {
                "name": "policy",
                "model": "builtin:tiny",
                "engine": "transformers",  # loads in seconds; the vLLM engine has its own tests
                "trainer": None,  # serve only: these runs test jobs, not training
                "partition": "gpu",
                "gpus_per_node": 0,
                "cpus": 1,
                "mem": "500M",
                "time": "10:00",
            }
        ],
        "clients": [
            {
                "name": "math",
                "agent": "ajet_hpc.agents.arithmetic:solve",
                "tasks": "builtin:arithmetic",
                "servers": ["policy"],
                "partition": "cpu",
                "array": array,
                "max_tasks": 2 * array,  # a finite share of work per array task
                "repeats": 1,
                "cpus": 1,
                "mem": "300M",
                "time": "10:00",
            }
        ],
    }


def write_topology(folder: Path, data: dict[str, Any]) -> Path:
    path = folder / "topology-in.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def run_module(module: str, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with this interpreter, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
