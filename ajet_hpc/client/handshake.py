"""How every holder of the run secret calls a server without ever sending the secret.

``RunAuth`` (an ``httpx.Auth``) asks the server for a challenge (``GET /v1/auth/challenge?c=<nonce>``),
checks the server's proof that it holds the secret *at the URL this client called*, and only then calls
with the run token derived from the exchange (``ajet_hpc.server.auth`` explains the scheme). A server that
answers without a valid proof — a rendezvous file planted by a neighbour, a relay of the real server, a
server of another run — gets nothing: ``ServerNotTrusted`` is raised before any token leaves. A 401 (an
expired token) runs the challenge once more. The runner's episode API, ``launch status``, hot swaps and the
tools all call through it.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections.abc import Generator
from typing import Any

import httpx

from ajet_hpc.server.auth import run_token, server_proof

CHALLENGE_PATH = "/v1/auth/challenge"


class ServerNotTrusted(ConnectionError):
    """The server at a URL did not prove that it holds the run secret: nothing was sent to it."""


class RunAuth(httpx.Auth):
    """Authenticate calls to the server at ``url`` (its rendezvous URL) with a run token."""

    requires_response_body = True

    def __init__(self, url: str, secret: str) -> None:
        self.url = url.rstrip("/")
        self._secret = secret
        self._token: str | None = None
        self._lock = threading.Lock()

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        with self._lock:
            token = self._token
        if token is None:
            token = yield from self._handshake()
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401 and "run token" in response.text:  # expired: prove again, once
            token = yield from self._handshake()
            request.headers["Authorization"] = f"Bearer {token}"
            yield request

    def _handshake(self) -> Generator[httpx.Request, httpx.Response, str]:
        client_nonce = secrets.token_urlsafe(24)
        response = yield httpx.Request("GET", f"{self.url}{CHALLENGE_PATH}", params={"c": client_nonce})
        token = answer(self.url, self._secret, client_nonce, response)
        with self._lock:
            self._token = token
        return token


def answer(url: str, secret: str, client_nonce: str, response: httpx.Response) -> str:
    """The run token for ``url`` from the server's answer to ``client_nonce``; ``ServerNotTrusted`` unless
    the answer proves that the server at ``url`` holds ``secret``."""
    url = url.rstrip("/")
    refusal = (
        f"the server at {url} does not hold the run secret (a rendezvous file planted by another user, or a "
        "server of another run?): nothing was sent to it"
    )
    if response.status_code != 200:
        if response.status_code >= 500:  # starting, or gone: the caller's usual retry applies
            raise httpx.RemoteProtocolError(
                f"{url}{CHALLENGE_PATH}: HTTP {response.status_code}", request=response.request
            )
        raise ServerNotTrusted(f"{refusal} (the challenge got HTTP {response.status_code})")
    try:
        body: Any = response.json()
        server_nonce, proof = str(body["s"]), str(body["proof"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ServerNotTrusted(f"{refusal} (no challenge answer in its reply)") from exc
    if not hmac.compare_digest(server_proof(secret, client_nonce, server_nonce, url), proof):
        raise ServerNotTrusted(refusal)
    return run_token(secret, client_nonce, server_nonce)


def run_client(url: str, secret: str, timeout_s: float = 10.0, **kwargs: Any) -> httpx.Client:
    """An ``httpx.Client`` on ``url`` whose every call carries a run token (proved for that URL)."""
    return httpx.Client(base_url=url, auth=RunAuth(url, secret), timeout=timeout_s, **kwargs)


def fetch_run_token(url: str, secret: str, timeout_s: float = 10.0) -> str:
    """One run token for the server at ``url`` (tools that write their own requests); valid
    ``RUN_TOKEN_TTL_S``."""
    client_nonce = secrets.token_urlsafe(24)
    reply = httpx.get(f"{url.rstrip('/')}{CHALLENGE_PATH}", params={"c": client_nonce}, timeout=timeout_s)
    return answer(url, secret, client_nonce, reply)
