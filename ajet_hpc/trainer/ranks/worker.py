"""One trainer rank: ``python -m ajet_hpc.trainer.ranks.worker --work-dir DIR --model DIR --config JSON``.

Run under torchrun (one node) or srun (several nodes), one process per rank; see ``launch``. The rank joins
the process group, builds the DeepSpeed engine, resumes from the last trusted checkpoint, writes
``ready.json`` (rank 0), then serves the work dir's inbox (see ``ajet_hpc.trainer.protocol``) until ``stop``
appears.

Only rank 0 reads the work dir's control files: every ``POLL_S`` it broadcasts what it found (`Found`: the
next batch, or a `Control`: nothing yet, stop, save) to all ranks, so all ranks take the same decision at the
same time whatever the shared file system shows each node, and no rank waits long inside a collective."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import logging
import os
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist

from ajet_hpc.config.placement import bind_rank_gpu
from ajet_hpc.config.trainer import TrainerConfig
from ajet_hpc.engine.model_path import offline_hub
from ajet_hpc.storage.files import holder_dead, read_json, write_json_atomic
from ajet_hpc.trainer.protocol.batch_file import Batch, read_batch
from ajet_hpc.trainer.protocol.checkpoints import RESUME_LIMIT_VAR, read_trainer_state
from ajet_hpc.trainer.protocol.rank_env import PARENT_HOST_VAR, PARENT_PID_VAR
from ajet_hpc.trainer.protocol.step_result import StepResult, write_error, write_result
from ajet_hpc.trainer.protocol.sync_channel import ENGINE_UP, wait_for_engine
from ajet_hpc.trainer.protocol.sync_plan import SyncPlan
from ajet_hpc.trainer.protocol.weight_handoff import (
    DiskWeights,
    MemoryWeights,
    WeightHandoff,
    WithheldWeights,
    local_export_root,
)
from ajet_hpc.trainer.protocol.work_dir import WorkDir, discard_after
from ajet_hpc.trainer.ranks import weight_sync, zero
from ajet_hpc.trainer.ranks.distributed import RankEnv, close_process_group, init_process_group, rank_env
from ajet_hpc.trainer.ranks.step import train_step

POLL_S = 0.1
"""Seconds between two looks at the inbox (each a small broadcast from rank 0)."""

log = logging.getLogger("ajet_hpc.trainer.ranks.worker")


class Control(enum.Enum):
    """What rank 0 found in the work dir's control files when there is no batch to train."""

    WAIT = "wait"
    """Nothing yet: look again after ``POLL_S``."""
    STOP = "stop"
    """The coordinator asked the ranks to exit (or the process that started them is gone)."""
    SAVE = "save"
    """The coordinator asked for a checkpoint of the current step (on Slurm's signal)."""


Found = Batch | Control
"""What rank 0 broadcasts after each look at the work dir."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m ajet_hpc.trainer.ranks.worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--work-dir", type=Path, required=True, help="The trainer's work dir (RUN/ckpt/<model>)."
    )
    parser.add_argument("--model", type=Path, required=True, help="The initial model folder.")
    parser.add_argument("--config", required=True, help="The TrainerConfig as JSON text.")
    return parser.parse_args(argv)


def setup_rank_logging(rank: int) -> None:
    logging.basicConfig(
        level=os.environ.get("AJET_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        force=True,
    )
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls torch's renamed collectives on every step: one warning per call, per rank.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars per rank


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Slurm's checkpoint signal reaches every process of the job (on every node, for srun ranks); the
    # server answers it by asking the ranks to save (save-request), so the ranks must survive it.
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    # So must they survive Slurm's SIGTERM (a preemption) until the server has asked them to stop: it may
    # first ask them to save. Once asked (or to end a rank that hangs after being asked), SIGTERM ends them.
    stop_file = WorkDir(Path(args.work_dir)).stop
    signal.signal(signal.SIGTERM, lambda signum, frame: _exit_if_asked(stop_file))
    env = rank_env(os.environ)
    # before anything starts CUDA: this rank's one GPU of the placement (AJET_RANK_GPUS)
    env = dataclasses.replace(env, gpu_bound=bind_rank_gpu(os.environ, env.node, env.local_rank))
    setup_rank_logging(env.rank)
    offline_hub()
    config = TrainerConfig.model_validate_json(args.config)
    return Rank(env, args.work_dir, args.model, config, SyncPlan.from_env(os.environ)).run()


def _recorded_step(environ: Mapping[str, str]) -> int | None:
    """The last step the coordinator recorded (``AJET_RESUME_AT_MOST``), None when not given."""
    value = environ.get(RESUME_LIMIT_VAR, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise RuntimeError(f"{RESUME_LIMIT_VAR}={value!r} is not a step number") from exc


def _exit_if_asked(stop_file: Path) -> None:
    if stop_file.exists():
        raise SystemExit(128 + signal.SIGTERM)
    logging.getLogger(__name__).info("SIGTERM ignored: the server asks the ranks to save, then to stop")


class Rank:
    """The life of one rank (see the module doc)."""

    def __init__(
        self, env: RankEnv, work_dir: Path, model_dir: Path, config: TrainerConfig, sync: SyncPlan
    ) -> None:
        self.env = env
        self.sync = sync  # the server's decision (`sync_plan`), carried in the environment
        self.work = WorkDir(Path(work_dir), export_root=export_root(Path(work_dir)))
        self.model_dir = Path(model_dir)
        self.config = config
        self.step = 0
        self.sender: weight_sync.WeightSender | None = None

    def run(self) -> int:
        # a CPU placement runs on the CPU also where CUDA is there (the launcher set DS_ACCELERATOR=cpu)
        on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR") != "cpu"
        started = time.monotonic()
        try:
            torch.manual_seed(self.config.seed + self.env.rank)
            init_process_group(self.env, on_gpu)
            self.models = zero.build(self.model_dir, self.config, on_gpu, self.env.device_index)
            self.pad_id = _pad_id(self.models.engine.module.config)
            self.step = zero.resume(
                self.models,
                self.work,
                self.env.rank,
                self.env.world_size,
                self.config.zero_stage,
                recorded=_recorded_step(os.environ),
            )
            if self.env.rank == 0:
                for path in discard_after(self.work, self.step):
                    log.info("removed %s, left by a run past step %d", path, self.step)
            self.sender = self._open_sender()
            weights = self._publish(self.step) if self.step else None
        except Exception as error:
            log.exception("start failed")
            if self.env.rank == 0:
                write_json_atomic(self.work.ready, {"error": f"rank {self.env.rank}: {_describe(error)}"})
            return 1
        if self.env.rank == 0:
            write_json_atomic(
                self.work.ready,
                {
                    "step": self.step,
                    "world_size": self.env.world_size,
                    "zero_stage": self.config.zero_stage,
                    "device": "cuda" if on_gpu else "cpu",
                    "start_time_s": round(time.monotonic() - started, 3),
                    "pid": os.getpid(),
                    **({} if weights is None else weights.to_json()),
                    "weight_sync": "memory" if self.sender is not None else "disk",
                },
            )
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        log.info(
            "rank %d of %d on node %s: ready after %.1f s at step %d",
            self.env.rank,
            self.env.world_size,
            node,
            time.monotonic() - started,
            self.step,
        )
        while True:
            batch = self._next_batch()
            if batch is None:
                log.info("stop requested: exiting at step %d", self.step)
                close_process_group()
                return 0
            try:
                self._train(batch)
            except Exception as error:
                log.exception("step %d failed", batch.step)
                write_error(self.work, batch.step, f"rank {self.env.rank}: {_describe(error)}")
                return 1

    def _next_batch(self) -> Batch | None:
        """The next batch (step ``self.step + 1``), or None on stop: rank 0 looks, everyone learns."""
        while True:
            decision: list[Found | None] = [look(self.work, self.step) if self.env.rank == 0 else None]
            dist.broadcast_object_list(decision, src=0)
            match decision[0]:
                case Batch() as batch:
                    return batch
                case Control.STOP:
                    return None
                case Control.SAVE:
                    self._save_on_request()
                case Control.WAIT:
                    time.sleep(POLL_S)
                case other:
                    raise RuntimeError(f"rank 0 broadcast {other!r}, not a batch nor a control")

    def _train(self, batch: Batch) -> None:
        if batch.step != self.step + 1:
            raise RuntimeError(f"got step {batch.step}, expected {self.step + 1}")
        rank = self.env.rank
        started = time.monotonic()
        metrics, gap = train_step(self.models, batch.samples, self.config, self.pad_id)
        step_time = time.monotonic() - started
        started = time.monotonic()
        weights = self._publish(batch.step)
        export_time = time.monotonic() - started
        checkpoint_time = 0.0
        if batch.save_checkpoint:
            started = time.monotonic()
            zero.save_checkpoint(
                self.models, self.work, batch.step, rank, self.env.world_size, self.config.zero_stage
            )
            checkpoint_time = time.monotonic() - started
        self.step = batch.step
        result = StepResult(
            step=batch.step,
            loss=metrics["loss"],
            kl=metrics["kl"],
            entropy=metrics["entropy"],
            clip_frac=metrics["clip_frac"],
            grad_norm=metrics["grad_norm"],
            tokens=int(metrics["tokens"]),
            samples=int(metrics["samples"]),
            step_time_s=round(step_time, 4),
            export_time_s=round(export_time, 4),
            checkpoint=batch.save_checkpoint,
            checkpoint_time_s=round(checkpoint_time, 4),
            weights=weights,
            off_policy=gap,
        )
        log.info(
            "step %d: loss %.5f, grad_norm %.4g, %d tokens; step %.2f s, export %.2f s, checkpoint %.2f s",
            result.step,
            result.loss,
            result.grad_norm,
            result.tokens,
            step_time,
            export_time,
            checkpoint_time,
        )
        if rank == 0:
            write_result(self.work, result)
            self.work.batch_file(batch.step).unlink(missing_ok=True)

    def _save_on_request(self) -> None:
        """All ranks: checkpoint the current step (asked for on Slurm's signal); rank 0 clears the request."""
        started = time.monotonic()
        try:
            zero.save_checkpoint(
                self.models, self.work, self.step, self.env.rank, self.env.world_size, self.config.zero_stage
            )
        except Exception as error:  # the previous checkpoint stays the trusted one
            log.exception("step %d: the requested checkpoint failed", self.step)
            if self.env.rank == 0:
                reason = f"rank {self.env.rank}: {_describe(error)}"
                write_json_atomic(self.work.save_refused, {"step": self.step, "reason": reason})
        else:
            log.info("step %d: checkpoint saved on request in %.2f s", self.step, time.monotonic() - started)

    def _open_sender(self) -> weight_sync.WeightSender | None:
        """The in-memory sender when the server's plan says so (`SyncPlan.in_memory`), else None (disk)."""
        if self.sync.backend is None:
            return None
        if not (self.work.sync / ENGINE_UP).exists():
            log.info("waiting for the server's engine to serve before opening the weight transfer")
        if not wait_for_engine(self.work.sync, _parent_alive):
            raise RuntimeError("the server went away while its engine was starting")
        zero3 = self.config.zero_stage == 3
        return weight_sync.WeightSender(
            self.models.engine.module, zero3, self.config, self.work.sync, self.env.rank, self.sync
        )

    def _publish(self, step: int) -> WeightHandoff:
        """Hand the engine step ``step``'s weights: sent in memory, or exported for a reload from disk."""
        if self.sender is not None:
            stats = self.sender.send(step)
            if stats.withheld:
                return WithheldWeights()
            return MemoryWeights(send_s=round(stats.seconds, 4), bytes=stats.bytes)
        return DiskWeights(zero.export_weights(self.models, self.work, step, self.model_dir, self.env.rank))


def take_save_request(work: WorkDir) -> dict | None:
    """The pending save request, taken: renamed away before it is read, so that a request the coordinator
    writes from then on (after it saw this one's checkpoint, say) is a new one and never deleted unread."""
    taken = work.save_request_taken
    try:
        os.replace(work.save_request, taken)
    except FileNotFoundError:
        return None
    request = read_json(taken)
    taken.unlink(missing_ok=True)
    return request


def look(work: WorkDir, step: int) -> Found:
    """Rank 0, at step ``step``: what the work dir holds for the ranks. A save request comes first (asked
    for on a signal, before the stop), then the stop, then the batch of step ``step + 1``. Batches for
    later steps get an error result naming the expected step, once each; a save request for another step
    is refused in ``save-refused.json``. A request is taken (gone) when it is read: the checkpoint it asks
    for is the answer, and nothing of it is left for the coordinator to see once that checkpoint is."""
    request = take_save_request(work)
    if request is not None:  # before "stop": a save is asked for first, on a signal
        wanted = request.get("step")
        state = read_trainer_state(work)
        if wanted == step and (state is None or state.step != step):
            return Control.SAVE
        if wanted != step:
            reason = f"the trainer is at step {step}, not {wanted}"
            log.warning("save request refused: %s", reason)
            write_json_atomic(work.save_refused, {"step": wanted, "reason": reason})
    if work.stop.exists():
        return Control.STOP
    if not _parent_alive():
        log.warning("the process that started the trainer is gone: stopping")
        return Control.STOP
    expected = step + 1
    for pending in work.pending_steps():
        if pending == expected:
            return read_batch(work.batch_file(pending))
        if pending > expected and not work.result_file(pending).exists():
            write_error(work, pending, f"the trainer is at step {step} and takes step {expected} next")
    return Control.WAIT


def export_root(work_dir: Path) -> Path:
    """Where ``weight_sync: disk`` exports go: node-local storage (``$SLURM_TMPDIR``, else the temp folder)
    when this rank shares the server's host, so the weights never cross the shared file system; the work
    dir's ``weights/`` otherwise (a rank 0 on another node than the server, where only shared storage is
    common to both). Checkpoints for resuming stay in the work dir either way."""
    if os.environ.get(PARENT_HOST_VAR, socket.gethostname()) != socket.gethostname():
        log.warning("rank 0 runs on another host than the server: weight exports go to shared storage")
        return work_dir / "weights"
    return local_export_root(work_dir)


def _parent_alive() -> bool:
    """False once the starting process (see ``launch``) is gone; True when unknown or on another host."""
    pid = os.environ.get(PARENT_PID_VAR)
    return not (pid and holder_dead(os.environ.get(PARENT_HOST_VAR), int(pid)))


def _pad_id(model_config) -> int:
    pad = getattr(model_config, "pad_token_id", None)
    if pad is None:
        eos = getattr(model_config, "eos_token_id", None)
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return int(pad)


def _describe(error: BaseException) -> str:
    last = traceback.extract_tb(error.__traceback__)[-1:] if error.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(error).__name__}: {error}{where}"


def exit_now(code: int) -> None:
    """End the rank without the interpreter's finalisation: its logs and output flushed, its checkpoints
    long written and closed. Tearing down torch, DeepSpeed, gloo and vLLM's weight-transfer group at exit
    took 5 to 20 s of the run's end on two cores (the coordinator waits for the ranks to exit before the
    server can stop), and now and then aborted (``close_process_group``)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
