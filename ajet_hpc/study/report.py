"""``STUDY report``: a Markdown page with PNG plots that answers "what worked".

It holds the best configuration, a table of configurations sorted by the metric (mean ± std over seeds),
every trial, the reward curves of all trials on one plot coloured by one parameter, the metric against
each parameter, step time and tokens per second per trial, and the supervisor's events (relaunches,
prunes, failures). Plots are drawn with matplotlib's Agg backend: no display needed on a login node.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.progress import tokens_per_s
from ajet_hpc.study.schema import SEED_PARAM, StudySpec
from ajet_hpc.study.state import TrialView, describe_event, short_params, trial_views


def write_report(spec: StudySpec, study_dir: StudyDir, colour_by: str | None = None) -> Path:
    """Write ``STUDY/report/report.md`` and its PNGs; returns the Markdown file."""
    import matplotlib

    matplotlib.use("Agg")
    out = study_dir.report_dir
    out.mkdir(parents=True, exist_ok=True)
    views = trial_views(spec, study_dir)
    colour = colour_by or spec.colour_by or next(iter(spec.space))
    plots = {
        "curves": plot_curves(views, spec, colour, out / "reward_curves.png"),
        "per_param": plot_metric_vs_params(views, spec, out / "metric_vs_params.png"),
        "speed": plot_speed(views, out / "speed.png"),
    }
    lines = [f"# Study {spec.name}", ""]
    lines += _summary(spec, views)
    configs = config_table(views, spec.metric.direction)
    if configs:
        best = configs[0]
        lines += ["## Best configuration", ""]
        lines += [f"- `{path}` = `{value}`" for path, value in best["params"]]
        lines += [
            f"- {spec.metric.name} (mean of the last {spec.metric.window} steps): "
            f"**{_pm(best['mean'], best['std'])}** over {best['n']} seed(s)",
            "",
        ]
    lines += ["## Configurations (best first; mean ± std over seeds)", ""]
    lines += ["| rank | configuration | seeds | " + spec.metric.name + " | states |", "|---|---|---|---|---|"]
    for rank, row in enumerate(configs, 1):
        text = " ".join(f"{p.rsplit('.', 1)[-1]}={v}" for p, v in row["params"])
        lines.append(f"| {rank} | {text} | {row['n']} | {_config_value(row)} | {row['states']} |")
    lines += ["", "## Trials", "", f"| trial | parameters | state | step | {spec.metric.name} | notes |"]
    lines.append("|---|---|---|---|---|---|")
    for v in sorted(views, key=lambda v: _sort_key(v.metric, spec.metric.direction)):
        metric = f"{v.metric:.4f}" if v.metric is not None else "-"
        notes = "; ".join(
            ([f"relaunched {v.relaunches}x"] if v.relaunches else []) + ([v.reason] if v.reason else [])
        )
        lines.append(f"| {v.number} | {short_params(v.params)} | {v.state} | {v.step} | {metric} | {notes} |")
    lines += ["", "## Plots", ""]
    titles = {
        "curves": f"{spec.metric.name} per step, every trial, coloured by `{colour}`",
        "per_param": f"final {spec.metric.name} against each parameter",
        "speed": "step time and tokens per second per trial",
    }
    for key, path in plots.items():
        lines += [f"### {titles[key]}", "", f"![{key}]({path.name})", ""]
    lines += ["## Events", ""]
    events = study_dir.events()
    notable = [e for e in events if e.get("event") not in ("launched", "supervisor_started")]
    lines += [f"- {describe_event(row)}" for row in notable] or ["(none)"]
    lines += ["", f"{len(events)} event(s) in all: {study_dir.events_file}", ""]
    target = out / "report.md"
    target.write_text("\n".join(lines))
    return target


def _summary(spec: StudySpec, views: list[TrialView]) -> list[str]:
    counts: dict[str, int] = defaultdict(int)
    for v in views:
        counts[v.state] += 1
    states = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no trial yet"
    space = ", ".join(f"`{p}`" for p in spec.space)
    return [
        f"{len(views)} of {spec.trial_budget()} trial(s): {states}. Space: {space}; seeds {spec.seeds}; "
        f"pruner {spec.pruner.kind}; metric {spec.metric.name} ({spec.metric.direction}, mean of the last "
        f"{spec.metric.window} steps).",
        "",
    ]


def config_table(views: list[TrialView], direction: str) -> list[dict[str, Any]]:
    """One row per configuration: its seeds' metrics' mean and std, best first (pruned and failed trials
    count in ``states`` but not in the mean). A configuration none of whose trials completed carries the
    best value its trials reached before they stopped (``reached``, ``reached_step``) and sorts after
    every completed one, by that value."""
    groups: dict[tuple, list[TrialView]] = defaultdict(list)
    for v in views:
        groups[v.config_key()].append(v)
    rows = []
    for key, members in groups.items():
        values = [v.metric for v in members if v.state == "complete" and v.metric is not None]
        states: dict[str, int] = defaultdict(int)
        for v in members:
            states[v.state] += 1
        stopped = [v for v in members if v.metric is not None and not math.isnan(v.metric)]
        best_stopped = (
            min(stopped, key=lambda v: _sort_key(v.metric, direction)) if stopped and not values else None
        )
        rows.append(
            {
                "params": list(key),
                "n": len(values),
                "mean": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "states": ", ".join(f"{n} {s}" for s, n in sorted(states.items())),
                "reached": best_stopped.metric if best_stopped else None,
                "reached_step": best_stopped.step if best_stopped else None,
            }
        )
    return sorted(rows, key=lambda r: (*_sort_key(r["mean"], direction), *_sort_key(r["reached"], direction)))


def _config_value(row: dict[str, Any]) -> str:
    if row["mean"] is None and row["reached"] is not None:
        return f"- (reached {row['reached']:.4f} at step {row['reached_step']}, none completed)"
    return _pm(row["mean"], row["std"])


def _sort_key(value: float | None, direction: str) -> tuple[int, float]:
    if value is None or math.isnan(value):
        return (1, 0.0)
    return (0, -value if direction == "maximize" else value)


def _pm(mean: float | None, std: float) -> str:
    return "-" if mean is None else f"{mean:.4f} ± {std:.4f}"


def _colours(values: list[Any]) -> dict[Any, Any]:
    from matplotlib import colormaps

    distinct = sorted(set(values), key=lambda v: (isinstance(v, str), v))
    cmap = colormaps["viridis"] if all(isinstance(v, (int, float)) for v in distinct) else colormaps["tab10"]
    n = max(1, len(distinct) - 1)
    return {v: cmap(i / n if cmap.name == "viridis" else i % 10) for i, v in enumerate(distinct)}


def plot_curves(views: list[TrialView], spec: StudySpec, colour: str, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colours = _colours([v.params.get(colour) for v in views])
    labelled: set[Any] = set()
    for v in views:
        steps = [r["step"] for r in v.rows if isinstance(r.get(spec.metric.name), (int, float))]
        values = [r[spec.metric.name] for r in v.rows if isinstance(r.get(spec.metric.name), (int, float))]
        if not steps:
            continue
        value = v.params.get(colour)
        style = {"complete": "-", "pruned": ":", "failed": "--"}.get(v.state, "-.")
        labelled.add(value)
        ax.plot(steps, values, style, color=colours[value], alpha=0.85)
        ax.annotate(str(v.number), (steps[-1], values[-1]), fontsize=7, color=colours[value])
    ax.set_xlabel("step")
    ax.set_ylabel(spec.metric.name)
    ax.set_title(f"{spec.metric.name} per trial (dotted: pruned, dashed: failed)")
    if labelled:  # one solid line per value, whatever the state of the trial drawn first
        from matplotlib.lines import Line2D

        name = colour.rsplit(".", 1)[-1]
        order = sorted(labelled, key=lambda v: (isinstance(v, str), v))
        handles = [Line2D([], [], color=colours[v], label=f"{name}={v}") for v in order]
        ax.legend(handles=handles, fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_metric_vs_params(views: list[TrialView], spec: StudySpec, path: Path) -> Path:
    import matplotlib.pyplot as plt

    params = [*spec.space, SEED_PARAM]
    fig, axes = plt.subplots(1, len(params), figsize=(4 * len(params), 4), squeeze=False)
    for ax, param in zip(axes[0], params, strict=True):
        points = [(v.params.get(param), v.metric, v.state) for v in views if v.metric is not None]
        categorical = any(isinstance(x, str) for x, _, _ in points)
        order = sorted({x for x, _, _ in points}, key=str) if categorical else []
        for x, y, state in points:
            xs = order.index(x) if categorical else x
            ax.scatter(xs, y, marker={"complete": "o", "pruned": "x"}.get(state, "^"), color="C0")
        if categorical:
            ax.set_xticks(range(len(order)), [str(o) for o in order])
        elif points and all(isinstance(x, (int, float)) and x > 0 for x, _, _ in points):
            values = [float(x) for x, _, _ in points if x is not None]
            if max(values) / min(values) > 20:
                ax.set_xscale("log")
        ax.set_xlabel(param.rsplit(".", 1)[-1])
        ax.set_ylabel(spec.metric.name)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{spec.metric.name} against each parameter (o complete, x pruned)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_speed(views: list[TrialView], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels, times, speeds = [], [], []
    for v in views:
        step_times = [r["step_time_s"] for r in v.rows if isinstance(r.get("step_time_s"), (int, float))]
        rates = [x for x in (tokens_per_s(r) for r in v.rows) if x is not None]
        labels.append(str(v.number))
        times.append(statistics.median(step_times) if step_times else 0.0)
        speeds.append(statistics.median(rates) if rates else 0.0)
    positions = list(range(len(labels)))
    left.bar(positions, times, color="C1")
    left.set_xticks(positions, labels)
    left.set_xlabel("trial")
    left.set_ylabel("median step time (s)")
    right.bar(positions, speeds, color="C2")
    right.set_xticks(positions, labels)
    right.set_xlabel("trial")
    right.set_ylabel("median tokens / s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
