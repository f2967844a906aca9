"""Finding a server through its rendezvous file, and waiting while it is away.

A client stops instead of waiting when the server ended for good: ``finished`` (``ServerFinished``) or
``failed`` (``ServerFailed``, with the server's reason), or when it stayed absent longer than the group's
``server_wait_s`` (``ServerUnavailable``). The last two are ``ServerGone``: the array task ends with that
message and releases its allocation (``runner_process.run_client`` exits with ``EXIT_SERVER_GONE``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

import httpx

from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)


POLL_FIRST_S = 1.0
POLL_START_S = 5.0
"""Longest pause in a wait's first minute, when a server normally comes up (its engine loading)."""
FIRST_MINUTE_S = 60.0
POLL_PER_OP_S = 10.0
"""After the first minute: one metadata operation per task per this many seconds. A read of an absent
rendezvous is one (the failed open), of a present one two (open, fstat)."""


class ServerGone(RuntimeError):
    """A server this client needs will not serve again: it failed, or stayed away too long."""


class ServerUnavailable(ServerGone):
    """The server did not become reachable within the allowed time (``clients[].server_wait_s``)."""


class ServerFailed(ServerGone):
    """The server's watchdog gave up (rendezvous state ``failed``); the message carries its reason."""


class ServerFinished(RuntimeError):
    """The server completed its training (or used up its task sources) and serves no more episodes."""


@dataclass(frozen=True)
class FoundServer:
    rendezvous: rendezvous.Rendezvous
    health: dict[str, object]

    @property
    def url(self) -> str:
        return self.rendezvous.url


def probe(record: rendezvous.Rendezvous, timeout_s: float = 5.0) -> dict[str, object] | None:
    """The server's /health answer, or None when it does not answer."""
    try:
        reply = httpx.get(f"{record.url}/health", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    return reply.json()


class WaitStopped(RuntimeError):
    """The waiting task was told to stop (SIGTERM, a cancel) while it waited for its server."""


def next_poll_s(
    previous_s: float,
    elapsed_s: float = 0.0,
    metadata_ops: int = 1,
    first_s: float = POLL_FIRST_S,
    rng: random.Random | None = None,
) -> float:
    """The pause before the next read of an away server's rendezvous, ``elapsed_s`` into the wait, the last
    read having cost ``metadata_ops``. In the first minute: ``first_s``, doubling up to ``POLL_START_S``, so
    a starting server is found within seconds. Then ``POLL_PER_OP_S`` per operation: 10,000 waiting tasks
    make at most 1,000 metadata operations a second on the shared file system. Up to a quarter more of
    jitter at either cap, so that tasks do not all read in the same second."""
    jitter = 1 + 0.25 * (rng or random).random()
    if elapsed_s < FIRST_MINUTE_S:
        if previous_s <= 0:
            return first_s
        if previous_s * 2 < POLL_START_S:
            return previous_s * 2
        return POLL_START_S * jitter
    return POLL_PER_OP_S * max(1, metadata_ops) * jitter


def wait_for_server(
    run: RunDir,
    name: str,
    timeout_s: float | None = None,
    poll_s: float = POLL_FIRST_S,
    report_every_s: float = 30.0,
    stop: threading.Event | None = None,
) -> FoundServer:
    """Block until server ``name`` has a fresh rendezvous file and answers /health.

    Re-reads the file on every try, so a server that was requeued onto another node is followed; the
    pauses between tries grow from ``poll_s`` (``next_poll_s``): a read of the file is a metadata operation
    on shared storage. ``timeout_s=None`` waits for ever (a server may sit in the queue
    for hours). Raises ``ServerFinished`` or ``ServerFailed`` as soon as the rendezvous says so,
    ``ServerUnavailable`` after ``timeout_s``, ``WaitStopped`` at once when ``stop`` is set.
    """
    path = run.rendezvous_file(name)
    start = last_report = time.monotonic()
    why = "no rendezvous file yet"
    pause = 0.0
    while True:
        record = rendezvous.read(path)
        if record is not None and record.state == "finished":
            detail = f": {record.reason}" if record.reason else ""
            raise ServerFinished(f"server {name!r} has finished its training{detail}")
        if record is not None and record.state == "failed":
            raise ServerFailed(
                f"server {name!r} failed (job {record.job_id}): {record.reason or 'no reason recorded'}"
            )
        if record is None:
            why = f"no rendezvous file yet ({path})"
        elif record.is_stale():
            why = f"rendezvous is stale (last heartbeat {record.age_s():.0f}s ago)"
        else:
            health = probe(record)
            if health is not None:
                return FoundServer(record, health)
            why = f"{record.url} does not answer"
        now = time.monotonic()
        if timeout_s is not None and now - start > timeout_s:
            raise ServerUnavailable(
                f"server {name!r} not reachable for {timeout_s:.0f}s (clients[].server_wait_s): {why}"
            )
        if now - last_report >= report_every_s:
            log.info("waiting for server %r for %.0fs: %s", name, now - start, why)
            last_report = now
        pause = next_poll_s(pause, now - start, 1 if record is None else 2, poll_s)
        if timeout_s is not None:
            pause = max(0.0, min(pause, start + timeout_s - now + 0.01))
        if stop is None:
            time.sleep(pause)
        elif stop.wait(pause):
            raise WaitStopped(f"stopped while waiting for server {name!r} ({why})")
