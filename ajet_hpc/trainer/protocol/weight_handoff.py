"""How a step's weights reached the engine (`WeightHandoff`), as a step's result and the ranks' ready record
name it, and the folders of exported weights (``weights/step-N/``, on node-local storage).

``disk``: the full model (or the adapter) as ``save_pretrained`` writes it, plus the initial model's tokenizer
files, which the engine reloads; the last :data:`KEEP_WEIGHTS` folders are kept. ``memory``: sent to the
engine before the result was written (``ajet_hpc.trainer.ranks.weight_sync``). ``withheld``: the server's job
was ending, the engine kept the previous weights."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from ajet_hpc.trainer.protocol.json_fields import typed_field
from ajet_hpc.trainer.protocol.work_dir import WorkDir, prune_steps, step_name

KEEP_WEIGHTS = 2
"""Weight folders kept under ``weights/`` (the newest ones)."""


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
        return DiskWeights(Path(typed_field(payload, "weights_dir", str, what)))
    if kind == MemoryWeights.kind:
        return MemoryWeights(
            typed_field(payload, "sync_send_s", float, what), typed_field(payload, "sync_bytes", int, what)
        )
    if kind == WithheldWeights.kind:
        return WithheldWeights()
    raise ValueError(f"{what}: field 'weights' is {kind!r}, not 'disk', 'memory' nor 'withheld'")


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
    prune_steps(work.weights, KEEP_WEIGHTS)
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
