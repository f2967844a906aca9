"""Real servers for tests: one engine per harness, started once in its own event loop thread, behind
any number of uvicorn apps (each with its own serving settings and its own real server store) on free
loopback ports."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import shutil
import socket
import tempfile
import threading
from pathlib import Path

import httpx
import uvicorn

from ajet_hpc.client.handshake import fetch_run_token
from ajet_hpc.config import ServingConfig
from ajet_hpc.engine.select import EngineKind, create_engine
from ajet_hpc.server.app import create_app
from ajet_hpc.server.context import JobContext, ModelContext
from ajet_hpc.server.process import uvicorn_config
from ajet_hpc.server.recorder import EpisodeRecorder

SECRET = "5e" * 32


@dataclasses.dataclass
class RunningServer:
    url: str
    ctx: ModelContext
    server: uvicorn.Server

    @property
    def admin(self) -> dict[str, str]:
        """The header of a run-secret holder: a run token from the challenge (the secret is never sent)."""
        return {"Authorization": f"Bearer {admin_token(self.url)}"}

    def begin(self, **body) -> dict:
        reply = httpx.post(f"{self.url}/v1/episodes", json=body, headers=self.admin, timeout=30)
        reply.raise_for_status()
        return reply.json()

    def end(self, episode_id: str, reward: float, **body) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/episodes/{episode_id}/end", json={"reward": reward, **body}, headers=self.admin
        )

    def episode(self, episode_id: str) -> dict:
        reply = httpx.get(f"{self.url}/v1/episodes/{episode_id}?timelines=true", headers=self.admin)
        reply.raise_for_status()
        return reply.json()

    def status(self) -> dict:
        return httpx.get(f"{self.url}/v1/status", headers=self.admin).json()


@functools.cache
def admin_token(url: str, secret: str = SECRET) -> str:
    """A run token for the server at ``url``, by the same challenge the runners use."""
    return fetch_run_token(url, secret)


class Harness:
    def __init__(self, kind: EngineKind, model_path: Path, max_model_len: int = 1024) -> None:
        # one torch thread, as the test process computes (tests/conftest.py): the default, the host's
        # cores, spins a second thread against every other process of the suite
        threads = {"cpu_threads": 1} if kind == "transformers" else {}
        self.engine = create_engine(kind, model_path, max_model_len=max_model_len, **threads)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"harness-{kind}", daemon=True)
        self.thread.start()
        self.servers: list[RunningServer] = []
        self.stores = Path(tempfile.mkdtemp(prefix="ajet-harness-stores-"))  # each server's store
        self._call(self.engine.start())

    def _call(self, coroutine, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def serve(
        self, name: str = "policy", tls: tuple[str, str] | None = None, store: Path | None = None, **settings
    ) -> RunningServer:
        """A server on a free loopback port; ``tls``: (certfile, keyfile) to speak HTTPS; ``store``: its
        server store's file (default: a new one in the harness's temporary folder), closed with the server."""
        base = {"max_model_len": self.engine.max_model_len, "max_tokens": 64}
        recorder = EpisodeRecorder(store or self.stores / f"{name}-{len(self.servers)}.h5")
        ctx = ModelContext(
            name=name,
            job=JobContext(engine=self.engine, secret=SECRET),
            settings=ServingConfig(**{**base, **settings}),
            recorder=recorder,
        )
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        url = f"{'https' if tls else 'http'}://127.0.0.1:{sock.getsockname()[1]}"
        ctx.public_url = url
        serving = ctx.settings.model_copy(
            update={"tls_certfile": tls[0] if tls else None, "tls_keyfile": tls[1] if tls else None}
        )
        config = uvicorn_config(create_app(ctx, manage_engine=False), serving)  # the servers' own settings
        server = uvicorn.Server(config)
        asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), self.loop)
        while not server.started:
            threading.Event().wait(0.02)
        running = RunningServer(url, ctx, server)
        self.servers.append(running)
        return running

    def close(self) -> None:
        for running in self.servers:
            running.server.should_exit = True
        threading.Event().wait(0.5)
        self._call(self.engine.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        shutil.rmtree(self.stores, ignore_errors=True)
