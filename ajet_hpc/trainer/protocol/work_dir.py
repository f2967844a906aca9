"""The trainer's work dir (``RUN/ckpt/<model>/``, see :mod:`ajet_hpc.trainer.protocol`): where each file of
the protocol lives, how steps are named, and the clean-ups of a start (the control files an earlier job left,
what an abandoned run left past the step the ranks resume at)."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path


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


def prune_steps(folder: Path, keep: int, protect: set[str] | None = None) -> None:
    """Remove the step folders of ``folder`` but the newest ``keep`` and those named in ``protect``."""
    steps = sorted((s, p) for p in folder.iterdir() if p.is_dir() and (s := step_of(p.name)) is not None)
    for _, path in steps[:-keep] if keep else steps:
        if path.name not in (protect or set()):
            shutil.rmtree(path, ignore_errors=True)
