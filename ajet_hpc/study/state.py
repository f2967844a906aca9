"""What a study looks like now, trial by trial: read from Optuna's journal, the supervisor's bookkeeping and
each run directory (never from the supervisor's memory: status and report work while it runs, or after)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ajet_hpc.study import search
from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.progress import step_rows, windowed
from ajet_hpc.study.schema import SEED_PARAM, StudySpec

STATE_NAMES = {"RUNNING": "running", "COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed"}


@dataclass(frozen=True)
class TrialView:
    number: int
    params: dict[str, Any]  # space paths and seed
    state: str  # running | complete | pruned | failed | waiting
    step: int
    metric: float | None  # the trial's value when done, else the windowed metric at its last step
    relaunches: int
    reason: str
    rows: list[dict[str, Any]]

    @property
    def seed(self) -> Any:
        return self.params.get(SEED_PARAM)

    def config_key(self) -> tuple[tuple[str, Any], ...]:
        """The configuration without the seed: trials with the same key are seeds of one configuration."""
        return tuple(sorted((k, v) for k, v in self.params.items() if k != SEED_PARAM))


def trial_views(spec: StudySpec, study_dir: StudyDir) -> list[TrialView]:
    study = search.load_study(spec, study_dir)
    views = []
    for frozen in study.get_trials(deepcopy=False):
        if frozen.state.name == "WAITING":
            continue
        book = study_dir.book(frozen.number)
        rows = step_rows(study_dir.run_dir(frozen.number))
        values = windowed(rows, spec.metric.name, spec.metric.window)
        metric = frozen.value if frozen.value is not None else (values[max(values)] if values else None)
        views.append(
            TrialView(
                number=frozen.number,
                params=dict(book.get("params") or frozen.params),
                state=STATE_NAMES.get(frozen.state.name, frozen.state.name.lower()),
                step=rows[-1]["step"] if rows else 0,
                metric=metric,
                relaunches=int(book.get("relaunches", 0)),
                reason=str(book.get("reason", "")),
                rows=rows,
            )
        )
    return views


def short_params(params: dict[str, Any]) -> str:
    """``lr=0.003 mode=tree seed=1``: each path's last segment, for one line of a table."""
    ordered = sorted(params.items(), key=lambda item: item[0] == SEED_PARAM)  # the seed last
    return " ".join(f"{path.rsplit('.', 1)[-1]}={_short(value)}" for path, value in ordered)


def _short(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def status_table(spec: StudySpec, study_dir: StudyDir) -> str:
    """One screen: each trial, its parameters, state, step and metric; the counts; the last events."""
    views = trial_views(spec, study_dir)
    lines = [f"study {spec.name} ({study_dir.root}): {len(views)} of {spec.trial_budget()} trial(s) started"]
    width = max([len(short_params(v.params)) for v in views] + [10])
    lines.append(
        f"  {'trial':>5}  {'parameters':<{width}}  {'state':<9} {'step':>6}  {spec.metric.name:>12}  notes"
    )
    for v in views:
        metric = f"{v.metric:12.4f}" if v.metric is not None else f"{'-':>12}"
        notes = [f"relaunched {v.relaunches}x"] if v.relaunches else []
        if v.reason:
            notes.append(v.reason[:80])
        step = str(v.step)
        lines.append(
            f"  {v.number:>5}  {short_params(v.params):<{width}}  {v.state:<9} {step:>6}  {metric}  "
            + "; ".join(notes)
        )
    counts: dict[str, int] = {}
    for v in views:
        counts[v.state] = counts.get(v.state, 0) + 1
    lines.append(
        "  " + ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
        if counts
        else "  no trial yet"
    )
    events = study_dir.events()[-5:]
    if events:
        lines.append("last events:")
        lines.extend(f"  {describe_event(row)}" for row in events)
    return "\n".join(lines)


def describe_event(row: dict[str, Any]) -> str:
    import time

    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.get("time", 0)))
    trial = f" trial {row['trial']}" if row.get("trial") is not None else ""
    extra = ", ".join(
        f"{k}={_short(v)}" for k, v in row.items() if k not in ("time", "event", "trial", "cancel", "params")
    )
    params = f" {short_params(row['params'])}" if row.get("params") else ""
    return f"{when} {row.get('event')}{trial}{params}" + (f" ({extra})" if extra else "")
