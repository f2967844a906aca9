"""A step's batch file, ``inbox/step-N.pt``: written by the coordinator, read by every rank.

``torch.save({"step": int, "save_checkpoint": bool, "samples": [each sample's other fields], "lengths":
tensor, "columns": {field: tensor}})``: the per-token fields of all samples as one tensor each (64-bit; the
loss mask 8-bit), in sample order (``lengths`` tokens each); an optional one (``weights``, ``parents``) holds
only the samples where it is set, the others have it as None in ``samples``. Files of the former layout
(per-sample dicts of every field) still read."""

from __future__ import annotations

import dataclasses
import io
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ajet_hpc.algo.sample_tensors import ARRAY_TYPES, Sample
from ajet_hpc.storage.files import write_bytes_atomic
from ajet_hpc.trainer.protocol.work_dir import WorkDir


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
