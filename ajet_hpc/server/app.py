"""The HTTP application of a server job."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from fastapi import FastAPI


@dataclass
class ServerState:
    """What the HTTP front reports about its server; shared with the process that runs it."""

    name: str
    model: str
    job_id: str
    started_at: float = field(default_factory=time.time)
    policy_version: int = 0


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title=f"ajet_hpc server {state.name}", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> dict[str, object]:
        return {
            "status": "ok",
            "server": state.name,
            "model": state.model,
            "job_id": state.job_id,
            "policy_version": state.policy_version,
            "uptime_s": round(time.time() - state.started_at, 3),
        }

    return app
