"""The search itself, through Optuna: its samplers, pruners and journal-file storage.

Optuna is an optional dependency (the ``study`` extra): ``require_optuna`` turns its absence into one clear
sentence. The storage is ``JournalStorage`` with the file backend, made for NFS: every process appends
operations to ``STUDY/optuna.journal`` under a lock file, so the report and a restarted supervisor read
exactly what the last supervisor wrote.

A trial is one run: its parameters are the space's paths plus ``seed``. A grid study puts the seeds in the
grid; the other samplers draw a configuration for one seed and queue the same configuration for the others,
so every configuration is seen with every seed (the report's mean ± std).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ajet_hpc.study.layout import StudyDir
from ajet_hpc.study.schema import SEED_PARAM, Range, StudySpec

if TYPE_CHECKING:
    import optuna

EXTRA = "study"


class OptunaMissing(RuntimeError):
    pass


def require_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError as exc:
        raise OptunaMissing(
            f"studies need Optuna: install the '{EXTRA}' extra (pip install 'ajet_hpc[{EXTRA}]', or "
            "pip install optuna)"
        ) from exc


def storage(study_dir: StudyDir) -> optuna.storages.JournalStorage:
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

    path = str(study_dir.journal)
    return optuna.storages.JournalStorage(JournalFileBackend(path, lock_obj=JournalFileOpenLock(path)))


def open_study(spec: StudySpec, study_dir: StudyDir) -> optuna.Study:
    """Create the Optuna study, or load it (same name, same storage) when it exists."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        storage=storage(study_dir),
        study_name=spec.name,
        sampler=sampler(spec),
        pruner=pruner(spec),
        direction=spec.metric.direction,
        load_if_exists=True,
    )


def load_study(spec: StudySpec, study_dir: StudyDir) -> optuna.Study:
    """The study for reading (status, report): no sampler or pruner needed."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=spec.name, storage=storage(study_dir))


def sampler(spec: StudySpec) -> optuna.samplers.BaseSampler:
    import optuna

    if spec.is_grid:
        return _grid_sampler(spec)
    if spec.sampler == "random":
        return optuna.samplers.RandomSampler(seed=spec.sampler_seed)
    return optuna.samplers.TPESampler(seed=spec.sampler_seed)


def _grid_sampler(spec: StudySpec) -> optuna.samplers.BaseSampler:
    """Optuna's GridSampler, without its ``study.stop()`` once the grid is done: that is only allowed
    inside ``optimize``, and our trials end through ``tell`` (the trial budget stops the study instead)."""
    import optuna

    class StudyGridSampler(optuna.samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            return None

    return StudyGridSampler(spec.grid_space(), seed=spec.sampler_seed)


def pruner(spec: StudySpec) -> optuna.pruners.BasePruner:
    import optuna

    p = spec.pruner
    if p.kind == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps)
    if p.kind == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_resource, reduction_factor=p.reduction_factor
        )
    return optuna.pruners.NopPruner()


def suggest(spec: StudySpec, study: optuna.Study, trial: optuna.Trial) -> dict[str, Any]:
    """Draw the trial's parameters (fixed ones for a queued or grid trial); for a fresh non-grid draw,
    queue the same configuration for the other seeds."""
    params: dict[str, Any] = {}
    for path, values in spec.space.items():
        if spec.is_grid:
            params[path] = trial.suggest_categorical(path, spec.grid_space()[path])
        elif isinstance(values, Range):
            if values.integer:
                params[path] = trial.suggest_int(path, round(values.low), round(values.high), log=values.log)
            else:
                params[path] = trial.suggest_float(path, values.low, values.high, log=values.log)
        else:
            params[path] = trial.suggest_categorical(path, values)
    queued = bool(trial.user_attrs.get("queued"))
    params[SEED_PARAM] = trial.suggest_categorical(SEED_PARAM, list(spec.seeds))
    if not spec.is_grid and not queued:
        for seed in spec.seeds:
            if seed != params[SEED_PARAM]:
                study.enqueue_trial({**params, SEED_PARAM: seed}, user_attrs={"queued": True})
    return params


def handle(study: optuna.Study, frozen: optuna.trial.FrozenTrial) -> optuna.Trial:
    """A live handle on a running trial, also one asked by an earlier supervisor (report, should_prune)."""
    import optuna

    return optuna.trial.Trial(study, frozen._trial_id)
