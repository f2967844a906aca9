"""Connections at scale, friendly and hostile: deadlines on reading a request, a bound on open connections
below the descriptor limit, and quiet accept errors.

uvicorn closes an idle connection only after it has answered a request on it (``timeout_keep_alive``): a
connection that never sends a whole request, or trickles its body, stays open for ever. On a compute node
that listens on every interface, 1,100 silent connections then exhaust a 1,024-descriptor limit, after which
``/health`` and chat time out and asyncio's accept loop logs tens of thousands of "Too many open files"
lines. So each connection of a server gets (``GuardedHttpProtocol``, uvicorn's httptools protocol with
three additions):

- ``header_timeout_s`` to send a request's headers once the connection opens or a request begins; a
  connection that sends nothing is closed then;
- ``body_timeout_s`` for the whole body once the headers are in;
- a bound, ``max_connections``: a connection past it first closes the connection that has gone longest
  without sending a complete request (silent and trickling connections; a connection busy with a request
  is never closed for another), and is itself refused when every one is busy.

``raise_descriptor_limit`` raises the soft limit on open files to the hard one when the server starts, and
the bound defaults to that limit less a reserve for the engine, stores and logs (``connection_bound``).
``quiet_accept_errors`` lets one accept-error line through per ``ACCEPT_LOG_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

RESERVE_FDS = 256  # descriptors left for the engine, trainer pipes, stores and logs
ACCEPT_LOG_EVERY_S = 10.0


def raise_descriptor_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_bound(configured: int | None, descriptor_limit: int) -> int:
    """``serving.max_connections``, or the descriptor limit less ``RESERVE_FDS`` (at least 64); never
    above what the descriptors allow."""
    room = max(64, descriptor_limit - RESERVE_FDS)
    return room if configured is None else min(configured, room)


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with request deadlines and a bound on open connections. Settings are
    class attributes, set on a subclass per server by ``guarded_protocol``."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 1024

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since = time.monotonic()  # since when it owes us a complete request
        self._busy = False  # a complete request is being answered

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections and not self._make_room():
            _note("connection refused: %d open, every one busy with a request", len(self.connections))
            transport.abort()
            return
        self._arm(self.header_timeout_s, "sent no complete request headers")

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a complete request (not this one); False when
        none is waiting."""
        idle = [
            c
            for c in self.connections
            if isinstance(c, GuardedHttpProtocol) and c is not self and not c._busy
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c._waiting_since)
        _note("connection limit %d reached: closing the longest-silent connection", self.max_connections)
        oldest._close("closed to make room under the connection limit")
        return True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.header_timeout_s, "sent no complete request headers")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.body_timeout_s, "did not send its request body in time")

    def on_message_complete(self) -> None:
        self._disarm()
        self._busy = True
        super().on_message_complete()

    def on_response_complete(self) -> None:
        self._busy = False
        self._waiting_since = time.monotonic()
        super().on_response_complete()  # arms uvicorn's keep-alive timeout for the next request

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._close, f"{what} within {seconds:g} s")

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self, why: str) -> None:
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closing connection from %s: %s", self.client, why)
            self.transport.abort()


def guarded_protocol(header_timeout_s: float, body_timeout_s: float, max_connections: int) -> type:
    """A ``GuardedHttpProtocol`` class with these settings, for ``uvicorn.Config(http=...)``."""
    settings = {
        "header_timeout_s": header_timeout_s,
        "body_timeout_s": body_timeout_s,
        "max_connections": max_connections,
    }
    return type("ServerHttpProtocol", (GuardedHttpProtocol,), settings)


_last_note = 0.0
_suppressed = 0


def _note(message: str, *args: Any) -> None:
    """A warning at most once per ``ACCEPT_LOG_EVERY_S``, with how many were held back."""
    global _last_note, _suppressed
    now = time.monotonic()
    if now - _last_note < ACCEPT_LOG_EVERY_S:
        _suppressed += 1
        return
    held = f" ({_suppressed} more such events in the last {now - _last_note:.0f} s)" if _suppressed else ""
    _last_note, _suppressed = now, 0
    log.warning(message + held, *args)


class _QuietAccept(logging.Filter):
    """Lets one of asyncio's accept-error records through per ``ACCEPT_LOG_EVERY_S``."""

    def __init__(self) -> None:
        super().__init__()
        self.last = 0.0
        self.held = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "accept" not in record.getMessage().lower():
            return True
        now = time.monotonic()
        if now - self.last < ACCEPT_LOG_EVERY_S:
            self.held += 1
            return False
        if self.held:
            record.msg = f"{record.msg} ({self.held} more accept errors in the last {now - self.last:.0f} s)"
        self.last, self.held = now, 0
        return True


def quiet_accept_errors() -> None:
    """Install the accept-error rate limit on asyncio's logger (once)."""
    logger = logging.getLogger("asyncio")
    if not any(isinstance(f, _QuietAccept) for f in logger.filters):
        logger.addFilter(_QuietAccept())
