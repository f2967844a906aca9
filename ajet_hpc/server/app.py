"""The HTTP application of a server job: routes, error handling and the engine's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI

from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.base import Engine
from ajet_hpc.server.episodes import EpisodeRegistry
from ajet_hpc.server.errors import install_error_handlers
from ajet_hpc.server.router import router
from ajet_hpc.server.serving import Service


@dataclass
class ServerContext:
    """Everything a request handler needs; one per server process (``app.state.ctx``)."""

    name: str  # the served model's name (the server name in the topology)
    engine: Engine
    settings: ServingConfig
    secret: str
    job_id: str = "local"
    public_url: str = ""  # how agents reach this server; set once the port is known
    started_at: float = field(default_factory=time.time)
    service: Service = field(init=False)
    episodes: EpisodeRegistry = field(init=False)

    def __post_init__(self) -> None:
        self.service = Service(self.engine, self.settings, self.name)
        self.episodes = EpisodeRegistry(
            self.name, lambda: self.engine.tokenizer, self.settings.episode_timeout_s
        )


def create_app(ctx: ServerContext, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app. With ``manage_engine`` the app starts and stops the engine with itself."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            await ctx.engine.start()
        sweeper = asyncio.create_task(ctx.episodes.run_sweeper())
        try:
            yield
        finally:
            sweeper.cancel()
            if manage_engine:
                await ctx.engine.stop()

    app = FastAPI(title=f"ajet_hpc server {ctx.name}", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.include_router(router)
    return app
