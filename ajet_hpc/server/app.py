"""The HTTP application of a server job: routes, error handling and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI

from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.base import Engine
from ajet_hpc.server import challenge, eval_routes, heap, watchdog
from ajet_hpc.server.episodes import Episode, EpisodeRegistry
from ajet_hpc.server.errors import install_error_handlers
from ajet_hpc.server.gate import RequestGate
from ajet_hpc.server.router import router
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


@dataclass
class ServerContext:
    """Everything a request handler needs; one per server process (``app.state.ctx``)."""

    name: str  # the served model's name (the server name in the topology)
    engine: Engine
    settings: ServingConfig
    secret: str
    recorder: ServerStore  # closed episodes and steps to RUN/data/<model>.h5
    job_id: str = "local"
    public_url: str = ""  # how agents reach this server; set once the port is known
    started_at: float = field(default_factory=time.time)
    coordinator: Coordinator | None = None  # when the model trains (`attach_trainer`)
    on_finished: Callable[[], None] | None = None  # called once training is complete
    on_failed: Callable[[], None] | None = None  # called once the watchdog gives up (``fail``)
    reason: str | None = None  # why the server finished early or failed (rendezvous, /v1/status)
    failed: bool = False
    engine_lost: str | None = None  # the engine died: the job is being checkpointed and requeued
    training_done: bool = False
    trained: bool = False  # this model's training is complete; it still serves co-trained models' episodes
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
    def state(self) -> str:
        """serving (no trainer), training, trained (done, still serving co-trained models' episodes),
        finished (training complete, or its task sources used up: no new episodes), or failed (the watchdog
        gave up: ``reason`` says why; the job ends with an error and is not requeued)."""
        if self.failed:
            return "failed"
        if self.training_done:
            return "finished"
        if self.trained:
            return "trained"
        return "training" if self.coordinator is not None else "serving"

    def attach_trainer(self, coordinator: Coordinator) -> None:
        """The trainer's collector takes each finished episode once it is in the store (see
        ``EpisodeRecorder.on_written``). The context is the coordinator's `TrainerHost`
        (``trainer.coordinator.host``)."""
        self.coordinator = coordinator
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
        self.failed, self.reason = True, reason
        log.error("server %s failed: %s", self.name, reason)
        if self.on_failed is not None:
            self.on_failed()

    def engine_failure(self) -> str | None:
        """Why the engine cannot serve any more (its process died), or None while it is fine
        (``watchdog.engine_failure``); the coordinator asks when a training step fails."""
        return watchdog.engine_failure(self.engine)

    def engine_died(self, why: str) -> None:
        """Checkpoint the trainer, then requeue this job, or fail the server where it cannot requeue
        (``watchdog.engine_died``; once: later calls do nothing). The coordinator calls it when a step
        failed with the engine dead."""
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
        self.trained = True
        log.info("training of %s is complete; serving until the other trained models are done", self.name)
        threading.Thread(target=self._wait_for_partners, name="wait-for-partners", daemon=True).start()

    def _wait_for_partners(self, poll_s: float = 2.0) -> None:
        while not (self.partners_done is None or self.partners_done()):
            time.sleep(poll_s)
        self._finish()

    def _finish(self) -> None:
        self.training_done = True
        if self.on_finished is not None:
            self.on_finished()


@contextlib.asynccontextmanager
async def running(ctx: ServerContext) -> AsyncIterator[None]:
    """One model's background work while the app serves, its engine started: the episode sweeper, the
    coordinator's training loop and the watchdog; on the way out the trainer and the store are closed."""
    tasks = [asyncio.create_task(ctx.episodes.run_sweeper())]
    training = None
    if ctx.coordinator is not None:
        training = asyncio.create_task(ctx.coordinator.run(), name=f"coordinator-{ctx.name}")
        tasks.append(training)
    tasks.append(asyncio.create_task(watchdog.watch(ctx, training), name=f"watchdog-{ctx.name}"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        if ctx.coordinator is not None:
            ctx.coordinator.close()
        ctx.recorder.close()


def create_app(ctx: ServerContext, manage_engine: bool = True, freeze_heap: bool = False) -> FastAPI:
    """The FastAPI app. With ``manage_engine`` the app starts and stops the engine with itself. With
    ``freeze_heap`` (the server's own process: ``ajet_hpc.server.process``) what exists once the engine has
    started, and then what lives on (open episodes above all), is moved out of the garbage collector's
    sight (``heap.aging``)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await _start_engine(ctx.engine, [ctx])
        try:
            async with contextlib.AsyncExitStack() as stack:
                if freeze_heap:
                    await stack.enter_async_context(heap.aging())
                await stack.enter_async_context(running(ctx))
                yield
        finally:
            if manage_engine:
                await ctx.engine.stop()

    return _model_app(ctx, lifespan)


def _model_app(ctx: ServerContext, lifespan=None) -> FastAPI:
    app = FastAPI(title=f"ajet_hpc server {ctx.name}", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(challenge.router)
    app.include_router(eval_routes.router)
    app.add_middleware(RequestGate, ctx=ctx)  # token and body size, before the body is read
    return app


async def _start_engine(engine: Engine, contexts: list[ServerContext]) -> None:
    """Start the engine, the models' trainer ranks loading meanwhile (closed again if the engine fails)."""
    for ctx in contexts:
        if ctx.coordinator is not None:
            ctx.coordinator.prestart()  # the ranks load while the engine does
    try:
        await engine.start()
    except BaseException:
        for ctx in contexts:
            if ctx.coordinator is not None:
                ctx.coordinator.close()
        raise


MODEL_PREFIX = "/m/"
"""A server with adapters serves its model ``name`` under ``/m/<name>`` (each model's rendezvous URL)."""


class SwarmApp:
    """The ASGI application of a server with adapters: one app per model (`create_app`'s routes, gate and
    errors, the model's context), reached under ``/m/<name>``, over one shared engine that this app starts
    once and stops once, around every model's background work (`running`). ``/health`` outside a model
    answers for the process; any other path outside the models is a 404 naming them."""

    def __init__(self, engine: Engine, contexts: list[ServerContext], freeze_heap: bool = False) -> None:
        self.engine, self.contexts, self.freeze_heap = engine, contexts, freeze_heap
        self.apps = {ctx.name: _model_app(ctx) for ctx in contexts}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        path: str = scope.get("path", "")
        if path.startswith(MODEL_PREFIX):
            name, _, rest = path[len(MODEL_PREFIX) :].partition("/")
            app = self.apps.get(name)
            if app is not None:
                prefix = MODEL_PREFIX + name
                inner = dict(scope, path="/" + rest, root_path=scope.get("root_path", "") + prefix)
                if scope.get("raw_path"):
                    inner["raw_path"] = scope["raw_path"][len(prefix) :] or b"/"
                await app(inner, receive, send)
                return
        if scope["type"] != "http":
            return
        if path == "/health":
            await _send_json(send, 200, {"status": "ok", "models": list(self.apps)})
            return
        known = ", ".join(f"{MODEL_PREFIX}{name}" for name in self.apps)
        await _send_json(send, 404, {"error": {"message": f"no model at {path}; this server serves {known}"}})

    async def _lifespan(self, receive, send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        async with contextlib.AsyncExitStack() as stack:
            try:
                await _start_engine(self.engine, self.contexts)
                stack.push_async_callback(self.engine.stop)
                if self.freeze_heap:
                    await stack.enter_async_context(heap.aging())
                for ctx in self.contexts:
                    await stack.enter_async_context(running(ctx))
            except BaseException as error:
                await send({"type": "lifespan.startup.failed", "message": f"{type(error).__name__}: {error}"})
                raise
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
        await send({"type": "lifespan.shutdown.complete"})


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
