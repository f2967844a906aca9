"""RUN/metrics.jsonl: one JSON row per training step and model, appended and fsync'ed.

On resume from a checkpoint at step ``k``, rows of that model past ``k`` (steps that will run again) are
removed first, so the file ends with every step exactly once. Several trainable models share the file
(their rows interleave; the ``model`` column tells them apart): appends and the rewrite of a resume hold a
POSIX lock on ``metrics.jsonl.lock`` (``lockf``, which network file systems honour), so one server's
resume never drops another's rows.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ajet_hpc.storage.atomic import write_bytes_atomic

KEYS = (
    "step",
    "model",
    "reward_mean",
    "reward_std",
    "loss",
    "kl",
    "entropy",
    "clip_frac",
    "grad_norm",
    "tokens",
    "samples",
    "episodes",
    "step_time_s",
    "train_time_s",
    "weight_sync_s",
    "policy_version",
    "staleness",
    "skipped_equal_groups",
    "dropped_stale",
    "time",
)


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line from a crash mid-append
    return rows


def append_row(path: Path, row: dict[str, Any]) -> None:
    missing = [key for key in ("step", "model") if key not in row]
    if missing:
        raise ValueError(f"a metrics row needs {missing}")
    with _locked(path), path.open("a") as handle:
        handle.write(json.dumps(row, sort_keys=False) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def truncate_after(path: Path, model: str, step: int) -> int:
    """Drop ``model``'s rows with a step above ``step`` (and torn lines); returns how many were dropped."""
    with _locked(path):
        rows = read_rows(path)
        kept = [row for row in rows if row.get("model") != model or row.get("step", 0) <= step]
        dropped = len(rows) - len(kept)
        if path.exists() and (dropped or len(rows) != _line_count(path)):
            write_bytes_atomic(path, "".join(json.dumps(row) + "\n" for row in kept).encode())
    return dropped


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.with_name(path.name + ".lock").open("a") as lock:
        fcntl.lockf(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(lock, fcntl.LOCK_UN)


def _line_count(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())
