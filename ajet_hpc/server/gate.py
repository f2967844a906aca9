"""What a request must pass before its body is read: the bearer token, then the body size.

A pure ASGI middleware in front of the routes. It checks the ``Authorization`` header of every route that
needs one with the functions of ``auth`` (the same the routes call again on the full request) and answers
401/403 before the body is parsed or buffered, so an unauthenticated client cannot make the server parse or
hold anything. The body of a refused request is still read and thrown away, chunk by chunk, if it is at most
``serving.max_request_bytes`` and arrives within ``DISCARD_S``: a server that closes a socket with unread
bytes in it sends RST, which can overtake the answer (the client then sees "connection reset" instead of
its 401); a larger or slower body stays unread and the connection is closed.
An authenticated body is capped at ``serving.max_request_bytes``: a larger
``Content-Length`` is answered 413 up front, and a body sent without one (chunked) is counted as it streams
and cut off with 413 once it passes the cap.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

from ajet_hpc.server.auth import AuthError, authorize_episode_call, authorize_run_call
from ajet_hpc.server.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC = frozenset({"/health", "/v1/auth/challenge"})  # the challenge: ajet_hpc/server/challenge.py
MODEL_CALLS = frozenset({"chat/completions", "completions"})
AUTHORIZATION = "ajet.authorization"  # scope key: the request's Authorization header value (or None)
DISCARD_S = 2.0  # a refused request's body (up to the cap) is read and dropped if it arrives within this time


class BodyTooLarge(HTTPException):
    """A streamed body passed the cap (rendered 413 by the app's error handler, or by the gate)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=413,
            detail=f"request body is larger than this server's limit of {limit} bytes "
            "(serving.max_request_bytes)",
        )


def check_credentials(path: str, header: str | None, secret: str, model: str) -> None:
    """Raise ``AuthError`` unless ``header`` may call ``path``: model calls need an episode token (of the
    episode the path names), the model list either credential, everything else under ``/v1`` the run
    secret. Paths outside the API (unknown ones: the router answers 404) are not checked here."""
    if path in PUBLIC:
        return
    episode_id: str | None = None
    route = None
    if path.startswith("/episodes/"):
        _, _, episode_id, version, *rest = path.split("/", 4) + [""] * 2
        if version != "v1" or not episode_id:
            return
        route = rest[0]
    elif path.startswith("/v1/"):
        route = path[len("/v1/") :]
    else:
        return
    if route in MODEL_CALLS:
        authorize_episode_call(secret, header, episode_id, model)
    elif route == "models":
        try:
            authorize_run_call(secret, header)
        except AuthError:
            authorize_episode_call(secret, header, episode_id, model)
    elif episode_id is None:
        authorize_run_call(secret, header)
    # other paths under /episodes/<id>/v1/ do not exist: the router answers 404


class RequestGate:
    """ASGI middleware: credentials from the headers, then a capped body (see the module docstring)."""

    def __init__(self, app: ASGIApp, ctx: Any) -> None:
        self.app, self.ctx = app, ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authorization = declared = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                declared = value.decode("latin-1")
            elif name == b"transfer-encoding":
                chunked = True
        scope[AUTHORIZATION] = authorization  # the routes read it here (no second parse of the headers)
        ctx, limit = self.ctx, self.ctx.settings.max_request_bytes
        try:
            check_credentials(scope["path"], authorization, ctx.job.secret, ctx.name)
        except AuthError as exc:
            kind = "authentication_error" if exc.status_code == 401 else "permission_error"
            drained = await _discard_body(receive, declared, limit)
            await _answer(scope, receive, send, exc.status_code, str(exc), kind, exc.code, drained)
            return
        if declared is not None:
            if not declared.strip().isdigit():
                await _answer(scope, receive, send, 400, "malformed Content-Length header", None, None)
                return
            if int(declared) > limit:
                message = (
                    f"request body of {int(declared)} bytes is larger than this server's limit of {limit} "
                    "bytes (serving.max_request_bytes)"
                )
                await _answer(scope, receive, send, 413, message, None, "request_too_large")
                return
        if not chunked:
            # The HTTP parser hands the app at most Content-Length bytes (checked above), or none without
            # one: nothing to count, so the request goes on without wrappers around receive and send.
            await self.app(scope, receive, send)
            return
        received = 0
        started = False

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge as exc:
            if started:
                raise
            await _answer(scope, receive, send, 413, str(exc.detail), None, "request_too_large")


async def _discard_body(receive: Receive, declared: str | None, limit: int) -> bool:
    """Read and drop the body of a refused request if it is within the cap and prompt; True when all of it
    was read (the connection can then be reused)."""
    if declared is not None and (not declared.strip().isdigit() or int(declared) > limit):
        return False
    left = limit
    try:
        async with asyncio.timeout(DISCARD_S):
            while left >= 0:
                message = await receive()
                if message["type"] != "http.request":
                    return False
                left -= len(message.get("body", b""))
                if not message.get("more_body", False):
                    return left >= 0
    except TimeoutError:
        pass
    return False


async def _answer(
    scope: Scope,
    receive: Receive,
    send: Send,
    status: int,
    message: str,
    kind: str | None,
    code: str | None,
    drained: bool = False,
) -> None:
    response = error_body(status, message, kind or "invalid_request_error", None, code)
    if status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    if not drained:
        response.headers["Connection"] = "close"  # the unread body stays unread: the connection is not reused
    await response(scope, receive, send)
