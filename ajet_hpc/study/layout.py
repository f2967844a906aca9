"""The study directory: where each piece of a study lives, and its event log.

Layout (docs/study.md)::

    STUDY/study.yaml         the study file, frozen at creation (resuming reads this copy)
    STUDY/base.yaml          the base topology, frozen at creation
    STUDY/optuna.journal     Optuna's JournalStorage (file backend: safe on NFS)
    STUDY/events.jsonl       one row per decision of the supervisor (start, relaunch, prune, failure...)
    STUDY/supervisor.lease   the lease of the one live supervisor (storage/lease.py)
    STUDY/supervisor.json    the Slurm job of the supervisor, with --slurm
    STUDY/trials/NNNN/       the run directory of trial NNNN (the launcher's layout)
    STUDY/trials/NNNN.json   the supervisor's bookkeeping of that trial (relaunches, last progress)
    STUDY/trials/NNNN.log    the launcher's output for that trial
    STUDY/report/            report.md and its PNGs
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ajet_hpc.storage.files import append_jsonl, read_json, read_jsonl, write_json_atomic


@dataclass(frozen=True)
class StudyDir:
    root: Path

    @property
    def spec_file(self) -> Path:
        return self.root / "study.yaml"

    @property
    def base_file(self) -> Path:
        return self.root / "base.yaml"

    @property
    def journal(self) -> Path:
        return self.root / "optuna.journal"

    @property
    def events_file(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def lease_anchor(self) -> Path:
        """The path the supervisor's lease is named after (``supervisor.lease`` next to it)."""
        return self.root / "supervisor"

    @property
    def supervisor_job_file(self) -> Path:
        return self.root / "supervisor.json"

    @property
    def trials_dir(self) -> Path:
        return self.root / "trials"

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    def run_dir(self, number: int) -> Path:
        return self.trials_dir / f"{number:04d}"

    def launch_log(self, number: int) -> Path:
        return self.trials_dir / f"{number:04d}.log"

    def exists(self) -> bool:
        return self.spec_file.is_file()

    # --- per-trial bookkeeping -----------------------------------------------------------------------
    def book(self, number: int) -> dict[str, Any]:
        return read_json(self.trials_dir / f"{number:04d}.json") or {}

    def write_book(self, number: int, book: dict[str, Any]) -> None:
        write_json_atomic(self.trials_dir / f"{number:04d}.json", book)

    # --- events ----------------------------------------------------------------------------------------
    def event(self, kind: str, trial: int | None = None, **fields: Any) -> dict[str, Any]:
        """Append one decision to ``events.jsonl`` (durable on return; a row cut by a crash is closed off)."""
        row = {"time": round(time.time(), 3), "event": kind, "trial": trial, **fields}
        append_jsonl(self.events_file, row, default=str)
        return row

    def events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events_file))  # a row cut by a crash mid-write is skipped
