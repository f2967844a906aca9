"""A step as the coordinator records it: the batch made ready for the ranks (`Prepared`), the step they are
training (`InFlight`), and the step's row (`step_row`) that goes to ``metrics.jsonl``, the trackers and the
server store (docs/architecture.md, "The coordinator's step", for its timing fields)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from ajet_hpc.algo.merge import MergeStats
from ajet_hpc.algo.sample_tensors import Sample
from ajet_hpc.trainer.coordinator.collector import (
    Batch,
    reward_by_group,
    reward_stats,
    staleness_histogram,
)
from ajet_hpc.trainer.protocol.step_result import StepResult
from ajet_hpc.trainer.protocol.weight_handoff import MemoryWeights


@dataclass
class Prepared:
    """A batch made ready for step ``step``: its samples, what merging did, its batch file's bytes, and
    the coordinator's work on it so far as (start, end) times (``time.monotonic``)."""

    step: int
    batch: Batch
    samples: list[Sample]
    merging: MergeStats
    encoded: bytes
    save: bool
    work: list[tuple[float, float]]
    taken: float  # when the collector gave the batch
    built: float  # when the build was over
    ranks_idle_since: float = 0.0  # set when it goes to the ranks: when their previous step ended
    eval_wait_s: float = 0.0  # how long it waited for eval rounds before going to the ranks

    def work_s(self, after: float = 0.0) -> float:
        """Seconds of work, counting only what was done after ``after``."""
        return sum(max(0.0, end - max(start, after)) for start, end in self.work)


@dataclass
class InFlight:
    prepared: Prepared
    started: float
    submitted: bool = False  # the batch file is in the ranks' inbox

    @property
    def step(self) -> int:
        return self.prepared.step


def step_row(
    model: str,
    step: int,
    prepared: Prepared,
    result: StepResult,
    step_s: float,
    sync_s: float,
    engine_s: dict[str, float | None] | None = None,
) -> dict[str, Any]:
    """The row of step ``step`` of ``model``: its rewards, the ranks' result, what merging did, its
    timings (``step_s`` from batch and idle ranks to the record, ``sync_s`` the weights into the engine,
    ``engine_s`` the engine's pause, sleep and wake), staleness and the collector's drops."""
    batch, samples, merging = prepared.batch, prepared.samples, prepared.merging
    mean, std = reward_stats(batch)
    lag = [step - 1 - sample.policy_version for sample in samples]
    row: dict[str, Any] = {
        "step": step,
        "model": model,
        "reward_mean": mean,
        "reward_std": std,
        "loss": result.loss,
        "kl": result.kl,
        "entropy": result.entropy,
        "clip_frac": result.clip_frac,
        "grad_norm": result.grad_norm,
        "tokens": result.tokens,
        "samples": len(samples),
        **merging.metrics(),
        "episodes": len(batch.episodes),
        "step_time_s": round(step_s, 4),
        "train_time_s": result.step_time_s,
        "weight_sync_s": round(sync_s, 4),
        "coordinator_s": round(prepared.work_s(), 4),
        "coordinator_critical_s": round(prepared.work_s(after=prepared.ranks_idle_since), 4),
        "eval_wait_s": round(prepared.eval_wait_s, 4),
        "prepared_ahead": prepared.built < prepared.ranks_idle_since,
        "weight_sync": result.weights.kind,
        "weight_sync_bytes": result.weights.bytes if isinstance(result.weights, MemoryWeights) else None,
        **(engine_s or dict.fromkeys(("engine_pause_s", "engine_sleep_s", "engine_wake_s"))),
        "policy_version": step,
        "staleness": statistics.fmean(lag) if lag else 0.0,
        "staleness_hist": staleness_histogram(batch.episodes, step - 1),
        **result.off_policy,
        "skipped_equal_groups": batch.skipped_equal,
        "client_groups": batch.tasks_per_client_group(),
        "reward_by_group": reward_by_group(batch),
        "mix_shortfall": batch.shortfall,
        "dropped_stale": batch.dropped_stale,
        "dropped_incomplete": batch.dropped_incomplete,
        "dropped_invalid": batch.dropped_invalid,  # could not be built: ids and reasons in the log
        "recovered_episodes": batch.recovered,
        "time": time.time(),
    }
    return row
