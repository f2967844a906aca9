"""A server job and the models it hosts: `JobContext` (the engine they share, the run's secret, the job)
and one `ModelContext` per model (its episodes, store, admission and trainer: the coordinator's
`TrainerHost`), with the model's lifecycle as one `ModelState`.

A plain server is a job with one model; a server with adapters is a job with several, over one engine
(each model then sees the engine through its own `ajet_hpc.engine.shared.SharedModel`). Request handlers
get the model they serve (``request.app.state.ctx``) and reach the job through it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.base import Engine
from ajet_hpc.server import watchdog
from ajet_hpc.server.episodes import Episode, EpisodeRegistry
from ajet_hpc.server.serving import Service

if TYPE_CHECKING:  # the server builds these in server/assembly.py; the HTTP front does not import them
    from ajet_hpc.config.evaluation import EvalConfig
    from ajet_hpc.storage.records import StepRecord
    from ajet_hpc.trainer.coordinator.evaluation import EvalRounds
    from ajet_hpc.trainer.coordinator.loop import Coordinator

log = logging.getLogger(__name__)


class ServerStore(Protocol):
    """The server store as a server uses it: `ajet_hpc.server.recorder.EpisodeRecorder`, which writes
    ``RUN/data/<model>.h5`` on its own thread (``server.assembly`` opens it). The proxy benchmark passes one
    that stores nothing (``tools/bench/proxy_procs.py``: it measures the API alone, docs/reliability.md)."""

    @property
    def path(self) -> Path: ...

    def submit(self, episode: Episode) -> None:
        """Queue a closed episode."""
        ...

    def submit_step(self, record: StepRecord) -> None: ...

    def on_written(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(episode)`` once a submitted episode is in the store."""
        ...

    async def written(self) -> bool:
        """Whether everything queued so far is in the store (waits for it)."""
        ...

    def unwritten_ids(self) -> frozenset[str]:
        """The episodes closed but not yet in the store."""
        ...

    def flush(self, timeout_s: float = 60.0) -> bool: ...

    def close(self) -> None: ...


@dataclass(eq=False)  # one per job: compared and hashed by identity
class JobContext:
    """What the models of one server job share: the engine (started and stopped once, by the app), the
    run's secret, the Slurm job, and whether the engine was lost (the watchdog saves and requeues once for
    every model of it)."""

    engine: Engine
    secret: str
    job_id: str = "local"
    started_at: float = field(default_factory=time.time)
    engine_lost: str | None = None  # the engine died: the job is being checkpointed and requeued (once)


class ModelState(enum.StrEnum):
    """Where a hosted model is in its life (its rendezvous and ``/v1/status`` say it as this string)."""

    SERVING = "serving"  # no trainer
    TRAINING = "training"
    TRAINED = "trained"  # its training is complete; it still serves co-trained models' episodes
    FINISHED = "finished"  # training complete, or its task sources used up: no new episodes
    FAILED = "failed"  # the watchdog gave up (``reason`` says why); the job ends with an error


@dataclass
class ModelContext:
    """One model of a server job: everything a request handler needs (``app.state.ctx``) and the
    `TrainerHost` of its coordinator (``ajet_hpc.trainer.coordinator.host``)."""

    name: str  # the model's name (the server name in the topology, or its adapter's)
    job: JobContext
    settings: ServingConfig
    recorder: ServerStore  # closed episodes and steps to RUN/data/<model>.h5
    view: Engine | None = None  # this model's view of the job's engine (`SharedModel`); None: the engine
    public_url: str = ""  # how agents reach this model; set once the port is known
    state: ModelState = ModelState.SERVING
    reason: str | None = None  # why the model finished early or failed (rendezvous, /v1/status)
    engine_lost: str | None = None  # this model saw its engine die (``watchdog.engine_died``)
    coordinator: Coordinator | None = None  # when the model trains (`attach_trainer`)
    on_finished: Callable[[], None] | None = None  # called once training is complete
    on_failed: Callable[[], None] | None = None  # called once the watchdog gives up (``fail``)
    partners_done: Callable[[], bool] | None = None  # True once every co-trained server has trained
    eval_configs: dict[str, EvalConfig] = field(default_factory=dict)  # eval groups using this model
    evaluation: EvalRounds | None = None  # the eval rounds that follow this model's steps
    service: Service = field(init=False)
    episodes: EpisodeRegistry = field(init=False)
    admission: asyncio.Event = field(init=False)  # cleared while a strictly on-policy step runs

    def __post_init__(self) -> None:
        self.service = Service(self.engine, self.settings, self.name)
        self.episodes = EpisodeRegistry(
            self.name,
            lambda: self.engine.tokenizer,
            self.settings.episode_timeout_s,
            keep_history=self.settings.keep_history,
        )
        self.episodes.on_closed(self.recorder.submit)
        self.admission = asyncio.Event()
        self.admission.set()

    @property
    def engine(self) -> Engine:
        """The engine as this model sees it."""
        return self.view if self.view is not None else self.job.engine

    @property
    def failed(self) -> bool:
        return self.state is ModelState.FAILED

    @property
    def over(self) -> bool:
        """Finished or failed: no more work for this model."""
        return self.state in (ModelState.FINISHED, ModelState.FAILED)

    def attach_trainer(self, coordinator: Coordinator) -> None:
        """The trainer's collector takes each finished episode once it is in the store (see
        ``EpisodeRecorder.on_written``)."""
        self.coordinator = coordinator
        self.state = ModelState.TRAINING
        self.episodes.on_closed(coordinator.collector.announce)  # coming: its task group waits for it
        self.recorder.on_written(coordinator.collector.add)

    @property
    def step(self) -> int:
        """The last trained step (0 without a trainer)."""
        return 0 if self.coordinator is None else self.coordinator.step

    @property
    def last_step_at(self) -> float | None:
        return None if self.coordinator is None else self.coordinator.last_step_at

    def fail(self, reason: str) -> None:
        """The watchdog gives up (the trainer's ranks failed ``trainer.max_restarts`` times in a row, or the
        engine died and the job cannot requeue itself): state ``failed`` with ``reason``; the server stops
        and its job exits non-zero, not requeued. Clients see the state and stop."""
        if self.failed:
            return
        self.state, self.reason = ModelState.FAILED, reason
        log.error("server %s failed: %s", self.name, reason)
        if self.on_failed is not None:
            self.on_failed()

    def engine_failure(self) -> str | None:
        """Why the engine cannot serve any more (its process died), or None while it is fine
        (``watchdog.engine_failure``); the coordinator asks when a training step fails."""
        return watchdog.engine_failure(self.engine)

    def engine_died(self, why: str) -> None:
        """Checkpoint the trainer, then requeue this job, or fail the server where it cannot requeue
        (``watchdog.engine_died``; once per job: later calls do nothing). The coordinator calls it when a
        step failed with the engine dead."""
        watchdog.engine_died(self, why)

    def finish_training(self, reason: str | None = None) -> None:
        """Training is complete (``reason``: why it ended before ``total_steps``). Alone, the server
        finishes (clients stop). When client groups also use other trainable servers ("partners"), it
        first keeps serving ("trained") until every partner has trained too, so that their agents, which
        need this model, can still run."""
        self.reason = reason
        if self.partners_done is None or self.partners_done():
            self._finish()
            return
        if not self.over:
            self.state = ModelState.TRAINED
        log.info("training of %s is complete; serving until the other trained models are done", self.name)
        threading.Thread(target=self._wait_for_partners, name="wait-for-partners", daemon=True).start()

    def _wait_for_partners(self, poll_s: float = 2.0) -> None:
        while not (self.partners_done is None or self.partners_done()):
            time.sleep(poll_s)
        self._finish()

    def _finish(self) -> None:
        if not self.failed:
            self.state = ModelState.FINISHED
        if self.on_finished is not None:
            self.on_finished()

    def finish_serving(self, reason: str) -> None:
        """The models trained beside this one are over: no new episodes for it either."""
        self.reason = self.reason or reason
        if not self.over:
            self.state = ModelState.FINISHED
