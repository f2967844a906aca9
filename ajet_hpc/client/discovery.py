"""Finding a server through its rendezvous file, and waiting while it is away.

A client stops instead of waiting when the server ended for good: ``finished`` (``ServerFinished``) or
``failed`` (``ServerFailed``, with the server's reason), or when it stayed absent longer than the group's
``server_wait_s`` (``ServerUnavailable``). The last two are ``ServerGone``: the array task ends with that
message and releases its allocation (``runner.run_client`` exits with ``EXIT_SERVER_GONE``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import httpx

from ajet_hpc.storage import rendezvous
from ajet_hpc.storage.rundir import RunDir

log = logging.getLogger(__name__)


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


def wait_for_server(
    run: RunDir,
    name: str,
    timeout_s: float | None = None,
    poll_s: float = 1.0,
    report_every_s: float = 30.0,
) -> FoundServer:
    """Block until server ``name`` has a fresh rendezvous file and answers /health.

    Re-reads the file on every try, so a server that was requeued onto another node is followed.
    ``timeout_s=None`` waits for ever (a server may sit in the queue for hours). Raises ``ServerFinished``
    or ``ServerFailed`` as soon as the rendezvous says so, ``ServerUnavailable`` after ``timeout_s``.
    """
    path = run.rendezvous_file(name)
    start = last_report = time.monotonic()
    why = "no rendezvous file yet"
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
        time.sleep(poll_s)
