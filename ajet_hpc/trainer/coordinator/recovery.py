"""A restarted server's episode state, rebuilt from its store (``RUN/data/<model>.h5``).

Two things survive a requeue only there: which episode keys ended (so that a resuming client commits them
instead of running them again, and a second run of one is not trained), and the finished episodes that
no training step consumed yet (so that the batch collector starts where the previous job left it; the
consumed ones are named by the trainer's journal, :mod:`ajet_hpc.trainer.coordinator.journal`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ajet_hpc.storage.episode_store_reader import EpisodeReader
from ajet_hpc.storage.h5_layout import StoreError
from ajet_hpc.storage.records import EpisodeRecord
from ajet_hpc.tracking.episode import EpisodeState, episode_key, is_eval

log = logging.getLogger(__name__)


def stored_summaries(path: Path) -> list[dict[str, Any]]:
    """Every committed episode's summary in the store; [] when there is no store yet."""
    if not Path(path).exists():
        return []
    with EpisodeReader(path) as reader:
        return reader.summaries()


@dataclass
class Unconsumed:
    """Finished episodes that no step consumed, split by whether they are still fresh enough to train."""

    fresh: list[str] = field(default_factory=list)  # episode ids, store order (oldest first)
    stale: list[str] = field(default_factory=list)


def unconsumed(summaries: list[dict[str, Any]], consumed, version: int, max_staleness: int) -> Unconsumed:
    """The finished episodes with calls that ``consumed`` (a journal's ids) does not name. Of two finished
    episodes of one key only the first counts (the later one was never the key's result)."""
    out, seen = Unconsumed(), set()
    for s in summaries:
        if s["state"] != EpisodeState.FINISHED or not s["calls"] or s["episode_id"] in consumed:
            continue
        if is_eval(s.get("metadata")):  # scored by its eval round, never trained
            continue
        repeat = (s.get("metadata") or {}).get("repeat")
        key = episode_key(s["task_id"], s["group"], repeat if isinstance(repeat, int) else None)
        if key is not None:
            if key in seen:
                continue
            seen.add(key)
        oldest = min(s["policy_versions"]) if s["policy_versions"] else version
        (out.stale if version - oldest > max_staleness else out.fresh).append(s["episode_id"])
    return out


def load_episodes(path: Path, episode_ids: list[str]) -> list[EpisodeRecord]:
    """The full episodes (timelines included) for the collector, in the order given."""
    if not episode_ids:
        return []
    episodes = []
    with EpisodeReader(path) as reader:
        for episode_id in episode_ids:
            try:
                episodes.append(reader.episode(episode_id))
            except (KeyError, StoreError) as exc:
                log.warning("cannot restore episode %s from %s: %s", episode_id, path, exc)
    return episodes
