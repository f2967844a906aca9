"""Evaluation during training: a client group's ``eval`` block, and the eval group derived from it.

An eval block makes the launcher start one more job array beside the group, its *eval group*
``<group>-eval``: the same agent, runtime and resources, over the held-out ``eval.tasks``. Every
``every_steps`` steps of the evaluated model (and at its start and its last step) the server opens an eval
round; the eval group runs every held-out task ``samples_per_task`` times against that policy version,
and the server then writes one eval row (mean reward, pass@k, per task) to metrics.jsonl. Eval episodes
are stored in the server store like any other, marked with their round, and never trained
(docs/evaluation.md).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from ajet_hpc.config.errors import ConfigIssue
from ajet_hpc.config.fields import Name

EVAL_SUFFIX = "-eval"
"""The eval group of client group ``g`` is ``g-eval`` (its jobs, its store folder, its episodes' group)."""


class EvalConfig(BaseModel):
    """Held-out evaluation of a client group's agent, on the current policy, during training."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    tasks: str = Field(
        description="Held-out task source ('builtin:<name>', 'reasoning_gym:<dataset>', a '.jsonl' path or "
        "'module.path:callable'), finite or cut by max_tasks: every round runs all of it; its tasks are "
        "never trained."
    )
    every_steps: int = Field(default=5, ge=1, description="An eval round after every this many steps.")
    at_start: bool = Field(
        default=True, description="Also evaluate the initial policy (a round at step 0) before training."
    )
    samples_per_task: int = Field(
        default=4, ge=1, description="Episodes per held-out task and round: pass@k is reported for k ≤ it."
    )
    max_tasks: int | None = Field(
        default=None, ge=1, description="Use only the first max_tasks held-out tasks; None: all."
    )
    temperature: float = Field(
        default=1.0,
        ge=0,
        le=10,
        allow_inf_nan=False,
        description="Sampling temperature of every model call of an eval episode (the server sets it, "
        "whatever the agent asks).",
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Most tokens per answer in an eval episode; None: what the agent asks for.",
    )
    success_threshold: float = Field(
        default=1.0,
        allow_inf_nan=False,
        description="An eval episode passes when its reward is at least this (for pass@k).",
    )
    model: Name | None = Field(
        default=None,
        description="Which of the group's servers the rounds follow (its steps); None: the first that "
        "trains.",
    )
    array: int = Field(default=1, ge=1, description="Array tasks of the eval group.")
    in_flight: int = Field(default=8, ge=1, description="Eval episodes in flight per eval array task.")
    timeout_s: float = Field(
        default=1800.0,
        gt=0,
        allow_inf_nan=False,
        description="Longest a round stays open; then it closes with the episodes it has (its row says "
        "it is incomplete) and training goes on.",
    )


def eval_group_name(group: str) -> str:
    return group + EVAL_SUFFIX


# The functions below take the topology's models (``config.topology`` imports this module, so they are
# typed ``Any`` here): ``group`` is a ``ClientGroupConfig``, ``topology`` a ``Topology``.


def eval_group(group: Any) -> Any:
    """The client group that runs ``group``'s evaluation: its agent, runtime and resources, the held-out
    tasks once each (``samples_per_task`` repeats), its own array."""
    ev = group.eval
    if ev is None:
        raise ValueError(f"client group {group.name} has no eval block")
    return group.model_copy(
        update={
            "name": eval_group_name(group.name),
            "tasks": ev.tasks,
            "array": ev.array,
            "in_flight": ev.in_flight,
            "max_tasks": ev.max_tasks,
            "repeats": ev.samples_per_task,
            "epochs": 1,
            "ratio": None,
            "eval": None,
        }
    )


def evaluated_model(topology: Any, group: Any) -> str | None:
    """The model whose steps ``group``'s eval rounds follow: ``eval.model``, else the first of the group's
    servers that trains (None when none does)."""
    if group.eval is not None and group.eval.model is not None:
        return group.eval.model
    for name in group.servers:
        if topology.server(name).trainer is not None:
            return name
    return None


def eval_issues(topology: Any) -> list[ConfigIssue]:
    """Eval blocks that cannot work: a model the group does not use, or one that does not train (no
    steps to follow), and an eval group name that another group already has."""
    issues = []
    names = {c.name for c in topology.clients}
    for i, group in enumerate(topology.clients):
        ev = group.eval
        if ev is None:
            continue
        where = f"clients[{i}].eval"
        if eval_group_name(group.name) in names:
            issues.append(
                ConfigIssue(
                    where,
                    f"the eval group of {group.name!r} is called {eval_group_name(group.name)!r}, the name "
                    "of another client group: rename that group",
                )
            )
        if ev.model is not None and ev.model not in group.servers:
            issues.append(
                ConfigIssue(
                    f"{where}.model",
                    f"model {ev.model!r} is not one of the group's servers ({', '.join(group.servers)})",
                )
            )
            continue
        model = evaluated_model(topology, group)
        known = {m.name for m in topology.models}
        if model is not None and model in known and topology.server(model).trainer is None:
            issues.append(
                ConfigIssue(
                    f"{where}.model",
                    f"model {model!r} does not train: eval rounds follow a trained model's steps; name one "
                    "that trains, or use `ajet-hpc eval` to evaluate a served model",
                )
            )
        elif model is None and all(s in known for s in group.servers):
            issues.append(
                ConfigIssue(
                    where,
                    f"none of the group's servers ({', '.join(group.servers)}) trains: eval rounds follow a "
                    "trained model's steps",
                )
            )
    return issues
