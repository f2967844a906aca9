"""The file protocol between the coordinator (HTTP front + engine) and the trainer's ranks.

Everything lives in one work dir on shared storage (``RUN/ckpt/<model>/``); every file is written to a
temporary name and renamed, so a reader sees a whole file or none:

``inbox/step-000001.pt``
    A batch, written by the coordinator: ``torch.save({"step": int, "save_checkpoint": bool, "samples":
    [each sample's other fields], "lengths": tensor, "columns": {field: tensor}})``: the per-token fields
    of all samples as one tensor each (64-bit; the loss mask 8-bit), in sample order (``lengths`` tokens
    each); an optional one (``weights``, ``parents``) holds only the samples where it is set, the others
    have it as None in ``samples``. Files of the former layout (per-sample dicts of every field) still
    read. Rank 0 deletes it once the step's result is written.
``outbox/step-000001.json``
    The result, written by rank 0 after the optimizer step and the weight hand-off: a :class:`StepResult`
    as flat JSON (``{"step", "loss", "kl", "entropy", "clip_frac", "grad_norm", "tokens", "samples",
    "step_time_s", "export_time_s", "checkpoint", "checkpoint_time_s", "off_policy", "weights"}`` with
    ``"weights":
    "disk"`` and ``"weights_dir"``, ``"weights": "memory"``, ``"sync_send_s"`` and ``"sync_bytes"``, or
    ``"weights": "withheld"`` when the server's job was ending and the in-memory send stopped); or
    ``{"step", "error"}`` when the step failed (the ranks then exit).
``weights/step-000001/``
    The full model as ``save_pretrained`` writes it, plus the initial model's tokenizer files: what the
    engine reloads. The last :data:`KEEP_WEIGHTS` folders are kept.
``ds/step-000001/``, ``ds/latest``, ``ds/trainer_state.json``
    DeepSpeed checkpoints (``engine.save_checkpoint(ds, tag="step-000001")``) and, written after the
    checkpoint is complete, the trainer state naming the last complete one (and, as ``previous``, the
    one before it, kept). Only the tag named in ``trainer_state.json`` is trusted (DeepSpeed's ``latest``
    may name a half-written one). Ranks started with ``AJET_RESUME_AT_MOST`` (the last step the coordinator
    recorded) go back to ``previous`` from a trusted checkpoint past it (`resume_point`).
``ready.json``
    Written by rank 0 once the ranks are up: ``{"step": the last trained step (0 when fresh), ...}`` and,
    when resumed, how that step's weights reached the engine (the fields of the hand-off, as in a result);
    the next batch to submit is ``step + 1``. ``{"error"}`` when a rank failed to start.
``stop``
    Created by the coordinator: the ranks exit at their next wait for a batch.
``save-request.json``
    Written by the coordinator on Slurm's pre-timeout/preemption signal: ``{"step": n}``. At their next
    wait for a batch, the ranks (then at step ``n``) save a checkpoint of step ``n`` unless the trusted one
    already is, and rank 0 removes the request; a request for another step is refused in
    ``save-refused.json``.

Steps are 1, 2, 3, ... with no gaps: after resuming at step ``n`` the ranks wait for ``n + 1``, and first
remove the weights, checkpoints and results an abandoned run left for steps after ``n``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import numpy as np
import torch

from ajet_hpc.algo.sample_tensors import ARRAY_TYPES, Sample
from ajet_hpc.storage.files import read_json, write_bytes_atomic, write_json_atomic

KEEP_WEIGHTS = 2
"""Weight folders kept under ``weights/`` (the newest ones)."""
KEEP_CHECKPOINTS = 2
"""DeepSpeed checkpoint tags kept under ``ds/`` (the newest ones; the trusted one always)."""


class TrainerFailed(RuntimeError):
    """A step failed on a rank, or the trainer's processes are gone."""


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def step_of(name: str) -> int | None:
    """The step of a ``step-000001`` name (with or without a suffix); None for other names."""
    stem = name.split(".", 1)[0]
    if not stem.startswith("step-") or not stem[5:].isdigit():
        return None
    return int(stem[5:])


@dataclass(frozen=True)
class WorkDir:
    """The paths of a trainer work dir (see the module doc)."""

    root: Path
    export_root: Path | None = None
    """Where weight exports go (``weight_sync: disk``): node-local storage; None: ``root/weights``."""

    @property
    def inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def outbox(self) -> Path:
        return self.root / "outbox"

    @property
    def weights(self) -> Path:
        return self.export_root if self.export_root is not None else self.root / "weights"

    @property
    def sync(self) -> Path:
        """The control calls of in-memory weight syncs (``sync_channel``)."""
        return self.root / "sync"

    @property
    def ds(self) -> Path:
        return self.root / "ds"

    @property
    def trainer_state(self) -> Path:
        return self.ds / "trainer_state.json"

    @property
    def ready(self) -> Path:
        return self.root / "ready.json"

    @property
    def stop(self) -> Path:
        return self.root / "stop"

    @property
    def save_request(self) -> Path:
        return self.root / "save-request.json"

    @property
    def save_request_taken(self) -> Path:
        """Where rank 0 moves a save request to read it (``worker.take_save_request``)."""
        return self.root / "save-request.taken.json"

    @property
    def save_refused(self) -> Path:
        return self.root / "save-refused.json"

    def batch_file(self, step: int) -> Path:
        return self.inbox / f"{step_name(step)}.pt"

    def result_file(self, step: int) -> Path:
        return self.outbox / f"{step_name(step)}.json"

    def weights_dir(self, step: int) -> Path:
        return self.weights / step_name(step)

    def pending_steps(self) -> list[int]:
        """Steps with a batch in the inbox, ascending."""
        if not self.inbox.is_dir():
            return []
        steps = (step_of(p.name) for p in self.inbox.glob("step-*.pt"))
        return sorted(s for s in steps if s is not None)


def prepare_for_ranks(work_dir: Path) -> WorkDir:
    """The work dir of ranks about to start, created, without the control files an earlier job left
    (``stop``, a save request or refusal, ``ready.json``): nobody waits on those now."""
    work = WorkDir(Path(work_dir).absolute())
    work.root.mkdir(parents=True, exist_ok=True)
    for stale in (work.stop, work.save_request, work.save_request_taken, work.save_refused, work.ready):
        stale.unlink(missing_ok=True)
    return work


# ---- batches -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One step's input as the ranks read it."""

    step: int
    samples: list[Sample]
    save_checkpoint: bool


_CRC32_SETTING = threading.Lock()
"""Held while `encode_batch` has torch's process-wide CRC32 option switched off."""

_ARRAY_FIELDS = ARRAY_TYPES
"""Per-token fields of a sample, stored as tensors (exact: 64-bit, the 0/1 loss mask 8-bit); pickling them
as lists of Python numbers (and ``dataclasses.asdict``'s deep copy) cost seconds per step at real batch
sizes, and one tensor per sample and field (5k samples) a third of a second in ``torch.save``: they are
one column each."""


def encode_batch(step: int, samples: list[Sample], save_checkpoint: bool) -> bytes:
    """The bytes of a batch file (see the module doc); the per-token fields are one tensor each (cast from
    the samples' arrays; lists are converted).

    Written without torch's per-record CRC32 (``torch.serialization.set_crc32_options``, a process-wide
    setting: switched off under a lock for this save only; ``torch.load`` reads such files): at a real batch
    (90 MB) the checksum is a third of the encoding's time, and a batch file is never read before it is
    whole (written to a temporary name, fsynced, renamed)."""
    if step < 1:
        raise ValueError(f"steps start at 1, got {step}")
    if not samples:
        raise ValueError(f"step {step}: a batch needs at least one sample")
    others = [
        {f.name: getattr(s, f.name) for f in dataclasses.fields(s) if f.name not in _ARRAY_FIELDS}
        for s in samples
    ]
    columns = {}
    for name, kind in _ARRAY_FIELDS.items():
        parts = [getattr(s, name) for s in samples]
        if name in _OPTIONAL_FIELDS:
            for fields, part in zip(others, parts, strict=True):
                if part is None:
                    fields[name] = None
            parts = [p for p in parts if p is not None]
        columns[name] = torch.from_numpy(
            np.concatenate([np.asarray(p, kind) for p in parts]) if parts else np.zeros(0, kind)
        )
    payload = {
        "step": step,
        "save_checkpoint": bool(save_checkpoint),
        "samples": others,
        "lengths": torch.tensor([len(s) for s in samples], dtype=torch.int64),
        "columns": columns,
    }
    buffer = io.BytesIO()
    with _CRC32_SETTING:
        crc32 = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            torch.save(payload, buffer)
        finally:
            torch.serialization.set_crc32_options(crc32)
    return buffer.getvalue()


def write_batch(
    work: WorkDir, step: int, samples: list[Sample], save_checkpoint: bool, encoded: bytes | None = None
) -> Path:
    """Write step ``step``'s batch file; ``encoded``: its bytes from `encode_batch`, made beforehand."""
    data = encode_batch(step, samples, save_checkpoint) if encoded is None else encoded
    path = work.batch_file(step)
    write_bytes_atomic(path, data)
    return path


def read_batch(path: Path) -> Batch:
    """A batch file (either layout) as samples whose per-token fields are lists of Python numbers."""
    payload = torch.load(path, weights_only=True)
    if "columns" in payload:
        samples = _columns_to_samples(payload)
    else:  # the former layout: one dict of every field per sample (lists, or a tensor per field)
        samples = [Sample(**_decode_sample(s)) for s in payload["samples"]]
    return Batch(step=int(payload["step"]), samples=samples, save_checkpoint=bool(payload["save_checkpoint"]))


_OPTIONAL_FIELDS = ("weights", "parents")


def _columns_to_samples(payload: dict[str, Any]) -> list[Sample]:
    """The samples of a columnar batch file: each column cut at the samples' lengths."""
    lengths = payload["lengths"].tolist()
    fields = [dict(other) for other in payload["samples"]]
    for name, column in payload["columns"].items():
        values, start = column.tolist(), 0
        for sample, n in zip(fields, lengths, strict=True):
            if name in _OPTIONAL_FIELDS and name in sample:  # None: not set for this sample
                continue
            sample[name], start = values[start : start + n], start + n
    return [Sample(**sample) for sample in fields]


def _decode_sample(fields: dict[str, Any]) -> dict[str, Any]:
    return {name: v.tolist() if isinstance(v, torch.Tensor) else v for name, v in fields.items()}


# ---- results -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskWeights:
    """The step's weights were exported to ``folder``, which the engine reloads (``weight_sync: disk``)."""

    folder: Path
    kind: ClassVar[Literal["disk"]] = "disk"

    def to_json(self) -> dict[str, Any]:
        return {"weights": self.kind, "weights_dir": str(self.folder)}


@dataclass(frozen=True)
class MemoryWeights:
    """The step's weights were sent to the engine in memory (``weight_sync: memory``), before the result
    was written: the engine holds them already."""

    send_s: float
    bytes: int
    kind: ClassVar[Literal["memory"]] = "memory"

    def to_json(self) -> dict[str, Any]:
        return {"weights": self.kind, "sync_send_s": self.send_s, "sync_bytes": self.bytes}


@dataclass(frozen=True)
class WithheldWeights:
    """The server's job was ending when the step's weights were to be sent in memory (``sync_channel``'s
    job-ending marker): the engine kept the previous ones, and the checkpoint the server asks for next
    carries this step's to the requeued job."""

    kind: ClassVar[Literal["withheld"]] = "withheld"

    def to_json(self) -> dict[str, Any]:
        return {"weights": self.kind}


WeightHandoff = DiskWeights | MemoryWeights | WithheldWeights
"""How a step's weights reached the engine."""


def handoff_from_json(payload: dict[str, Any], what: str) -> WeightHandoff:
    """The hand-off a result (or the ready record) names in ``weights``, with the fields that go with it."""
    kind = payload.get("weights")
    if kind == DiskWeights.kind:
        return DiskWeights(Path(_field(payload, "weights_dir", str, what)))
    if kind == MemoryWeights.kind:
        return MemoryWeights(
            _field(payload, "sync_send_s", float, what), _field(payload, "sync_bytes", int, what)
        )
    if kind == WithheldWeights.kind:
        return WithheldWeights()
    raise ValueError(f"{what}: field 'weights' is {kind!r}, not 'disk', 'memory' nor 'withheld'")


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
            item.name: _field(payload, item.name, kinds[str(item.type)], what)
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


_T = TypeVar("_T", int, float, bool, str)


def _field(payload: dict[str, Any], name: str, kind: type[_T], what: str) -> _T:
    """``payload[name]`` as ``kind`` (an int is a float too; a bool is neither); ``ValueError`` naming it."""
    value: Any = payload.get(name)
    if isinstance(value, bool) and kind is not bool:
        fits = False
    elif kind is float:
        fits = isinstance(value, int | float)
    else:
        fits = isinstance(value, kind)
    if not fits:
        raise ValueError(f"{what}: field {name!r} is {value!r}, not a {kind.__name__}")
    return kind(value)


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


# ---- weights -------------------------------------------------------------------------------------------

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
_WRITTEN_BY_SAVE_PRETRAINED = ("config.json", "generation_config.json")


def copy_model_extras(model_dir: Path, dest: Path) -> None:
    """Copy the model folder's files that are not weights nor written by ``save_pretrained`` (tokenizer,
    chat template, ...) from ``model_dir`` to ``dest``."""
    for path in sorted(Path(model_dir).iterdir()):
        if not path.is_file() or path.name in _WRITTEN_BY_SAVE_PRETRAINED:
            continue
        if path.name.endswith(_WEIGHT_SUFFIXES):
            continue
        shutil.copy2(path, dest / path.name)


def publish_weights(work: WorkDir, step: int, staged: Path) -> Path:
    """Rename the finished folder ``staged`` to ``weights/step-N`` (replacing one from an abandoned run)
    and drop all but the newest :data:`KEEP_WEIGHTS` folders."""
    final = work.weights_dir(step)
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    _prune(work.weights, KEEP_WEIGHTS)
    return final


def staging_dir(work: WorkDir, step: int) -> Path:
    """A fresh folder next to ``weights/step-N`` to write it in (hidden, so pruning never sees it)."""
    path = work.weights / f".{step_name(step)}.tmp"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def local_export_root(work_dir: Path) -> Path:
    """The node-local folder of ``work_dir``'s weight exports: ``$SLURM_TMPDIR`` (Slurm empties it when the
    job ends), else the temp folder, which nobody empties: the server removes it when it stops
    (``remove_local_exports``)."""
    local = Path(os.environ.get("SLURM_TMPDIR") or tempfile.gettempdir())
    digest = hashlib.sha1(str(work_dir.resolve()).encode()).hexdigest()[:12]
    return local / f"ajet-weights-{digest}"


def remove_local_exports(work_dir: Path) -> None:
    """Remove ``work_dir``'s node-local weight exports (a whole model per kept step): nothing reads them
    once the server stops, and a requeued job exports again from its checkpoint."""
    shutil.rmtree(local_export_root(work_dir), ignore_errors=True)


def discard_after(work: WorkDir, step: int) -> list[str]:
    """Remove what an abandoned run left past ``step`` (the step the ranks resume at): weight folders,
    DeepSpeed tags and results of later steps. Batches in the inbox stay (the coordinator may have
    submitted the next one already). Returns the removed paths, relative to the work dir (weight exports
    on node-local storage: whole)."""
    removed = []
    for folder in (work.weights, work.ds, work.outbox):
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            later = step_of(path.name)
            if later is None or later <= step:
                continue
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(str(path.relative_to(work.root)) if path.is_relative_to(work.root) else str(path))
    return removed


def _prune(folder: Path, keep: int, protect: set[str] | None = None) -> None:
    steps = sorted((s, p) for p in folder.iterdir() if p.is_dir() and (s := step_of(p.name)) is not None)
    for _, path in steps[:-keep] if keep else steps:
        if path.name not in (protect or set()):
            shutil.rmtree(path, ignore_errors=True)


# ---- checkpoints ---------------------------------------------------------------------------------------


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
    _prune(
        work.ds, KEEP_CHECKPOINTS, protect={state.tag} | ({state.previous.tag} if state.previous else set())
    )


def uncommit_checkpoint(work: WorkDir, state: TrainerState | None) -> None:
    """Name ``state`` (the checkpoint the ranks went back to) the trusted one; None: no checkpoint."""
    if state is None:
        work.trainer_state.unlink(missing_ok=True)
    else:
        write_json_atomic(work.trainer_state, dataclasses.asdict(state))


# ---- the coordinator's side ----------------------------------------------------------------------------


_A = TypeVar("_A")
"""What a wait returns: a step's result, the ready record, a checkpoint's state."""


class TrainerChannel:
    """The coordinator's handle on the ranks: submit batches, await results, stop them.

    ``alive`` answers whether the rank processes still run (e.g. ``lambda: proc.poll() is None``); without
    it a dead trainer is noticed only by ``timeout_s``. ``log_path`` (the ranks' log) is quoted in errors.
    """

    def __init__(
        self,
        work_dir: Path,
        *,
        alive: Callable[[], bool] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.work = WorkDir(Path(work_dir))
        self._alive = alive
        self._log_path = log_path

    def submit(
        self, step: int, samples: list[Sample], save_checkpoint: bool = False, encoded: bytes | None = None
    ) -> Path:
        """Hand step ``step``'s batch to the ranks (removing a stale result of an abandoned run first);
        ``encoded``: the batch file's bytes made beforehand (`encode_batch`)."""
        self.work.result_file(step).unlink(missing_ok=True)
        return write_batch(self.work, step, samples, save_checkpoint, encoded)

    async def wait_result(
        self, step: int, poll_s: float = 0.05, timeout_s: float | None = None
    ) -> StepResult:
        """The result of step ``step``; ``TrainerFailed`` if the step failed or the ranks are gone,
        ``TimeoutError`` after ``timeout_s``."""
        return await self._wait(lambda: read_result(self.work, step), f"step {step}", poll_s, timeout_s)

    async def wait_ready(self, poll_s: float = 0.1, timeout_s: float | None = None) -> dict[str, Any]:
        """Rank 0's ready record once the ranks are up: ``{"step": last trained step, ...}``."""
        return await self._wait(self._read_ready, "the ranks to start", poll_s, timeout_s)

    def request_stop(self) -> None:
        """Ask the ranks to exit (at their next wait for a batch)."""
        self.work.root.mkdir(parents=True, exist_ok=True)
        self.work.stop.touch()

    def request_save(self, step: int) -> None:
        """Ask the ranks, which must be at step ``step``, to checkpoint it at their next wait for a batch."""
        self.work.save_refused.unlink(missing_ok=True)
        write_json_atomic(self.work.save_request, {"step": step})

    def wait_result_blocking(self, step: int, timeout_s: float, poll_s: float = 0.05) -> StepResult:
        """`wait_result` for a caller that cannot await (a signal handler on the event loop's thread)."""
        return self._wait_blocking(lambda: read_result(self.work, step), f"step {step}", poll_s, timeout_s)

    def wait_saved_blocking(self, step: int, timeout_s: float, poll_s: float = 0.05) -> TrainerState:
        """Block until the trusted checkpoint is step ``step`` (after `request_save`); its state."""

        def saved() -> TrainerState | Failed | None:
            refused = read_json(self.work.save_refused)
            if refused is not None and refused.get("step") == step:
                return Failed(str(refused.get("reason", "refused")))
            state = read_trainer_state(self.work)
            return state if state is not None and state.step == step else None

        return self._wait_blocking(saved, f"the checkpoint of step {step}", poll_s, timeout_s)

    def last_checkpoint_step(self) -> int | None:
        """The step of the last complete checkpoint, None when there is none."""
        state = read_trainer_state(self.work)
        return None if state is None else state.step

    def _read_ready(self) -> dict[str, Any] | Failed | None:
        payload = read_json(self.work.ready)
        if payload is not None and "error" in payload:
            return Failed(str(payload["error"]))
        return payload

    async def _wait(
        self, read: Callable[[], _A | Failed | None], what: str, poll_s: float, timeout_s: float | None
    ) -> _A:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (found := self._poll(read, what, deadline, timeout_s)) is None:
            await asyncio.sleep(poll_s)
        return found

    def _wait_blocking(
        self, read: Callable[[], _A | Failed | None], what: str, poll_s: float, timeout_s: float
    ) -> _A:
        deadline = time.monotonic() + timeout_s
        while (found := self._poll(read, what, deadline, timeout_s)) is None:
            time.sleep(poll_s)
        return found

    def _poll(
        self,
        read: Callable[[], _A | Failed | None],
        what: str,
        deadline: float | None,
        timeout_s: float | None,
    ) -> _A | None:
        """One look: the answer, None (not yet), or an error (failed, processes gone, past the deadline)."""
        found = read()
        if found is None and self._alive is not None and not self._alive():
            found = read()  # it may have been written just before the exit
            if found is None:
                raise TrainerFailed(f"the trainer's processes exited while waiting for {what}" + self._tail())
        if isinstance(found, Failed):
            raise TrainerFailed(f"{what} failed: {found.error}" + self._tail())
        if found is not None:
            return found
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no answer from the trainer for {what} within {timeout_s} s" + self._tail())
        return None

    def _tail(self, lines: int = 20) -> str:
        if self._log_path is None or not Path(self._log_path).is_file():
            return ""
        text = Path(self._log_path).read_text(errors="replace").splitlines()[-lines:]
        return f"\n--- last lines of {self._log_path} ---\n" + "\n".join(text)
