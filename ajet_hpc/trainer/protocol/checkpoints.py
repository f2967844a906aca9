"""Checkpoint trust: ``ds/trainer_state.json`` names the last complete DeepSpeed checkpoint, and the one
before it.

Only the tag named there is trusted (DeepSpeed's ``latest`` may name a half-written one); it is written only
once the checkpoint is complete. Ranks started with ``AJET_RESUME_AT_MOST`` (the last step the coordinator
recorded) go back to ``previous`` from a trusted checkpoint past it (`resume_point`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ajet_hpc.storage.files import read_json, write_json_atomic
from ajet_hpc.trainer.protocol.work_dir import WorkDir, prune_steps

KEEP_CHECKPOINTS = 2
"""DeepSpeed checkpoint tags kept under ``ds/`` (the newest ones; the trusted one always)."""


@dataclass(frozen=True)
class TrainerState:
    """What ``ds/trainer_state.json`` holds: the last complete checkpoint, and the one committed before it
    (kept on disk), where the ranks go back to when the last one's step was never recorded (`resume_point`).
    ``first``: no checkpoint came before (a state written before ``previous`` existed has neither)."""

    step: int
    tag: str
    world_size: int
    zero_stage: int
    rng_files: list[str]  # per rank, relative to ds/<tag>/
    previous: TrainerState | None = None
    first: bool = False


RESUME_LIMIT_VAR = "AJET_RESUME_AT_MOST"
"""Set by the coordinator for the ranks it starts: the last step it recorded (metrics row, server store)."""


def read_trainer_state(work: WorkDir) -> TrainerState | None:
    payload = read_json(work.trainer_state)
    if payload is None:
        return None
    previous = payload.pop("previous", None)
    if previous is not None:
        previous = TrainerState(**{**previous, "previous": None})
    return TrainerState(**payload, previous=previous)


def next_trainer_state(prior: TrainerState | None, state: TrainerState) -> TrainerState:
    """``state`` (a checkpoint just written) with the committed checkpoint before its step: ``prior`` (the
    trusted one now), or the one before ``prior`` when ``prior`` is not older (a step saved again after a
    resume went back)."""
    before = prior if prior is None or prior.step < state.step else prior.previous
    if before is None:
        return dataclasses.replace(state, previous=None, first=prior is None or prior.first)
    return dataclasses.replace(state, previous=dataclasses.replace(before, previous=None), first=False)


def resume_point(state: TrainerState, recorded: int | None) -> tuple[TrainerState | None, str | None]:
    """Where the ranks resume: the trusted checkpoint, unless its step is past ``recorded`` (the last step
    the coordinator recorded; None: not known). That happens when a rank died after the checkpoint was
    committed and before the step's result reached the coordinator: the step was trained and saved but
    never recorded, and its batch goes to the ranks again as the same step. The ranks then go back one
    checkpoint (None: to a fresh start, when that checkpoint was the first), so that no episode is trained
    twice. Returns the checkpoint (or None) and, when it is not the trusted one, why (a log line)."""
    if recorded is None or state.step <= recorded:
        return state, None
    why = f"checkpoint {state.tag} is past step {recorded}, the last the server recorded"
    if state.previous is not None and state.previous.step <= recorded:
        return state.previous, f"{why}: resuming from {state.previous.tag}, its step is trained again"
    if state.previous is None and state.first:
        return None, f"{why}: starting afresh (it was the first checkpoint), its steps are trained again"
    # more than one checkpoint past the record (metrics.jsonl edited, or from another run): not our crash
    return state, f"{why}, as is the checkpoint before it: resuming from {state.tag} anyway"


def commit_checkpoint(work: WorkDir, state: TrainerState) -> None:
    """Name ``state.tag`` the trusted checkpoint, then drop older tags (all but :data:`KEEP_CHECKPOINTS`,
    and never the trusted one or the one before it)."""
    write_json_atomic(work.trainer_state, dataclasses.asdict(state))
    prune_steps(
        work.ds, KEEP_CHECKPOINTS, protect={state.tag} | ({state.previous.tag} if state.previous else set())
    )


def uncommit_checkpoint(work: WorkDir, state: TrainerState | None) -> None:
    """Name ``state`` (the checkpoint the ranks went back to) the trusted one; None: no checkpoint."""
    if state is None:
        work.trainer_state.unlink(missing_ok=True)
    else:
        write_json_atomic(work.trainer_state, dataclasses.asdict(state))
