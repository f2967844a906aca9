"""Who may call a server: run tokens from a challenge, and signed episode tokens (pure functions, no web
framework).

Every authenticated request carries ``Authorization: Bearer <token>``. The **run secret** (the hex string in
``RUN/secret``, mode 0600) is the key of every token, held by the user, the launcher and the client runners;
it is never sent over HTTP (a server that receives it answers 401). Its holders first prove to each other
that they hold it (``ajet_hpc.client.handshake`` does the client side)::

    client: c = random nonce                 GET /v1/auth/challenge?c=<c>     (unauthenticated)
    server: s = base64url(t || r || HMAC(K, "run1-nonce|" t || r))            t: issue time, r: random
            proof = HMAC(K, "run1-server|" c "|" s "|" url)                   url: the server's public URL
    client: checks proof for the URL it called (else: a server that does not hold the secret, or a relay
            of a real one: it sends nothing), then calls with the **run token**
            run1.<s>.<c>.<base64url(HMAC(K, "run1-client|" s "|" c))>

The server checks a run token without state: ``s`` was minted with K and is younger than
``RUN_TOKEN_TTL_S``, and the mac is right. A planted rendezvous file thus learns neither the secret nor a
token: it cannot answer the challenge, and a relay to the real server fails because the proof names the
real server's URL. A token seen on the wire (without TLS) is valid until it expires; the secret is not.
Each process remembers the tokens it has verified (``_Verified``: keyed by secret and token, bounded, the
expiry compared on every use), so a token used again costs a look-up instead of its HMACs; what is admitted
is exactly what a full check admits.

An **episode token** is issued by the server when an episode begins and handed to the agent as its API
key. It authorizes only chat/completions calls for its own episode and model, until it expires. Format::

    ep1.<base64url(payload)>.<base64url(HMAC-SHA256(secret, "ep1." + base64url(payload)))>

with ``payload = {"e": episode_id, "m": model, "x": expiry}`` as compact JSON with sorted keys, expiry in
whole unix seconds, base64url without padding. The HMAC key is the secret string as UTF-8 bytes.

What each presented token gets (``authorize_run_call`` / ``authorize_episode_call``)::

    presented                        episode API, status      chat / completions
    no header, not "Bearer <token>"  401 Unauthorized         401 Unauthorized
    the run secret itself            401 Unauthorized         401 Unauthorized
    run token, forged/expired        401 Unauthorized         401 Unauthorized
    run token, valid                 allowed                  403 Forbidden (begin an episode, use its token)
    episode token, forged/malformed  401 Unauthorized         401 Unauthorized
    episode token, expired           401 Unauthorized         401 Unauthorized
    episode token, valid             403 Forbidden            allowed, if for this model and (when the
                                                              request names one) this episode; else 403

Run tokens are refused for model calls on purpose: every token the server serves is recorded for
training, and a call outside an episode has nowhere to be recorded. Error messages never echo a token;
``redact`` removes tokens and secrets from text bound for logs.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import os
import re
import time
from dataclasses import dataclass

TOKEN_VERSION = "ep1"
RUN_TOKEN_VERSION = "run1"
RUN_TOKEN_TTL_S = 24 * 3600.0  # a client whose token expired runs the challenge again (on its 401)
_CLIENT_NONCE = re.compile(r"[A-Za-z0-9_-]{16,128}")
_STAMP_BYTES, _RANDOM_BYTES, _MAC_BYTES = 8, 16, 32
VERIFIED_CACHE_SIZE = 4096  # tokens whose signature was checked, per process (about 1 MB at most)


class _Verified:
    """Tokens whose signatures this process already checked, with their expiry: an agent calls with the
    same episode token many times, a client runner with the same run token all run long, and a request is
    checked twice (the gate, then its route). Two HMACs and a JSON parse per check were a tenth of a chat
    call's CPU. Only tokens that passed are kept (a forged one is checked in full each time), keyed by the
    secret and the token, so a hit means "this exact string was verified with this exact key"; the expiry
    is compared on every use. Bounded: the oldest entry goes first (insertion order)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: dict[tuple[str, str], tuple[float, EpisodeClaims | None]] = {}

    def get(self, secret: str, token: str) -> tuple[float, EpisodeClaims | None] | None:
        return self.entries.get((secret, token))

    def put(self, secret: str, token: str, expires_at: float, claims: EpisodeClaims | None) -> None:
        if len(self.entries) >= self.size:
            del self.entries[next(iter(self.entries))]
        self.entries[(secret, token)] = (expires_at, claims)


_verified = _Verified(VERIFIED_CACHE_SIZE)


class AuthError(Exception):
    """A request that may not proceed; ``status_code`` and ``code`` shape the OpenAI-style error body."""

    status_code: int = 401
    code: str = "invalid_api_key"


class Unauthorized(AuthError):
    """No credential, or one that is malformed, forged or expired (HTTP 401)."""

    status_code = 401
    code = "invalid_api_key"


class Forbidden(AuthError):
    """A valid credential that does not cover this request (HTTP 403)."""

    status_code = 403
    code = "forbidden"


@dataclass(frozen=True)
class EpisodeClaims:
    """What a verified episode token grants."""

    episode_id: str
    model: str
    expires_at: float


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _signature(secret: str, signed: str) -> str:
    digest = hmac.new(secret.encode("utf-8"), signed.encode("ascii"), hashlib.sha256).digest()
    return _b64encode(digest)


def issue_episode_token(
    secret: str, episode_id: str, model: str, ttl_s: float, now: float | None = None
) -> str:
    """A token for the chat calls of one episode on one model, valid ``ttl_s`` seconds from ``now``."""
    if not secret:
        raise ValueError("cannot sign an episode token with an empty secret")
    if not episode_id or not model:
        raise ValueError("an episode token needs a non-empty episode_id and model")
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be positive, got {ttl_s}")
    expiry = math.ceil((time.time() if now is None else now) + ttl_s)
    payload = json.dumps({"e": episode_id, "m": model, "x": expiry}, separators=(",", ":"), sort_keys=True)
    payload_b64 = _b64encode(payload.encode("utf-8"))
    signed = f"{TOKEN_VERSION}.{payload_b64}"
    return f"{signed}.{_signature(secret, signed)}"


def verify_episode_token(secret: str, token: str, now: float | None = None) -> EpisodeClaims:
    """The claims of a token this run's secret signed; ``Unauthorized`` (saying why) otherwise."""
    known = _verified.get(secret, token)
    if known is not None and known[1] is not None:
        claims = known[1]
    else:
        claims = _verify_episode_signature(secret, token)
        _verified.put(secret, token, claims.expires_at, claims)
    if (time.time() if now is None else now) >= claims.expires_at:
        raise Unauthorized(
            f"episode token expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(claims.expires_at))}"
        )
    return claims


def _verify_episode_signature(secret: str, token: str) -> EpisodeClaims:
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != TOKEN_VERSION or not parts[1] or not parts[2]:
        raise Unauthorized(f"malformed episode token (expected {TOKEN_VERSION}.<payload>.<signature>)")
    signed = f"{parts[0]}.{parts[1]}"
    if not secret or not hmac.compare_digest(_signature(secret, signed).encode(), parts[2].encode()):
        raise Unauthorized("episode token signature does not match (forged, or issued for another run)")
    try:
        payload = json.loads(_b64decode(parts[1]))
        claims = EpisodeClaims(str(payload["e"]), str(payload["m"]), float(payload["x"]))
    except (binascii.Error, ValueError, TypeError, KeyError) as exc:
        raise Unauthorized("malformed episode token payload") from exc
    return claims


def _mac(secret: str, label: str, *parts: bytes | str) -> bytes:
    message = (
        label.encode("ascii") + b"|" + b"|".join(p if isinstance(p, bytes) else p.encode() for p in parts)
    )
    return hmac.new(secret.encode("utf-8"), message, hashlib.sha256).digest()


def check_client_nonce(nonce: str) -> str:
    """``nonce`` when it is 16 to 128 base64url characters; ``Unauthorized`` otherwise."""
    if not _CLIENT_NONCE.fullmatch(nonce):
        raise Unauthorized("malformed challenge nonce: send 16 to 128 base64url characters as c")
    return nonce


def mint_challenge(
    secret: str, client_nonce: str, server_url: str, now: float | None = None
) -> tuple[str, str]:
    """The server's answer to a challenge: ``(s, proof)``, ``s`` a server nonce only a holder of the
    secret can mint, ``proof`` that this server (at ``server_url``) holds the secret."""
    if not secret:
        raise ValueError("cannot answer a challenge with an empty secret")
    check_client_nonce(client_nonce)
    stamp = int(time.time() if now is None else now).to_bytes(_STAMP_BYTES, "big")
    body = stamp + os.urandom(_RANDOM_BYTES)
    server_nonce = _b64encode(body + _mac(secret, "run1-nonce", body))
    return server_nonce, server_proof(secret, client_nonce, server_nonce, server_url)


def server_proof(secret: str, client_nonce: str, server_nonce: str, server_url: str) -> str:
    """What a server that holds ``secret`` answers at ``server_url`` (the client checks it)."""
    return _b64encode(_mac(secret, "run1-server", client_nonce, server_nonce, server_url.rstrip("/")))


def run_token(secret: str, client_nonce: str, server_nonce: str) -> str:
    """The bearer token a client derives once the server proved that it holds ``secret``."""
    mac = _b64encode(_mac(secret, "run1-client", server_nonce, client_nonce))
    return f"{RUN_TOKEN_VERSION}.{server_nonce}.{client_nonce}.{mac}"


def verify_run_token(secret: str, token: str, now: float | None = None) -> None:
    """Nothing when ``token`` is a run token of this run's secret, unexpired; ``Unauthorized`` otherwise."""
    known = _verified.get(secret, token)
    if known is not None and known[1] is None:
        expires_at = known[0]
    else:
        expires_at = _verify_run_signature(secret, token)
        _verified.put(secret, token, expires_at, None)
    if (time.time() if now is None else now) >= expires_at:
        raise Unauthorized("run token expired: run the challenge again (GET /v1/auth/challenge)")


def _verify_run_signature(secret: str, token: str) -> float:
    """When the run token expires, if this secret made it; ``Unauthorized`` otherwise."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != RUN_TOKEN_VERSION or not _CLIENT_NONCE.fullmatch(parts[2]):
        raise Unauthorized(f"malformed run token (expected {RUN_TOKEN_VERSION}.<s>.<c>.<mac>)")
    _, server_nonce, client_nonce, mac = parts
    try:
        raw = _b64decode(server_nonce)
    except (binascii.Error, ValueError) as exc:
        raise Unauthorized("malformed run token") from exc
    body, minted = raw[: _STAMP_BYTES + _RANDOM_BYTES], raw[_STAMP_BYTES + _RANDOM_BYTES :]
    expected = _b64encode(_mac(secret, "run1-client", server_nonce, client_nonce))
    if (
        not secret
        or len(minted) != _MAC_BYTES
        or not hmac.compare_digest(_mac(secret, "run1-nonce", body), minted)
        or not hmac.compare_digest(expected.encode(), mac.encode())
    ):
        raise Unauthorized("run token does not match (forged, or made for another run)")
    return int.from_bytes(body[:_STAMP_BYTES], "big") + RUN_TOKEN_TTL_S


def bearer_token(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header value."""
    if header is None or not header.strip():
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("malformed Authorization header: expected 'Bearer <token>'")
    return token.strip()


def is_run_secret(secret: str, presented: str) -> bool:
    """Whether ``presented`` is the run secret, compared in constant time."""
    if not secret:
        return False
    return hmac.compare_digest(secret.encode("utf-8"), presented.encode("utf-8"))


_SECRET_SENT = (
    "the run secret itself is never accepted over HTTP: prove it with the challenge (GET "
    "/v1/auth/challenge, ajet_hpc.client.handshake) and call with the run token it gives"
)


def authorize_run_call(secret: str, header: str | None) -> None:
    """Admit a call of the episode API or status: only a run token (from the challenge) may make one."""
    token = bearer_token(header)
    if token.startswith(f"{RUN_TOKEN_VERSION}."):
        verify_run_token(secret, token)
        return
    if is_run_secret(secret, token):
        raise Unauthorized(_SECRET_SENT)
    if token.startswith(f"{TOKEN_VERSION}."):
        verify_episode_token(secret, token)  # 401 when forged or expired
        raise Forbidden("an episode token may only call the model; the episode API needs a run token")
    raise Unauthorized("invalid API key: the episode API needs a run token (GET /v1/auth/challenge)")


def authorize_episode_call(
    secret: str, header: str | None, episode_id: str | None, model: str
) -> EpisodeClaims:
    """Admit a chat/completions call for ``model`` (and ``episode_id`` when the request names one)."""
    token = bearer_token(header)
    if is_run_secret(secret, token):
        raise Unauthorized(_SECRET_SENT)
    if token.startswith(f"{RUN_TOKEN_VERSION}."):
        verify_run_token(secret, token)
        raise Forbidden("model calls are recorded per episode: begin an episode and call with its token")
    if not token.startswith(f"{TOKEN_VERSION}."):
        raise Unauthorized("invalid API key: model calls need an episode token")
    claims = verify_episode_token(secret, token)
    if claims.model != model:
        raise Forbidden(f"this episode token is for model {claims.model!r}, not {model!r}")
    if episode_id is not None and episode_id != claims.episode_id:
        raise Forbidden(f"this episode token is for episode {claims.episode_id!r}, not {episode_id!r}")
    return claims


_SECRET_PATTERNS = (
    re.compile(rf"{RUN_TOKEN_VERSION}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"),
    re.compile(rf"{TOKEN_VERSION}\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+"),
    re.compile(r"(?<![0-9A-Fa-f])[0-9A-Fa-f]{64,}(?![0-9A-Fa-f])"),
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!\[redacted\])[A-Za-z0-9._~+/=-]+")  # RFC 6750 b64token


def redact(text: str) -> str:
    """``text`` with run and episode tokens, run secrets (64+ hex digits) and bearer values replaced by
    ``[redacted]``, for log lines."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub("[redacted]", text)
    return _BEARER.sub(r"\1[redacted]", text)
