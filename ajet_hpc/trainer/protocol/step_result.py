"""A step's result, ``outbox/step-N.json``, written by rank 0 after the optimizer step and the weight
hand-off: a :class:`StepResult` as flat JSON, or ``{"step", "error"}`` when the step failed (the ranks then
exit). `Failed` is what a rank writes instead of any answer (a result, the ready record, a checkpoint)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.trainer.protocol.json_fields import typed_field
from ajet_hpc.trainer.protocol.weight_handoff import WeightHandoff, handoff_from_json
from ajet_hpc.trainer.protocol.work_dir import WorkDir


@dataclass(frozen=True)
class StepResult:
    """What rank 0 reports of a trained step (``outbox/step-N.json``): the step's metrics (equal on every
    rank), its timings, and how its weights reached the engine."""

    step: int
    loss: float
    kl: float
    """To the reference model; 0 without one."""
    entropy: float
    clip_frac: float
    grad_norm: float
    """Before clipping; NaN when DeepSpeed gives none."""
    tokens: int
    """Masked (trained) tokens of the batch."""
    samples: int
    step_time_s: float
    """Forward, backward and optimizer step."""
    export_time_s: float
    """The weight hand-off (export to disk, or the in-memory send)."""
    checkpoint: bool
    checkpoint_time_s: float
    weights: WeightHandoff
    off_policy: dict[str, float] = dataclasses.field(default_factory=dict)
    """The engine/trainer gap (``ajet_hpc.trainer.ranks.step.off_policy_metrics``); absent in older files."""

    def to_json(self) -> dict[str, Any]:
        """The flat JSON of a result file (the module doc)."""
        fields = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}
        if not self.off_policy:  # a run without correction writes the former layout
            del fields["off_policy"]
        return {**fields, **self.weights.to_json()}

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> StepResult:
        """Read a result file's JSON; ``ValueError`` naming the field that is missing or of another type."""
        what = f"the result of step {payload.get('step')!r}"
        kinds = {"int": int, "float": float, "bool": bool}
        values: dict[str, Any] = {
            item.name: typed_field(payload, item.name, kinds[str(item.type)], what)
            for item in dataclasses.fields(cls)
            if item.name not in ("weights", "off_policy")
        }
        gap = payload.get("off_policy", {})
        if not (isinstance(gap, dict) and all(isinstance(v, int | float) for v in gap.values())):
            raise ValueError(f"{what}: field 'off_policy' is {gap!r}, not an object of numbers")
        return cls(**values, weights=handoff_from_json(payload, what), off_policy=dict(gap))


@dataclass(frozen=True)
class Failed:
    """What a rank wrote instead of an answer (a result, the ready record, a checkpoint): why it failed."""

    error: str


def write_result(work: WorkDir, result: StepResult) -> None:
    write_json_atomic(work.result_file(result.step), result.to_json())


def write_error(work: WorkDir, step: int, error: str) -> None:
    """Report a failed step, unless a result (or another rank's error) is already there."""
    if not work.result_file(step).exists():
        write_json_atomic(work.result_file(step), {"step": step, "error": error})


def read_result(work: WorkDir, step: int) -> StepResult | Failed | None:
    """Step ``step``'s result, the error that ended it, or None (not written yet)."""
    payload = read_json(work.result_file(step))
    if payload is None:
        return None
    if "error" in payload:
        return Failed(str(payload["error"]))
    return StepResult.from_json(payload)
