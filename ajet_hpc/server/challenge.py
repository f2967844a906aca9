"""The one unauthenticated route of the run's own callers: the challenge in which a server proves that it
holds the run secret before a client derives its run token (``ajet_hpc.server.auth`` explains the scheme,
``ajet_hpc.client.handshake`` is the client side)."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request

from ajet_hpc.server.auth import RUN_TOKEN_TTL_S, Unauthorized, check_client_nonce, mint_challenge
from ajet_hpc.server.errors import BadRequest, Unavailable

router = APIRouter()


@router.get("/v1/auth/challenge")
async def challenge(request: Request, c: str = Query(default="", max_length=128)) -> dict[str, object]:
    ctx = request.app.state.ctx
    try:
        check_client_nonce(c)
    except Unauthorized as exc:
        raise BadRequest(str(exc), param="c", code="invalid_value") from exc
    if not ctx.public_url:  # the proof names the URL clients reach; never the Host header a relay chose
        raise Unavailable("the server does not know its public URL yet: try again", code="not_ready")
    server_nonce, proof = mint_challenge(ctx.job.secret, c, ctx.public_url)
    return {"s": server_nonce, "proof": proof, "url": ctx.public_url, "ttl_s": RUN_TOKEN_TTL_S}
