"""A PNG of a run's training curves: reward, episode length, tokens and step time, one line per model.

Drawn on a bare :class:`matplotlib.figure.Figure` (the Agg renderer), so no display nor pyplot state is
touched. Panels without data say so instead of being left empty.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ajet_hpc.offline.run import InspectError, ModelRun
from ajet_hpc.offline.views import FAILED_STATES, step_rows

TIMES = (("step_time_s", "step"), ("train_time_s", "train"), ("weight_sync_s", "weight sync"))


def plot(models: list[ModelRun], out: Path, title: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    data = [(model, step_rows(model), model.summaries()) for model in models]
    if not any(rows or summaries for _, rows, summaries in data):
        raise InspectError("nothing to plot yet: no step trained and no episode recorded")
    if not out.parent.is_dir():
        raise InspectError(f"cannot write {out}: folder {out.parent} does not exist")
    figure = Figure(figsize=(12, 8), layout="constrained")
    reward, length, tokens, times = figure.subplots(2, 2).flat
    for model, rows, summaries in data:
        _reward(reward, model.name, rows, summaries)
        _lengths(length, model.name, summaries)
        _per_step(tokens, rows, "tokens", model.name)
        for key, label in TIMES:
            _per_step(times, rows, key, f"{model.name} {label}" if len(models) > 1 else label)
    reward.set(title="reward per step", xlabel="step", ylabel="reward")
    length.set(title="episode length", xlabel="episode (store order)", ylabel="tokens")
    tokens.set(title="tokens per step", xlabel="step", ylabel="tokens")
    times.set(title="step time", xlabel="step", ylabel="seconds")
    for axes in (reward, length, tokens, times):
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        if axes.has_data():
            axes.grid(alpha=0.3)
            if axes.get_legend_handles_labels()[0]:
                axes.legend(fontsize="small")
        else:
            axes.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=axes.transAxes)
    figure.suptitle(f"{title}  ({', '.join(model.name for model in models)})")
    figure.savefig(out, dpi=100)


def _reward(axes, name: str, rows: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> None:
    """Mean reward per step with a ±std band; before any step, each episode's reward."""
    points = [
        (row["step"], row["reward_mean"], row.get("reward_std")) for row in rows if _num(row, "reward_mean")
    ]
    if points:
        steps, means, stds = zip(*points, strict=True)
        (line,) = axes.plot(steps, means, marker="o", markersize=3, label=name)
        if all(std is not None for std in stds):
            low = [m - s for m, s in zip(means, stds, strict=True)]
            high = [m + s for m, s in zip(means, stds, strict=True)]
            axes.fill_between(steps, low, high, alpha=0.2, color=line.get_color())
        return
    rewards = [(i, s["reward"]) for i, s in enumerate(summaries) if s.get("reward") is not None]
    if rewards:
        xs, ys = zip(*rewards, strict=True)
        axes.scatter(xs, ys, s=8, label=f"{name} (episodes, no step yet)")


def _lengths(axes, name: str, summaries: list[dict[str, Any]]) -> None:
    """Tokens of each episode, failed ones (aborted, dropped) in red."""
    ok = [(i, s["tokens"]) for i, s in enumerate(summaries) if s.get("tokens") is not None]
    failed = [(i, t) for i, t in ok if summaries[i].get("state") in FAILED_STATES]
    done = [(i, t) for i, t in ok if summaries[i].get("state") not in FAILED_STATES]
    if done:
        xs, ys = zip(*done, strict=True)
        axes.scatter(xs, ys, s=8, label=name)
    if failed:
        xs, ys = zip(*failed, strict=True)
        axes.scatter(xs, ys, s=14, marker="x", color="red", label=f"{name} aborted/dropped")


def _per_step(axes, rows: list[dict[str, Any]], key: str, label: str) -> None:
    points = [(row["step"], row[key]) for row in rows if _num(row, key)]
    if points:
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, marker="o", markersize=3, label=label)


def _num(row: dict[str, Any], key: str) -> bool:
    return isinstance(row.get(key), int | float) and not isinstance(row.get(key), bool)
