"""Tasks and rewards from the ``reasoning-gym`` package: ``tasks: reasoning_gym:<dataset>[?size=N&seed=S]``.

The source yields the dataset's items in order as tasks (``<dataset>-<seed>-<index>``) whose data is the
question and where the item comes from; the agent's reward is the dataset's own verifier,
``score_answer(answer, entry)``, on the item rebuilt from that (procedural datasets rebuild the same item
from the same config, seed and index). Other ``key=value`` parameters are fields of the dataset's config
(``reasoning_gym:chain_sum?size=200&seed=3&min_terms=2&max_terms=3``). Several datasets mix through client
groups with ``ratio`` (one group per dataset; each step's ``reward_by_group`` shows them apart).

reasoning-gym is imported only here, by ``tasks`` and ``score``, in the client group's own runtime (``env:
reasoning-gym.txt``): the server and the launcher never need it (the launcher checks a spec's form with
``parse_spec``, which imports nothing).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Iterator
from typing import Any

from ajet_hpc.environments.episode import Task

PREFIX = "reasoning_gym:"
DEFAULT_SIZE = 500
DEFAULT_SEED = 0
_DATASET = re.compile(r"^[a-z0-9_]+$")
_PARAM = re.compile(r"^[a-z_][a-z0-9_]*$")


def parse_spec(spec: str) -> tuple[str, dict[str, int | float | bool | str]]:
    """``reasoning_gym:<dataset>[?size=N&seed=S&<config field>=<value>...]`` as (dataset, parameters):
    values are YAML-like scalars (``3`` an int, ``0.5`` a float, ``true`` a bool, else a string).
    ``ValueError`` naming what is wrong. Needs no reasoning-gym: the launcher checks specs with it."""
    body = spec.removeprefix(PREFIX)
    dataset, _, query = body.partition("?")
    if not _DATASET.fullmatch(dataset):
        raise ValueError(
            f"invalid reasoning-gym source {spec!r}; use 'reasoning_gym:<dataset>[?size=N&seed=S]' with a "
            "dataset name such as chain_sum"
        )
    params: dict[str, int | float | bool | str] = {}
    for pair in query.split("&") if query else []:
        key, sep, raw = pair.partition("=")
        if not sep or not _PARAM.fullmatch(key) or not raw or key in params:
            raise ValueError(f"invalid parameter {pair!r} in {spec!r}; use key=value pairs joined by '&'")
        params[key] = _scalar(raw)
    return dataset, params


def _scalar(raw: str) -> int | float | bool | str:
    if raw in ("true", "false"):
        return raw == "true"
    for kind in (int, float):
        try:
            value = kind(raw)
        except ValueError:
            continue
        if math.isfinite(value):
            return value
    return raw


class ReasoningGymMissing(ImportError):
    """reasoning-gym is not installed in this runtime."""


def _library() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymMissing(
            "reasoning-gym is not installed in this client runtime: give the group `env: reasoning-gym.txt` "
            f"(envs/reasoning-gym.txt) or install reasoning-gym there ({exc})"
        ) from exc
    return reasoning_gym


@functools.lru_cache(maxsize=32)
def _dataset(name: str, config_json: str) -> Any:
    return _library().create_dataset(name, **json.loads(config_json))


def dataset_of(name: str, config: dict[str, Any]) -> Any:
    """The dataset ``name`` built with ``config`` (size and seed included), once per process."""
    return _dataset(name, json.dumps(config, sort_keys=True))


def tasks(spec: str) -> Iterator[Task]:
    """Every item of the dataset ``spec`` names, in order, as a task; the dataset is built here, so a
    missing library, an unknown dataset or a bad config field raise at once (``ReasoningGymMissing``,
    ``ValueError``)."""
    name, params = parse_spec(spec)
    config: dict[str, Any] = {"size": DEFAULT_SIZE, "seed": DEFAULT_SEED, **params}
    try:
        dataset = dataset_of(name, config)
    except ReasoningGymMissing:
        raise
    except (ValueError, TypeError, AssertionError) as exc:  # unknown dataset, or a bad config field
        raise ValueError(f"reasoning-gym cannot build {spec!r}: {exc}") from exc
    return _items(name, config, dataset)


def _items(name: str, config: dict[str, Any], dataset: Any) -> Iterator[Task]:
    for index in range(len(dataset)):
        entry = dataset[index]
        yield Task(
            id=f"{name}-{config['seed']}-{index}",
            data={
                "question": entry["question"],
                "answer": entry[
                    "answer"
                ],  # the oracle answer, for other scorers (environments.rewards.math_answer)
                "dataset": name,
                "config": config,
                "index": index,
            },
        )


def score(data: dict[str, Any], answer: str | None) -> float:
    """The dataset's own verifier on ``answer`` for the task ``data`` (from `tasks`)."""
    dataset = dataset_of(data["dataset"], data["config"])
    return float(dataset.score_answer(answer, dataset[int(data["index"])]))
