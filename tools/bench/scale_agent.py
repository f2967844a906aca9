"""The agent and task source of ``scale.py``: episodes that stay open until the harness lets them end.

``hold`` makes one chat call, then waits (no CPU, no file access) until the process gets SIGUSR1, makes a
second chat call with the conversation so far, and returns a reward. A population of such episodes is
"open episodes" on the server for as long as the harness likes. Released episodes (and every episode that
begins after the release) end at once.

The agent talks to the model with the real ``openai`` client; the clients of one process share one httpx
connection pool, as a user's agent library would (one client per episode would hold one pool each).

``tasks`` is the group's task source: numbered tasks with a one-line question.
"""

from __future__ import annotations

import os
import signal
import threading
import zlib
from collections.abc import Iterator
from typing import Any

import httpx

from ajet_hpc.environments.episode import EpisodeContext, Task

RELEASE = threading.Event()
HOLD_MAX_ENV = "AJET_SCALE_HOLD_MAX_S"
"""The longest an episode waits for the release (default 1800 s): a harness that died releases nothing."""
TASKS = 1_000_000
KEEP_ALIVE_ENV = "AJET_SCALE_KEEP_ALIVE"
"""Idle connections the agents of one process keep (default 4096; 0: each call on a new connection)."""

_pool: httpx.Client | None = None
_pool_lock = threading.Lock()


def _release(signum: int, frame: object) -> None:
    RELEASE.set()


if threading.current_thread() is threading.main_thread():  # imported by the runner's main thread
    signal.signal(signal.SIGUSR1, _release)


def _http() -> httpx.Client:
    global _pool
    with _pool_lock:
        if _pool is None:
            # idle connections are dropped here (2 s) before the server drops them (serving.keep_alive_s):
            # a request sent as the server closes its side would fail, a race of HTTP/1.1 keep-alive
            keep = int(os.environ.get(KEEP_ALIVE_ENV, "4096"))  # 0: a connection per call (none held open)
            limits = httpx.Limits(max_connections=4096, max_keepalive_connections=keep, keepalive_expiry=2.0)
            _pool = httpx.Client(limits=limits, timeout=httpx.Timeout(600.0))
        return _pool


def tasks() -> Iterator[dict[str, Any]]:
    for n in range(TASKS):
        yield {"id": f"s{n}", "question": f"Say {n}."}


def hold(ctx: EpisodeContext) -> float:
    client = ctx.model.client(http_client=_http())
    messages: list[Any] = [{"role": "user", "content": ctx.task.data["question"]}]
    reply = client.chat.completions.create(model=ctx.model.name, messages=messages, max_tokens=8)
    RELEASE.wait(float(os.environ.get(HOLD_MAX_ENV, "1800")))
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""}]
    messages += [{"role": "user", "content": "Again."}]
    client.chat.completions.create(model=ctx.model.name, messages=messages, max_tokens=8)
    return _reward(ctx.task, ctx.repeat)


def _reward(task: Task, repeat: int) -> float:
    """A fixed reward in [0, 1] per (task, repeat): the repeats of a task differ, so no group is skipped."""
    return zlib.crc32(f"{task.id}/{repeat}".encode()) % 1000 / 999
