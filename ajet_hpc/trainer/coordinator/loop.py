"""The training loop of a server, in the process that holds the HTTP front and the engine.

finished episodes → collector → batch → samples with GRPO advantages → trainer ranks (DeepSpeed, separate
processes, file protocol in RUN/ckpt/<model>/) → new weights → engine reload → policy version + 1 →
metrics row. Checkpoints every ``save_every`` steps, at the last step, and on Slurm's pre-timeout or
preemption signal (`Coordinator.save_on_signal`). On start it resumes from the ranks' last complete
checkpoint: the engine gets that step's weights and the policy version continues, and the collector gets
back the finished episodes of the server store that no step consumed (the journal, written before each
step's batch goes to the ranks, names the consumed ones: no episode is trained twice).

With ``max_staleness`` > 0 the next step's batch is collected, built and encoded while the ranks train the
current step (``batch_preparer.BatchPreparer``; docs/architecture.md, "The coordinator's step"): it is
judged stale against the policy that will train it, and it is consumed (journal line, batch file) only once
the current step is recorded; a batch prepared but never sent goes back to the collector, or, at a crash,
stays unconsumed in the store.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from ajet_hpc.config import TrainerConfig
from ajet_hpc.process_tree import kill_tree
from ajet_hpc.storage.records import StepRecord
from ajet_hpc.trainer.coordinator import metrics
from ajet_hpc.trainer.coordinator.batch_preparer import BatchPreparer
from ajet_hpc.trainer.coordinator.channel import TrainerChannel, TrainerFailed
from ajet_hpc.trainer.coordinator.collector import (
    Batch,
    BatchCollector,
)
from ajet_hpc.trainer.coordinator.experiment_trackers import step_histograms
from ajet_hpc.trainer.coordinator.host import TrainerHost, TrainerSetup
from ajet_hpc.trainer.coordinator.journal import ConsumedJournal
from ajet_hpc.trainer.coordinator.rank_launcher import start_ranks
from ajet_hpc.trainer.coordinator.recovery import load_episodes, stored_summaries, unconsumed
from ajet_hpc.trainer.coordinator.step_record import InFlight, Prepared, step_row
from ajet_hpc.trainer.protocol.checkpoints import RESUME_LIMIT_VAR, read_trainer_state
from ajet_hpc.trainer.protocol.step_result import StepResult
from ajet_hpc.trainer.protocol.sync_channel import SyncServer, announce_job_ending, clear
from ajet_hpc.trainer.protocol.weight_handoff import MemoryWeights, WithheldWeights
from ajet_hpc.trainer.protocol.work_dir import WorkDir

log = logging.getLogger(__name__)


class TrainingGaveUp(RuntimeError):
    """The ranks failed ``trainer.max_restarts + 1`` steps in a row; the message says why."""


class Coordinator:
    """Trains one model for the server that hosts it (``host``: what it needs of the server, see
    ``trainer.host``); everything else comes with ``setup``, once."""

    def __init__(self, host: TrainerHost, setup: TrainerSetup) -> None:
        self.host, self.setup = host, setup
        self.server, self.config = setup.server, setup.trainer
        self.model_path, self.on_slurm = setup.model_path, setup.on_slurm
        self.work_dir = setup.run.trainer_dir(self.server.name)
        self.metrics_path = setup.run.metrics_file
        self.collector = BatchCollector(
            self.config, mix=setup.mix, repeats_of=setup.repeats_of, ended_count=setup.ended_count
        )
        self.batches = BatchPreparer(  # what the steps train: collected, built and encoded, one ahead
            self.config, self.collector, setup.sources_ended, tokenizer=lambda: host.engine.tokenizer
        )
        self.journal = ConsumedJournal(self.work_dir / "consumed.jsonl")
        self.stored = setup.stored  # the store's summaries read at the server's start, until restored
        self.trackers = setup.trackers  # closed with the ranks (`close`)
        self.sources_ended = setup.sources_ended
        self.evaluation = setup.evaluation  # eval rounds that follow this model's steps (or None)
        self._restored = False
        self.placement = setup.placement
        self.sync = setup.sync
        self.process: subprocess.Popen | None = None
        self._prestarted = False  # self.process was started by prestart, while the engine loaded
        self.channel: TrainerChannel | None = None
        self.step = 0
        self._in_flight: InFlight | None = None  # the step the ranks are training, until it is recorded
        self._ranks_idle_since = 0.0  # monotonic: the ranks' last result (or start): they wait from then
        self._recorded_step = 0  # the last step recorded (metrics row, store) since the ranks started
        self.stopping = False  # set by save_on_signal: no batch goes to the ranks any more
        self.last_step_at: float | None = None  # when the last step was recorded (time.time())

    @property
    def trainer(self) -> TrainerConfig:
        return self.config

    async def run(self) -> None:
        """Train to the end. On an error the server's watchdog decides (``host.engine_died``): a dead engine
        checkpoints and requeues the job; anything else fails the server, which then stops (it never
        serves an untrained model to the end of its allocation)."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            engine_dead = self.host.engine_failure()
            if engine_dead is not None:
                log.error("training step failed with the engine dead: %s", exc)
                self.host.engine_died(engine_dead)  # checkpoints while the ranks still run
                return
            log.exception("training stopped by an error")
            reason = str(exc) if isinstance(exc, TrainingGaveUp) else f"training stopped: {exc!r}"
            metrics.append_event(self.metrics_path, self.server.name, "failed", reason, at_step=self.step)
            self.host.fail(reason)
        finally:
            self.close()

    def prestart(self) -> None:
        """Start the ranks while the engine loads (each takes tens of seconds on CPUs, minutes for a large
        model): they load the model and build DeepSpeed meanwhile, and open an in-memory weight transfer
        only once the engine serves (``sync_channel.ENGINE_UP``). Not when they share the engine's GPUs
        (``colocate``): the engine sizes its memory first; nor with ``trainer.start_with_engine: false``.
        ``run`` takes over the ranks started here."""
        if not self.config.start_with_engine or self.placement.mode == "colocate" or self.process is not None:
            return
        self._prepare_work_dir()
        self.process, self._prestarted = self._launch_ranks(), True
        log.info("trainer ranks starting while the engine loads")

    def _prepare_work_dir(self) -> None:
        work = WorkDir(self.work_dir)
        work.root.mkdir(parents=True, exist_ok=True)
        _discard_batches(work)  # left by an earlier job: nobody waits for their results
        clear(work.sync)  # calls and answers of an earlier job, and its ENGINE_UP marker

    async def _run(self) -> None:
        if not self._prestarted:
            self._prepare_work_dir()
        sync_server = self._start_sync_server()
        try:
            channel = await self._resume_before_serving()
            await self._restore_collector()
            self._open_eval_rounds(self.step)  # at the start (eval.at_start), or one a preemption cut
            total = self.config.total_steps
            bar = tqdm(
                total=total,
                initial=self.step,
                desc=f"train {self.server.name}",
                file=sys.stderr,
                mininterval=1,
            )
            failures, ended, retry = 0, None, None
            while self.step < total:
                prepared, retry = await self.batches.take(self.step + 1, retry), None
                if self.stopping:  # saved on a signal: the job is going down, nothing more is trained
                    await asyncio.Future()  # until the server's shutdown cancels this task
                if prepared is None:
                    ended = f"task sources exhausted at step {self.step} of {total} ({self.sources_ended()})"
                    break
                try:
                    if not await self._train_prepared(channel, prepared):
                        continue  # nothing in the batch could be built: the next batch trains this step
                    failures = 0
                except TrainerFailed as error:
                    if self.host.engine_failure() is not None:
                        raise  # not the ranks' fault: run() hands over to the watchdog (requeue)
                    failures += 1
                    self._restarting(error, failures)
                    await self.batches.put_back_ahead()  # prepared for a step after the failed one: not sent
                    self.close()
                    _discard_batches(WorkDir(self.work_dir))
                    retry = prepared.batch  # trained again by the new ranks: its episodes are not lost
                    channel = await self._start_ranks()
                    bar.reset(total)
                    bar.update(self.step)
                    continue
                bar.update(1)
            bar.close()
            self.collector.closed = True
            if ended is not None:
                await self._end_early(channel, ended)
            channel.request_stop()
            await self._last_eval_rounds(final=ended is not None)
        finally:
            self.batches.cancel_ahead()  # a batch prepared for a step that never comes: not consumed
            if sync_server is not None:
                sync_server.cancel()
        log.info("training of %s finished at step %d", self.server.name, self.step)
        self.host.finish_training(ended)

    def _restarting(self, error: TrainerFailed, failures: int) -> None:
        """A step failed: record why (log, metrics event), or give up after ``max_restarts`` in a row."""
        limit = self.config.max_restarts
        step = self.step + 1
        if failures > limit:
            raise TrainingGaveUp(
                f"trainer ranks failed {failures} time(s) in a row (trainer.max_restarts={limit}); "
                f"last at step {step}: {error}"
            ) from error
        log.error(
            "step %d failed (%s); restarting the ranks from their last checkpoint (restart %d of %d)",
            step,
            error,
            failures,
            limit,
        )
        metrics.append_event(
            self.metrics_path,
            self.server.name,
            "trainer_restart",
            str(error),
            at_step=step,
            restart=failures,
            max_restarts=limit,
        )

    async def _end_early(self, channel: TrainerChannel, reason: str) -> None:
        """No batch will come: checkpoint the last step (the final model), record why, and stop."""
        log.warning("training of %s ends early: %s", self.server.name, reason)
        if self.step and channel.last_checkpoint_step() != self.step:
            channel.request_save(self.step)
            await asyncio.to_thread(channel.wait_saved_blocking, self.step, 600)
        metrics.append_event(self.metrics_path, self.server.name, "ended", reason, at_step=self.step)

    def _start_sync_server(self) -> asyncio.Task | None:
        """With in-memory weight syncs: the task that answers the ranks' control calls (``sync_channel``)."""
        receiver = self.setup.receiver
        if not self.sync.in_memory or receiver is None:  # a setup in memory has one (`TrainerSetup`)
            return None
        server = SyncServer(
            WorkDir(self.work_dir).sync, receiver.weight_transfer, abandon=receiver.abandon_weight_update
        )
        return asyncio.get_running_loop().create_task(server.serve(), name="weight-sync")

    async def _resume_before_serving(self) -> TrainerChannel:
        """The first start of the ranks. With a checkpoint to resume (a requeued job), no new episode begins
        until the engine holds the checkpoint's weights (episodes wait at their begin): the engine would
        otherwise serve the initial policy (for an adapter, version 0: the base) in the meantime."""
        resuming = read_trainer_state(WorkDir(self.work_dir)) is not None
        if resuming:
            log.info(
                "%s resumes from a checkpoint: new episodes wait until its weights are in the engine",
                self.server.name,
            )
            self.host.admission.clear()
        try:
            return await self._start_ranks()
        finally:
            if resuming:
                self.host.admission.set()

    async def _start_ranks(self) -> TrainerChannel:
        """Start the ranks, wait until they have resumed from their last checkpoint (and handed the engine
        its weights), and continue from that step."""
        prestarted, self._prestarted = self._prestarted, False
        if not prestarted:
            self.process = self._launch_ranks()
        process = self.process
        assert process is not None
        channel = TrainerChannel(
            self.work_dir, alive=lambda: process.poll() is None, log_path=self._ranks_log
        )
        self.channel = channel
        ready = await channel.wait_ready(timeout_s=900)
        self._ranks_idle_since = time.monotonic()
        self.step = int(ready.get("step", 0))
        self._recorded_step = self.step  # steps after the checkpoint run (and are recorded) again
        if self.step:
            await self._resume(ready)
        dropped = metrics.truncate_after(self.metrics_path, self.server.name, self.step)
        if dropped:
            log.info(
                "removed %d metrics rows past the checkpoint at step %d (they run again)", dropped, self.step
            )
        if self.evaluation is not None:
            self.evaluation.reload()  # eval rows past the checkpoint went with the step rows
        return channel

    def _open_eval_rounds(self, step: int, final: bool = False) -> None:
        """Open the eval rounds due now that the engine serves policy ``step`` (every one not yet run at
        ``step`` when ``final``: training ended early there)."""
        if self.evaluation is not None:
            self.evaluation.open_due(step, final=final)

    async def _eval_gate(self) -> float:
        """Wait until the open eval rounds close (their episodes must all see the current policy); returns
        the seconds waited."""
        if self.evaluation is None or not self.evaluation.open:
            return 0.0
        started = time.monotonic()
        await self.evaluation.wait_closed()
        self._ranks_idle_since = max(self._ranks_idle_since, time.monotonic())  # idle for eval, not for us
        return time.monotonic() - started

    async def _last_eval_rounds(self, final: bool) -> None:
        """Training is over: run the last step's rounds (those of an early end too), then let the eval
        tasks stop."""
        if self.evaluation is None:
            return
        self._open_eval_rounds(self.step, final=final)
        await self.evaluation.wait_closed()
        self.evaluation.finish()

    def _last_recorded(self) -> int:
        """The last step recorded: since ranks first started in this process, else in metrics.jsonl (by an
        earlier job). The ranks go back from a checkpoint past it (`protocol.resume_point`)."""
        if self.channel is not None:
            return self._recorded_step
        return metrics.last_step(self.metrics_path, self.server.name)

    @property
    def _ranks_log(self) -> Path:
        return self.work_dir / "ranks.log"

    def _launch_ranks(self) -> subprocess.Popen:
        env = dict(os.environ if self.setup.rank_env is None else self.setup.rank_env)
        env[RESUME_LIMIT_VAR] = str(self._last_recorded())
        return start_ranks(
            self.work_dir,
            self.model_path,
            self.config,
            on_slurm=self.on_slurm,
            placement=self.placement,
            log_path=self._ranks_log,
            env=env,
            sync=self.sync,
        )

    async def _restore_collector(self) -> None:
        """Once per server process: the finished episodes of an earlier life that no step consumed go back
        into the collector (those too stale for the resumed policy are dropped and reported)."""
        if self._restored:
            return
        self._restored = True
        path = self.host.recorder.path
        summaries = (
            self.stored if self.stored is not None else await asyncio.to_thread(stored_summaries, path)
        )
        self.stored = None
        consumed = await asyncio.to_thread(self.journal.read)
        found = unconsumed(summaries, consumed, self.step, self.config.max_staleness)
        episodes = await asyncio.to_thread(load_episodes, path, found.fresh)
        self.collector.note_dropped_stale(found.stale)
        self.collector.restore(episodes)
        lost = consumed.trained_after(self.step)
        if episodes or found.stale or lost:
            log.info(
                "restored %d finished episode(s) no step consumed; %d too stale for policy %d (dropped); "
                "%d taken by steps after checkpoint %d were lost with them",
                len(episodes),
                len(found.stale),
                self.step,
                lost,
                self.step,
            )

    async def _resume(self, ready: dict) -> None:
        started = time.monotonic()
        if ready.get("weights") == WithheldWeights.kind:  # the job began to end while the ranks started
            if not self.stopping:
                raise TrainerFailed(f"the ranks resumed at step {self.step} but withheld its weights")
            log.info("resumed at step %d as the job ends: the engine gets no weights", self.step)
            return
        if ready.get("weights") == "memory":  # the ranks sent the checkpoint's weights while starting
            if self.host.engine.policy_version != self.step:
                raise TrainerFailed(
                    f"the ranks resumed at step {self.step} but the engine holds policy version "
                    f"{self.host.engine.policy_version}"
                )
        else:
            weights = ready.get("weights_dir")
            if not weights or not Path(weights).is_dir():
                raise TrainerFailed(
                    f"the ranks resumed at step {self.step} but exported no weights ({weights!r})"
                )
            await self.host.engine.load_weights(Path(weights), self.step)
        self.collector.set_policy_version(self.step)
        log.info(
            "resumed %s at step %d (weights to the engine in %.2fs)",
            self.server.name,
            self.step,
            time.monotonic() - started,
        )

    async def _train_step(self, channel: TrainerChannel, batch: Batch) -> bool:
        """Train the next step on ``batch``; False when none of its episodes could be built (each one
        dropped, reported with the next batch): no step then."""
        prepared = await self.batches.prepare(self.step + 1, batch)
        return prepared is not None and await self._train_prepared(channel, prepared)

    def _overlaps(self) -> bool:
        """Whether the next batch may be prepared while the ranks train: only if its samples can be within
        ``max_staleness`` of the policy that will train them (see docs/architecture.md). With
        ``max_staleness: 0`` they must come from the policy the running step makes: no overlap."""
        return self.config.max_staleness > 0

    async def _train_prepared(self, channel: TrainerChannel, prepared: Prepared) -> bool:
        """Consume a prepared batch (journal line, fsynced, then the batch file), start preparing the next
        one when staleness allows, wait for the result, sync the weights, record the step."""
        batch, samples, step = prepared.batch, prepared.samples, prepared.step
        prepared.eval_wait_s = await self._eval_gate()
        if not samples:
            log.warning(
                "step %d: no episode of the batch could be built (%d dropped: %s); the next batch trains it",
                step,
                batch.dropped_invalid,
                ", ".join(batch.invalid),
            )
            self.collector.carry_over(batch)
            return False
        prepared.ranks_idle_since = self._ranks_idle_since
        started = max(prepared.taken, self._ranks_idle_since)  # the step begins once both are there
        on_policy = self.config.max_staleness == 0
        if on_policy:
            self.host.admission.clear()  # strictly on-policy: no new episode while the weights change
        try:
            in_flight = self._in_flight = InFlight(prepared, started)
            colocated = self.placement.mode == "colocate"
            sleep_s = await self.host.engine.sleep() if colocated else 0.0  # the ranks need the GPUs
            trained_ids = list(dict.fromkeys(e.episode_id for e in batch.episodes))
            journal_at = time.monotonic()
            if not self.stopping:
                await asyncio.to_thread(self.journal.append, step, trained_ids, batch.dropped_ids)
            if self.stopping:  # saved on a signal meanwhile: the batch never goes to the ranks
                await asyncio.Future()  # until the server's shutdown cancels this task
            channel.submit(step, samples, save_checkpoint=prepared.save, encoded=prepared.encoded)
            in_flight.submitted = True
            prepared.work.append((journal_at, time.monotonic()))
            if self._overlaps() and step < self.config.total_steps:
                self.batches.start_ahead(step + 1)
            result = await channel.wait_result(step)
            self._ranks_idle_since = time.monotonic()
            if self._in_flight is None:  # recorded by save_on_signal meanwhile: the job is going down
                return True
            trained = time.monotonic()
            wake_s = await self.host.engine.wake_up() if colocated else 0.0
            if isinstance(result.weights, WithheldWeights):  # only while save_on_signal runs, not here
                raise TrainerFailed(f"step {step}'s weights were withheld, yet the job is not ending")
            if isinstance(result.weights, MemoryWeights):  # sent before the result was written
                sync_s = result.weights.send_s
                pause_s = self.setup.receiver.last_pause_s if self.setup.receiver is not None else 0.0
            else:
                await self.host.engine.load_weights(result.weights.folder, step)
                sync_s = pause_s = time.monotonic() - trained
            engine_s = {"engine_pause_s": _round(pause_s), "engine_sleep_s": sleep_s, "engine_wake_s": wake_s}
        finally:
            self.host.admission.set()
        self._in_flight = None
        self.step = step
        self.collector.set_policy_version(step)
        self._record(prepared, result, time.monotonic() - started, sync_s, engine_s)
        self._open_eval_rounds(step)
        return True

    def save_on_signal(self, timeout_s: float) -> int | None:
        """Checkpoint now, on Slurm's pre-timeout or preemption signal, so that the requeued job resumes here.

        Runs in the signal handler, on the event loop's thread, which stays blocked meanwhile (the ranks are
        other processes and go on). A step the ranks are training is first waited for and recorded
        (metrics row, server store): its result would otherwise be lost with the batch. Then the ranks save
        that step unless the trusted checkpoint already is it, and are asked to exit. Returns the step
        saved, None when there was nothing to save (no step yet, or the ranks are not up).

        An in-memory weight sync needs the blocked loop (``SyncServer``), so the job-ending marker goes
        first: the step's send stops, or is never begun, and its result comes with the weights withheld
        (the checkpoint of the step carries them to the requeued job).
        """
        self.stopping = True
        channel = self.channel
        if channel is not None:
            announce_job_ending(channel.work.sync)
        if channel is None or self.process is None or self.process.poll() is not None:
            log.warning("signal: the trainer's ranks are not running; nothing to checkpoint")
            return None
        deadline = time.monotonic() + timeout_s
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None and not in_flight.submitted:
            log.info("signal: step %d was not handed to the ranks; it is not trained", in_flight.step)
        elif in_flight is not None:
            log.info("signal: waiting for step %d to finish before checkpointing it", in_flight.step)
            result = channel.wait_result_blocking(in_flight.step, max(1.0, deadline - time.monotonic()))
            self.step = in_flight.step
            self._record(in_flight.prepared, result, time.monotonic() - in_flight.started, 0.0)
        if self.step == 0:
            channel.request_stop()
            return None
        if channel.last_checkpoint_step() != self.step:
            started = time.monotonic()
            channel.request_save(self.step)
            channel.wait_saved_blocking(self.step, max(1.0, deadline - time.monotonic()))
            log.info("signal: checkpoint of step %d saved in %.1f s", self.step, time.monotonic() - started)
        else:
            log.info("signal: step %d is already checkpointed", self.step)
        channel.request_stop()
        return self.step

    def _record(
        self,
        prepared: Prepared,
        result: StepResult,
        step_s: float,
        sync_s: float,
        engine_s: dict[str, float | None] | None = None,
    ) -> None:
        if self.step <= self._recorded_step:  # save_on_signal recorded it during the step's last awaits
            log.info("step %d is recorded already", self.step)
            return
        self._recorded_step = self.step
        batch, samples, merging = prepared.batch, prepared.samples, prepared.merging
        row = step_row(self.server.name, self.step, prepared, result, step_s, sync_s, engine_s)
        mean, std = row["reward_mean"], row["reward_std"]
        metrics.append_row(self.metrics_path, row)
        self.last_step_at = row["time"]
        if self.trackers is not None:
            self.trackers.log(row, step_histograms(batch.episodes, samples))
        self.host.recorder.submit_step(StepRecord(step=self.step, metrics=row, samples=samples))
        log.info(
            "step %d/%d  reward %.3f±%.3f  loss %.4f  entropy %s  tokens %s  samples %d→%d  step %.2fs  "
            "weight sync %.0f ms  coordinator %.2fs (%.2fs while the ranks waited)",
            self.step,
            self.config.total_steps,
            mean,
            std,
            result.loss,
            _fmt(result.entropy),
            result.tokens,
            merging.samples_before,
            merging.samples_after,
            step_s,
            sync_s * 1000,
            row["coordinator_s"],
            row["coordinator_critical_s"],
        )

    def close(self) -> None:
        """Stop the ranks: ask (they exit at their next wait for a batch), then SIGTERM, then SIGKILL to
        torchrun and every rank (each rank runs in a session of its own: killing torchrun alone would
        leave ranks hung in a collective running on). The trackers are closed first."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close()
        if self.process is None or self.process.poll() is not None:
            return
        TrainerChannel(self.work_dir).request_stop()
        process = self.process
        for name, action in (
            ("", None),
            ("SIGTERM", process.terminate),
            ("SIGKILL", lambda: kill_tree(process.pid)),
        ):
            if action is not None:
                log.warning("trainer ranks still running: %s", name)
                action()
            try:
                process.wait(timeout=10)
                return
            except subprocess.TimeoutExpired:
                continue


def _discard_batches(work: WorkDir) -> None:
    """Remove the batches left in the inbox by ranks that died or by an earlier job: restarted ranks would
    train them on their own, unasked, while the coordinator submits that step again and waits for a result
    that never comes."""
    for step in work.pending_steps():
        work.batch_file(step).unlink(missing_ok=True)


def _round(value) -> float | None:
    return None if value is None else round(float(value), 4)


def _fmt(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)
