"""What the study tests share (local and dev cluster): the penalized agent, a grid order, readers of a
study's events, Optuna journal and trial steps, and the choice of the trial whose server a test kills."""

from __future__ import annotations

import json
from collections.abc import Container
from pathlib import Path
from typing import Any

from ajet_hpc.environments.episode import EpisodeContext

GOOD = "ajet_hpc.environments.arithmetic.agent:solve"
BAD = "tests.study_support:penalized_arithmetic"


def penalized_arithmetic(ctx: EpisodeContext) -> float:
    """The arithmetic agent with 1 taken off every reward: always below the plain agent, never constant."""
    from ajet_hpc.environments.arithmetic.agent import solve

    return solve(ctx) - 1.0


def good_first_seed(seeds: list[int]) -> int:
    """A grid sampler seed whose order puts the good agent among the first two trials and the bad one
    among the rest: a bad trial then reaches its rung after a good one did, and successive halving
    prunes it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for seed in range(50):
        sampler = optuna.samplers.GridSampler({"a": [GOOD, BAD], "seed": seeds}, seed=seed)
        study = optuna.create_study(sampler=sampler)
        order = []
        for _ in range(2 * len(seeds)):
            trial = study.ask()
            order.append(trial.suggest_categorical("a", [GOOD, BAD]))
            trial.suggest_categorical("seed", seeds)
        if GOOD in order[:2] and BAD in order[2:]:
            return seed
    raise AssertionError("no sampler seed gives that order")


def study_events(study_dir: Path) -> list[dict[str, Any]]:
    path = study_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def study_journal(study_dir: Path, name: str) -> Any:
    """The study as Optuna's journal has it now."""
    import optuna

    from ajet_hpc.study.layout import StudyDir
    from ajet_hpc.study.search import storage

    return optuna.load_study(study_name=name, storage=storage(StudyDir(study_dir)))


def run_steps(run: Path) -> int:
    """The last step in a trial run's metrics.jsonl (0 before the first)."""
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(line).get("step", 0) for line in path.read_text().splitlines()), default=0)


def good_trials_to_hold(study_dir: Path, held: Container[int], steps: int) -> list[int]:
    """Good trials not held yet whose run is at step 2 (the rung) to ``steps - 3``. A test suspends their
    clients: with no new episode and max_staleness 1 a trainer stops within two steps, short of the last,
    so the trial waits for the supervisor's decision at the rung however late that comes (a supervisor
    restarting, a loaded machine) and still has a step to train after a kill."""
    good = [
        e["trial"]
        for e in study_events(study_dir)
        if e["event"] == "started" and e["params"]["clients.math.agent"] == GOOD and e["trial"] not in held
    ]
    return [n for n in good if 2 <= run_steps(study_dir / "trials" / f"{n:04d}") <= steps - 3]


def promoted_held_trial(study_dir: Path, held: Container[int]) -> int | None:
    """A held trial that successive halving kept past its rung (the supervisor's ``promoted`` event)."""
    events = study_events(study_dir)
    for event in events:
        if event["event"] == "promoted" and event["trial"] in held and event["rung"] == 0:
            return int(event["trial"])
    finished = any(e["event"] == "study_finished" for e in events)
    assert not finished, f"the study ended with no good trial held at its rung: {events}"
    return None
