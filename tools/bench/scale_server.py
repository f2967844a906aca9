"""The server of ``scale.py``: the real server process with an engine and trainer ranks that cost nothing.

    python tools/bench/scale_server.py serve RUN      # what ``python -m ajet_hpc.server RUN`` runs, except:
    python tools/bench/scale_server.py ranks WORKDIR  # (started by the server) the no-op trainer ranks

``serve`` runs ``ajet_hpc.server.process.serve`` (bind, assemble, auth, recorder and store, collector,
coordinator, rendezvous and heartbeat, uvicorn with the guarded protocol) with two parts replaced, for
measurement only:

- the engine is ``zero_engine.ZeroEngine`` (the model's tokenizer; every answer instant), built where the
  server would build its real engine (``assembly.create_engine``);
- the trainer ranks are this file's ``ranks``, started where the coordinator starts the real ones
  (``coordinator.start_ranks``). They speak the real file protocol (``trainer.protocol``, ``worker.look``):
  ``ready.json``, batch in, result out, checkpoints committed as ``trainer_state.json``; each step consumes
  its batch and trains nothing. The weights they hand over are an empty folder, which the zero engine
  "loads" by taking the step as its policy version.

Nothing here is a user option: a topology cannot name this engine or these ranks.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for folder in (REPO, HERE):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from ajet_hpc.config import TrainerConfig  # noqa: E402
from ajet_hpc.config.placement import Placement  # noqa: E402
from ajet_hpc.storage.files import write_json_atomic  # noqa: E402
from ajet_hpc.trainer.protocol.batch_file import Batch  # noqa: E402
from ajet_hpc.trainer.protocol.checkpoints import (  # noqa: E402
    RESUME_LIMIT_VAR,
    TrainerState,
    commit_checkpoint,
    next_trainer_state,
    read_trainer_state,
    resume_point,
    uncommit_checkpoint,
)
from ajet_hpc.trainer.protocol.step_result import (  # noqa: E402
    StepResult,
    write_result,
)
from ajet_hpc.trainer.protocol.sync_plan import SyncPlan  # noqa: E402
from ajet_hpc.trainer.protocol.weight_handoff import DiskWeights  # noqa: E402
from ajet_hpc.trainer.protocol.work_dir import WorkDir, prepare_for_ranks, step_name  # noqa: E402


def zero_engine(kind: str, model_path: Path, **settings: Any):
    """Stands in for ``ajet_hpc.engine.create_engine``: the server's engine settings, a zero engine."""
    from zero_engine import ZeroEngine

    return ZeroEngine(model_path, int(settings["max_model_len"]))


def start_noop_ranks(
    work_dir: Path,
    model_dir: Path,
    config: TrainerConfig,
    *,
    on_slurm: bool,
    placement: Placement,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    sync: SyncPlan | None = None,
) -> subprocess.Popen:
    """Stands in for ``rank_launcher.start_ranks``: the same stale files cleared, this file's ``ranks``."""
    work = prepare_for_ranks(work_dir)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, __file__, "ranks", str(work.root)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            start_new_session=True,
        )


GC_OFF_ENV = "AJET_SCALE_GC_OFF"
"""Set to 1: the server runs with Python's cyclic garbage collector off (a diagnosis: does its cost grow
with the open episodes?)."""


GC_STATS_ENV = "AJET_SCALE_GC_STATS"
"""A file the server rewrites every half second with its garbage collector's work so far: collections,
seconds and objects collected per generation (``gc.callbacks``), the generations' counts, and the objects
frozen."""


THAW_EVERY_ENV = "AJET_SCALE_THAW_EVERY"
"""Thaw the server's heap every this many ticks of its ager (``heap.THAW_EVERY``): a thaw within the
harness's few minutes, to see what it collects and how long the event loop waits for it."""


def record_collections(path: Path) -> None:
    import gc
    import threading

    totals = {g: {"collections": 0, "seconds": 0.0, "collected": 0} for g in range(3)}
    started = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            row = totals[info["generation"]]
            row["collections"] += 1
            row["seconds"] += time.perf_counter() - started[0]
            row["collected"] += info["collected"]

    def write() -> None:
        while True:
            time.sleep(0.5)
            snapshot: dict[str, Any] = {str(g): dict(row) for g, row in totals.items()}
            snapshot["counts"] = list(gc.get_count())
            snapshot["frozen"] = gc.get_freeze_count()
            write_json_atomic(path, snapshot)

    gc.callbacks.append(callback)
    threading.Thread(target=write, name="gc-stats", daemon=True).start()


def serve(run_dir: str) -> int:
    from ajet_hpc.server import assembly, process
    from ajet_hpc.trainer.coordinator import loop

    if os.environ.get(GC_OFF_ENV) == "1":
        import gc

        gc.disable()
    if os.environ.get(GC_STATS_ENV):
        record_collections(Path(os.environ[GC_STATS_ENV]))
    if os.environ.get(THAW_EVERY_ENV):
        from ajet_hpc.server import heap

        heap.THAW_EVERY = int(os.environ[THAW_EVERY_ENV])
    assembly.create_engine = zero_engine
    loop.start_ranks = start_noop_ranks
    return process.serve(run_dir)


def ranks(work_dir: str) -> int:
    """One rank that trains nothing: resumes from the committed checkpoint as the real ranks do
    (``resume_point`` with the coordinator's last recorded step), then answers every batch at once."""
    from ajet_hpc.trainer.ranks.worker import POLL_S, Control, look

    work = WorkDir(Path(work_dir))
    work.ds.mkdir(parents=True, exist_ok=True)
    weights = work.root / "noop-weights"
    weights.mkdir(exist_ok=True)
    step = _resume_step(work, os.environ.get(RESUME_LIMIT_VAR))
    ready: dict[str, Any] = {"step": step, "world_size": 1, "zero_stage": 0, "device": "cpu"}
    if step:
        ready.update(DiskWeights(weights).to_json())
    write_json_atomic(work.ready, {**ready, "pid": os.getpid(), "weight_sync": "disk"})
    while True:
        found = look(work, step)
        if isinstance(found, Batch):
            step = found.step
            if found.save_checkpoint:
                _commit(work, step)
            write_result(work, _result(found, weights))
        elif found is Control.SAVE:
            _commit(work, step)
            work.save_request.unlink(missing_ok=True)
        elif found is Control.STOP:
            return 0
        else:
            time.sleep(POLL_S)


def _resume_step(work: WorkDir, recorded: str | None) -> int:
    state = read_trainer_state(work)
    if state is None:
        return 0
    point, _ = resume_point(state, int(recorded) if recorded else None)
    uncommit_checkpoint(work, point)
    return point.step if point is not None else 0


def _commit(work: WorkDir, step: int) -> None:
    tag = step_name(step)
    (work.ds / tag).mkdir(parents=True, exist_ok=True)
    state = TrainerState(step=step, tag=tag, world_size=1, zero_stage=0, rng_files=[])
    commit_checkpoint(work, next_trainer_state(read_trainer_state(work), state))


def _result(batch: Batch, weights: Path) -> StepResult:
    return StepResult(
        step=batch.step,
        loss=0.0,
        kl=0.0,
        entropy=0.0,
        clip_frac=0.0,
        grad_norm=math.nan,
        tokens=sum(sum(sample.loss_mask) for sample in batch.samples),
        samples=len(batch.samples),
        step_time_s=0.0,
        export_time_s=0.0,
        checkpoint=batch.save_checkpoint,
        checkpoint_time_s=0.0,
        weights=DiskWeights(weights),
    )


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in ("serve", "ranks"):
        raise SystemExit("usage: scale_server.py serve RUN | ranks WORKDIR")
    return serve(args[1]) if args[0] == "serve" else ranks(args[1])


if __name__ == "__main__":
    sys.exit(main())
