"""The HTTP application of a server job: one app for every job, routing by model name, around the engine's
lifetime and each model's background work.

Each model gets the same FastAPI sub-application (routes, token gate, error handlers) over its
`ModelContext`, reached under ``/m/<name>``; a job that hosts a single model also answers at the root, as
a plain server always has. ``/health`` outside a model answers for the process; any other path outside the
models is a 404 naming them. The app starts the job's engine once (the models' trainer ranks loading
meanwhile) and stops it once, after every model's background work (`running`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI

from ajet_hpc.engine.base import Engine
from ajet_hpc.server import challenge, eval_routes, heap, watchdog
from ajet_hpc.server.context import ModelContext
from ajet_hpc.server.errors import install_error_handlers
from ajet_hpc.server.gate import RequestGate
from ajet_hpc.server.router import router

MODEL_PREFIX = "/m/"
"""A server job serves its model ``name`` under ``/m/<name>`` (the rendezvous URL of each model of a job
with several)."""


@contextlib.asynccontextmanager
async def running(ctx: ModelContext) -> AsyncIterator[None]:
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


class ServerApp:
    """The ASGI application of a server job (see the module doc). With ``manage_engine`` it starts and
    stops the job's engine; with ``freeze_heap`` (the server's own process: ``ajet_hpc.server.process``)
    what exists once the engine has started, and then what lives on (open episodes above all), is moved
    out of the garbage collector's sight (``heap.aging``)."""

    def __init__(
        self, models: Sequence[ModelContext], manage_engine: bool = True, freeze_heap: bool = False
    ) -> None:
        if not models or len({ctx.job for ctx in models}) != 1:
            raise ValueError("a server app serves the models of one job (at least one)")
        self.models = list(models)
        self.engine: Engine = models[0].job.engine
        self.manage_engine, self.freeze_heap = manage_engine, freeze_heap
        self.apps = {ctx.name: _model_app(ctx) for ctx in models}
        self.lone = self.apps[models[0].name] if len(models) == 1 else None

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
        if self.lone is not None:
            await self.lone(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        if path == "/health":
            await _send_json(send, 200, {"status": "ok", "models": list(self.apps)})
            return
        known = ", ".join(f"{MODEL_PREFIX}{name}" for name in self.apps)
        await _send_json(send, 404, {"error": {"message": f"no model at {path}; this server serves {known}"}})

    @contextlib.asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """The job's engine started (with ``manage_engine``) and every model's background work running, for
        the block; stopped in reverse on the way out."""
        async with contextlib.AsyncExitStack() as stack:
            if self.manage_engine:
                await _start_engine(self.engine, self.models)
                stack.push_async_callback(self.engine.stop)
            if self.freeze_heap:
                await stack.enter_async_context(heap.aging())
            for ctx in self.models:
                await stack.enter_async_context(running(ctx))
            yield

    async def _lifespan(self, receive, send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        lifespan = self.lifespan()
        try:
            await lifespan.__aenter__()
        except BaseException as error:
            await send({"type": "lifespan.startup.failed", "message": f"{type(error).__name__}: {error}"})
            raise
        try:
            await send({"type": "lifespan.startup.complete"})
            message = await receive()
            assert message["type"] == "lifespan.shutdown"
        finally:
            await lifespan.__aexit__(None, None, None)
        await send({"type": "lifespan.shutdown.complete"})


def create_app(
    models: ModelContext | Sequence[ModelContext], manage_engine: bool = True, freeze_heap: bool = False
) -> ServerApp:
    """The app of a server job hosting ``models`` (one context or several of one job)."""
    return ServerApp([models] if isinstance(models, ModelContext) else models, manage_engine, freeze_heap)


def _model_app(ctx: ModelContext) -> FastAPI:
    app = FastAPI(title=f"ajet_hpc server {ctx.name}", docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(challenge.router)
    app.include_router(eval_routes.router)
    app.add_middleware(RequestGate, ctx=ctx)  # token and body size, before the body is read
    return app


async def _start_engine(engine: Engine, models: list[ModelContext]) -> None:
    """Start the engine, the models' trainer ranks loading meanwhile (closed again if the engine fails)."""
    for ctx in models:
        if ctx.coordinator is not None:
            ctx.coordinator.prestart()  # the ranks load while the engine does
    try:
        await engine.start()
    except BaseException:
        for ctx in models:
            if ctx.coordinator is not None:
                ctx.coordinator.close()
        raise


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
