"""The study file: a base topology, a search space over dotted overrides, seeds, and how to run the trials.

Validated with pydantic like the topology, and every problem is a ``ConfigError`` naming its field
(``space.servers.policy.trainer.lr``, ``max_concurrent``) so that ``python -m ajet_hpc.study`` exits 2
before anything is submitted. Each override path is checked by applying it, with each value it can take,
to the base topology with the launcher's own override code and validating the result: a typo in a path is
an error here, not a failed run three hours later.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ajet_hpc.config import ConfigError, ConfigIssue, issues_from_validation_error, load_topology
from ajet_hpc.config.load import _read_mapping
from ajet_hpc.environments.sources import source_issues

_STRICT = ConfigDict(extra="forbid", frozen=True)
SEED_PARAM = "seed"  # the Optuna parameter that carries a trial's seed


class Range(BaseModel):
    """A numeric range: ``{low, high}``, ``log: true`` for a log-range, ``integer: true`` for whole numbers;
    ``num`` points (linear or geometric) when the study is a grid."""

    model_config = _STRICT
    low: float
    high: float
    log: bool = False
    integer: bool = False
    num: int | None = Field(default=None, ge=2, description="Grid points (grid sampler only).")

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if not self.low < self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-range needs low > 0 (got {self.low})")
        return self

    def grid(self) -> list[Any]:
        """The ``num`` grid points from low to high (geometric for a log-range)."""
        assert self.num is not None
        if self.log:
            ratio = (self.high / self.low) ** (1 / (self.num - 1))
            points = [self.low * ratio**i for i in range(self.num)]
        else:
            points = [self.low + (self.high - self.low) * i / (self.num - 1) for i in range(self.num)]
        points[-1] = self.high
        return sorted({round(p) for p in points}) if self.integer else [float(f"{p:.6g}") for p in points]

    def ends(self) -> list[Any]:
        return [round(self.low), round(self.high)] if self.integer else [self.low, self.high]


class MetricSpec(BaseModel):
    model_config = _STRICT
    name: str = Field(default="reward_mean", description="A column of metrics.jsonl.")
    window: int = Field(default=3, ge=1, description="The metric is the mean of the last `window` steps.")
    direction: Literal["maximize", "minimize"] = "maximize"


class PrunerSpec(BaseModel):
    model_config = _STRICT
    kind: Literal["none", "median", "successive_halving"] = "none"
    min_resource: int = Field(default=2, ge=1, description="successive_halving: steps before the 1st rung.")
    reduction_factor: int = Field(default=2, ge=2, description="successive_halving: keep 1 in this many.")
    warmup_steps: int = Field(default=2, ge=0, description="median: steps never pruned.")
    startup_trials: int = Field(default=2, ge=0, description="median: trials that finish before any prune.")


class SupervisorJob(BaseModel):
    """The supervisor as a small CPU Slurm job (``--slurm``); it requeues itself before ``time`` runs out."""

    model_config = _STRICT
    partition: str = "cpu"
    time: str = "4:00:00"
    cpus: int = Field(default=1, ge=1)
    mem: str = "2G"
    signal_delay_s: int = Field(default=120, ge=10)


class StudySpec(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    base: str = Field(description="The base topology (relative to the study file).")
    dir: str | None = Field(default=None, description="The study directory (default studies/<name>).")
    overrides: list[str] = Field(default_factory=list, description="Applied to every trial.")
    space: dict[str, list[Any] | Range] = Field(description="Dotted override path -> values or a range.")
    seeds: list[int] = Field(default_factory=lambda: [0], min_length=1)
    seed_path: str = Field(default="servers.0.trainer.seed", description="Where a trial's seed goes.")
    sampler: Literal["auto", "grid", "tpe", "random"] = "auto"
    sampler_seed: int = 0
    max_trials: int | None = Field(default=None, ge=1)
    max_concurrent: int = Field(default=2, ge=1, description="Runs in flight at once.")
    metric: MetricSpec = Field(default_factory=MetricSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    max_relaunches: int = Field(default=2, ge=0, description="Relaunches of one trial's run, at most.")
    stall_after: float = Field(default=1800.0, gt=0, description="Seconds without a new step: stalled.")
    poll_s: float = Field(default=10.0, gt=0)
    colour_by: str | None = Field(default=None, description="Parameter that colours the report's curves.")
    supervisor: SupervisorJob = Field(default_factory=SupervisorJob)

    @model_validator(mode="after")
    def _space(self) -> StudySpec:
        if not self.space:
            raise ValueError("the search space is empty: give at least one override path and its values")
        for path, values in self.space.items():
            if isinstance(values, list) and not values:
                raise ValueError(f"space.{path}: no values")
            if path == SEED_PARAM or path == self.seed_path:
                raise ValueError(f"space.{path}: seeds are set with 'seeds', not in the space")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds: repeated seed in {self.seeds}")
        if self.colour_by is not None and self.colour_by not in self.space:
            raise ValueError(f"colour_by: {self.colour_by!r} is not a path of the space")
        return self

    # --- what the study explores ---------------------------------------------------------------------
    @property
    def is_grid(self) -> bool:
        if self.sampler == "auto":
            return all(isinstance(v, list) or v.num is not None for v in self.space.values())
        return self.sampler == "grid"

    def grid_space(self) -> dict[str, list[Any]]:
        """The grid (ranges expanded to ``num`` points) with the seeds as one more axis."""
        grid = {path: v if isinstance(v, list) else v.grid() for path, v in self.space.items()}
        return {**grid, SEED_PARAM: list(self.seeds)}

    def grid_size(self) -> int:
        return math.prod(len(v) for v in self.grid_space().values())

    def trial_budget(self) -> int:
        """How many trials the study runs in all."""
        if self.is_grid:
            size = self.grid_size()
            return size if self.max_trials is None else min(size, self.max_trials)
        assert self.max_trials is not None
        return self.max_trials

    def trial_overrides(self, params: dict[str, Any]) -> list[str]:
        """The launcher overrides of one trial: the fixed ones, then its parameters and seed."""
        chosen = [f"{path}={_yaml_value(params[path])}" for path in self.space if path in params]
        return [*self.overrides, *chosen, f"{self.seed_path}={int(params[SEED_PARAM])}"]


def _yaml_value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, float) else str(value)


def load_study(path: str | Path, dir_base: Path | None = None) -> tuple[StudySpec, Path]:
    """Read and check a study file; returns the spec and the base topology's path. ``ConfigError`` names
    every problem's field (``space.<path>``, ``max_concurrent``...)."""
    path = Path(path)
    data = _read_mapping(path)
    try:
        spec = StudySpec.model_validate(data)
    except ValidationError as err:
        raise ConfigError(issues_from_validation_error(err, StudySpec)) from None
    base = (path.parent / spec.base).resolve()
    if not base.is_file():
        raise ConfigError.at("base", f"{base} does not exist")
    issues = check_paths(spec, base)
    if spec.is_grid:
        ranges = [p for p, v in spec.space.items() if isinstance(v, Range) and v.num is None]
        issues += [ConfigIssue(f"space.{p}", "a grid needs 'num' points for a range") for p in ranges]
    elif spec.max_trials is None:
        issues.append(ConfigIssue("max_trials", f"required with the {spec.sampler} sampler"))
    if issues:
        raise ConfigError(issues)
    return spec, base


def check_paths(spec: StudySpec, base: Path) -> list[ConfigIssue]:
    """Apply every override, each value of each space path, and the seed to the base topology with the
    launcher's override code; an issue per path that does not validate (unknown key, wrong type...)."""
    raw = _read_mapping(base)
    issues: list[ConfigIssue] = []
    checks: list[tuple[str, list[str]]] = [("overrides", [o]) for o in spec.overrides]
    for path, values in spec.space.items():
        options = values if isinstance(values, list) else values.ends()
        checks += [(f"space.{path}", [f"{path}={_yaml_value(v)}"]) for v in options]
    checks.append(("seed_path", [f"{spec.seed_path}={spec.seeds[0]}"]))
    reported: set[str] = set()
    for field, overrides in checks:
        if field in reported:
            continue
        try:
            topology = load_topology(
                raw, [*spec.overrides, *overrides] if field != "overrides" else overrides
            )
            if bad := source_issues(topology):  # as the launcher checks them
                raise ConfigError(bad)
        except ConfigError as exc:
            reported.add(field)
            detail = "; ".join(str(issue) for issue in exc.issues)
            issues.append(ConfigIssue(field, f"{overrides[0]!r} does not apply to {base.name}: {detail}"))
    return issues


def expand(spec: StudySpec) -> list[dict[str, Any]]:
    """Every grid point (seeds included) in a fixed order: what a grid study runs."""
    grid = spec.grid_space()
    return [dict(zip(grid, combo, strict=True)) for combo in itertools.product(*grid.values())]
