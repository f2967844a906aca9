"""Export episodes to JSON Lines or Parquet: one row per episode, or one per sample (model call).

Per episode: the summary fields, the final conversation (the last call's messages, its reply included) and
the reward. Per sample: one row per timeline with its token ids, authors, loss mask, per-token logprobs
(0.0 on prompt tokens), the episode and turn rewards, and, for episodes a step trained on, the step and
the sample's advantage and weight.

In Parquet, free-form values (``messages``, ``metadata``) are JSON strings, so the columns have one type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ajet_hpc.offline.run import InspectError, ModelRun
from ajet_hpc.offline.views import EpisodeFilter, drift_count

FORMATS = ("jsonl", "parquet")
PER = ("episode", "sample")
JSON_COLUMNS = ("messages", "metadata", "tools")
SUMMARY_FIELDS = (
    "episode_id",
    "task_id",
    "group",
    "state",
    "reward",
    "turn_rewards",
    "reason",
    "calls",
    "tokens",
    "policy_versions",
    "started_at",
    "ended_at",
    "metadata",
)


def episode_rows(model: ModelRun, chosen: EpisodeFilter) -> Iterator[dict[str, Any]]:
    for summary in chosen.apply(model):
        record = model.episode(summary["episode_id"])
        row = {"model": model.name, **{key: summary.get(key) for key in SUMMARY_FIELDS}}
        row["drift"] = drift_count(summary.get("drift"))
        row["messages"] = record.timelines[-1].messages if record.timelines else []
        yield row


def trained_samples(model: ModelRun) -> dict[tuple[str, tuple[int, ...]], tuple[int, Any]]:
    """``(episode_id, token_ids) -> (step, Sample)`` for every sample a step of ``model`` trained on."""
    found: dict[tuple[str, tuple[int, ...]], tuple[int, Any]] = {}
    reader = model.reader
    if reader is None:  # no store yet
        return found
    for entry in model.steps():
        for sample in reader.step_samples(entry["step"]):
            found[(sample.episode_id, tuple(sample.token_ids))] = (entry["step"], sample)
    return found


def sample_rows(model: ModelRun, chosen: EpisodeFilter) -> Iterator[dict[str, Any]]:
    trained = trained_samples(model)
    for summary in chosen.apply(model):
        record = model.episode(summary["episode_id"])
        turn_rewards = record.turn_rewards or []
        for turn, timeline in enumerate(record.timelines):
            n_prompt = len(timeline.prompt_ids)
            step, sample = trained.get((record.episode_id, tuple(timeline.token_ids)), (None, None))
            yield {
                "model": model.name,
                "episode_id": record.episode_id,
                "task_id": record.task_id,
                "group": record.group,
                "state": record.state,
                "turn": turn,
                "policy_version": timeline.policy_version,
                "version_spans": [list(span) for span in timeline.version_spans],
                "finish_reason": timeline.finish_reason,
                "prompt_tokens": n_prompt,
                "token_ids": timeline.token_ids,
                "token_authors": timeline.token_authors,
                "loss_mask": timeline.loss_mask,
                "logprobs": [0.0] * n_prompt + timeline.response_logprobs,
                "reward": record.reward,
                "turn_reward": turn_rewards[turn] if turn < len(turn_rewards) else None,
                "step": step,
                "advantage": _advantage(sample),
                "weight": None if sample is None else sample.weight,
                "drift": len(timeline.drift),
                "messages": timeline.messages,
            }


def _advantage(sample: Any) -> float | None:
    """The advantage of a sample's trained tokens (one value per sample today: its turn's advantage)."""
    if sample is None:
        return None
    for mask, advantage in zip(sample.loss_mask, sample.advantages, strict=True):
        if mask:
            return float(advantage)
    return 0.0


def export(models: list[ModelRun], chosen: EpisodeFilter, fmt: str, per: str, out: Path) -> int:
    """Write the rows to ``out``; returns how many."""
    if fmt not in FORMATS:
        raise InspectError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    make = episode_rows if per == "episode" else sample_rows
    rows = [row for model in models for row in make(model, chosen)]
    if not rows:
        raise InspectError("no episodes match: nothing exported")
    if not out.parent.is_dir():
        raise InspectError(f"cannot write {out}: folder {out.parent} does not exist")
    if fmt == "jsonl":
        with out.open("w") as handle:
            for row in rows:
                handle.write(json.dumps(row, default=str) + "\n")
    else:
        _write_parquet(rows, out)
    return len(rows)


def _write_parquet(rows: list[dict[str, Any]], out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    flat = [
        {k: json.dumps(v, default=str) if k in JSON_COLUMNS else v for k, v in row.items()} for row in rows
    ]
    pq.write_table(pa.Table.from_pylist(flat), out)
