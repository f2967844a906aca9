"""The consumed-episodes journal: which finished episodes a training step took, written before it trains.

``RUN/ckpt/<model>/consumed.jsonl``, one line per step, appended and fsynced before the step's batch goes
to the ranks: ``{"step": n, "trained": [ids], "dropped": [ids]}`` (dropped: stale, equal-reward or
incomplete groups set aside since the previous step). A restarted server puts back into its collector
only the finished episodes of its store that no line names, so that no episode is trained twice whatever
the moment of a crash; the episodes of a step lost with the crash (after its line, before its checkpoint)
are not trained again, and the resume reports them.

A torn last line (a crash mid-append) is ignored: the step it began was never submitted.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ajet_hpc.storage.files import append_jsonl

log = logging.getLogger(__name__)


@dataclass
class Consumed:
    """What the journal holds: episode id -> the step that consumed it, per kind."""

    trained: dict[str, int] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    def __contains__(self, episode_id: str) -> bool:
        return episode_id in self.trained or episode_id in self.dropped

    def trained_after(self, step: int) -> int:
        """Episodes taken by steps after ``step`` (lost with those steps when the ranks resumed there)."""
        return sum(1 for taken in self.trained.values() if taken > step)


class ConsumedJournal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def append(self, step: int, trained: list[str], dropped: list[str]) -> None:
        """Record a step's episodes; durable on return."""
        append_jsonl(self.path, {"step": step, "trained": trained, "dropped": dropped})

    def read(self) -> Consumed:
        consumed = Consumed()
        if not self.path.exists():
            return consumed
        lines = self.path.read_bytes().split(b"\n")
        for number, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            try:
                entry = json.loads(raw)
                step = int(entry["step"])
                trained, dropped = list(entry["trained"]), list(entry["dropped"])
            except (ValueError, KeyError, TypeError):
                log.warning("%s: line %d is not a journal entry (a torn write?); ignored", self.path, number)
                continue
            consumed.trained.update(dict.fromkeys(trained, step))
            consumed.dropped.update(dict.fromkeys(dropped, step))
        return consumed
