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

from pydantic import BaseModel, Field

from ajet_hpc.config.fields import MODEL_CONFIG, Name

EVAL_SUFFIX = "-eval"
"""The eval group of client group ``g`` is ``g-eval`` (its jobs, its store folder, its episodes' group)."""


class EvalConfig(BaseModel):
    """Held-out evaluation of a client group's agent, on the current policy, during training."""

    model_config = MODEL_CONFIG

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


# ``evaluated_model`` takes the topology's models (``config.clients`` imports this module, so they are typed
# ``Any`` here): ``group`` is a ``ClientGroupConfig``, ``topology`` a ``Topology``.


def evaluated_model(topology: Any, group: Any) -> str | None:
    """The model whose steps ``group``'s eval rounds follow: ``eval.model``, else the first of the group's
    servers that trains (None when none does)."""
    if group.eval is not None and group.eval.model is not None:
        return group.eval.model
    for name in group.servers:
        if topology.server(name).trainer is not None:
            return name
    return None
