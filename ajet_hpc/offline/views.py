"""Text reports of a run: the summary, the episode table, and the filters they share with export.

Every function here is pure formatting over what :mod:`ajet_hpc.offline.run` read; nothing prints. Text that
comes from a run (model text, task ids, reasons and tracebacks) goes through ``printable`` first: a model or
an agent can write terminal escape sequences, and the reader's terminal must not obey them.
"""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ajet_hpc.offline.run import InspectError, ModelRun, Run
from ajet_hpc.tracking.episode import EpisodeState

FAILED_STATES = (EpisodeState.ABORTED, EpisodeState.DROPPED)
STEP_COLUMNS = ("reward_mean", "reward_std", "episodes", "samples", "tokens", "step_time_s")
SPARK = "▁▂▃▄▅▆▇█"
MAX_STEP_ROWS = 10
MAX_FAILURE_ROWS = 5


# ------------------------------------------------------------------------------------------ formatting
# C0 and C1 controls (ESC starts every terminal escape sequence), DEL, bidirectional overrides that reorder
# what is shown, and lone surrogates (not printable at all); \t and \n are matched only by _UNSAFE_LINE
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, lines: bool = True) -> str:
    """``text`` safe to print on a terminal: control characters, bidirectional overrides and lone
    surrogates written as ``\\xNN`` / ``\\uNNNN``. ``lines``: keep newlines and tabs (model text stays
    readable); else they are escaped too (one table cell, one line)."""
    return (_UNSAFE if lines else _UNSAFE_LINE).sub(_escape, text)


def fmt(value: Any, digits: int = 3) -> str:
    """A cell: ``-`` for missing, floats to ``digits`` significant decimals, lists joined."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return printable(str(value), lines=False)


def fmt_versions(versions: Sequence[int] | None) -> str:
    """``[2, 3, 4]`` -> ``2-4``; ``[1, 3]`` -> ``1,3``."""
    if not versions:
        return "-"
    values = sorted(set(int(v) for v in versions))
    if values == list(range(values[0], values[-1] + 1)) and len(values) > 2:
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)


def fmt_time(epoch: float | None) -> str:
    if not epoch:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[str] = ()) -> str:
    """A plain text table; columns named in ``right`` are right-aligned (numbers)."""
    cells = [[fmt(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    align = set(right)

    def line(values: Sequence[str]) -> str:
        parts = [
            value.rjust(width) if header in align else value.ljust(width)
            for header, value, width in zip(headers, values, widths, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(row) for row in cells)])


def sparkline(values: Sequence[float | None]) -> str:
    present = [v for v in values if v is not None and not math.isnan(v)]
    if not present:
        return ""
    low, high = min(present), max(present)
    span = (high - low) or 1.0
    return "".join(
        " " if v is None or math.isnan(v) else SPARK[int((v - low) / span * (len(SPARK) - 1))] for v in values
    )


def drift_count(value: Any) -> int:
    """The drift of a summary: a count, or a mapping kind -> count."""
    if isinstance(value, dict):
        return sum(int(v) for v in value.values())
    return int(value or 0)


# --------------------------------------------------------------------------------------------- filters
@dataclass(frozen=True)
class EpisodeFilter:
    """Which episodes a command looks at; every ``None`` field matches all."""

    step: int | None = None
    task: str | None = None
    group: str | None = None
    state: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    limit: int | None = None

    def apply(self, model: ModelRun) -> list[dict[str, Any]]:
        """``model``'s episode summaries that match, in store order, at most ``limit`` (the latest)."""
        summaries = model.summaries()
        if self.step is not None:
            ids = set(step_episode_ids(model, self.step) or ())
            summaries = [s for s in summaries if s["episode_id"] in ids]
        kept = [s for s in summaries if self._matches(s)]
        if self.limit is not None:
            kept = kept[-self.limit :] if self.limit > 0 else []
        return kept

    def _matches(self, summary: dict[str, Any]) -> bool:
        reward = summary.get("reward")
        return (
            (self.task is None or summary.get("task_id") == self.task)
            and (self.group is None or summary.get("group") == self.group)
            and (self.state is None or summary.get("state") == self.state)
            and (self.min_reward is None or (reward is not None and reward >= self.min_reward))
            and (self.max_reward is None or (reward is not None and reward <= self.max_reward))
        )


def step_episode_ids(model: ModelRun, step: int) -> list[str] | None:
    """The episodes step ``step`` of ``model`` trained on; ``None`` if its store has no such step."""
    for entry in model.steps():
        if entry["step"] == step:
            return list(entry.get("episode_ids") or [])
    return None


def check_step(models: list[ModelRun], step: int | None) -> None:
    """``InspectError`` unless some model's store recorded ``step`` (when one is asked for)."""
    if step is None or any(step_episode_ids(model, step) is not None for model in models):
        return
    known = sorted({entry["step"] for model in models for entry in model.steps()})
    listed = f"{known[0]}..{known[-1]}" if known else "none yet"
    names = ", ".join(model.name for model in models)
    raise InspectError(f"no step {step} in the store of {names} (steps: {listed})")


# --------------------------------------------------------------------------------------------- summary
def step_rows(model: ModelRun) -> list[dict[str, Any]]:
    """One dict per step: ``metrics.jsonl`` rows, else the metrics the store kept with each step."""
    if model.metrics:
        return sorted(model.metrics, key=lambda row: row["step"])
    return [{"step": entry["step"], **(entry.get("metrics") or {})} for entry in model.steps()]


def merge_ratio(model: ModelRun, summaries: list[dict[str, Any]]) -> tuple[float, str] | None:
    """Training samples per timeline (1.0 until timelines are merged), with where the numbers came from."""
    rows = [row for row in model.metrics if row.get("samples_before_merge") is not None]
    if rows:  # the trainer's own counts (docs/merging.md)
        after = sum(row.get("samples") or 0 for row in rows)
        before = sum(row["samples_before_merge"] for row in rows)
        if before:
            return after / before, f"samples {after} / samples_before_merge {before}, metrics.jsonl"
    calls = {s["episode_id"]: int(s.get("calls") or 0) for s in summaries}
    samples = timelines = 0
    for entry in model.steps():
        samples += int(entry.get("n_samples") or 0)
        timelines += sum(calls.get(episode_id, 0) for episode_id in entry.get("episode_ids") or [])
    if timelines:
        return samples / timelines, f"samples {samples} / timelines {timelines} of the trained episodes"
    return None


def drift_by_kind(model: ModelRun, summaries: list[dict[str, Any]]) -> Counter[str]:
    """Drift events by kind; episodes whose summary only counts them are read to find the kinds."""
    kinds: Counter[str] = Counter()
    for summary in summaries:
        drift = summary.get("drift")
        if isinstance(drift, dict):
            kinds.update({kind: int(n) for kind, n in drift.items()})
        elif drift_count(drift):
            record = model.episode(summary["episode_id"])
            kinds.update(event.kind for timeline in record.timelines for event in timeline.drift)
    return kinds


def summary_text(run: Run, models: list[ModelRun]) -> str:
    blocks = [f"run {run.name}  ({run.root})"]
    blocks += [model_summary(model) for model in models]
    return "\n\n".join(blocks)


def model_summary(model: ModelRun) -> str:
    summaries = model.summaries()
    rows = step_rows(model)
    store = f"{model.store_path.name}" if model.has_store else f"no store yet ({model.store_path.name})"
    lines = [f"model {model.name}  [{store}]"]
    last = rows[-1] if rows else {}
    lines.append(
        f"  steps      {len(rows)}"
        + (f" (last {last['step']}, policy version {fmt(last.get('policy_version'))})" if rows else "")
        + (f"; {len(model.steps())} in the store" if model.has_store and not model.metrics else "")
    )
    states = Counter(s.get("state") for s in summaries)
    by_state = ", ".join(f"{state} {n}" for state, n in sorted(states.items(), key=lambda kv: -kv[1]))
    lines.append(f"  episodes   {len(summaries)}" + (f" ({by_state})" if summaries else ""))
    lines += _task_lines(summaries)
    lines += _step_lines(rows)
    lines += eval_lines(model.eval_rows)
    ratio = merge_ratio(model, summaries)
    lines.append(
        f"  merge      {ratio[0]:.2f} samples per timeline ({ratio[1]})" if ratio else "  merge      -"
    )
    kinds = drift_by_kind(model, summaries)
    detail = ", ".join(f"{kind} {n}" for kind, n in kinds.most_common())
    lines.append(f"  drift      {sum(kinds.values())} events" + (f" ({detail})" if detail else ""))
    lines += _failure_lines(summaries)
    return "\n".join(lines)


def _task_lines(summaries: list[dict[str, Any]]) -> list[str]:
    tasks: dict[Any, list[float]] = {}
    for s in summaries:
        tasks.setdefault(s.get("task_id"), [])
        if s.get("reward") is not None:
            tasks[s.get("task_id")].append(float(s["reward"]))
    if not tasks:
        return ["  tasks      0"]
    counts = Counter(s.get("task_id") for s in summaries)
    means = [sum(r) / len(r) for r in tasks.values() if r]
    line = f"  tasks      {len(tasks)} (episodes per task {min(counts.values())}-{max(counts.values())}"
    if means:
        line += f"; mean reward per task {min(means):.3f}..{max(means):.3f}"
        rewards = [r for values in tasks.values() for r in values]
        line += f"; episode reward mean {sum(rewards) / len(rewards):.3f}"
    return [line + ")"]


def _step_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["  reward by step: no step trained yet"]
    columns = [c for c in STEP_COLUMNS if any(row.get(c) is not None for row in rows)]
    shown = rows[-MAX_STEP_ROWS:]
    headers = ["step", *columns]
    text = table(headers, ([row["step"], *(row.get(c) for c in columns)] for row in shown), right=headers)
    lines = [f"  reward by step  {sparkline([row.get('reward_mean') for row in rows])}"]
    if len(rows) > len(shown):
        lines.append(f"    ({len(rows) - len(shown)} earlier steps not shown)")
    lines += ["    " + line for line in text.splitlines()]
    return lines


def eval_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The eval rounds of a model, per eval group: step, reward, pass@k, episodes, the best step."""
    lines = []
    for group in dict.fromkeys(row["eval"] for row in rows):
        mine = sorted((r for r in rows if r["eval"] == group), key=lambda r: r["step"])
        ks = sorted({c for r in mine for c in r if c.startswith("eval_pass@")}, key=lambda c: int(c[10:]))
        headers = ["step", "reward", *(c.removeprefix("eval_") for c in ks), "episodes", "complete"]
        cells = (
            [
                r["step"],
                r.get("eval_reward_mean"),
                *(r.get(c) for c in ks),
                r.get("eval_episodes"),
                r.get("eval_complete"),
            ]
            for r in mine
        )
        last = mine[-1]
        best = f"best step {last.get('eval_best_step')} (pass@1 {fmt(last.get('eval_best_pass@1'))})"
        lines.append(f"  eval {group}  {sparkline([r.get('eval_pass@1') for r in mine])}  {best}")
        lines += ["    " + line for line in table(headers, cells, right=headers).splitlines()]
    return lines


def _failure_lines(summaries: list[dict[str, Any]]) -> list[str]:
    failed = [s for s in summaries if s.get("state") in FAILED_STATES]
    if not failed:
        return ["  failures   0"]
    reasons = Counter((s.get("state"), s.get("reason") or "(no reason)") for s in failed)
    lines = [f"  failures   {len(failed)}"]
    lines += [f"    {n} x {state}: {fmt(reason)}" for (state, reason), n in reasons.most_common()]
    for s in failed[-MAX_FAILURE_ROWS:]:
        task, ended = fmt(s.get("task_id")), fmt_time(s.get("ended_at"))
        lines.append(f"    {fmt(s['episode_id'])}  {fmt(s.get('state'))}  task {task}  ended {ended}")
    return lines


# -------------------------------------------------------------------------------------------- episodes
EPISODE_HEADERS = ("id", "task", "group", "state", "reward", "calls", "tokens", "drift", "versions")


def episodes_text(selected: list[tuple[ModelRun, list[dict[str, Any]]]]) -> str:
    """The episode table; a ``model`` column is added when episodes of several models are listed."""
    several = len(selected) > 1
    headers = (("model",) if several else ()) + EPISODE_HEADERS
    rows = []
    for model, summaries in selected:
        for s in summaries:
            row = [
                s["episode_id"],
                s.get("task_id"),
                s.get("group"),
                s.get("state"),
                s.get("reward"),
                s.get("calls"),
                s.get("tokens"),
                drift_count(s.get("drift")),
                fmt_versions(s.get("policy_versions")),
            ]
            rows.append([model.name, *row] if several else row)
    if not rows:
        return "no episodes match"
    return table(headers, rows, right=("reward", "calls", "tokens", "drift")) + f"\n{len(rows)} episodes"
