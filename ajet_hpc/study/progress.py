"""A trial's progress read from its run directory: steps, the windowed metric, throughput, server state."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir
from ajet_hpc.trainer.coordinator.metrics import read_rows


def step_rows(run_dir: Path) -> list[dict[str, Any]]:
    """One row per step (a step trained again after a relaunch keeps its last row), in step order."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_rows(RunDir(run_dir).metrics_file):
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]


def windowed(rows: list[dict[str, Any]], name: str, window: int) -> dict[int, float]:
    """Step -> mean of ``name`` over the last ``window`` steps up to it (the study's metric at that step)."""
    values: dict[int, float] = {}
    seen: list[float] = []
    for row in rows:
        value = row.get(name)
        if isinstance(value, (int, float)):
            seen.append(float(value))
            values[row["step"]] = statistics.fmean(seen[-window:])
    return values


def tokens_per_s(row: dict[str, Any]) -> float | None:
    tokens, seconds = row.get("tokens"), row.get("step_time_s")
    if isinstance(tokens, (int, float)) and isinstance(seconds, (int, float)) and seconds > 0:
        return tokens / seconds
    return None


@dataclass(frozen=True)
class ServerEnd:
    """How the run's trained servers stand: all finished, one failed (with its reason), or still going."""

    finished: bool
    failed: str | None  # "<server>: <reason>" of a failed server


def server_end(run_dir: Path, servers: list[str]) -> ServerEnd:
    failed, done = None, 0
    for name in servers:
        try:
            record = rendezvous.read(RunDir(run_dir).rendezvous_file(name))
        except ValueError:
            continue
        if record is None:
            continue
        if record.state == "failed":
            failed = f"{name}: {record.reason or 'failed (no reason given)'}"
        elif record.state == "finished":
            done += 1
    return ServerEnd(finished=bool(servers) and done == len(servers), failed=failed)
